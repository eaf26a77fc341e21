"""Training configuration: typed sections, TOML/YAML files, ``--set section.key=value`` overrides.

A run's configuration is a :class:`Config`: one dataclass per section (:class:`RunConfig`, ``model``,
:class:`DataConfig`, :class:`~weightgeom.optim.config.OptimConfig` with its ``muon`` / ``adamw`` / ``md`` tables,
:class:`ScheduleConfig`, :class:`TrainConfig`, :class:`DiagnosticsConfig`,
:class:`~weightgeom.train.qk_clip.QKClipConfig`), every field documented with its units.
Files, overrides and Python dicts all become a :class:`Config` through :func:`load_config`: keys are checked (unknown
ones get a "did you mean"), values coerced to the field's type, bounds and choices checked, each error one line
naming the key. Override values are TOML literals (:func:`weightgeom.schema.parse_value`) for ``train``, ``sweep`` and
``demo`` alike: ``--set optim.md.gain_lr=1e-3`` is the float 0.001.

The ``[model]`` table holds ``kind``, an optional ``preset`` and any field of that kind's model config dataclass
(``weightgeom.models.GPTConfig``, ``LlamaConfig``, ``ResMLPConfig``), checked against it.

The resolved config a run writes (``config.resolved.toml``, :func:`dump_toml`) loads back to an equal
:class:`Config`. Bundled configs live in the ``weightgeom/configs`` package directory and are reachable by name
(``weightgeom train tiny-shakespeare``); see :func:`resolve_config_path`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from weightgeom._files import is_regular, read_text_bounded
from weightgeom.diagnostics.monitors import MAX_SEQS, SATURATION_THRESHOLD
from weightgeom.models import PRESETS as MODEL_PRESETS
from weightgeom.models import GPTConfig, LlamaConfig, ResMLPConfig, available_presets
from weightgeom.optim.config import OptimConfig
from weightgeom.schema import (
    MAX_DEPTH,
    ConfigError,
    Section,
    check_plain_data,
    coerce,
    field_docs,
    field_types,
    from_dict,
    parse_value,
    setting,
    suggest,
    to_dict,
)
from weightgeom.train.qk_clip import QKClipConfig
from weightgeom.train.rundir import check_relative_name
from weightgeom.train.tracking import LoggingConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the tomli backport
    import tomli as tomllib

__all__ = [
    "Config",
    "RunConfig",
    "DataConfig",
    "ScheduleConfig",
    "TrainConfig",
    "DiagnosticsConfig",
    "QKClipConfig",
    "LoggingConfig",
    "MODEL_CONFIGS",
    "load_config",
    "config_from_dict",
    "read_config_file",
    "parse_overrides",
    "with_overrides",
    "get_key",
    "set_key",
    "config_hash",
    "dump_toml",
    "resolve_config_path",
    "bundled_configs",
    "check_run_name",
    "preset_report",
    "describe_presets",
    "RESUMABLE_KEYS",
]

RESUMABLE_KEYS = ("train.max_steps", "run.name", "run.out_dir", *(f"logging.{f.name}" for f in
                                                                  dataclasses.fields(LoggingConfig)))
"""Keys a run may change when it resumes (``--set train.max_steps=...`` to continue, a moved or renamed run
directory, experiment tracking turned on or off): :func:`config_hash` leaves them out, and a resume never refuses a
checkpoint over them."""

MODEL_CONFIGS: dict[str, type] = {"gpt": GPTConfig, "llama": LlamaConfig, "resmlp": ResMLPConfig}
"""``model.kind`` → the model config dataclass whose fields the ``[model]`` table may set."""


def check_run_name(name: str) -> str:
    """Refuse a ``run.name`` that would put the run directory outside ``run.out_dir``; returns ``name``.

    The name is a path relative to ``run.out_dir`` (``"x"`` or ``"sweep/x"``); the rules are
    :func:`weightgeom.train.rundir.check_relative_name`'s (symbolic links that lead out of ``out_dir`` are refused
    when the trainer resolves the run directory, :func:`weightgeom.train.rundir.safe_child`). ``run.out_dir`` itself
    may be any path.

    Raises:
        ValueError: one line naming ``run.name`` and what is wrong with it.
    """
    return check_relative_name(name, "run.name", "run.out_dir")


@dataclass
class RunConfig(Section):
    """Where the run lives and what it runs on (``[run]``)."""

    _prefix: ClassVar[str] = "run"

    name: str = setting("run", "run directory name under out_dir (may contain '/': sweep/run)")
    out_dir: str = setting("runs", "parent of run directories")
    seed: int = setting(0, "random seed (model init, data order)", ge=0, le=2**63 - 1)
    device: Literal["auto", "cpu", "cuda"] = setting("auto", "auto | cpu | cuda")
    dtype: Literal["float32", "bfloat16", "float16"] = setting("float32", "autocast dtype of the forward on CUDA")
    parallel: Literal["ddp", "fsdp"] = setting("ddp", "data parallelism under torchrun with WORLD_SIZE > 1")
    compile: bool = setting(False, "torch.compile the model")

    def check(self) -> None:
        check_run_name(self.name)


@dataclass
class DataConfig(Section):
    """The training data (``[data]``)."""

    _prefix: ClassVar[str] = "data"

    kind: Literal["shakespeare", "text", "bin", "mnist", "synthetic"] = setting(
        "shakespeare", "shakespeare (bundled) | text (a file) | bin (train.bin/val.bin) | mnist (bundled) | synthetic")
    path: str = setting("", "text file (text) or directory with train.bin/val.bin (bin)")
    tokenizer: Literal["char", "gpt2"] = setting("char", "char | gpt2 (BPE)")
    block_size: int = setting(128, "tokens per sequence", gt=0)
    batch_size: int = setting(16, "sequences (or examples) per micro-batch per rank", gt=0)
    val_fraction: float = setting(0.1, "held-out share for corpora without a split", gt=0, lt=1)

    def check(self) -> None:
        if self.kind in ("text", "bin") and not self.path:
            raise ConfigError(f"config key data.path is required for data.kind={self.kind!r}")


@dataclass
class ScheduleConfig(Section):
    """Learning-rate schedule, a multiplier on every group's lr (``[schedule]``)."""

    _prefix: ClassVar[str] = "schedule"

    kind: Literal["cosine", "linear", "constant"] = setting("cosine", "cosine | linear | constant")
    warmup: int = setting(0, "steps of linear warmup from 0", ge=0)
    min_lr_ratio: float = setting(0.1, "final lr / peak lr for cosine and linear decay", ge=0, le=1)
    decay_steps: int = setting(0, "steps over which to decay (0 = train.max_steps)", ge=0)


@dataclass
class TrainConfig(Section):
    """The training loop (``[train]``)."""

    _prefix: ClassVar[str] = "train"

    max_steps: int = setting(1000, "optimizer steps", gt=0)
    grad_accum: int = setting(1, "micro-batches per optimizer step, global (divided across ranks)", gt=0)
    eval_every: int = setting(100, "steps between evaluations (0 = only at the end)", ge=0)
    eval_iters: int = setting(20, "micro-batches per evaluation", gt=0)
    grad_clip: float = setting(1.0, "max global gradient norm (0 = off)", ge=0)
    ckpt_every: int = setting(0, "steps between checkpoints (0 = only at the end)", ge=0)
    keep_checkpoints: int = setting(2, "most recent checkpoints kept on disk", gt=0)
    log_every: int = setting(10, "steps between train-metric lines", gt=0)
    compile_optimizer: Literal["auto", "on", "off"] = setting(
        "auto", "torch.compile the optimizer step (weightgeom.optim.compile_step; CUDA graphs on CUDA): auto = on CUDA "
                "only, on, off; the one-off cost is logged (split 'compile')")
    diverge_factor: float = setting(5.0, "diverged when loss > factor × best smoothed loss (0 = off; NaN/Inf always)",
                                    ge=0)
    diverge_warmup: int = setting(10, "steps before the loss-explosion check starts", ge=0)
    smoothing: float = setting(0.9, "EMA factor of the smoothed train loss", ge=0, lt=1)

    def check_processes(self, world_size: int) -> None:
        """Refuse a process count that does not divide ``grad_accum`` (each rank runs grad_accum / world_size
        micro-batches). Used by the trainer at start and by a sweep before it submits multi-GPU runs.

        Raises:
            ValueError: one line naming the key, its value and the process count.
        """
        if self.grad_accum % world_size != 0:
            raise ValueError(f"config key train.grad_accum={self.grad_accum}: must be a multiple of the number of "
                             f"processes ({world_size})")


@dataclass
class DiagnosticsConfig(Section):
    """Weight and attention diagnostics during training (``[diagnostics]``)."""

    _prefix: ClassVar[str] = "diagnostics"

    every: int = setting(0, "steps between weightgeom.diagnostics.collect calls (0 = off)", ge=0)
    max_seqs: int = setting(MAX_SEQS, "sequences of the step's batch the diagnostics forward uses", gt=0)
    saturation_threshold: float = setting(SATURATION_THRESHOLD, "a softmax row counts as saturated when its max "
                                                                "probability exceeds this", gt=0, lt=1)


@dataclass
class Config(Section):
    """A run's full configuration."""

    run: RunConfig = setting(RunConfig(), "run directory, seed, device")
    model: dict[str, Any] = setting({"kind": "gpt", "preset": ""},
                                    "kind (gpt | llama | resmlp), preset, and fields of that kind's model config")
    data: DataConfig = setting(DataConfig(), "training data")
    optim: OptimConfig = setting(OptimConfig(), "optimizer")
    schedule: ScheduleConfig = setting(ScheduleConfig(), "learning-rate schedule")
    train: TrainConfig = setting(TrainConfig(), "training loop")
    diagnostics: DiagnosticsConfig = setting(DiagnosticsConfig(), "diagnostics")
    qk_clip: QKClipConfig = setting(QKClipConfig(), "QK-clip: per-head attention-logit bound after each step")
    logging: LoggingConfig = setting(LoggingConfig(), "experiment tracking (Weights & Biases, MLflow)")

    def check(self) -> None:
        object.__setattr__(self, "model", _check_model(self.model))
        ctx_key = {"gpt": "block_size", "llama": "max_seq_len"}.get(self.model["kind"])
        ctx = self.model.get(ctx_key) if ctx_key else None
        if ctx is not None and self.data.kind != "mnist" and ctx < self.data.block_size:
            raise ConfigError(f"config key model.{ctx_key}={ctx}: shorter than data.block_size={self.data.block_size} "
                              f"(the model's context must hold a training sequence)")
        if self.optim.strategy == "auto" and self.model["kind"] not in ("gpt", "llama"):
            raise ConfigError(f"config key optim.strategy='auto': moves attention layers, and "
                              f"model.kind={self.model['kind']!r} has none; choose another optim.strategy")


def _model_fields(kind: str) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(MODEL_CONFIGS[kind])}


def _check_model(table: Mapping[str, Any]) -> dict[str, Any]:
    """The ``[model]`` table with ``kind`` / ``preset`` checked and every other key checked and coerced against the
    kind's model config dataclass (schema's ``coerce``: the same coercion as every other section)."""
    out = dict(table)
    kind = out.setdefault("kind", "gpt")
    if kind not in MODEL_CONFIGS:
        raise ConfigError(f"config key model.kind={kind!r}: must be one of {', '.join(MODEL_CONFIGS)}"
                          f"{suggest(str(kind), MODEL_CONFIGS)}")
    preset = out.setdefault("preset", "")
    if not isinstance(preset, str):
        raise ConfigError(f"config key model.preset: expected a string, got {preset!r}")
    if preset and preset not in available_presets(kind):
        raise ConfigError(f"config key model.preset={preset!r}: not a {kind} preset (available: "
                          f"{', '.join(available_presets(kind))}){suggest(preset, available_presets(kind))}")
    fields = _model_fields(kind)
    hints = field_types(MODEL_CONFIGS[kind])
    for k, v in list(out.items()):
        if k in ("kind", "preset"):
            continue
        if k not in fields:
            raise ConfigError(f"unknown config key model.{k} for model.kind={kind!r}"
                              f"{suggest(k, [*fields, 'kind', 'preset'])}")
        out[k] = coerce(f"model.{k}", v, hints[k])
    return out


def model_field_docs(kind: str) -> dict[str, str]:
    """Model field → its documentation line (from the model config's docstring ``Attributes:``)."""
    doc = MODEL_CONFIGS[kind].__doc__ or ""
    out = {}
    for line in doc.splitlines():
        s = line.strip()
        name, sep, rest = s.partition(":")
        if sep and name in _model_fields(kind):
            out[name] = rest.strip()
    return out


# ---------------------------------------------------------------------------------------------------- files
def bundled_dir() -> Path:
    """The package directory holding the bundled configs (``weightgeom/configs``)."""
    return Path(__file__).resolve().parent.parent / "configs"


def bundled_configs() -> list[str]:
    """Names of the bundled configs (file stems), e.g. ``["gpt2-small-owt", "resmlp-mnist", "tiny-shakespeare"]``."""
    d = bundled_dir()
    return sorted(p.stem for p in d.iterdir() if p.suffix in (".toml", ".yaml", ".yml"))


def resolve_config_path(name_or_path: str | os.PathLike) -> Path:
    """A config file path from a path or a bundled config name.

    Args:
        name_or_path: an existing file path, or the stem of a bundled config (``tiny-shakespeare``).

    Raises:
        ValueError: neither an existing file nor a bundled name (lists the bundled names).
    """
    p = Path(name_or_path)
    if not p.is_dir() and is_regular(p, "config"):  # a FIFO or device is refused here, naming it
        return p
    for ext in (".toml", ".yaml", ".yml"):
        q = bundled_dir() / f"{p.name}{ext}" if p.suffix == "" else bundled_dir() / p.name
        if q.is_file():
            return q
    names = bundled_configs()
    raise ValueError(f"config {str(name_or_path)!r} is neither a file nor a bundled config "
                     f"(bundled: {', '.join(names) or 'none'}){suggest(p.stem, names)}")


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a TOML or YAML file into a nested dict (no checking of keys; :func:`config_from_dict` does that).

    Raises:
        ValueError: unknown extension, a file too large or not a regular file, not UTF-8, or a parse error (with the
            file name and the parser's message).
    """
    path = Path(path)
    if path.suffix not in (".toml", ".yaml", ".yml"):
        raise ValueError(f"config {path}: unknown extension {path.suffix!r} (use .toml, .yaml or .yml)")
    # bounded, never blocking on a FIFO; a byte-order mark (some Windows editors) is not an error
    text = read_text_bounded(path, what="config").removeprefix("\ufeff")
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else (yaml.safe_load(text) or {})
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"config {path}: cannot parse: {e}".replace("\n", " ")) from e
    except RecursionError:
        raise ValueError(f"config {path}: nested deeper than {MAX_DEPTH} levels") from None
    try:
        check_plain_data(data, f"config {path}")
    except ConfigError as e:
        raise ValueError(str(e)) from None
    if not isinstance(data, dict):
        raise ValueError(f"config {path}: top level must be a table/mapping, got {type(data).__name__}")
    return data


# ---------------------------------------------------------------------------------------------------- overrides
def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["optim.muon.lr=0.01", ...]`` → ``{"optim.muon.lr": 0.01, ...}``; values are TOML literals (text that is not
    one is a string). The one parser of ``--set`` for ``train``, ``sweep`` and ``demo``.

    Raises:
        ValueError: an item without ``=`` or without a ``section.key`` path.
    """
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected section.key=value")
        key, raw = item.split("=", 1)
        key = ".".join(part.strip() for part in key.split("."))
        parts = key.split(".")
        if len(parts) < 2 or not all(parts):
            raise ValueError(f"--set {item!r}: the key must be section.key (e.g. train.max_steps=100)")
        try:
            out[key] = parse_value(raw)
        except ConfigError as e:
            raise ValueError(f"--set {key}: {e}") from None
    return out


def set_key(cfg: dict[str, Any], key: str, value: Any) -> None:
    """``cfg["a"]["b"] = value`` for ``key="a.b"`` in a nested dict (tables created as needed; a non-table on the
    way is replaced); ``value=None`` deletes the key."""
    parts = key.split(".")
    d = cfg
    for k in parts[:-1]:
        if not isinstance(d.get(k), dict):
            d[k] = {}
        d = d[k]
    if value is None:
        d.pop(parts[-1], None)
    else:
        d[parts[-1]] = value


def get_key(cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """``cfg["a"]["b"]`` for ``key="a.b"`` in a nested dict, or ``default``."""
    d: Any = cfg
    for k in key.split("."):
        if not isinstance(d, Mapping) or k not in d:
            return default
        d = d[k]
    return d


def with_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of the nested dict ``data`` with the dotted-key ``overrides`` set (no checking)."""
    out = copy.deepcopy(dict(data))
    for k, v in overrides.items():
        set_key(out, k, v)
    return out


# ---------------------------------------------------------------------------------------------------- loading
def config_from_dict(data: Mapping[str, Any] | Config, where: str | None = "config") -> Config:
    """A checked :class:`Config` from a (partial) nested dict; missing keys take their defaults.

    Raises:
        ValueError: one line, ``"<where>: <what is wrong with which key>"`` (no prefix when ``where`` is None).
    """
    if isinstance(data, Config):
        return data
    prefix = f"{where}: " if where else ""
    if not isinstance(data, Mapping):
        raise ValueError(f"{prefix}expected a table, got {type(data).__name__}")
    sections = [f.name for f in dataclasses.fields(Config)]
    for key in data:
        if key not in sections:
            raise ValueError(f"{prefix}unknown config section [{key}]{suggest(str(key), sections)} "
                             f"(sections: {', '.join(sections)})")
    try:
        return from_dict(Config, data)
    except ConfigError as e:
        raise ValueError(f"{prefix}{e}") from None


def load_config(source: str | os.PathLike | Mapping[str, Any] | Config | None = None,
                overrides: Iterable[str] | Mapping[str, Any] = ()) -> Config:
    """The resolved, checked config: defaults ← file or dict ← overrides.

    Args:
        source: path to a .toml/.yaml file, a bundled config name, a (partial) config dict, a :class:`Config`, or
            None (defaults).
        overrides: ``section.key=value`` strings (TOML literal values) or an already parsed ``{dotted key: value}``
            mapping, applied last, in order.

    Raises:
        ValueError: one line naming the file or override and the key: unknown key (with "did you mean"), a value
            of the wrong type, a bad choice or an out-of-range value.
    """
    if source is None:
        data, where = {}, "config"
    elif isinstance(source, Config):
        data, where = config_to_dict(source), "config"
    elif isinstance(source, Mapping):
        data, where = dict(source), "config"
    else:
        path = resolve_config_path(source)
        data, where = read_config_file(path), f"config {path.name}"
    cfg = config_from_dict(data, where)
    items = dict(overrides) if isinstance(overrides, Mapping) else parse_overrides(list(overrides))
    if not items:
        return cfg
    try:
        return config_from_dict(with_overrides(data, items), None)
    except ValueError as e:
        msg = str(e)
        # name the override the message is about (overrides apply together: data.kind=bin needs data.path too)
        named = [k for k in items if re.search(rf"(?<![\w.]){re.escape(k)}(?=[=:;\s]|$)", msg)]
        where = f"--set {named[0]}={_show(items[named[0]])}" if named else "--set " + " ".join(
            f"{k}={_show(v)}" for k, v in items.items())
        raise ValueError(f"{where}: {msg}") from None


def _show(v: Any) -> str:
    return _toml_value(v) if not isinstance(v, str) else v


# ---------------------------------------------------------------------------------------------------- presets
def preset_report(cfg: Config) -> dict[str, dict[str, Any]]:
    """What each preset in ``cfg`` set: ``{"optim.preset": {"value": "paper", "set": {key: value}, "kept": {key:
    [value used, the preset's value]}}, "model.preset": {...}}``, keys dotted. ``set``: the keys that have the
    preset's value; ``kept``: the keys the preset names whose value the config wrote otherwise (a preset never
    replaces a written key: :func:`weightgeom.optim.config.apply_preset`, and model fields over a model preset).
    Presets that set nothing (``optim.preset = "ours"``, no model preset) are left out."""
    out: dict[str, dict[str, Any]] = {}
    o = cfg.optim
    if o.preset_values() or o.preset_overrides():
        entry = {"value": o.preset, "set": {f"optim.muon.{k}": v for k, v in o.preset_values().items()},
                 "kept": {f"optim.muon.{k}": [v, p] for k, (v, p) in o.preset_overrides().items()}}
        if o.preset == "paper":
            # build_optimizer gives manifold groups no decay, as the published code does; part of the preset's
            # algorithm, so a resolved config re-run reproduces it; optim.muon.weight_decay (the preset's 0.1 or
            # the user's) applies to unconstrained Muon matrices, and a rule's weight_decay wins over both
            entry["set"]["manifold groups' weight_decay (optim.muon.weight_decay: unconstrained matrices)"] = 0.0
        out["optim.preset"] = entry
    name = cfg.model.get("preset")
    if name:
        base, model = MODEL_PRESETS[name][1], cfg.model
        out["model.preset"] = {"value": name,
                               "set": {f"model.{k}": v for k, v in base.items() if model.get(k, v) == v},
                               "kept": {f"model.{k}": [model[k], v] for k, v in base.items() if model.get(k, v) != v}}
    return out


def _preset_value(v: Any) -> str:
    return "(unset)" if v is None else _toml_value(v)


def describe_presets(report: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per preset of a :func:`preset_report`: ``optim.preset="paper" set optim.muon.x=…, …; not from the
    preset: optim.muon.y=1 (the preset's: 20)``."""
    lines = []
    for key, r in report.items():
        line = f"{key}={_toml_value(r['value'])} set " + (", ".join(
            f"{k}={_preset_value(v)}" for k, v in r["set"].items()) or "nothing")
        if r["kept"]:
            line += "; not from the preset: " + ", ".join(
                f"{k}={_preset_value(v)} (the preset's: {_preset_value(p)})" for k, (v, p) in r["kept"].items())
        lines.append(line)
    return lines


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as a nested dict of plain values (what the run directory and checkpoints store)."""
    return to_dict(cfg)


def config_hash(cfg: Config | Mapping[str, Any], ignore: Iterable[str] = RESUMABLE_KEYS) -> str:
    """A short stable hash of the config, ignoring keys that may legitimately change on resume.

    Args:
        cfg: a resolved config (or its :func:`config_to_dict` form).
        ignore: ``section.key`` names left out of the hash (extending max_steps on resume is allowed).

    Returns:
        16 hex characters (SHA-256 prefix).
    """
    c = copy.deepcopy(config_to_dict(cfg) if isinstance(cfg, Config) else dict(cfg))
    for full in ignore:
        s, k = full.split(".", 1)
        if isinstance(c.get(s), dict):
            c[s] = {kk: vv for kk, vv in c[s].items() if kk != k}
            if not c[s]:  # a section of resumable keys only (logging): hashes like a config without it
                del c[s]
    for s in UNHASHED_AT_DEFAULTS:
        if s in c and c[s] == _defaults(s):
            del c[s]
    blob = json.dumps(c, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


UNHASHED_AT_DEFAULTS = ("qk_clip",)
"""Sections added after runs were checkpointed: at their defaults they hash like a config without them, so a run
checkpointed before the section existed still resumes (:func:`config_hash`)."""


def _defaults(section: str) -> Any:
    return config_to_dict(Config()).get(section)


# ---------------------------------------------------------------------------------------------------- dumping
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        if isinstance(v, float) and v != v:
            return "nan"
        if isinstance(v, float) and v in (float("inf"), float("-inf")):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):  # TOML basic string; DEL is not allowed raw (JSON leaves it)
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)} = {_toml_value(x)}"
                               for k, x in v.items()) + "}"
    return json.dumps(str(v))


def _section_lines(title: str, obj: Any, docs: Mapping[str, str], comments: bool) -> list[str]:
    lines = [f"[{title}]"]
    nested = []
    items = obj.items() if isinstance(obj, Mapping) else ((f.name, getattr(obj, f.name)) for f in
                                                          dataclasses.fields(obj))
    for k, v in items:
        if dataclasses.is_dataclass(v):
            nested.append((k, v))
            continue
        if comments and docs.get(k):
            lines.append(f"# {docs[k]}")
        if v is None:
            if comments:
                lines.append(f"# {k} = (unset)")
            continue
        v = to_dict(v)
        lines.append(f"{k} = {_toml_value(v)}")
    lines.append("")
    for k, v in nested:
        lines += _section_lines(f"{title}.{k}", v, field_docs(type(v)), comments)
    return lines


def dump_toml(cfg: Config, comments: bool = False) -> str:
    """The config as TOML text that :func:`load_config` reads back to an equal :class:`Config`.

    Args:
        cfg: the config.
        comments: put each field's documentation (meaning, units) above it, and list unset optional fields.
    """
    lines: list[str] = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        docs = model_field_docs(v.get("kind", "gpt")) if f.name == "model" else field_docs(type(v))
        lines += _section_lines(f.name, v, docs, comments)
    return "\n".join(lines)
