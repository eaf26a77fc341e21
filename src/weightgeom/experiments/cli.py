"""``weightgeom sweep RECIPE [CONFIG]``: run an experiment recipe (manifolds | continuity | md) and report it.

CONFIG is a preset name (``tiny-shakespeare`` → ``presets/<recipe>-tiny-shakespeare.toml`` or
``presets/tiny-shakespeare.toml``, shipped in ``weightgeom.experiments``, else the trainer's bundled config) or a
TOML/YAML path — the CPU preset and the paper-scale config go through the same recipe unchanged. Finished runs are
skipped, so re-running the same command resumes a sweep; ``OUT/sweep.json`` lists every run with its status.

One sweep at a time owns ``OUT`` (a lock from planning to the report); a sweep whose runs were trained with other
settings, or whose directory was run with other sweep-level settings (recipe, config, ``--steps``, ``--set``; not
``--only`` or ``--seeds``), is refused with one line naming the difference. Bad input (recipe, preset, ``--only``,
``--set``, an unusable ``OUT``) is one line on stderr and exit code 2; nothing is written.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from weightgeom.cli import os_error_line

if TYPE_CHECKING:
    from weightgeom.experiments.runner import Recipe

RECIPES = {
    "manifolds": "weightgeom.experiments.manifolds",
    "continuity": "weightgeom.experiments.continuity",
    "md": "weightgeom.experiments.md",
}


def get_recipe(name: str) -> Recipe:
    """The :class:`Recipe` called ``name``.

    Raises:
        ValueError: unknown recipe name.
    """
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return importlib.import_module(RECIPES[name]).RECIPE


def _int_list(text: str) -> list[int]:
    try:
        if "-" in text and "," not in text and not text.startswith("-"):
            a, b = text.split("-")
            return list(range(int(a), int(b) + 1))
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds expects e.g. 0,1,2 or 0-4, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (``--steps``, ``--jobs``, ``--threads``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``weightgeom sweep``."""
    p.add_argument("recipe", choices=list(RECIPES), help="experiment recipe")
    p.add_argument("config", nargs="?", default=None,
                   help="preset name or TOML/YAML path (default: the recipe's CPU preset)")
    p.add_argument("--seeds", type=_int_list, default=None, help="seeds, e.g. 0,1,2 or 0-4 (default: preset/recipe)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="override train.max_steps (intervals shrink to fit)")
    p.add_argument("--out", default=None, help="sweep directory (default: runs/sweeps/<recipe>-<config>)")
    p.add_argument("--only", default=None, help="comma-separated variant names (prefix* allowed) to run")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key in every run (repeatable)")
    p.add_argument("--no-resume", action="store_true", help="re-run finished runs instead of skipping them")
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    p.add_argument("--list", action="store_true", help="print the planned runs and exit")
    p.add_argument("--quiet", action="store_true", help="one line per run, no trainer progress")
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="runs trained in parallel, one process each (CPU: 2 jobs × 1 thread on 2 cores)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads per run (default: PyTorch's)")


def execute(recipe_name: str, config: str | None = None, seeds=None, steps: int | None = None,
            out: str | Path | None = None, only=None, sets=(), resume: bool = True, report: bool = True,
            progress: bool = True, list_only: bool = False, train_fn=None,
            quiet_trainer: bool = False, jobs: int = 1, threads: int | None = None,
            lock: bool = True) -> tuple[dict, Path | None]:
    """Plan, run and report a sweep (the body of ``weightgeom sweep``; also used by ``weightgeom demo``).

    ``progress`` prints one line per run; the trainer's own progress bar is shown too unless ``quiet_trainer``.
    Everything is planned and validated before the sweep directory is touched; from then on until the report is
    written this process holds the sweep directory's lock.

    Args:
        lock: take ``out``'s lock (False: the caller holds it).

    Returns:
        ``(manifest, report_path)``; ``report_path`` is None with ``report=False`` or ``list_only``.

    Raises:
        ValueError: bad recipe, preset content, ``--only``, ``--set``; the directory is owned by another sweep
            (``LockError``); runs, or the sweep directory, recorded with other settings (``SweepSettingsError``).
        FileNotFoundError: unknown preset or config file.
        OSError: the sweep directory cannot be written.
    """
    # imported here, not at module level: the config schema imports torch, and `weightgeom sweep --help` must not
    from weightgeom.experiments.runner import SWEEP_SETTINGS_KEY, load_parts, plan, run_sweep, sweep_settings
    from weightgeom.train.config import parse_overrides
    from weightgeom.train.rundir import DirLock

    recipe = get_recipe(recipe_name)
    label, parts, sweep = load_parts(config or recipe.default_config, recipe.name)
    seeds = list(seeds) if seeds else [int(s) for s in sweep.get("seeds", recipe.default_seeds)]
    if steps is None and sweep.get("steps"):
        steps = int(sweep["steps"])
    try:
        variants = recipe.variants(parts, sweep, steps)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"{sweep['_path']}: the [sweep] table does not fit recipe {recipe.name}: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    only_list = [o.strip() for o in only.split(",")] if isinstance(only, str) else (list(only) if only else None)
    set_values = parse_overrides(sets)
    runs = plan(recipe.name, variants, parts, seeds, steps=steps, only=only_list, sets=set_values)
    out = Path(out or Path("runs") / "sweeps" / f"{recipe.name}-{label}")
    if list_only:
        for r in runs:
            ov = " ".join(f"{k}={v}" for k, v in r.overrides.items())
            ctl = f" controls={r.controls}" if r.controls else ""
            print(f"{out / r.name}  [{r.part}] {ov}{ctl}")
        print(f"{len(runs)} runs")
        return {"runs": [r.record() for r in runs]}, None
    with DirLock(out, what="sweep directory") if lock else contextlib.nullcontext():
        if progress:
            print(f"sweep {recipe.name}: {len(runs)} runs ({len({r.variant for r in runs})} variants × "
                  f"{len(seeds)} seeds) from {sweep['_path']} → {out}", flush=True)
        meta = {"recipe": recipe.name, "config": str(sweep["_path"]), "label": label, "seeds": seeds, "steps": steps,
                "only": only_list,
                SWEEP_SETTINGS_KEY: sweep_settings(recipe.name, sweep["_path"], parts, steps, set_values)}
        manifest = run_sweep(runs, out, train_fn=train_fn, resume=resume, progress=progress,
                             trainer_progress=progress and not quiet_trainer, post_run=recipe.post_run, meta=meta,
                             jobs=jobs, threads=threads, lock=False)
        path = None
        if report:
            from weightgeom.experiments.report import make_report

            path = make_report([out], out=out, title=f"weightgeom sweep {recipe.name} {label}")
    return manifest, path


def run(args: argparse.Namespace) -> int:
    """Entry point of ``weightgeom sweep``; exit 1 if a run failed (divergence is a result, not a failure)."""
    try:
        manifest, path = execute(args.recipe, args.config, seeds=args.seeds, steps=args.steps, out=args.out,
                                 only=args.only, sets=args.sets, resume=not args.no_resume,
                                 report=not args.no_report, progress=True, list_only=args.list,
                                 quiet_trainer=args.quiet, jobs=args.jobs, threads=args.threads)
    except (ValueError, FileNotFoundError) as e:
        print(f"weightgeom sweep: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        hint = " (choose another --out)" if isinstance(e, (FileExistsError, NotADirectoryError)) else ""
        print(f"weightgeom sweep: {os_error_line(e)}{hint}", file=sys.stderr)
        return 2
    if args.list:
        return 0
    runs = manifest["runs"]
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.get("status", "?")] = counts.get(r.get("status", "?"), 0) + 1
    print("sweep finished: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    if path:
        print(f"report: {path}")
    return 1 if counts.get("failed") else 0
