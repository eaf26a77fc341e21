"""``weightgeom`` command line: train | sweep | analyze | report | bench | data | demo.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; this file only
dispatches, importing the chosen module lazily so ``weightgeom --help`` stays fast. An ``OSError`` a subcommand lets
through (a path that cannot be written or read: not a directory, no permission, disk full) ends the command with one
line naming the path and the system's reason, and exit code 2, like any other bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import signal
import sys
import threading

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("weightgeom.experiments.demo", "the main CPU job: small versions of the paper experiments + report"),
    "train": ("weightgeom.train.cli", "train a model from a TOML/YAML config (torchrun for DDP/FSDP2)"),
    "sweep": ("weightgeom.experiments.cli", "run an experiment recipe: manifolds | continuity | md"),
    "report": ("weightgeom.experiments.report_cli", "regenerate tables and plots from run directories"),
    "analyze": ("weightgeom.analysis.cli", "continuity analysis of a checkpoint (HF dir, torch .pt, GGUF)"),
    "bench": ("weightgeom.benchmarks_cli", "run the benchmarks in benchmarks/"),
    "data": ("weightgeom.data.cli", "prepare token datasets (train.bin/val.bin) from text, JSONL, parquet"),
}


def os_error_line(e: OSError) -> str:
    """One line for an ``OSError``: the path(s) it names and the system's reason, e.g.
    ``cannot use runs/x/checkpoints/ckpt_00000008.pt: No space left on device (ENOSPC)``."""
    reason = e.strerror or str(e) or type(e).__name__
    code = errno.errorcode.get(e.errno) if isinstance(e.errno, int) else None
    if code:
        reason += f" ({code})"
    if e.filename is None:
        return reason
    where = str(e.filename) + (f" -> {e.filename2}" if e.filename2 is not None else "")
    return f"cannot use {where}: {reason}"


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per available subcommand."""
    parser = argparse.ArgumentParser(prog="weightgeom", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name):
                continue  # subcommand not built yet
            raise
        p = sub.add_parser(name, help=help_, description=help_)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


class Terminated(BaseException):
    """Raised in the main thread when the process gets SIGTERM (a scheduler's or ``kill``'s stop request), so a run
    unwinds like on Ctrl-C: ``status.json`` says failed with the reason, locks are released, logs are closed."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated("terminated by SIGTERM")


@contextlib.contextmanager
def _sigterm_unwinds():
    """Turn SIGTERM into :class:`Terminated` while a command runs (main thread only; restored afterwards)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``weightgeom`` script. Returns the process exit code (130 after Ctrl-C, 143 after
    SIGTERM)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        with _sigterm_unwinds():
            return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("weightgeom: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("weightgeom: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except OSError as e:
        print(f"weightgeom {args.command}: error: {os_error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
