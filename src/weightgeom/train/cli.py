"""``weightgeom train CONFIG [--set section.key=value ...] [--resume RUN_DIR] [--out DIR]``.

CONFIG is a TOML/YAML file or a bundled config name (``tiny-shakespeare``, ``resmlp-mnist``, ``gpt2-small-owt``;
``--list`` prints them). ``--resume RUN_DIR`` continues the run in RUN_DIR from its newest checkpoint using the run's
``config.resolved.toml`` (CONFIG may then be omitted; ``--set`` still applies, e.g. to raise ``train.max_steps``).
Distributed: ``torchrun --nproc_per_node=N -m weightgeom train CONFIG`` (``--set run.parallel=fsdp`` for FSDP2).
Exit codes: 0 done (also: already done before), 3 diverged, 2 bad input — bad config, unusable checkpoint, a run
directory another process is writing, a ``run.name`` leaving ``run.out_dir``, or a run directory that cannot be
written (one line on stderr naming the key, file or path).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from weightgeom._files import SpecialFileError, is_regular


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the ``train`` subcommand's arguments."""
    p.add_argument("config", nargs="?", help="TOML/YAML config file or bundled config name")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable), e.g. --set train.max_steps=200")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint")
    p.add_argument("--out", metavar="DIR", help="run directory (default: run.out_dir/run.name)")
    p.add_argument("--fresh", action="store_true",
                   help="start from step 0; an earlier run's files in the run directory are moved to previous/")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--list", action="store_true", help="list the bundled configs and exit")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (TOML, every key documented) and exit")


def _live_parent_lock(run_dir: str) -> str:
    """The enclosing directory of ``run_dir`` whose lock a live process holds (a sweep or demo directory), or "".
    Only the command line checks this: a sweep's own workers train inside its locked directory."""
    from weightgeom.train.rundir import LOCK_NAME, lock_is_stale, read_lock

    for parent in list(Path(run_dir).absolute().parents)[:3]:
        if not (parent / LOCK_NAME).is_file():
            continue
        rec = read_lock(parent)
        if rec is not None and lock_is_stale(rec) is False:
            return str(parent)
    return ""


def run(args: argparse.Namespace) -> int:
    """Run ``weightgeom train``; returns the exit code (0 done, 3 diverged, 2 error)."""
    from weightgeom.train.config import bundled_configs, dump_toml, load_config

    if args.list:
        print("\n".join(bundled_configs()))
        return 0
    config = args.config
    run_dir = args.out
    resume: bool | str = False if args.fresh else "auto"
    if args.resume:
        rd = Path(args.resume)
        resolved = rd / "config.resolved.toml"
        if config is None:
            try:
                present = is_regular(resolved, "the run's resolved config")
            except (SpecialFileError, OSError) as e:  # a FIFO, a directory, a loop of links: say which
                print(f"weightgeom train: --resume {rd}: {e}", file=sys.stderr)
                return 2
            if not present:
                print(f"weightgeom train: --resume {rd}: no config.resolved.toml there", file=sys.stderr)
                return 2
            config = str(resolved)
        if run_dir and Path(run_dir).resolve() != rd.resolve():
            print("weightgeom train: --out and --resume name different directories", file=sys.stderr)
            return 2
        run_dir, resume = str(rd), True
    owner = _live_parent_lock(run_dir) if run_dir else None
    if owner:
        print(f"weightgeom train: {run_dir} lies in {owner}, which a running sweep or demo owns (one writer); wait "
              "for it, or choose another --out", file=sys.stderr)
        return 2
    if config is None:
        print(f"weightgeom train: give a CONFIG (file or one of: {', '.join(bundled_configs())})", file=sys.stderr)
        return 2
    try:
        if args.print_config:
            print(dump_toml(load_config(config, args.overrides), comments=True))
            return 0
        from weightgeom.train import train

        res = train(config, run_dir=run_dir, overrides=args.overrides, progress=not args.no_progress,
                    resume=resume)
    except ValueError as e:  # bad config / unusable checkpoint / directory in use: one clear line
        print(f"weightgeom train: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a callback refusing a setting (e.g. a tracker's store): its own line
        if isinstance(e.__cause__, ValueError):
            print(f"weightgeom train: error: {e.__cause__}", file=sys.stderr)
            return 2
        raise
    except OSError as e:  # unwritable or full run directory: one line naming the path and the reason
        from weightgeom._cli_args import os_error_line

        print(f"weightgeom train: error: {os_error_line(e)}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(res, default=str))
    return 0 if res["status"] == "done" else 3
