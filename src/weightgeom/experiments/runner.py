"""Shared sweep runner: expand a recipe into runs, run them one after another, resume, write a manifest.

A *recipe* (``manifolds``, ``continuity``, ``md``) is data: a list of :class:`Variant` — a name plus a dict of
``"section.key" -> value`` overrides on a base trainer config. :func:`plan` crosses the variants with the seeds and
returns fully resolved :class:`RunSpec` objects; :func:`run_sweep` trains each one with
``weightgeom.train.train`` into ``OUT/<run name>/``, skips runs whose ``status.json`` already says ``done`` or
``diverged`` (so an interrupted sweep resumes), and keeps ``OUT/sweep.json`` (the manifest) up to date after
every run. Each run directory also gets ``experiment.json`` (recipe, variant, seed, overrides) so that
``weightgeom report`` can group runs without the manifest.

A sweep directory has one writer: :func:`run_sweep` holds ``DirLock(out, "sweep directory")`` for the whole sweep (a
second sweep in the same directory gets a one-line ``LockError``). Each run records its *settings* (every config key
after the trainer's validation, plus the variant's controls) and their hash in ``experiment.json`` and the manifest;
re-running a sweep whose runs were trained (or started) with other settings is refused with
:class:`SweepSettingsError` naming the first difference, so a report never shows old runs under new settings. The
sweep directory itself has one set of *sweep-level settings* (:func:`sweep_settings`: recipe, config file and its
content, ``--steps``, ``--set``), recorded in the manifest; a command with other sweep-level settings is refused
the same way, even when it plans only runs the directory does not hold yet (another ``--only`` or ``--seeds``, which
are free). The manifest keeps every invocation (command, time, ``--only``, ``--seeds``) and the union of the seeds.
Parallel runs (``jobs > 1``) train in worker processes that die with the sweep process (:func:`die_with_parent`).

Base configs (the CONFIG argument) are either a preset name (a file of the package's ``experiments/presets/``) or a
path to a TOML/YAML file. A file is either a plain trainer config (it has a ``[model]`` table) or a *sweep file*
with named parts, e.g. ``[parts.resmlp]`` and ``[parts.llama]`` (each a trainer config) plus an optional
``[sweep]`` table (``seeds``, ``steps``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from weightgeom._files import read_json, read_toml, write_atomic
from weightgeom._fmt import duration
from weightgeom._signals import stop_request_handler
from weightgeom.experiments.callbacks import build_callbacks
from weightgeom.train import train
from weightgeom.train.config import (
    bundled_configs,
    config_to_dict,
    get_key,
    load_config,
    read_config_file,
    resolve_config_path,
    set_key,
    with_overrides,
)
from weightgeom.train.rundir import TRAINER_FILES, DirLock, read_status

FINISHED = ("done", "diverged")
MANIFEST = "sweep.json"
EXPERIMENT_FILE = "experiment.json"
PREVIOUS_EXPERIMENT_FILE = "experiment.previous.json"
"""Name a re-trained run's old ``experiment.json`` is given, so the trainer moves it to ``previous/`` with its run."""
RUN_OUTPUTS = (*TRAINER_FILES, "controls.json")
"""Entries of a run directory that show the run was trained (at least started) there (callbacks write their files
only after the trainer has written its own)."""
IGNORED_SETTINGS = ("run.out_dir",)
"""Config keys left out of a run's settings: the sweep chooses the run directory itself."""
IGNORED_SETTING_PREFIXES = ("logging.",)
"""Config sections left out of a run's and a sweep's settings: experiment tracking does not change what a run
computes, so it may be turned on or off when a sweep is re-run."""


class SweepSettingsError(ValueError):
    """A run in the sweep directory was trained (or started) with other settings than the command plans for it."""


@dataclass(frozen=True)
class Variant:
    """One arm of a recipe.

    Attributes:
        name: short identifier, used in run names and report tables (e.g. ``"hetero"``).
        overrides: ``"section.key" -> value`` applied on top of the part's base config.
        description: one line for the report.
        part: which base config of a multi-part preset this variant uses (``"main"`` for single-config recipes).
        controls: the trainer callbacks the run uses, declared as ``{name: value}`` and built by
            :func:`weightgeom.experiments.callbacks.build_callbacks` (``name``: a key of its registry; ``value``: the
            callback's argument, or a table of its keyword arguments); recorded in the manifest and, as
            ``controls.<name>``, in the settings.
        group: optional grouping key for reports (e.g. the optimizer in the MD sweep).
        tags: free-form numbers/strings the report uses (e.g. ``{"width": 128, "lr": 0.02}``).
        after: name of another variant whose run with the same seed must finish first; when that run diverged (or
            was skipped itself), this one is not trained but recorded as ``skipped`` (an LR ladder stops at its
            first diverged rung). Ignored when that variant is not among the planned ones (``--only``).
    """

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    part: str = "main"
    controls: dict[str, Any] = field(default_factory=dict)
    group: str = ""
    tags: dict[str, Any] = field(default_factory=dict)
    after: str = ""


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
    after: str = ""  # run name (same seed) that must finish first; its divergence skips this run (Variant.after)
    fresh: bool = False  # start over instead of resuming from the run's checkpoint (--no-resume)
    settings: dict[str, Any] = field(default_factory=dict)  # see resolved_settings(); filled by plan()

    def resolved(self) -> dict[str, Any]:
        """The run's settings (computed and cached on first use; see :func:`resolved_settings`)."""
        if not self.settings:
            self.settings = resolved_settings(self)
        return self.settings

    def record(self) -> dict[str, Any]:
        """The JSON-able description written to the manifest: what :func:`plan` decided plus the settings hash."""
        d = asdict(self)
        for k in ("config", "fresh", "settings"):
            d.pop(k)
        d["settings_hash"] = settings_hash(self.resolved())
        return d

    def experiment_record(self) -> dict[str, Any]:
        """The content of the run's ``experiment.json``: :meth:`record` plus the full settings."""
        return {**self.record(), "settings": self.resolved()}


# ----------------------------------------------------------------------------------------------------------- configs
def preset_dirs() -> list[Path]:
    """Directories searched for preset names, in order."""
    dirs = [Path(__file__).resolve().parent / "presets"]
    out: list[Path] = []
    for d in dirs:
        if d not in out:
            out.append(d)
    return out


def sweep_presets() -> list[str]:
    """Sweep preset names found in :func:`preset_dirs` (``weightgeom.models.available_presets`` lists model
    presets)."""
    names = set()
    for d in preset_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.toml"))
    return sorted(names)


def resolve_preset(arg: str, recipe: str | None = None) -> tuple[str, Path]:
    """Map the CONFIG argument to ``(preset label, file path)``.

    Lookup for a name (not a path), in the package's ``experiments/presets/``: ``<recipe>-<name>.toml``, then
    ``<name>.toml``; then the trainer's bundled configs (``weightgeom train <name>``).

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
    if arg in bundled_configs():
        return arg, resolve_config_path(arg)
    raise FileNotFoundError(f"unknown preset {arg!r}; available: {', '.join(sweep_presets()) or '(none)'} "
                            "(a '<recipe>-' prefix may be left out)")


def load_parts(arg: str, recipe: str | None = None) -> tuple[str, dict[str, dict[str, Any]], dict[str, Any]]:
    """Load the CONFIG argument into ``(label, parts, sweep_defaults)``.

    A plain trainer config becomes the single part named after its model kind *and* ``"main"``.
    """
    label, path = resolve_preset(arg, recipe)
    data = read_config_file(path)
    sweep = data.pop("sweep", {}) or {}
    if not isinstance(sweep, dict):
        raise ValueError(f"{path}: [sweep] must be a table")
    sweep = dict(sweep)
    if "parts" in data:
        if not isinstance(data["parts"], dict) or not all(isinstance(v, dict) for v in data["parts"].values()):
            raise ValueError(f"{path}: [parts] must hold tables ([parts.<name>] trainer configs)")
        parts = {k: dict(v) for k, v in data["parts"].items()}
        if not parts:
            raise ValueError(f"{path}: [parts] is empty")
    else:
        if not isinstance(data.get("model"), dict):
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


def fit_steps(cfg: dict[str, Any], steps: int) -> None:
    """Set ``train.max_steps`` and shrink eval / diagnostics / checkpoint / warmup intervals to fit ``steps``."""
    set_key(cfg, "train.max_steps", int(steps))
    quarter = max(1, steps // 4)
    for key in ("train.eval_every", "diagnostics.every", "train.log_every"):
        v = get_key(cfg, key)
        if isinstance(v, int) and v > 0 and v > quarter:
            set_key(cfg, key, quarter)
    v = get_key(cfg, "train.ckpt_every")
    if isinstance(v, int) and v > 0 and v > steps:
        set_key(cfg, "train.ckpt_every", steps)
    w = get_key(cfg, "schedule.warmup")
    if isinstance(w, int) and w > 0 and w >= steps:
        set_key(cfg, "schedule.warmup", max(0, steps // 10))


# -------------------------------------------------------------------------------------------------------- settings
_MISSING = object()


def flatten(cfg: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": {}}`` → ``{"a.b": 1}`` (an empty table sets nothing)."""
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _jsonable(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples → lists, unknown objects → strings)."""
    return json.loads(json.dumps(obj, default=str))


def resolved_settings(spec: RunSpec) -> dict[str, Any]:
    """Everything that decides what a run computes, as flat ``section.key -> value`` (JSON-able).

    Every key of the run's config after the trainer's validation (defaults filled in, values coerced to the schema's
    types), without :data:`IGNORED_SETTINGS`, plus the variant's controls as ``controls.<name>``. Data-derived model
    fields the trainer fills in at start (vocabulary size, context length) are not included.

    Raises:
        ValueError: the config is invalid (one line naming the key and the run).
    """
    try:
        cfg = load_config(spec.config)
    except ValueError as e:
        raise ValueError(f"{e} (run {spec.name})") from None
    flat = {k: v for k, v in flatten(config_to_dict(cfg)).items()
            if k not in IGNORED_SETTINGS and not k.startswith(IGNORED_SETTING_PREFIXES)}
    flat.update({f"controls.{k}": v for k, v in sorted(spec.controls.items())})
    return _jsonable(flat)


def settings_hash(settings: dict[str, Any]) -> str:
    """16 hex characters identifying ``settings`` (SHA-256 of its sorted JSON)."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _same(a: Any, b: Any) -> bool:
    """Equal as settings: numbers by value (``1 == 1.0``; NaN equals NaN), lists element by element."""
    num = (int, float)
    if isinstance(a, num) and isinstance(b, num) and not isinstance(a, bool) and not isinstance(b, bool):
        return float(a) == float(b) or (math.isnan(float(a)) and math.isnan(float(b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


FREE_SETTINGS = ("model.", "optim.rules.", "controls.")
"""Settings that may be absent from a validated config (model fields left to their defaults, the free ``optim.rules``
table, controls): absent on one side only, they differ. Any other key is always present in a validated config, so one
absent on one side only was written by another version of weightgeom and is not a difference."""


def settings_differences(recorded: dict[str, Any], planned: dict[str, Any],
                         only_common: bool = False) -> list[tuple[str, Any, Any]]:
    """Settings that differ, as ``(key, recorded value, planned value)`` in the planned order.

    A value missing on one side is :data:`_MISSING`; that counts only for :data:`FREE_SETTINGS`.

    Args:
        recorded: what the run directory says the run was trained with.
        planned: what the command plans (:func:`resolved_settings`).
        only_common: compare only keys present on both sides (for the trainer's ``config.resolved.toml``, which
            also holds data-derived fields).
    """
    out = []
    for key in list(planned) + [k for k in recorded if k not in planned]:
        old, new = recorded.get(key, _MISSING), planned.get(key, _MISSING)
        if old is _MISSING or new is _MISSING:
            if only_common or not key.startswith(FREE_SETTINGS):
                continue
            out.append((key, old, new))
        elif not _same(old, new):
            out.append((key, old, new))
    return out


def _fmt_value(v: Any) -> str:
    return json.dumps(v, default=str)


def describe_difference(key: str, old: Any, new: Any) -> str:
    """``"train.max_steps=60, the command asks 120"`` and the forms for a key set on one side only."""
    if old is _MISSING:
        return f"without {key}, the command sets {key}={_fmt_value(new)}"
    if new is _MISSING:
        return f"with {key}={_fmt_value(old)}, the command does not set it"
    return f"with {key}={_fmt_value(old)}, the command asks {_fmt_value(new)}"


@dataclass(frozen=True)
class Unreadable:
    """A run or sweep file that is there but cannot be used: ``reason`` is one line naming it and what is wrong."""

    reason: str


def _read_json(path: Path) -> Any:
    """A run or sweep file's JSON (``read_json``: bounded, no FIFO, deep nesting and huge integers refused), None
    where it is missing, :class:`Unreadable` where it is there but unusable."""
    try:
        return read_json(path)
    except FileNotFoundError:
        return None
    except ValueError as e:
        return Unreadable(str(e))
    except OSError as e:
        return Unreadable(f"{path}: {e.strerror or e}")


def _resolved_toml(run_dir: Path) -> dict[str, Any] | None:
    """The trainer's ``config.resolved.toml`` of a run, flattened, or None if missing/unreadable."""
    try:
        return _jsonable(flatten(read_toml(run_dir / "config.resolved.toml")))
    except (OSError, ValueError):
        return None


def has_run_outputs(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds anything a training wrote (:data:`RUN_OUTPUTS`)."""
    return any((run_dir / n).exists() for n in RUN_OUTPUTS)


def recorded_difference(spec: RunSpec, run_dir: Path) -> list[tuple[str, Any, Any]]:
    """How the run trained (or started) in ``run_dir`` differs from ``spec``; empty if it does not (or never ran).

    Two records are compared with the planned settings: the sweep's ``experiment.json`` (all settings and the
    controls) and the trainer's ``config.resolved.toml`` (the keys both have; also covers runs recorded before
    settings were written to ``experiment.json``).
    """
    if not run_dir.is_dir() or not has_run_outputs(run_dir):
        return []
    planned = spec.resolved()
    exp = _read_json(run_dir / EXPERIMENT_FILE)
    diffs: list[tuple[str, Any, Any]] = []
    if isinstance(exp, dict) and isinstance(exp.get("settings"), dict):
        diffs = settings_differences(exp["settings"], planned)
    resolved = _resolved_toml(run_dir)
    if resolved is not None:
        seen = {d[0] for d in diffs}
        diffs += [d for d in settings_differences(resolved, planned, only_common=True) if d[0] not in seen]
    return diffs


def check_recorded_settings(runs: Sequence[RunSpec], out: Path) -> None:
    """Refuse to resume a sweep whose runs were trained or started with other settings.

    Raises:
        SweepSettingsError: one line naming the sweep, the first run that differs and its first differing setting.
    """
    for spec in runs:
        run_dir = out / spec.name
        diffs = recorded_difference(spec, run_dir)
        if not diffs:
            continue
        verb = "trained" if read_status(run_dir).get("state") in FINISHED else "started"
        more = f" ({len(diffs) - 1} more settings differ)" if len(diffs) > 1 else ""
        raise SweepSettingsError(
            f"sweep {out}: run {spec.name} was {verb} {describe_difference(*diffs[0])}{more}; use --out for a new "
            f"sweep directory or --no-resume to train the runs again (old results move to "
            f"{run_dir / 'previous'}/)")


SWEEP_SETTINGS_KEY = "sweep_settings"
"""Manifest key of the sweep-level settings (:func:`sweep_settings`)."""
LEGACY_SWEEP_KEYS = ("recipe", "steps")
"""Sweep-level settings a manifest written before :data:`SWEEP_SETTINGS_KEY` existed records at its top level."""


def sweep_settings(recipe: str, config_path: str | Path, parts: dict[str, dict[str, Any]], steps: int | None,
                   sets: dict[str, Any] | None) -> dict[str, Any]:
    """The settings every run of one sweep directory shares (JSON-able).

    Args:
        recipe: recipe name.
        config_path: the config file the CONFIG argument resolved to (recorded as an absolute path, for messages).
        parts: its trainer configs (:func:`load_parts`); recorded as a hash, which is what is compared, so an
            edited file is noticed and a copy elsewhere is the same config (its ``[logging]`` tables left out, as
            ``--set logging.*`` is: tracking does not change what the runs compute).
        steps: the effective ``--steps`` (the ``[sweep] steps`` of the file when not given), or None.
        sets: the parsed ``--set`` overrides.
    """
    return {"recipe": recipe, "config": str(Path(config_path).resolve()),
            "config_hash": settings_hash(_jsonable({k: {s: t for s, t in v.items() if s != "logging"}
                                                    for k, v in parts.items()})), "steps": steps,
            "sets": _jsonable({k: v for k, v in (sets or {}).items() if not k.startswith(IGNORED_SETTING_PREFIXES)})}


def _describe_sweep_difference(key: str, old: Any, new: Any) -> str:
    """``"with --steps 2, the command asks --steps 3"`` and the like for one sweep-level setting."""
    if key == "recipe":
        return f"by recipe {old}, the command runs recipe {new}"
    if key == "config":
        if old == new:
            return f"from another content of config {old} (its trainer configs differ)"
        return f"from config {old}, whose trainer configs differ from those of the command's {new}"
    if key == "steps":
        def steps(v: Any) -> str:
            return "no --steps" if v is None else f"--steps {v}"
        return f"with {steps(old)}, the command gives {steps(new)}"
    k = key.split(" ", 1)[1]
    if old is _MISSING:
        return f"without --set {k}, the command sets {k}={_fmt_value(new)}"
    if new is _MISSING:
        return f"with --set {k}={_fmt_value(old)}, the command does not set it"
    return f"with --set {k}={_fmt_value(old)}, the command sets {k}={_fmt_value(new)}"


def sweep_settings_difference(manifest: Any, planned: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """The first sweep-level setting in which ``planned`` differs from an earlier manifest, or None.

    The config file is compared by content (``config_hash``: the same trainer configs under another path are the
    same config); the difference then reads ``("config", recorded path, planned path)``. A manifest without
    :data:`SWEEP_SETTINGS_KEY` (written by an older weightgeom) is compared on :data:`LEGACY_SWEEP_KEYS` where it
    records them; an unreadable one is not compared. ``--set`` keys are compared one by one (``("set optim.muon.lr",
    old, new)``; a side without the key is :data:`_MISSING`).
    """
    if not isinstance(manifest, dict):
        return None
    recorded = manifest.get(SWEEP_SETTINGS_KEY)
    if not isinstance(recorded, dict):
        recorded = {k: manifest[k] for k in LEGACY_SWEEP_KEYS if k in manifest}
    if "recipe" in recorded and not _same(recorded["recipe"], planned.get("recipe")):
        return "recipe", recorded["recipe"], planned.get("recipe")
    if "config_hash" in recorded and recorded["config_hash"] != planned.get("config_hash"):
        return "config", recorded.get("config", "?"), planned.get("config")
    if "steps" in recorded and not _same(recorded["steps"], planned.get("steps")):
        return "steps", recorded["steps"], planned.get("steps")
    old_sets, new_sets = recorded.get("sets"), planned.get("sets") or {}
    if isinstance(old_sets, dict):
        for k in list(new_sets) + [k for k in old_sets if k not in new_sets]:
            a, b = old_sets.get(k, _MISSING), new_sets.get(k, _MISSING)
            if a is _MISSING or b is _MISSING or not _same(a, b):
                return f"set {k}", a, b
    return None


def trained_run_names(out: Path) -> list[str]:
    """Names of the run directories directly under ``out`` that hold a training's outputs, sorted."""
    if not out.is_dir():
        return []
    return sorted(d.name for d in out.iterdir() if d.is_dir() and has_run_outputs(d))


def check_sweep_settings(manifest: Any, planned: dict[str, Any], runs: Sequence[RunSpec], out: Path,
                         resume: bool) -> None:
    """Refuse a command whose sweep-level settings differ from those the sweep directory was run with.

    ``--no-resume`` may change them only when the command trains again every run the directory holds (else the
    directory would mix runs of two settings); otherwise the way out is another ``--out``.

    Raises:
        SweepSettingsError: one line naming the sweep directory, the first difference and the ways out.
    """
    diff = sweep_settings_difference(manifest, planned)
    if diff is None:
        return
    left = sorted(set(trained_run_names(out)) - {r.name for r in runs})
    if not resume and not left:
        return
    line = f"sweep {out} was run {_describe_sweep_difference(*diff)}; use --out for a new sweep directory"
    if left:
        line += f" (--no-resume would leave {len(left)} of its runs, e.g. {left[0]}, with the old settings)"
    else:
        line += " or --no-resume to train its runs again (old results move to <run>/previous/)"
    raise SweepSettingsError(line)


def earlier_manifest(out: Path) -> Any:
    """The ``sweep.json`` already in ``out`` as read: None if there is none, :class:`Unreadable` (naming the file
    and why) if it cannot be read or parsed."""
    path = Path(out) / MANIFEST
    if not os.path.lexists(path):
        return None
    old = _read_json(path)
    return old if old is not None else Unreadable(f"{path}: a dangling link")


def check_before_writing(runs: Sequence[RunSpec], out: Path, planned: Any, resume: bool, old: Any = ...) -> None:
    """The refusals of a sweep command that depend on what ``out`` already holds, checked without writing (the
    sweep's own start, and ``--dry-run`` so that it predicts them): runs trained or started with other settings
    (when resuming) and sweep-level settings that differ (``planned``: :func:`sweep_settings`; None skips it).

    Also refuses a run whose directory is taken by something that is not a directory (a file, a dangling link).

    Raises:
        SweepSettingsError: as :func:`check_recorded_settings` / :func:`check_sweep_settings`.
        NotADirectoryError: a run's directory path holds something else.
    """
    for spec in runs:
        run_dir = Path(out) / spec.name
        if os.path.lexists(run_dir) and not run_dir.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", str(run_dir))
    if resume:
        check_recorded_settings(runs, out)
    if isinstance(planned, dict):
        check_sweep_settings(earlier_manifest(out) if old is ... else old, planned, runs, out, resume)


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
        ValueError: unknown part, ``only`` matching nothing, or a config the trainer would refuse (naming the key).
    """
    chosen = list(variants)
    if only:
        def keep(v: Variant) -> bool:
            return any(v.name == o or (o.endswith("*") and v.name.startswith(o[:-1])) or v.group == o for o in only)

        chosen = [v for v in chosen if keep(v)]
        if not chosen:
            names = ", ".join(v.name for v in variants)
            raise ValueError(f"--only {','.join(only)} matches no variant; variants: {names}")
    for key in sets or {}:
        if key in ("run.seed", "run.name"):
            raise ValueError(f"--set {key}: the sweep sets {key} for every run (use --seeds for seeds, --out for "
                             "where the runs go)")
        varying = sorted({v.name for v in chosen if any(key == k or k.startswith(key + ".") or key.startswith(k + ".")
                                                        for k in v.overrides)})
        if varying:
            raise ValueError(f"--set {key}: recipe {recipe!r} sets this key itself in variant(s) "
                             f"{', '.join(varying[:4])}{' …' if len(varying) > 4 else ''}; a --set would make them "
                             f"train the same thing (choose variants with --only, or edit a copy of the preset)")
    runs: list[RunSpec] = []
    planned_variants = {v.name for v in chosen}
    for v in chosen:
        if v.part not in parts:
            raise ValueError(f"variant {v.name!r} needs config part {v.part!r}; the config has {sorted(parts)}")
        if v.controls:  # an unknown or bad callback is one line before anything runs
            try:
                build_callbacks(v.controls)
            except ValueError as e:
                raise ValueError(f"variant {v.name!r}: {e}") from None
        for seed in seeds:
            cfg = with_overrides(parts[v.part], v.overrides)
            if steps is not None:
                fit_steps(cfg, steps)
            if sets:
                cfg = with_overrides(cfg, sets)
            set_key(cfg, "run.seed", int(seed))
            name = run_name(v.name, seed)
            set_key(cfg, "run.name", name)
            controls = dict(v.controls)
            spec = RunSpec(name=name, recipe=recipe, variant=v.name, seed=int(seed), part=v.part, config=cfg,
                           overrides=dict(v.overrides), description=v.description,
                           controls=controls, group=v.group, tags=dict(v.tags),
                           after=run_name(v.after, seed) if v.after in planned_variants else "")
            spec.resolved()  # validates the config now: a bad --set is one line before anything runs
            runs.append(spec)
    return runs


# ------------------------------------------------------------------------------------------------------------- run
TrainFn = Callable[[RunSpec, Path, bool], dict[str, Any]]

CONTROLS_FILE = "controls.json"
"""What a run's callbacks did (their merged :meth:`~weightgeom.train.callbacks.Callback.summary`)."""


def default_train_fn(spec: RunSpec, run_dir: Path, progress: bool) -> dict[str, Any]:
    """Train one run with ``weightgeom.train.train`` and the callbacks its variant declares.

    The callbacks are built from ``spec.controls`` by :func:`weightgeom.experiments.callbacks.build_callbacks`; when
    the run trained (it was not already finished), their merged summaries are written to ``run_dir/controls.json``.
    """
    callbacks = build_callbacks(spec.controls)
    result = train(spec.config, run_dir=str(run_dir), progress=progress, resume=False if spec.fresh else "auto",
                   callbacks=callbacks)
    run_dir = Path(result.get("run_dir", run_dir))
    if callbacks and not result.get("already_done") and run_dir.is_dir():
        summary: dict[str, Any] = {}
        for cb in callbacks:
            summary.update(cb.summary() if hasattr(cb, "summary") else {})
        _write_json(run_dir / CONTROLS_FILE, summary)
    return result


def _write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1, default=str))


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(v) if math.isfinite(float(v)) else None
    return out


# ------------------------------------------------------------------------------------------------ worker processes
PR_SET_PDEATHSIG = 1
"""Linux ``prctl`` option: the signal a process gets when the thread that created it exits."""


def _set_pdeathsig() -> bool:
    """Linux only: ask the kernel to SIGKILL this process when its parent dies. Returns whether it did."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int, poll_s: float) -> None:
    """Loop of the watchdog thread: exit the process once it is no longer a child of ``parent_pid``."""
    while True:
        time.sleep(poll_s)
        if os.getppid() != parent_pid:
            os._exit(1)


def die_with_parent(parent_pid: int, poll_s: float = 1.0, pdeathsig: bool = True) -> None:
    """Make this (worker) process exit when its parent ``parent_pid`` dies, including by ``kill -9``.

    On Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` has the kernel kill this process as soon as the parent exits. On
    every POSIX system a daemon thread also checks ``os.getppid()`` every ``poll_s`` seconds and exits the process
    once it has been re-parented (its parent died). If the parent is already gone when this is called (it died
    while this process started), the process exits at once.

    Args:
        parent_pid: pid of the process that started this one (the sweep process).
        poll_s: seconds between two checks of the watchdog thread.
        pdeathsig: use ``prctl`` where available (False: the watchdog alone, e.g. to test the fallback).
    """
    if pdeathsig:
        _set_pdeathsig()
    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid, poll_s), daemon=True,
                     name="weightgeom-parent-watch").start()


def _worker_init(threads: int | None, parent_pid: int | None = None) -> None:
    """Initializer of a sweep worker process: die with the sweep process, set the torch thread count."""
    if parent_pid is not None:
        die_with_parent(parent_pid)
    # Ctrl-C reaches a worker twice (the terminal's SIGINT to the process group, then stop_workers'): raise once, and
    # never inside threading/queue code, where it can hang the unwinding (TensorBoard's writer) until the sweep kills
    # the worker with its run's status still "running"
    handler = stop_request_handler("interrupted ({signal})", exc_type=KeyboardInterrupt, once=True)
    for sig in (signal.SIGINT, signal.SIGALRM):
        signal.signal(sig, handler)
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


# ---------------------------------------------------------------------------------------------------------- sweep
def _seed_union(old: Any, new: Any) -> Any:
    """Sorted union of two recorded seed lists; ``new`` unchanged when ``old`` is not a list of integers."""
    if not (isinstance(old, list) and isinstance(new, list)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in old + new)):
        return new
    return sorted(set(old) | set(new))


def _one_line(e: BaseException) -> str:
    return (f"{type(e).__name__}: {e}".splitlines() or [type(e).__name__])[0]


POOL_POLL_S = 0.5
"""Longest the sweep process blocks at a time while its workers train. Ctrl-C may be delivered to one of the pool's
helper threads; a main thread blocked on a lock without a timeout is then not woken, and the KeyboardInterrupt waited
until a run finished (a held run: forever; seen as a hang of the interrupted-parent hostile row in the full suite).
Waking every ``POOL_POLL_S`` lets the main thread run the pending handler."""

PROGRESS_EVERY_S = 300.0
"""Seconds between the sweep's "still running" lines while ``--jobs`` workers train (their trainers print no
progress bar): each running run's last recorded step of its ``train.max_steps`` (from its ``status.json``, written at
each evaluation and checkpoint) and how many runs have finished."""

WORKER_GRACE_S = 20.0
"""Seconds an interrupted sweep gives its workers to unwind (mark their runs failed, release their locks) before
killing them; a worker is normally between two steps well within that on the CPU presets."""


def stop_workers(ex, grace_s: float = WORKER_GRACE_S) -> None:
    """Stop the worker processes of a sweep's process pool now, without waiting for their runs.

    Each live worker gets SIGINT, so its trainer unwinds as on Ctrl-C (``status.json`` says failed, the run's lock is
    released); the pool is shut down with its queued runs cancelled; whatever is still alive after ``grace_s`` seconds
    is killed.
    """
    procs = [p for p in list((getattr(ex, "_processes", None) or {}).values()) if p.is_alive()]
    for p in procs:
        with contextlib.suppress(OSError):
            os.kill(p.pid, signal.SIGINT)
    ex.shutdown(wait=False, cancel_futures=True)  # no further runs start; idle workers exit
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)


class _Sweep:
    """State of one :func:`run_sweep` call: the runs, their manifest records, and what to do after each run."""

    def __init__(self, runs: Sequence[RunSpec], out: Path, train_fn: TrainFn, resume: bool, progress: bool,
                 trainer_progress: bool, post_run: Callable[[RunSpec, Path], None] | None,
                 meta: dict[str, Any] | None, jobs: int, threads: int | None, launcher: Any = None) -> None:
        self.runs, self.out, self.train_fn = list(runs), out, train_fn
        self.launcher = launcher  # None: this machine (jobs/threads); else launchers.SlurmLauncher / RayLauncher
        self.resume, self.progress, self.tp, self.post_run = resume, progress, trainer_progress, post_run
        self.jobs, self.threads = jobs, threads
        self.manifest_path = out / MANIFEST
        meta = dict(meta or {})
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.invocation: dict[str, Any] = {
            "time": now, "command": " ".join(sys.argv), "only": meta.pop("only", None), "seeds": meta.get("seeds"),
            "resume": resume, "jobs": jobs, "threads": threads, "planned": len(self.runs),
            **(launcher.record() if launcher is not None else {"launcher": "local"}),
        }
        self.manifest: dict[str, Any] = {
            "created": now,
            "command": self.invocation["command"],
            **meta,
            "jobs": jobs,
            "threads": threads,
            "invocations": [self.invocation],
            "runs": [],
        }
        self.records: list[dict[str, Any]] = []
        self._index = {spec.name: i for i, spec in enumerate(self.runs)}
        self.t0 = time.perf_counter()
        self.last_progress = self.t0  # the last "still running" line (PROGRESS_EVERY_S)
        self.done_count = 0

    # -- manifest ------------------------------------------------------------------------------------------------
    def _earlier_records(self, old: Any) -> dict[str, dict[str, Any]]:
        """Run records of the earlier manifest ``old``, whose invocations and seeds this manifest takes over.

        An unreadable one is kept aside (renamed), never overwritten.
        """
        if old is None:
            return {}
        if not isinstance(old, dict) or not isinstance(old.get("runs", []), list):
            why = old.reason if isinstance(old, Unreadable) else f"{self.manifest_path}: not a sweep manifest"
            aside = self.manifest_path.with_name(f"sweep.unreadable-{time.strftime('%Y%m%dT%H%M%SZ')}.json")
            os.replace(self.manifest_path, aside)
            print(f"weightgeom sweep: {why}; unreadable, kept as {aside}", file=sys.stderr)
            return {}
        self.manifest["created"] = old.get("created", self.manifest["created"])
        earlier = old.get("invocations")
        if not isinstance(earlier, list):  # a manifest of an older weightgeom: its one invocation, as recorded
            earlier = [{"time": old.get("created"), "command": old.get("command"), "seeds": old.get("seeds")}]
        self.manifest["invocations"] = [*earlier, self.invocation]
        self.manifest["seeds"] = _seed_union(old.get("seeds"), self.manifest.get("seeds"))
        return {r["name"]: r for r in old.get("runs", []) if isinstance(r, dict) and "name" in r}

    def write_manifest(self) -> None:
        _write_json(self.manifest_path, self.manifest)

    def start(self) -> None:
        """Check recorded settings, merge the earlier manifest, write the new one.

        The runs' recorded settings are checked when resuming, the sweep-level settings always (when the caller
        gave them in ``meta``), both before anything is written.
        """
        old = earlier_manifest(self.out)
        check_before_writing(self.runs, self.out, self.manifest.get(SWEEP_SETTINGS_KEY), self.resume, old)
        by_name = self._earlier_records(old)
        for spec in self.runs:
            rec = {**by_name.get(spec.name, {}), **spec.record(), "run_dir": str(self.out / spec.name)}
            if not self.resume or rec.get("settings_hash") != by_name.get(spec.name, {}).get("settings_hash"):
                for k in ("status", "step", "final", "reason", "wall_s", "post_error"):
                    rec.pop(k, None)  # a record of other settings (or a run to be re-trained) says nothing now
            if rec.get("status") == "skipped":  # decided again when the run it comes after has finished
                rec.pop("reason", None)
                rec["status"] = "pending"
            rec.setdefault("status", "pending")
            self.records.append(rec)
        # keep runs of earlier invocations (e.g. other --only subsets) in the manifest
        planned = {r["name"] for r in self.records}
        self.records += [r for n, r in by_name.items() if n not in planned]
        self.manifest["runs"] = self.records
        self.write_manifest()

    # -- one run -------------------------------------------------------------------------------------------------
    def tag(self, i: int) -> str:
        return f"[{i + 1}/{len(self.runs)}] {self.runs[i].recipe} {self.runs[i].name}"

    def _post(self, i: int) -> None:
        spec, rec = self.runs[i], self.records[i]
        if self.post_run is None or rec["status"] not in FINISHED:
            return
        try:
            self.post_run(spec, self.out / spec.name)
        except Exception as e:  # noqa: BLE001
            rec["post_error"] = _one_line(e)
            if self.progress:
                print(f"{self.tag(i)}: post-run analysis failed: {rec['post_error']}", file=sys.stderr, flush=True)

    def skip_finished(self) -> list[int]:
        """Record runs already finished with these settings (``resume``); return the indices left to train."""
        todo = []
        for i, spec in enumerate(self.runs):
            status = read_status(self.out / spec.name)
            if not (self.resume and status.get("state") in FINISHED):
                todo.append(i)
                continue
            self.records[i].update(status=status["state"], step=status.get("step"), reason=status.get("reason"))
            if self.progress:
                print(f"{self.tag(i)}: already {status['state']} at step {status.get('step')} (skipped)", flush=True)
            self._post(i)
            self.write_manifest()
        return todo

    def blocked(self, i: int) -> tuple[str, str]:
        """Whether run ``i`` may start: ``("run", "")``, ``("wait", "")`` while the run it comes after is pending or
        running, or ``("skip", reason)`` when that run diverged or was skipped (:attr:`Variant.after`)."""
        dep = self.runs[i].after
        j = self._index.get(dep) if dep else None
        if j is None:
            return "run", ""
        rec = self.records[j]
        state = rec.get("status")
        if state in ("pending", "running"):
            return "wait", ""
        if state == "diverged":
            return "skip", f"not trained: {dep} diverged at step {rec.get('step')}"
        if state == "skipped":
            return "skip", str(rec.get("reason") or f"not trained: {dep} was skipped")
        return "run", ""

    def skip(self, i: int, reason: str) -> None:
        """Record run ``i`` as ``skipped`` (nothing is trained or written in its directory)."""
        self.records[i].update(status="skipped", reason=reason)
        for k in ("step", "final", "wall_s"):
            self.records[i].pop(k, None)
        self.write_manifest()
        if self.progress:
            print(f"{self.tag(i)}: skipped ({reason})", flush=True)

    def mark_started(self, i: int) -> None:
        """Before training run ``i``: its record says ``running`` and its directory holds ``experiment.json``.

        A run trained again (``resume=False``) in a directory with an earlier run's outputs first renames the old
        ``experiment.json`` to :data:`PREVIOUS_EXPERIMENT_FILE`; the trainer then moves it, with the rest of the
        earlier run, into ``previous/<UTC time>/``.
        """
        spec = self.runs[i]
        self.records[i]["status"] = "running"
        spec.fresh = not self.resume
        run_dir = self.out / spec.name
        run_dir.mkdir(parents=True, exist_ok=True)  # experiment.json first, so a partial run is reportable
        exp = run_dir / EXPERIMENT_FILE
        if spec.fresh and exp.exists() and has_run_outputs(run_dir):
            os.replace(exp, run_dir / PREVIOUS_EXPERIMENT_FILE)
        _write_json(exp, spec.experiment_record())

    def finish(self, i: int, kind: str, payload: Any, wall: float) -> None:
        """Record the outcome of run ``i`` (``kind`` ``"ok"`` with the trainer's result, or ``"error"``)."""
        spec, rec, run_dir = self.runs[i], self.records[i], self.out / self.runs[i].name
        if kind == "ok":
            state = payload.get("status") or read_status(run_dir).get("state") or "done"
            rec.update(status=state, step=payload.get("step"), final=_finite(payload.get("final", {})),
                       reason=read_status(run_dir).get("reason"))
        else:
            rec.update(status="failed", reason=payload)
            if self.progress:
                print(f"{self.tag(i)}: FAILED {payload}", file=sys.stderr, flush=True)
        rec["wall_s"] = round(wall, 2)
        if run_dir.is_dir():
            done = {"final": rec["final"]} if rec.get("final") else {}  # e.g. train_time_s, summed over resumes
            _write_json(run_dir / EXPERIMENT_FILE, {**spec.experiment_record(), "wall_s": rec["wall_s"], **done})
        self._post(i)
        self.write_manifest()
        self.done_count += 1
        if self.progress:
            self._print_done(i, wall)

    def _print_done(self, i: int, wall: float) -> None:
        rec = self.records[i]
        elapsed = time.perf_counter() - self.t0
        left = sum(1 for r in self.records[:len(self.runs)] if r["status"] in ("pending", "running"))
        eta = elapsed / max(1, self.done_count) * left / max(1, self.jobs)
        fin = rec.get("final") or {}
        val = fin.get("val_loss", fin.get("val/loss"))
        extra = f" val_loss {val:.4f}" if isinstance(val, float) else ""
        where = f"at step {rec['step']}" if rec.get("step") is not None else "before its first step"
        print(f"{self.tag(i)}: {rec['status']} {where}{extra} in {duration(wall)}"
              f" (sweep {duration(elapsed)}, ~{duration(eta)} left)", flush=True)

    def _print_running(self, running: list[int]) -> None:
        """One line on the runs in flight: each one's last recorded step of its ``train.max_steps``."""
        self.last_progress = time.perf_counter()
        parts = []
        for i in running:
            step = read_status(self.out / self.runs[i].name).get("step")
            total = (self.runs[i].config.get("train") or {}).get("max_steps")
            of = f"/{total}" if isinstance(total, int) and not isinstance(total, bool) else ""
            at = (f"step {step}{of}" if isinstance(step, int) and not isinstance(step, bool)
                  else f"starting ({total} steps)" if of else "starting")
            parts.append(f"{self.runs[i].name} {at}")
        ended = sum(1 for r in self.records[:len(self.runs)] if r.get("status") not in ("pending", "running"))
        print(f"sweep: running {', '.join(parts)}; {ended} of {len(self.runs)} runs ended "
              f"(sweep {duration(self.last_progress - self.t0)})", flush=True)

    # -- all runs ------------------------------------------------------------------------------------------------
    def run_sequential(self, todo: list[int]) -> None:
        """Train the runs ``todo`` one after another in this process."""
        old_threads = None
        if self.threads:
            import torch

            old_threads = torch.get_num_threads()
            torch.set_num_threads(int(self.threads))
        try:
            for i in todo:
                state, why = self.blocked(i)
                if state == "skip":
                    self.skip(i, why)
                    continue
                if self.progress:
                    print(f"{self.tag(i)}: {self.runs[i].description or self.runs[i].variant} ...", flush=True)
                self.mark_started(i)
                self.finish(i, *_worker_call(self.train_fn, self.runs[i], self.out / self.runs[i].name, self.tp))
        finally:
            if old_threads:
                import torch

                torch.set_num_threads(old_threads)

    def run_parallel(self, todo: list[int]) -> None:
        """Train the runs ``todo``, ``jobs`` at a time, each in a worker process that dies with this one."""
        import multiprocessing as mp
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        ctx = mp.get_context("spawn")
        ex = ProcessPoolExecutor(max_workers=self.jobs, mp_context=ctx, initializer=_worker_init,
                                 initargs=(self.threads, os.getpid()))
        try:
            self._drive_pool(ex, todo, wait, FIRST_COMPLETED)
        except BaseException:  # Ctrl-C, SIGTERM, an error of ours: stop the workers instead of waiting for their runs
            stop_workers(ex)
            raise
        ex.shutdown(wait=True)

    def _drive_pool(self, ex, todo: list[int], wait, first_completed) -> None:
        """Keep ``jobs`` runs in flight in ``ex`` until ``todo`` is done, recording each as it finishes."""
        pending = {}
        queue = list(todo)
        while queue or pending:
            while queue and len(pending) < self.jobs:
                i = None
                for k, cand in enumerate(queue):  # the first queued run not waiting for the run it comes after
                    state, why = self.blocked(cand)
                    if state == "skip":
                        queue.pop(k)
                        self.skip(cand, why)
                        break
                    if state == "run" or not pending:
                        i = queue.pop(k)
                        break
                else:
                    break  # every queued run waits for a run in flight
                if i is None:
                    continue
                if self.progress:
                    print(f"{self.tag(i)}: {self.runs[i].description or self.runs[i].variant} ... (started)",
                          flush=True)
                self.mark_started(i)
                pending[ex.submit(_worker_call, self.train_fn, self.runs[i], self.out / self.runs[i].name,
                                  False)] = i
            if not pending:
                continue
            finished: set = set()
            while not finished:  # short waits: see POOL_POLL_S
                finished, _ = wait(list(pending), timeout=POOL_POLL_S, return_when=first_completed)
                if self.progress and not finished and time.perf_counter() - self.last_progress >= PROGRESS_EVERY_S:
                    self._print_running(sorted(pending.values()))
            for fut in finished:
                i = pending.pop(fut)
                try:
                    result = fut.result()
                except Exception as e:  # noqa: BLE001 - a crashed worker process
                    result = ("error", _one_line(e), 0.0)
                self.finish(i, *result)

    def run(self) -> dict[str, Any]:
        """Start, train what is left, and return the final manifest."""
        self.start()
        todo = self.skip_finished()
        if self.launcher is not None:
            if todo:
                self.launcher.run(self, todo)
        elif self.jobs <= 1 or len(todo) <= 1:
            self.run_sequential(todo)
        else:
            self.run_parallel(todo)
        self.manifest["wall_s"] = round(time.perf_counter() - self.t0, 2)
        self.manifest["failed"] = sum(r.get("status") == "failed" for r in self.records[:len(self.runs)])
        self.invocation.update(wall_s=self.manifest["wall_s"], failed=self.manifest["failed"])
        self.write_manifest()
        return self.manifest


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
    lock: bool = True,
    launcher: Any = None,
) -> dict[str, Any]:
    """Run ``runs`` into ``out/<name>/`` and return the manifest (also written to ``out/sweep.json``).

    With ``resume``, a run whose ``status.json`` state is ``done``/``diverged`` is skipped (its ``post_run`` is
    still called if its outputs are missing — the callback decides), and a run directory whose recorded settings
    differ from the planned ones refuses the whole sweep before anything is written. A run that raises is recorded
    as ``failed`` with the one-line error and the sweep continues. Worker processes (``jobs > 1``) exit when this
    process dies.

    Args:
        runs: output of :func:`plan`.
        out: sweep directory.
        train_fn: ``(spec, run_dir, progress) -> result dict``; defaults to the trainer. With ``jobs > 1`` it must
            be picklable (a module-level function).
        resume: skip finished runs; False trains every run again (the trainer moves an earlier run's files to
            ``<run>/previous/<UTC time>/``).
        progress: print one line per run.
        trainer_progress: let the trainer show its progress bar (default: same as ``progress``; always off with
            ``jobs > 1``).
        post_run: called after each finished run (e.g. continuity analysis of its checkpoints).
        meta: extra fields for the manifest (recipe, config label, seeds, steps). ``meta["sweep_settings"]``
            (:func:`sweep_settings`) is checked against the earlier manifest and recorded; ``meta["only"]`` goes
            into this invocation's entry of ``"invocations"``. The manifest's ``"seeds"`` becomes the union with
            the earlier manifest's.
        jobs: runs trained at the same time, each in its own process (small CPU models: ``jobs=2, threads=1`` on
            2 cores beats one 2-thread run, whose tiny matmuls spend their time synchronising threads).
        threads: ``torch.set_num_threads`` for the training (None: leave PyTorch's default).
        lock: hold ``out``'s :class:`~weightgeom.train.rundir.DirLock` while running (False: the caller holds it).
        launcher: where the runs train: None on this machine (``jobs``, ``threads``), or a
            :class:`weightgeom.experiments.launchers.SlurmLauncher` / ``RayLauncher`` (the directory, manifest,
            resume rules and report are the same; ``train_fn`` is not used: the job trains with the trainer).

    Raises:
        LockError: another live process runs a sweep in ``out`` (one line naming its pid and host).
        SweepSettingsError: ``resume`` and a run in ``out`` was trained or started with other settings; or
            ``meta["sweep_settings"]`` differs from the earlier manifest's (see :func:`check_sweep_settings`).
        ValueError: a run's config is invalid.
    """
    out = Path(out)
    sweep = _Sweep(runs, out, train_fn or default_train_fn, resume, progress,
                   progress if trainer_progress is None else trainer_progress, post_run, meta, jobs, threads,
                   launcher)
    guard = DirLock(out, what="sweep directory") if lock else contextlib.nullcontext()
    with guard:
        return sweep.run()
