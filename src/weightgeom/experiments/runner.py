"""Shared sweep runner: expand a recipe into runs, run them one after another, resume, write a manifest.

A *recipe* (``manifolds``, ``continuity``, ``md``) is data: a list of :class:`Variant` — a name plus a dict of
``"section.key" -> value`` overrides on a base trainer config. :func:`plan` crosses the variants with the seeds and
returns fully resolved :class:`RunSpec` objects; :func:`run_sweep` trains each one with
``weightgeom.train.train`` into ``OUT/<run name>/``, skips runs whose ``status.json`` already says ``done`` or
``diverged`` (so an interrupted sweep resumes), and keeps ``OUT/sweep.json`` (the manifest) up to date after
every run. Each run directory also gets ``experiment.json`` (recipe, variant, seed, overrides) so that
``weightgeom report`` can group runs without the manifest.

Base configs (the CONFIG argument) are either a preset name looked up in ``configs/experiments/<name>.toml`` or a
path to a TOML/YAML file. A file is either a plain trainer config (it has a ``[model]`` table) or a *sweep file*
with named parts, e.g. ``[parts.resmlp]`` and ``[parts.llama]`` (each a trainer config) plus an optional
``[sweep]`` table (``seeds``, ``steps``).
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

FINISHED = ("done", "diverged")
MANIFEST = "sweep.json"
EXPERIMENT_FILE = "experiment.json"


@dataclass(frozen=True)
class Variant:
    """One arm of a recipe.

    Attributes:
        name: short identifier, used in run names and report tables (e.g. ``"hetero"``).
        overrides: ``"section.key" -> value`` applied on top of the part's base config.
        description: one line for the report.
        part: which base config of a multi-part preset this variant uses (``"main"`` for single-config recipes).
        controls: extra training-time controls implemented in :mod:`weightgeom.experiments.controls`
            (e.g. ``{"sigma_cap": 1.0}``); recorded in the manifest.
        group: optional grouping key for reports (e.g. the optimizer in the MD sweep).
        tags: free-form numbers/strings the report uses (e.g. ``{"width": 128, "lr": 0.02}``).
    """

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    part: str = "main"
    controls: dict[str, Any] = field(default_factory=dict)
    group: str = ""
    tags: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunSpec:
    """A fully resolved run: variant × seed with its final config."""

    name: str
    recipe: str
    variant: str
    seed: int
    part: str
    config: dict[str, Any]
    overrides: dict[str, Any]
    description: str = ""
    controls: dict[str, Any] = field(default_factory=dict)
    group: str = ""
    tags: dict[str, Any] = field(default_factory=dict)
    fresh: bool = False  # start over instead of resuming from the run's checkpoint (--no-resume)

    def record(self) -> dict[str, Any]:
        """The JSON-able description written to ``experiment.json`` and the manifest."""
        d = asdict(self)
        d.pop("config")
        d.pop("fresh")
        return d


# ----------------------------------------------------------------------------------------------------------- configs
def repo_root() -> Path:
    """The source checkout holding ``configs/`` (editable install), else the current directory."""
    here = Path(__file__).resolve()
    for p in here.parents:
        if (p / "configs").is_dir() and (p / "pyproject.toml").exists():
            return p
    return Path.cwd()


def preset_dirs() -> list[Path]:
    """Directories searched for preset names, in order."""
    dirs = [Path.cwd() / "configs" / "experiments", repo_root() / "configs" / "experiments"]
    out: list[Path] = []
    for d in dirs:
        if d not in out:
            out.append(d)
    return out


def available_presets() -> list[str]:
    """Preset names found in :func:`preset_dirs`."""
    names = set()
    for d in preset_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.toml"))
    return sorted(names)


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML or YAML file into a dict."""
    path = Path(path)
    if path.suffix in (".yaml", ".yml"):
        import yaml

        with open(path) as f:
            data = yaml.safe_load(f) or {}
    else:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a table at the top level")
    return data


def resolve_config(arg: str, recipe: str | None = None) -> tuple[str, Path]:
    """Map the CONFIG argument to ``(preset label, file path)``.

    Lookup for a name (not a path): ``configs/experiments/<recipe>-<name>.toml``, then
    ``configs/experiments/<name>.toml`` (current directory first, then the source checkout), then the trainer's
    bundled configs (``weightgeom train <name>``).

    Raises:
        FileNotFoundError: when ``arg`` is neither an existing file nor a known preset.
    """
    p = Path(arg)
    if p.suffix in (".toml", ".yaml", ".yml") or os.sep in arg:
        if not p.exists():
            raise FileNotFoundError(f"config file not found: {arg}")
        return p.stem, p
    for d in preset_dirs():
        for stem in ([f"{recipe}-{arg}"] if recipe else []) + [arg]:
            cand = d / f"{stem}.toml"
            if cand.exists():
                return arg, cand
    try:
        from weightgeom.train.config import resolve_config_path

        return arg, Path(resolve_config_path(arg))
    except (ImportError, ValueError):
        pass
    raise FileNotFoundError(f"unknown preset {arg!r}; available: {', '.join(available_presets()) or '(none)'} "
                            "(a '<recipe>-' prefix may be left out)")


def load_parts(arg: str, recipe: str | None = None) -> tuple[str, dict[str, dict[str, Any]], dict[str, Any]]:
    """Load the CONFIG argument into ``(label, parts, sweep_defaults)``.

    A plain trainer config becomes the single part named after its model kind *and* ``"main"``.
    """
    label, path = resolve_config(arg, recipe)
    data = load_file(path)
    sweep = dict(data.pop("sweep", {}) or {})
    if "parts" in data:
        parts = {k: dict(v) for k, v in data["parts"].items()}
        if not parts:
            raise ValueError(f"{path}: [parts] is empty")
    else:
        if "model" not in data:
            raise ValueError(f"{path}: neither a trainer config ([model] table) nor a sweep file ([parts.*] tables)")
        kind = str(data["model"].get("kind", "gpt"))
        parts = {"main": data, kind: data}
    sweep["_path"] = str(path)
    return label, parts, sweep


@dataclass(frozen=True)
class Recipe:
    """A named experiment: how to turn base configs into variants.

    Attributes:
        name: ``manifolds`` | ``continuity`` | ``md``.
        default_config: preset used when CONFIG is omitted.
        default_seeds: seeds when neither ``--seeds`` nor the preset's ``[sweep] seeds`` say otherwise.
        variants: ``(parts, sweep_table, steps) -> list[Variant]``; ``steps`` is ``--steps`` or None.
        post_run: optional ``(spec, run_dir)`` analysis after each finished run.
        doc: one paragraph for ``--help`` and the docs.
    """

    name: str
    default_config: str
    default_seeds: tuple[int, ...]
    variants: Callable[[dict[str, dict[str, Any]], dict[str, Any], int | None], list[Variant]]
    post_run: Callable[[RunSpec, Path], None] | None = None
    doc: str = ""


def set_path(cfg: dict[str, Any], key: str, value: Any) -> None:
    """Set ``cfg["a"]["b"] = value`` for ``key="a.b"`` (creating tables); ``value=None`` deletes the key."""
    parts = key.split(".")
    d = cfg
    for k in parts[:-1]:
        nxt = d.get(k)
        if not isinstance(nxt, dict):
            nxt = {}
            d[k] = nxt
        d = nxt
    if value is None:
        d.pop(parts[-1], None)
    else:
        d[parts[-1]] = value


def get_path(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    """``cfg["a"]["b"]`` for ``key="a.b"``, or ``default``."""
    d: Any = cfg
    for k in key.split("."):
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def apply_overrides(cfg: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``cfg`` with ``overrides`` applied."""
    out = copy.deepcopy(cfg)
    for k, v in overrides.items():
        set_path(out, k, v)
    return out


def parse_set(items: Iterable[str]) -> dict[str, Any]:
    """Parse ``--set section.key=value`` strings; values are TOML literals, else plain strings."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set expects section.key=value, got {item!r}")
        key, raw = item.split("=", 1)
        key = key.strip()
        if "." not in key:
            raise ValueError(f"--set key must be section.key, got {key!r}")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        out[key] = value
    return out


def fit_steps(cfg: dict[str, Any], steps: int) -> None:
    """Set ``train.max_steps`` and shrink eval / diagnostics / checkpoint / warmup intervals to fit ``steps``."""
    set_path(cfg, "train.max_steps", int(steps))
    quarter = max(1, steps // 4)
    for key in ("train.eval_every", "diagnostics.every", "train.log_every"):
        v = get_path(cfg, key)
        if isinstance(v, int) and v > 0 and v > quarter:
            set_path(cfg, key, quarter)
    v = get_path(cfg, "train.ckpt_every")
    if isinstance(v, int) and v > 0 and v > steps:
        set_path(cfg, "train.ckpt_every", steps)
    w = get_path(cfg, "schedule.warmup")
    if isinstance(w, int) and w > 0 and w >= steps:
        set_path(cfg, "schedule.warmup", max(0, steps // 10))


# ------------------------------------------------------------------------------------------------------------ plan
def run_name(variant: str, seed: int) -> str:
    """Directory name of one run."""
    return f"{variant}-s{seed}"


def plan(
    recipe: str,
    variants: Sequence[Variant],
    parts: dict[str, dict[str, Any]],
    seeds: Sequence[int],
    steps: int | None = None,
    only: Sequence[str] | None = None,
    sets: dict[str, Any] | None = None,
) -> list[RunSpec]:
    """Cross variants with seeds into resolved runs.

    Args:
        recipe: recipe name, recorded in each run.
        variants: the recipe's variants.
        parts: base configs by part name (see :func:`load_parts`).
        seeds: seeds to run for every variant.
        steps: if given, overrides ``train.max_steps`` (and shrinks intervals to fit).
        only: keep variants whose name matches one of these (exact name, or a prefix ending in ``*``).
        sets: user ``--set`` overrides applied last to every run.

    Raises:
        ValueError: unknown part, or ``only`` matching nothing.
    """
    chosen = list(variants)
    if only:
        def keep(v: Variant) -> bool:
            return any(v.name == o or (o.endswith("*") and v.name.startswith(o[:-1])) or v.group == o for o in only)

        chosen = [v for v in chosen if keep(v)]
        if not chosen:
            names = ", ".join(v.name for v in variants)
            raise ValueError(f"--only {','.join(only)} matches no variant; variants: {names}")
    runs: list[RunSpec] = []
    for v in chosen:
        if v.part not in parts:
            raise ValueError(f"variant {v.name!r} needs config part {v.part!r}; the config has {sorted(parts)}")
        for seed in seeds:
            cfg = apply_overrides(parts[v.part], v.overrides)
            if steps is not None:
                fit_steps(cfg, steps)
            if sets:
                cfg = apply_overrides(cfg, sets)
            set_path(cfg, "run.seed", int(seed))
            name = run_name(v.name, seed)
            set_path(cfg, "run.name", name)
            controls = dict(v.controls)
            if steps is not None and "continuity_every" in controls:
                controls["continuity_every"] = max(1, min(int(controls["continuity_every"]), steps // 8 or 1))
            runs.append(RunSpec(name=name, recipe=recipe, variant=v.name, seed=int(seed), part=v.part, config=cfg,
                                overrides=dict(v.overrides), description=v.description,
                                controls=controls, group=v.group, tags=dict(v.tags)))
    return runs


# ------------------------------------------------------------------------------------------------------------- run
def read_status(run_dir: Path) -> dict[str, Any]:
    """``status.json`` of a run directory, or ``{}``."""
    try:
        with open(run_dir / "status.json") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def _default_train(config: dict[str, Any], run_dir: str, progress: bool, fresh: bool = False) -> dict[str, Any]:
    from weightgeom.train import train

    return train(config, run_dir=run_dir, progress=progress, resume=False if fresh else "auto")


TrainFn = Callable[[RunSpec, Path, bool], dict[str, Any]]


def default_train_fn(spec: RunSpec, run_dir: Path, progress: bool) -> dict[str, Any]:
    """Train one run with ``weightgeom.train.train``, applying the variant's controls if any."""
    if spec.controls:
        from weightgeom.experiments.controls import train_with_controls

        return train_with_controls(spec.config, run_dir, spec.controls, progress=progress, fresh=spec.fresh)
    return _default_train(spec.config, str(run_dir), progress, spec.fresh)


def _fmt_s(s: float) -> str:
    if s < 90:
        return f"{s:.0f}s"
    if s < 5400:
        return f"{s / 60:.1f}min"
    return f"{s / 3600:.1f}h"


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(v) if math.isfinite(float(v)) else None
    return out


def _worker_init(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(int(threads))


def _worker_call(train_fn: TrainFn, spec: RunSpec, run_dir: Path, progress: bool) -> tuple[str, Any, float]:
    """Run one training in a worker process; exceptions come back as a one-line message (always picklable)."""
    t0 = time.perf_counter()
    try:
        return "ok", train_fn(spec, run_dir, progress) or {}, time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001
        if os.environ.get("WG_DEBUG"):
            traceback.print_exc()
        return "error", f"{type(e).__name__}: {e}".splitlines()[0], time.perf_counter() - t0


def run_sweep(
    runs: Sequence[RunSpec],
    out: str | Path,
    train_fn: TrainFn | None = None,
    resume: bool = True,
    progress: bool = True,
    trainer_progress: bool | None = None,
    post_run: Callable[[RunSpec, Path], None] | None = None,
    meta: dict[str, Any] | None = None,
    jobs: int = 1,
    threads: int | None = None,
) -> dict[str, Any]:
    """Run ``runs`` into ``out/<name>/`` and return the manifest (also written to ``out/sweep.json``).

    A run whose ``status.json`` state is ``done``/``diverged`` is skipped when ``resume`` (its ``post_run`` is
    still called if its outputs are missing — the callback decides). A run that raises is recorded as
    ``failed`` with the one-line error and the sweep continues.

    Args:
        runs: output of :func:`plan`.
        out: sweep directory.
        train_fn: ``(spec, run_dir, progress) -> result dict``; defaults to the trainer. With ``jobs > 1`` it must
            be picklable (a module-level function).
        resume: skip finished runs.
        progress: print one line per run.
        trainer_progress: let the trainer show its progress bar (default: same as ``progress``; always off with
            ``jobs > 1``).
        post_run: called after each finished run (e.g. continuity analysis of its checkpoints).
        meta: extra fields for the manifest (recipe, config label, command).
        jobs: runs trained at the same time, each in its own process (small CPU models: ``jobs=2, threads=1`` on
            2 cores beats one 2-thread run, whose tiny matmuls spend their time synchronising threads).
        threads: ``torch.set_num_threads`` for the training (None: leave PyTorch's default).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_fn = train_fn or default_train_fn
    manifest_path = out / MANIFEST
    manifest: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        **(meta or {}),
        "jobs": jobs,
        "threads": threads,
        "runs": [],
    }
    by_name: dict[str, dict[str, Any]] = {}
    if manifest_path.exists():
        try:
            old = json.loads(manifest_path.read_text())
            manifest["created"] = old.get("created", manifest["created"])
            by_name = {r["name"]: r for r in old.get("runs", [])}
        except (OSError, json.JSONDecodeError):
            by_name = {}
    records = []
    for spec in runs:
        rec = {**by_name.get(spec.name, {}), **spec.record(), "run_dir": str(out / spec.name)}
        rec.setdefault("status", "pending")
        records.append(rec)
    # keep runs of earlier invocations (e.g. other --only subsets) in the manifest
    planned = {r["name"] for r in records}
    records += [r for n, r in by_name.items() if n not in planned]
    manifest["runs"] = records
    _write_json(manifest_path, manifest)

    t_sweep = time.perf_counter()
    n = len(runs)
    done_count = 0
    tp = progress if trainer_progress is None else trainer_progress

    def mark_started(i: int) -> None:
        records[i]["status"] = "running"
        runs[i].fresh = not resume
        run_dir = out / runs[i].name
        run_dir.mkdir(parents=True, exist_ok=True)  # experiment.json first, so a partial run is reportable
        _write_json(run_dir / EXPERIMENT_FILE, runs[i].record())

    def tag(i: int) -> str:
        return f"[{i + 1}/{n}] {runs[i].recipe} {runs[i].name}"

    def finish(i: int, kind: str, payload: Any, wall: float) -> None:
        nonlocal done_count
        spec, rec, run_dir = runs[i], records[i], out / runs[i].name
        if kind == "ok":
            result = payload
            state = result.get("status") or read_status(run_dir).get("state") or "done"
            rec.update(status=state, step=result.get("step"), final=_finite(result.get("final", {})),
                       reason=read_status(run_dir).get("reason"))
        else:
            rec.update(status="failed", reason=payload)
            if progress:
                print(f"{tag(i)}: FAILED {payload}", file=sys.stderr, flush=True)
        rec["wall_s"] = round(wall, 2)
        if run_dir.is_dir():
            _write_json(run_dir / EXPERIMENT_FILE, {**spec.record(), "wall_s": rec["wall_s"]})
        if rec["status"] in FINISHED and post_run is not None:
            try:
                post_run(spec, run_dir)
            except Exception as e:  # noqa: BLE001
                rec["post_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
                if progress:
                    print(f"{tag(i)}: post-run analysis failed: {rec['post_error']}", file=sys.stderr, flush=True)
        _write_json(manifest_path, manifest)
        done_count += 1
        if progress:
            elapsed = time.perf_counter() - t_sweep
            left = sum(1 for r in records[:n] if r["status"] in ("pending", "running"))
            eta = elapsed / max(1, done_count) * left / max(1, jobs)
            fin = rec.get("final") or {}
            val = fin.get("val_loss", fin.get("val/loss"))
            extra = f" val_loss {val:.4f}" if isinstance(val, float) else ""
            print(f"{tag(i)}: {rec['status']} at step {rec.get('step')}{extra} in {_fmt_s(wall)}"
                  f" (sweep {_fmt_s(elapsed)}, ~{_fmt_s(eta)} left)", flush=True)

    todo = []
    for i, spec in enumerate(runs):
        status = read_status(out / spec.name)
        if resume and status.get("state") in FINISHED:
            records[i].update(status=status["state"], step=status.get("step"), reason=status.get("reason"))
            if progress:
                print(f"{tag(i)}: already {status['state']} at step {status.get('step')} (skipped)", flush=True)
            if post_run is not None:
                try:
                    post_run(spec, out / spec.name)
                except Exception as e:  # noqa: BLE001
                    records[i]["post_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            _write_json(manifest_path, manifest)
        else:
            todo.append(i)

    if jobs <= 1 or len(todo) <= 1:
        old_threads = None
        if threads:
            import torch

            old_threads = torch.get_num_threads()
            torch.set_num_threads(int(threads))
        try:
            for i in todo:
                if progress:
                    print(f"{tag(i)}: {runs[i].description or runs[i].variant} ...", flush=True)
                mark_started(i)
                finish(i, *_worker_call(train_fn, runs[i], out / runs[i].name, tp))
        finally:
            if old_threads:
                import torch

                torch.set_num_threads(old_threads)
    else:
        import multiprocessing as mp
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        ctx = mp.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init,
                                 initargs=(threads,)) as ex:
            pending = {}
            queue = list(todo)
            while queue or pending:
                while queue and len(pending) < jobs:
                    i = queue.pop(0)
                    if progress:
                        print(f"{tag(i)}: {runs[i].description or runs[i].variant} ... (started)", flush=True)
                    mark_started(i)
                    pending[ex.submit(_worker_call, train_fn, runs[i], out / runs[i].name, False)] = i
                finished, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                for fut in finished:
                    i = pending.pop(fut)
                    try:
                        finish(i, *fut.result())
                    except Exception as e:  # noqa: BLE001 - a crashed worker process
                        finish(i, "error", f"{type(e).__name__}: {e}".splitlines()[0], 0.0)
    manifest["wall_s"] = round(time.perf_counter() - t_sweep, 2)
    manifest["failed"] = sum(r.get("status") == "failed" for r in records[:n])
    _write_json(manifest_path, manifest)
    return manifest
