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
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from weightgeom._cli_args import nonneg_int, os_error_line, positive_int

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
    c = p.add_argument_group("clusters (--launcher slurm | ray; docs/experiments.md: Running at paper scale)")
    c.add_argument("--launcher", choices=("local", "slurm", "ray"), default="local",
                   help="where the runs train: local (this machine, default), slurm (a job array through submitit; "
                        "pip install 'weightgeom[slurm]'), ray (Ray tasks; pip install 'weightgeom[ray]')")
    c.add_argument("--dry-run", action="store_true",
                   help="print per run the command and resources that would be submitted, and exit")
    c.add_argument("--gpus-per-run", type=nonneg_int, default=None,
                   help="GPUs per run (default 0; more than 1 trains under torchrun on one node)")
    c.add_argument("--cpus-per-run", type=positive_int, default=None,
                   help="CPU cores per run (default: 8 per GPU, 1 without GPUs)")
    c.add_argument("--mem-per-run", type=float, default=None, metavar="GB",
                   help="memory per run in GB (slurm; GPU runs default to a size from the model: the dry run says how)")
    c.add_argument("--time-limit", default=None, metavar="MIN|H:MM:SS",
                   help="time limit per job (slurm, default 240 min); longer runs are requeued from their checkpoint")
    c.add_argument("--partition", default=None, help="SLURM partition (default: the cluster's)")
    c.add_argument("--slurm-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="extra sbatch option, e.g. account=myproj, qos=high, constraint=a100 (repeatable)")
    c.add_argument("--slurm-setup", action="append", default=[], metavar="LINE",
                   help="shell line run in each job before training, e.g. 'module load cuda' (repeatable)")
    c.add_argument("--array-parallelism", type=positive_int, default=None,
                   help="most array tasks running at once (slurm; default: the cluster's limit)")
    c.add_argument("--submitit-cluster", choices=("slurm", "local"), default=None,
                   help="slurm (default), or local: the same submitit jobs as processes on this machine")
    c.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (auto, ray://head:10001, head:6379; default: a local Ray instance)")
    c.add_argument("--check-paths", action="store_true", default=None,
                   help="refuse the sweep when a path its runs read (data.path) does not exist on this machine "
                        "(default: a dry run lists and flags them)")
    c.add_argument("--max-retries", type=nonneg_int, default=None,
                   help="Ray: retries of a run whose worker or node died (default 3); each resumes from its checkpoint")


CLUSTER_OPTIONS = {
    "gpus_per_run": ("--gpus-per-run", ("slurm", "ray")), "cpus_per_run": ("--cpus-per-run", ("slurm", "ray")),
    "mem_per_run": ("--mem-per-run", ("slurm",)), "time_limit": ("--time-limit", ("slurm",)),
    "partition": ("--partition", ("slurm",)), "slurm_opt": ("--slurm-opt", ("slurm",)),
    "slurm_setup": ("--slurm-setup", ("slurm",)), "array_parallelism": ("--array-parallelism", ("slurm",)),
    "submitit_cluster": ("--submitit-cluster", ("slurm",)), "ray_address": ("--ray-address", ("ray",)),
    "max_retries": ("--max-retries", ("ray",)), "check_paths": ("--check-paths", ("slurm", "ray")),
}
"""Option (argparse dest) → (flag, the launchers that use it): a flag given for another launcher is refused."""


def cluster_options(args: argparse.Namespace) -> dict:
    """The cluster options given on the command line (``{dest: value}``), checked against ``--launcher``.

    Raises:
        ValueError: an option of another launcher, ``--jobs`` with a cluster launcher, or a bad ``--slurm-opt``.
    """
    given = {k: getattr(args, k, None) for k in CLUSTER_OPTIONS}
    given = {k: v for k, v in given.items() if v not in (None, [])}
    for k in given:
        flag, users = CLUSTER_OPTIONS[k]
        if args.launcher not in users:
            raise ValueError(f"{flag} is an option of --launcher {' / '.join(users)}, not {args.launcher}")
    if args.launcher != "local" and args.jobs != 1:
        raise ValueError(f"--jobs {args.jobs} applies to --launcher local; with --launcher {args.launcher} as many "
                         "runs train at once as the cluster's resources allow")
    from weightgeom.experiments import launchers

    for key, value in given.items():  # each value becomes part of an sbatch script or a Ray address: one line each
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and re.search(r"[\x00-\x1f\x7f]", v):
                raise ValueError(f"{CLUSTER_OPTIONS[key][0]} {v!r}: contains a line break or control character, "
                                 "which would start a new line of the job script")
    partition = given.get("partition")
    if partition is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*", partition):
        raise ValueError(f"--partition {partition!r}: expected a SLURM partition name (letters, digits, _ . -; "
                         "several separated by commas)")
    seen: dict[str, str] = {}
    for item in given.get("slurm_opt", []):
        key, _ = launchers.check_slurm_opt(item)
        if key in seen:
            raise ValueError(f"--slurm-opt {item!r}: {key} was already given ({seen[key]!r}); give each option once")
        seen[key] = item
    mem = given.get("mem_per_run")
    if mem is not None and not (mem > 0 and math.isfinite(mem)):
        raise ValueError(f"--mem-per-run {mem:g}: must be a positive number of GB (SLURM reads 0 as all of a node's "
                         "memory)")
    return given


def execute(recipe_name: str, config: str | None = None, seeds=None, steps: int | None = None,
            out: str | Path | None = None, only=None, sets=(), resume: bool = True, report: bool = True,
            progress: bool = True, list_only: bool = False, train_fn=None,
            quiet_trainer: bool = False, jobs: int = 1, threads: int | None = None,
            lock: bool = True, launcher: str = "local", cluster: dict | None = None,
            dry_run: bool = False) -> tuple[dict, Path | None]:
    """Plan, run and report a sweep (the body of ``weightgeom sweep``; also used by ``weightgeom demo``).

    ``progress`` prints one line per run; the trainer's own progress bar is shown too unless ``quiet_trainer``.
    Everything is planned and validated before the sweep directory is touched; from then on until the report is
    written this process holds the sweep directory's lock.

    Args:
        lock: take ``out``'s lock (False: the caller holds it).
        launcher: ``local`` | ``slurm`` | ``ray`` (:mod:`weightgeom.experiments.launchers`).
        cluster: the launcher's options (:func:`cluster_options`: ``gpus_per_run``, ``partition`` ...).
        dry_run: print per run the command and resources that would be submitted; nothing is written.

    Returns:
        ``(manifest, report_path)``; ``report_path`` is None with ``report=False`` or ``list_only``.

    Raises:
        ValueError: bad recipe, preset content, ``--only``, ``--set``; the directory is owned by another sweep
            (``LockError``); runs, or the sweep directory, recorded with other settings (``SweepSettingsError``).
        FileNotFoundError: unknown preset or config file.
        OSError: the sweep directory cannot be written.
    """
    # imported here, not at module level: the config schema imports torch, and `weightgeom sweep --help` must not
    from weightgeom.experiments import compression
    from weightgeom.experiments.runner import SWEEP_SETTINGS_KEY, load_parts, plan, run_sweep, sweep_settings
    from weightgeom.train.config import parse_overrides
    from weightgeom.train.rundir import DirLock

    if compression.is_compress_preset(config, recipe_name):  # no training: compress a pretrained model, measure it
        if launcher != "local" and not (list_only or dry_run):
            raise ValueError(f"--launcher {launcher}: a compress sweep runs in this process (one model loaded once); "
                             "run it without --launcher")
        if dry_run:  # what would run, nothing written: the points, as --list prints them
            print("dry run: a compress sweep runs here, in this process; nothing is written")
        return compression.execute(config, out, resume=resume, progress=progress, list_only=list_only or dry_run,
                                   threads=threads)
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
    from weightgeom.experiments import launchers

    cl = dict(cluster or {})
    resources = launchers.Resources(
        gpus=cl.get("gpus_per_run", 0), cpus=cl.get("cpus_per_run", 1), mem_gb=cl.get("mem_per_run"),
        time_min=launchers.parse_time_limit(str(cl["time_limit"])) if cl.get("time_limit") else 240,
        partition=cl.get("partition") or "")
    sized: list[str] = []
    if launcher != "local":  # a GPU run's CPUs and memory sized from the config where the command line is silent
        resources, sized = launchers.sized_resources(runs, resources, cl)
    if resources.gpus > 1:  # torchrun with one process per GPU: what the trainer would refuse on the cluster
        from weightgeom.schema import from_dict
        from weightgeom.train.config import TrainConfig

        for spec in runs:
            try:
                from_dict(TrainConfig, spec.config["train"]).check_processes(resources.gpus)
            except ValueError as e:
                raise ValueError(f"--gpus-per-run {resources.gpus}: run {spec.name}: {e}; add --set "
                                 f"train.grad_accum={resources.gpus}") from None
    extra = dict(launchers.check_slurm_opt(item) for item in cl.get("slurm_opt", []))
    runner_launcher = launchers.make_launcher(  # a missing package is one line here, before anything is written
        launcher, resources, address=cl.get("ray_address") or "", max_retries=cl.get("max_retries", 3),
        array_parallelism=cl.get("array_parallelism") or 0, extra=extra, setup=cl.get("slurm_setup", []),
        cluster=cl.get("submitit_cluster") or "slurm", check_package=not dry_run)
    planned = sweep_settings(recipe.name, sweep["_path"], parts, steps, set_values)
    if not list_only:  # what the sweep would refuse, refused before anything is written (and by --dry-run alike)
        from weightgeom._paths import unwritable_reason
        from weightgeom.experiments.runner import check_before_writing

        problem = unwritable_reason(out) or (DirLock(out, what="sweep directory").in_use_reason() if lock else "")
        if problem:
            raise ValueError(problem)
        check_before_writing(runs, out, planned, resume)
        if cl.get("check_paths"):
            launchers.check_paths(runs)
    if dry_run:
        notes = (sized + [f"sbatch --{k.replace('_', '-')}={v}" for k, v in extra.items()]
                 + [f"setup: {line}" for line in cl.get("slurm_setup", [])]
                 + ([f"array parallelism: {cl['array_parallelism']}"] if cl.get("array_parallelism") else []))
        # an sbatch script only where one would be submitted (--submitit-cluster local runs processes here)
        script = runner_launcher.sbatch_preview if getattr(runner_launcher, "cluster", "") == "slurm" else None
        launchers.dry_run(runs, out, launcher, resources, notes=notes, resume=resume,
                          script=(lambda n: script(out, n)) if script is not None else None,
                          task_spec=runner_launcher.task_spec() if hasattr(runner_launcher, "task_spec") else "")
        return {"runs": [r.record() for r in runs]}, None
    if runner_launcher is not None:
        runner_launcher.check()
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
                SWEEP_SETTINGS_KEY: planned}
        manifest = run_sweep(runs, out, train_fn=train_fn, resume=resume, progress=progress,
                             trainer_progress=progress and not quiet_trainer, post_run=recipe.post_run, meta=meta,
                             jobs=jobs, threads=threads, lock=False, launcher=runner_launcher)
        path = None
        if report:
            from weightgeom.experiments.report import make_report

            try:
                path = make_report([out], out=out, title=f"weightgeom sweep {recipe.name} {label}")
            except FileNotFoundError:  # every run failed before writing its directory: sweep.json says why
                failed = [r for r in manifest["runs"] if r.get("status") == "failed"]
                if not failed:
                    raise
                print(f"no report: no run wrote a run directory ({len(failed)} failed before their first step; "
                      f"reasons in {out / 'sweep.json'}), first: {failed[0].get('name')}: "
                      f"{str(failed[0].get('reason') or failed[0].get('error') or '')[:300]}", flush=True)
    return manifest, path


def run(args: argparse.Namespace) -> int:
    """Entry point of ``weightgeom sweep``; exit 1 if a run failed (divergence is a result, not a failure)."""
    try:
        manifest, path = execute(args.recipe, args.config, seeds=args.seeds, steps=args.steps, out=args.out,
                                 only=args.only, sets=args.sets, resume=not args.no_resume,
                                 report=not args.no_report, progress=True, list_only=args.list,
                                 quiet_trainer=args.quiet, jobs=args.jobs, threads=args.threads,
                                 launcher=args.launcher, cluster=cluster_options(args), dry_run=args.dry_run)
    except (ValueError, FileNotFoundError) as e:
        print(f"weightgeom sweep: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        hint = " (choose another --out)" if isinstance(e, (FileExistsError, NotADirectoryError)) else ""
        print(f"weightgeom sweep: {os_error_line(e)}{hint}", file=sys.stderr)
        return 2
    if args.list or args.dry_run:
        return 0
    runs = manifest["runs"]
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.get("status", "?")] = counts.get(r.get("status", "?"), 0) + 1
    print("sweep finished: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    if path:
        print(f"report: {path}")
    return 1 if counts.get("failed") else 0
