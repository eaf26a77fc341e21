"""Training configuration: schema with defaults, TOML/YAML loading, ``--set section.key=value`` overrides, validation.

A config is a nested dict with the sections of :data:`DEFAULTS`. Every key in a loaded file or an override must exist
in the schema (the ``[model]`` section is checked against the chosen model's config dataclass when the models package
provides it; ``optim.md`` is a free table handed to the magnitude–direction wrapper). Values are coerced to the type
of the default (``"3"`` → 3 for an int key, ``"true"`` → True for a bool key, ``"0.9,0.95"`` → [0.9, 0.95] for a list
key). Errors are ``ValueError`` with one line naming the key and, for typos, the closest valid names.

Bundled configs live in the ``weightgeom/configs`` package directory and are reachable by name
(``weightgeom train tiny-shakespeare``); see :func:`resolve_config_path`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from weightgeom.train.rundir import check_relative_name

__all__ = [
    "DEFAULTS",
    "CHOICES",
    "load_config",
    "load_file",
    "apply_overrides",
    "validate",
    "merge",
    "config_hash",
    "dump_toml",
    "resolve_config_path",
    "bundled_configs",
    "check_run_name",
    "RESUMABLE_KEYS",
]

RESUMABLE_KEYS = ("train.max_steps", "run.name", "run.out_dir")
"""Keys a run may change when it resumes (``--set train.max_steps=...`` to continue, a moved or renamed run
directory): :func:`config_hash` leaves them out, and a resume never refuses a checkpoint over them."""

#: The full schema: every section and key with its default value (the default's type is the key's type).
DEFAULTS: dict[str, dict[str, Any]] = {
    "run": {
        "name": "run",  # run directory name under out_dir
        "out_dir": "runs",  # parent of run directories
        "seed": 0,
        "device": "auto",  # auto | cpu | cuda
        "dtype": "float32",  # float32 | bfloat16 (autocast dtype for the forward on CUDA)
        "parallel": "ddp",  # ddp | fsdp (only used under torchrun with WORLD_SIZE > 1)
        "compile": False,  # torch.compile the model
    },
    "model": {
        "kind": "gpt",  # gpt | llama | resmlp; the other keys are the model config's fields
        "preset": "",  # optional weightgeom.models preset (e.g. "gpt2") whose values the other keys override
    },
    "data": {
        "kind": "shakespeare",  # shakespeare | text | bin | mnist
        "path": "",  # text file (text), directory with train.bin/val.bin (bin)
        "tokenizer": "char",  # char | gpt2
        "block_size": 128,  # tokens per sequence
        "batch_size": 16,  # sequences (or examples) per micro-batch per rank
        "val_fraction": 0.1,  # held-out share for corpora without a split
    },
    "optim": {
        "name": "adamw",  # muon | adamw | muon-md | adamw-md | any name build_optimizer knows
        "strategy": "unconstrained",  # param_groups strategy
        "lr": 0.02,  # Muon (matrix) learning rate
        "adamw_lr": 6e-4,  # AdamW learning rate (AdamW groups, or every group with name="adamw")
        "weight_decay": 0.1,  # AdamW decay on 2-D params (1-D params get 0)
        "muon_weight_decay": 0.0,  # decoupled decay on Muon matrices (seed 000: 0)
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "momentum": 0.95,
        "nesterov": True,
        "momentum_form": "ema",  # ema | sum
        "msign_method": "polar_express",
        "adjust_lr_fn": "original",  # original | match_rms_adamw
        "dual_steps": 20,
        "dual_lr": 0.1,
        "dual_tol": 1e-4,
        "split_qkv": False,
        "md": {},  # MagnitudeDirection options (gains, parameterization, sphere, gain_lr, ...)
    },
    "schedule": {
        "kind": "cosine",  # cosine | linear | constant
        "warmup": 0,  # steps of linear warmup from 0
        "min_lr_ratio": 0.1,  # final lr / peak lr for cosine and linear decay
        "decay_steps": 0,  # steps over which to decay (0 = train.max_steps)
    },
    "train": {
        "max_steps": 1000,  # optimizer steps
        "grad_accum": 1,  # micro-batches per optimizer step, global (divided across ranks)
        "eval_every": 100,  # steps between evaluations (0 = only at the end)
        "eval_iters": 20,  # micro-batches per evaluation
        "grad_clip": 1.0,  # max global grad norm (0 = off)
        "ckpt_every": 0,  # steps between checkpoints (0 = only at the end)
        "keep_checkpoints": 2,  # most recent checkpoints kept on disk
        "log_every": 10,  # steps between train-metric lines
        "diverge_factor": 5.0,  # diverged when loss > factor × best smoothed loss (0 = off; NaN/Inf always)
        "diverge_warmup": 10,  # steps before the loss-explosion check starts
        "smoothing": 0.9,  # EMA factor of the smoothed train loss
    },
    "diagnostics": {
        "every": 0,  # steps between weightgeom.diagnostics.collect calls (0 = off)
    },
}

#: Keys restricted to a fixed set of values.
CHOICES: dict[str, tuple[str, ...]] = {
    "run.device": ("auto", "cpu", "cuda"),
    "run.dtype": ("float32", "bfloat16", "float16"),
    "run.parallel": ("ddp", "fsdp"),
    "model.kind": ("gpt", "llama", "resmlp"),
    "data.kind": ("shakespeare", "text", "bin", "mnist", "synthetic"),
    "data.tokenizer": ("char", "gpt2"),
    "optim.momentum_form": ("ema", "sum"),
    "optim.adjust_lr_fn": ("original", "match_rms_adamw"),
    "schedule.kind": ("cosine", "linear", "constant"),
}

# keys that must be > 0 / >= 0
_POSITIVE = {"data.block_size", "data.batch_size", "train.max_steps", "train.grad_accum", "train.eval_iters",
             "train.keep_checkpoints", "train.log_every"}
_NONNEG = {"schedule.warmup", "schedule.decay_steps", "train.eval_every", "train.ckpt_every", "train.grad_clip",
           "train.diverge_factor", "train.diverge_warmup", "diagnostics.every", "optim.lr", "optim.adamw_lr",
           "optim.weight_decay", "optim.muon_weight_decay", "run.seed"}
_FREE_TABLES = {"optim.md"}  # dict-valued keys whose contents are validated by their consumer


def _suggest(name: str, options: Iterable[str]) -> str:
    m = difflib.get_close_matches(name, list(options), n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(repr(x) for x in m)}?" if m else ""


def bundled_dir() -> Path:
    """The package directory holding the bundled configs (``weightgeom/configs``)."""
    return Path(__file__).resolve().parent.parent / "configs"


def bundled_configs() -> list[str]:
    """Names of the bundled configs (file stems), e.g. ``["gpt2-small-owt", "resmlp-mnist", "tiny-shakespeare"]``."""
    d = bundled_dir()
    if not d.is_dir():
        return []
    return sorted(p.stem for p in d.iterdir() if p.suffix in (".toml", ".yaml", ".yml"))


def resolve_config_path(name_or_path: str | os.PathLike) -> Path:
    """A config file path from a path or a bundled config name.

    Args:
        name_or_path: an existing file path, or the stem of a bundled config (``tiny-shakespeare``).

    Raises:
        ValueError: neither an existing file nor a bundled name (lists the bundled names).
    """
    p = Path(name_or_path)
    if p.is_file():
        return p
    for ext in (".toml", ".yaml", ".yml"):
        q = bundled_dir() / f"{p.name}{ext}" if p.suffix == "" else bundled_dir() / p.name
        if q.is_file():
            return q
    names = bundled_configs()
    raise ValueError(f"config {str(name_or_path)!r} is neither a file nor a bundled config "
                     f"(bundled: {', '.join(names) or 'none'}){_suggest(p.stem, names)}")


def load_file(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a TOML or YAML file into a nested dict (no validation).

    Raises:
        ValueError: unknown extension, or a parse error (with the file name and the parser's message).
    """
    path = Path(path)
    if path.suffix not in (".toml", ".yaml", ".yml"):
        raise ValueError(f"config {path}: unknown extension {path.suffix!r} (use .toml, .yaml or .yml)")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]

            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as e:  # tomllib.TOMLDecodeError, yaml.YAMLError
        raise ValueError(f"config {path}: cannot parse: {e}".replace("\n", " ")) from e
    if not isinstance(data, dict):
        raise ValueError(f"config {path}: top level must be a table/mapping, got {type(data).__name__}")
    return data


def _model_fields(kind: str) -> dict[str, Any] | None:
    """Field name → default of the model config dataclass for ``kind``, or None if the models package lacks it."""
    import importlib

    names = {"gpt": "GPTConfig", "llama": "LlamaConfig", "resmlp": "ResMLPConfig"}
    if kind not in names:
        return None
    cls = None
    for mod in ("weightgeom.models", f"weightgeom.models.{kind}"):
        try:
            cls = getattr(importlib.import_module(mod), names[kind], None)
        except Exception:
            cls = None
        if cls is not None:
            break
    if cls is None or not dataclasses.is_dataclass(cls):
        return None
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
        else:
            out[f.name] = None
    return out


def _parse_literal(text: str) -> Any:
    """A value from override text with no typed default: TOML-ish literal (int, float, bool, list, string)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except Exception:
        return text


def _coerce(key: str, value: Any, default: Any) -> Any:
    """``value`` converted to the type of ``default``; ValueError naming ``key`` when impossible."""
    def bad(expect: str) -> ValueError:
        return ValueError(f"config key {key!r}: expected {expect}, got {value!r}")

    if default is None:
        return _parse_literal(value) if isinstance(value, str) else value
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.strip().lower() in ("true", "1", "yes", "on")
        raise bad("a bool (true/false)")
    if isinstance(default, int):
        if isinstance(value, bool):
            raise bad("an integer")
        if isinstance(value, int):
            return value
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise bad("an integer") from None
        if not f.is_integer():
            raise bad("an integer")
        return int(f)
    if isinstance(default, float):
        if isinstance(value, bool):
            raise bad("a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad("a number") from None
    if isinstance(default, str):
        if isinstance(value, (dict, list)):
            raise bad("a string")
        return str(value)
    if isinstance(default, (list, tuple)):
        if isinstance(value, str):
            s = value.strip()
            if s.startswith("["):
                value = _parse_literal(s)
            else:
                value = [v.strip() for v in s.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise bad("a list")
        if default:
            value = [_coerce(f"{key}[{i}]", v, default[0]) for i, v in enumerate(value)]
        return list(value)
    if isinstance(default, dict):
        if not isinstance(value, dict):
            raise bad("a table")
        return dict(value)
    return value


def merge(base: dict[str, Any], update: Mapping[str, Any], *, where: str = "config") -> dict[str, Any]:
    """``base`` updated by ``update`` section by section, every key checked against the schema and coerced.

    Args:
        base: a full config (all sections present); modified copy is returned.
        update: a partial config (from a file or dict).
        where: name of the source for error messages.

    Raises:
        ValueError: unknown section or key, or a value of the wrong type.
    """
    out = copy.deepcopy(base)
    for section, table in update.items():
        if section not in DEFAULTS:
            raise ValueError(f"{where}: unknown section [{section}]{_suggest(section, DEFAULTS)} "
                             f"(sections: {', '.join(DEFAULTS)})")
        if not isinstance(table, Mapping):
            raise ValueError(f"{where}: [{section}] must be a table, got {table!r}")
        if section == "model" and "kind" in table:
            out["model"]["kind"] = _coerce("model.kind", table["kind"], "")
        for key, value in table.items():
            _set(out, section, key, value, where)
    return out


def _schema_default(cfg: dict[str, Any], section: str, key: str) -> tuple[bool, Any]:
    """(known, default) of ``section.key`` given the current config (model keys depend on model.kind)."""
    if key in DEFAULTS[section]:
        return True, DEFAULTS[section][key]
    if section == "model":
        fields = _model_fields(cfg["model"].get("kind", "gpt"))
        if fields is None:
            return True, None  # models package not available: accept, type from the literal
        if key in fields:
            return True, fields[key]
    return False, None


def _set(cfg: dict[str, Any], section: str, key: str, value: Any, where: str) -> None:
    known, default = _schema_default(cfg, section, key)
    if not known:
        options = list(DEFAULTS[section])
        if section == "model":
            options += list(_model_fields(cfg["model"].get("kind", "gpt")) or {})
        raise ValueError(f"{where}: unknown key {section}.{key}{_suggest(key, options)}")
    full = f"{section}.{key}"
    if full in _FREE_TABLES and isinstance(cfg[section].get(key), dict) and isinstance(value, Mapping):
        cfg[section][key] = {**cfg[section][key], **value}
        return
    cfg[section][key] = _coerce(full, value, default)


def apply_overrides(cfg: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """``cfg`` with ``section.key=value`` overrides applied (``optim.md.gains=row`` sets a key of a free table).

    Raises:
        ValueError: malformed override, unknown section/key, or a value that does not fit the key's type.
    """
    out = copy.deepcopy(cfg)
    for ov in overrides:
        if "=" not in ov:
            raise ValueError(f"override {ov!r}: expected section.key=value")
        path, value = ov.split("=", 1)
        parts = path.strip().split(".")
        if len(parts) < 2 or not all(parts):
            raise ValueError(f"override {ov!r}: key must be section.key (e.g. train.max_steps=100)")
        section, key = parts[0], parts[1]
        if section not in DEFAULTS:
            raise ValueError(f"override {ov!r}: unknown section {section!r}{_suggest(section, DEFAULTS)}")
        if len(parts) > 2:
            full = f"{section}.{key}"
            if full not in _FREE_TABLES:
                raise ValueError(f"override {ov!r}: {full} is not a table")
            table = out[section].setdefault(key, {})
            for p in parts[2:-1]:
                table = table.setdefault(p, {})
            table[parts[-1]] = _parse_literal(value)
            continue
        _set(out, section, key, value, f"override {ov!r}")
    return out


def validate(cfg: dict[str, Any]) -> dict[str, Any]:
    """Check value ranges and choices; returns ``cfg``.

    Raises:
        ValueError: one line naming the key and the allowed values.
    """
    for full, options in CHOICES.items():
        s, k = full.split(".")
        v = cfg[s][k]
        if v not in options:
            raise ValueError(f"config key {full}={v!r}: must be one of {', '.join(options)}{_suggest(str(v), options)}")
    for full in _POSITIVE | _NONNEG:
        s, k = full.split(".")
        v = cfg[s][k]
        if full in _POSITIVE and not v > 0:
            raise ValueError(f"config key {full}={v!r}: must be > 0")
        if full in _NONNEG and not v >= 0:
            raise ValueError(f"config key {full}={v!r}: must be >= 0")
    r = cfg["schedule"]["min_lr_ratio"]
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"config key schedule.min_lr_ratio={r!r}: must be in [0, 1]")
    b = cfg["optim"]["betas"]
    if len(b) != 2 or not all(0.0 <= x < 1.0 for x in b):
        raise ValueError(f"config key optim.betas={b!r}: must be two numbers in [0, 1)")
    sm = cfg["train"]["smoothing"]
    if not 0.0 <= sm < 1.0:
        raise ValueError(f"config key train.smoothing={sm!r}: must be in [0, 1)")
    if cfg["data"]["kind"] in ("text", "bin") and not cfg["data"]["path"]:
        raise ValueError(f"config key data.path is required for data.kind={cfg['data']['kind']!r}")
    check_run_name(cfg["run"]["name"])
    return cfg


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


def load_config(source: str | os.PathLike | Mapping[str, Any] | None = None,
                overrides: Iterable[str] = ()) -> dict[str, Any]:
    """The resolved, validated config: defaults ← file or dict ← overrides.

    Args:
        source: path to a .toml/.yaml file, a bundled config name, a (partial) config dict, or None (defaults).
        overrides: ``section.key=value`` strings applied last.

    Returns:
        A full nested dict with every section and key of the schema.

    Raises:
        ValueError: on any unknown key, type mismatch, bad choice or out-of-range value.
    """
    cfg = copy.deepcopy(DEFAULTS)
    if source is not None:
        if isinstance(source, Mapping):
            cfg = merge(cfg, source, where="config")
        else:
            path = resolve_config_path(source)
            cfg = merge(cfg, load_file(path), where=f"config {path.name}")
    cfg = apply_overrides(cfg, overrides)
    return validate(cfg)


def config_hash(cfg: Mapping[str, Any], ignore: Iterable[str] = RESUMABLE_KEYS) -> str:
    """A short stable hash of the config, ignoring keys that may legitimately change on resume.

    Args:
        cfg: a resolved config.
        ignore: ``section.key`` names left out of the hash (extending max_steps on resume is allowed).

    Returns:
        16 hex characters (SHA-256 prefix).
    """
    c = copy.deepcopy(dict(cfg))
    for full in ignore:
        s, k = full.split(".", 1)
        if isinstance(c.get(s), dict):
            c[s] = {kk: vv for kk, vv in c[s].items() if kk != k}
    blob = json.dumps(c, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v) if not (isinstance(v, float) and v != v) else "nan"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if v is None:
        return '""'
    return json.dumps(str(v))


def dump_toml(cfg: Mapping[str, Any]) -> str:
    """The config as TOML text (round-trips through :func:`load_config`)."""
    lines = []
    for section, table in cfg.items():
        lines.append(f"[{section}]")
        for k, v in table.items():
            if v is None:
                continue
            lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)
