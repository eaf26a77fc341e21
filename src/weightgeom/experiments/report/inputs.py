"""What a report reads from run and sweep directories — untrusted input — checked on the way in and escaped on the
way out.

A sweep directory may come from someone else, so ``weightgeom report`` treats every byte of it as hostile:

* **Reading.** Every file goes through :mod:`weightgeom._files` (regular files only — a FIFO never blocks —, a size
  bound, UTF-8, JSON nesting and integer length bounded). A file that cannot be read is treated as absent and named in
  one warning.
* **Typing.** Each JSON/TOML record is conformed to a declared shape (:data:`STATUS`, :data:`EXPERIMENT`,
  :data:`CONTROLS`, :data:`MANIFEST` …): a value of the wrong type (a string where a step belongs, a list where a
  table belongs, NaN as a step count, an integer too large for a float) is dropped and named in the warning, so the
  report code downstream only ever meets the types it expects.
* **Escaping.** Every value that came from such a file and reaches ``report.md`` goes through :func:`md_text` (plain
  text) or :func:`md_code` (a code span); plot labels through :func:`plot_text`. The result is inert both as
  markdown and as HTML rendered from it: no raw tags, no links or images, no new lines, headings or table rows.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from weightgeom._files import read_json, read_text_bounded, read_toml

__all__ = ["md_text", "md_code", "html_text", "plot_text", "Problems", "load_json", "load_toml", "load_jsonl",
           "conform", "conform_config", "Type", "Map", "ListOf", "STATUS", "TAGS", "EXPERIMENT", "CONTROLS", "META",
           "MANIFEST", "METRICS_ROW", "CONTINUITY_ROW", "CONFIG_KEYS"]

METRICS_LIMIT = 2 << 30
"""Size bound (bytes) of a ``metrics.jsonl`` / ``continuity.jsonl`` / ``heads.jsonl`` a report reads: a 50k-step run
with diagnostics every 50 steps writes ~100 MB; 2 GiB is twenty times that."""

# ------------------------------------------------------------------------------------------------------ escaping
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_MD_PUNCT = re.compile(r"([\\`*\[\]|~]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")
_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


def _visible(text: str) -> str:
    """Control characters (new lines, tabs, escape sequences, line/paragraph separators) as visible ``\\xNN``."""
    return _CONTROL.sub(lambda m: {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(m.group(), f"\\x{ord(m.group()):02x}")
                        if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text)


def md_text(value: Any) -> str:
    """``value`` as markdown that renders as exactly its text, on one line, inert as HTML.

    Control characters become visible escapes (``\\n``), so the value stays on its line (no heading, list item or table
    row can start inside it); ``&``, ``<`` and ``>`` become HTML entities, so no renderer sees a tag or an autolink;
    backslash, backtick, ``*``, ``[``, ``]``, ``|``, ``~`` and word-boundary ``_`` are backslash-escaped, so no code
    span, emphasis, link, image or table cell can start inside it. Other punctuation is left as typed (it has no
    inline meaning), so ordinary names and reasons read as they are.
    """
    text = _visible(str(value))
    text = _MD_PUNCT.sub(lambda m: "\\" + m.group(), text)
    return re.sub(r"[&<>]", lambda m: _ENTITIES[m.group()], text)


def html_text(value: Any) -> str:
    """``value`` for an HTML context inside the markdown (``<summary>…</summary>``): one line, entity-escaped."""
    return html.escape(_visible(str(value)), quote=True)


def md_code(value: Any) -> str:
    """``value`` as a markdown code span (``` `name` ```), on one line, whatever backticks it holds.

    The fence is one backtick longer than the longest run inside (CommonMark's rule), control characters become
    visible escapes, and ``|`` is escaped so a span inside a table cell cannot end the cell. Inside a code span a
    renderer shows ``<`` and ``&`` literally (it escapes them itself), so no tag can form.
    """
    text = _visible(str(value)).replace("|", "\\|")
    if not text.strip():
        return md_text(value) if text else "(empty)"
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or (text.startswith(" ") and text.endswith(" ")) else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def plot_text(value: Any, limit: int = 80) -> str:
    """``value`` for a matplotlib label or title: one line, at most ``limit`` characters. (The report's figures
    turn mathtext off — ``text.parse_math`` — so a ``$`` in a name is shown, never parsed.)"""
    text = _visible(str(value))
    return text if len(text) <= limit else text[:limit - 1] + "…"


# -------------------------------------------------------------------------------------------------------- typing
class Problems:
    """The one-line problems found while reading one run or sweep directory (shown as warnings, never raised)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, where: Any, what: str) -> None:
        """Record ``where: what`` (``where`` is a path or a ``path:key`` string)."""
        self.lines.append(f"{where}: {what}")

    def __bool__(self) -> bool:
        return bool(self.lines)


class Type:
    """A declared value shape: ``check(value)`` returns the conformed value or raises ``TypeError`` saying why."""

    def __init__(self, name: str, check: Callable[[Any], Any]):
        self.name = name
        self.check = check

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Type({self.name})"


_INT_BOUND = 2 ** 53


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{_show(v)} is not an integer")
    if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
        raise TypeError(f"{_show(v)} is not an integer")
    if abs(v) > _INT_BOUND:
        raise TypeError(f"{_show(v)} is out of range")
    return int(v)


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{_show(v)} is not a number")
    if isinstance(v, int) and abs(v) > _INT_BOUND:
        raise TypeError(f"{_show(v)} is out of range")
    return float(v)


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{_show(v)} is not a string")
    return v


def _scalar(v: Any) -> Any:
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return _int(v)
    if isinstance(v, float):
        return v
    if isinstance(v, list) and all(x is None or isinstance(x, (bool, str, float)) or
                                   (isinstance(x, int) and abs(x) <= _INT_BOUND) for x in v) and len(v) <= 1000:
        return list(v)
    raise TypeError(f"{_show(v)} is not a plain value")


Int = Type("integer", _int)
NonNegInt = Type("integer ≥ 0", lambda v: _nonneg(_int(v)))
Number = Type("number", _number)
Str = Type("string", _str)
Scalar = Type("plain value", _scalar)
PositiveNumber = Type("positive finite number", lambda v: _positive(_number(v)))
PositiveInt = Type("positive integer", lambda v: _positive(_int(v)))
OptStr = Type("string or null", lambda v: None if v is None else _str(v))


def _control(v: Any) -> Any:
    """A declared experiment control's value: a plain value, or a table of plain values (a callback's keyword
    arguments, e.g. ``auto_assign = {threshold = 10}``)."""
    if isinstance(v, dict):
        if len(v) > 1000:
            raise TypeError("a table of more than 1000 entries")
        return {str(k): _scalar(x) for k, x in v.items()}
    return _scalar(v)


Control = Type("plain value or table of plain values", _control)


def _positive(v: float) -> float:
    if not (math.isfinite(v) and v > 0):
        raise TypeError(f"{v!r} is not a positive finite number")
    return v


def _nonneg(v: int) -> int:
    if v < 0:
        raise TypeError(f"{v} is negative")
    return v


def one_of(*choices: str) -> Type:
    """A string from ``choices``."""
    def check(v: Any) -> str:
        if v not in choices:
            raise TypeError(f"{_show(v)} is not one of {', '.join(choices)}")
        return v
    return Type("one of " + ", ".join(choices), check)


class Map(Type):
    """A JSON object with string keys and values of one shape (values that do not conform are dropped)."""

    def __init__(self, value: Type | dict, max_items: int = 100_000):
        super().__init__("table", lambda v: v)
        self.value, self.max_items = value, max_items


class ListOf(Type):
    """A JSON array of one shape (items that do not conform are dropped)."""

    def __init__(self, item: Type | dict, max_items: int = 100_000):
        super().__init__("list", lambda v: v)
        self.item, self.max_items = item, max_items


def _show(v: Any) -> str:
    text = repr(v) if not isinstance(v, (dict, list)) else type(v).__name__
    return text if len(text) <= 40 else text[:37] + "..."


_DROP = object()
"""What :func:`_conform` returns for a value that does not conform (``None`` can be a legitimate value)."""


def conform(value: Any, shape: Type | dict, where: str, problems: Problems) -> Any:
    """``value`` conformed to ``shape``, never raising.

    A dict shape keeps the declared keys whose values conform (each other one named in ``problems``) and drops
    undeclared keys silently; :class:`Map` / :class:`ListOf` keep the entries that conform; a :class:`Type` checks
    one value (``null`` passes only a type that accepts it, such as a status's ``reason``).

    Returns:
        The conformed value, or ``None`` when ``value`` itself does not conform (recorded in ``problems``).
    """
    out = _conform(value, shape, where, problems)
    return None if out is _DROP else out


def _conform(value: Any, shape: Type | dict, where: str, problems: Problems) -> Any:
    if isinstance(shape, (dict, Map)):
        if not isinstance(value, dict):
            problems.add(where, f"expected a table, found {_show(value)}; ignored")
            return _DROP
        if isinstance(shape, Map):
            items = [(str(k), k, shape.value) for k in list(value)[:shape.max_items]]
        else:
            items = [(k, k, sub) for k, sub in shape.items() if k in value]
        out = {}
        for name, key, sub in items:
            v = _conform(value[key], sub, f"{where}:{name}", problems)
            if v is not _DROP:
                out[name] = v
        return out
    if isinstance(shape, ListOf):
        if not isinstance(value, list):
            problems.add(where, f"expected a list, found {_show(value)}; ignored")
            return _DROP
        got = [_conform(x, shape.item, f"{where}[{i}]", problems) for i, x in enumerate(value[:shape.max_items])]
        return [x for x in got if x is not _DROP]
    try:
        return shape.check(value)
    except TypeError as e:
        problems.add(where, f"{e}; ignored")
        return _DROP


# ------------------------------------------------------------------------------------------------- the records
STATUS = {"state": one_of("running", "done", "diverged", "failed", "interrupted"), "step": NonNegInt,
          "reason": OptStr, "time": Str}
"""``status.json`` (the trainer's)."""

TAGS = {"study": Str, "strategy": Str, "algorithm": Str, "arm": Str, "kind": Str, "optimizer": Str, "axis": Str,
        "value": Scalar, "lr": PositiveNumber, "gain_lr": PositiveNumber, "rung": NonNegInt, "width": PositiveInt,
        "warmup": NonNegInt, "lr_multiplier": PositiveNumber, "msign_dtype": Str, "control": Str}
"""The tags the recipes give their runs (``experiment.json``'s ``tags``) and their types."""

EXPERIMENT = {"name": Str, "recipe": Str, "variant": Str, "seed": Int, "part": Str, "group": Str,
              "description": Str, "after": Str, "settings_hash": Str, "overrides": Map(Scalar),
              "settings": Map(Control), "tags": TAGS, "controls": Map(Control),
              "final": Map(Number)}
"""``experiment.json`` (the sweep runner's)."""

CONTROLS = {"sigma_cap": Number, "steps": NonNegInt, "rescales": NonNegInt, "max_product_seen": Number,
            "layers": NonNegInt, "auto_threshold": Number, "auto_layers": NonNegInt,
            "auto_max_bound": Map(Number),
            "auto_moves": ListOf({"layer": Str, "action": Str, "step": NonNegInt, "bound": Number,
                                   "qk_sigma_prod": Number, "qk_sigma_prod_after": Number}),
            "qk_clip_tau": Number, "alpha": Number, "constrained": Str, "clips": NonNegInt, "skipped": NonNegInt,
            "max_logit_seen": Number, "layers_heads": NonNegInt, "layers_whole": NonNegInt,
            "layers_skipped": NonNegInt}
"""``controls.json`` (the experiment callbacks')."""

META = {"num_params": Number, "n_params": Number, "params": Number, "device_kind": Str}
"""The keys of ``meta.json`` a report reads."""

MANIFEST = {"recipe": Str, "config": Str, "label": Str, "wall_s": Number, "command": Str,
            "runs": ListOf({"name": Str, "run_dir": Str, "status": Str})}
"""The keys of a sweep's ``sweep.json`` a report reads."""

METRICS_ROW = {"step": NonNegInt, "split": Str}
"""The fixed keys of a ``metrics.jsonl`` / ``heads.jsonl`` line; every other key is a metric whose value must be a
number (others are skipped)."""

CONTINUITY_ROW = {"step": NonNegInt, "kind": Str, "role": Str, "layer": NonNegInt}
"""The fixed keys of a ``continuity.jsonl`` line; every other key is a number."""

CONFIG_KEYS: dict[tuple[str, ...], Type] = {
    ("model", "kind"): Str, ("model", "width"): PositiveInt, ("model", "dim"): PositiveInt,
    ("model", "qk_norm"): Type("boolean", lambda v: v if isinstance(v, bool) else _raise(f"{_show(v)} is not a "
                                                                                        "boolean")),
    ("train", "max_steps"): NonNegInt, ("optim", "strategy"): Str, ("optim", "name"): Str,
    ("data", "kind"): Str, ("data", "block_size"): PositiveInt, ("data", "batch_size"): PositiveInt,
    ("run", "seed"): Int,
}
"""The keys of ``config.resolved.toml`` a report computes with, and their types. Every other key is shown as text
(the settings appendix) and only needs to be a plain value."""


def _raise(msg: str) -> Any:
    raise TypeError(msg)


def conform_config(config: Any, where: str, problems: Problems) -> dict[str, Any]:
    """``config.resolved.toml`` with every table a table, every leaf a plain value and :data:`CONFIG_KEYS` typed."""
    if not isinstance(config, dict):
        return {}
    out: dict[str, Any] = {}
    for section, table in config.items():
        if not isinstance(table, dict):
            problems.add(f"{where}:{section}", f"expected a table, found {_show(table)}; ignored")
            continue
        out[str(section)] = _conform_table(table, (str(section),), where, problems)
    return out


def _conform_table(table: dict, path: tuple[str, ...], where: str, problems: Problems) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, v in table.items():
        p = (*path, str(key))
        if isinstance(v, dict):
            if len(p) < 4:
                out[str(key)] = _conform_table(v, p, where, problems)
            continue
        shape = CONFIG_KEYS.get(p, Scalar)
        c = conform(v, shape, f"{where}:{'.'.join(p)}", problems)
        if c is not None:
            out[str(key)] = c
    return out


# -------------------------------------------------------------------------------------------------------- reading
def load_json(path: Path, shape: Type | dict, problems: Problems) -> Any:
    """A JSON file conformed to ``shape``; None (and a problem unless it is simply absent) when it cannot be used."""
    if not path.exists() and not path.is_symlink():
        return None
    try:
        raw = read_json(path)
    except (OSError, ValueError) as e:
        problems.add(path, f"{_reason(e)}; ignored")
        return None
    return conform(raw, shape, str(path), problems)


def load_toml(path: Path, problems: Problems) -> dict[str, Any]:
    """A run's ``config.resolved.toml`` conformed (:func:`conform_config`); ``{}`` when it cannot be used."""
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        raw = read_toml(path)
    except (OSError, ValueError) as e:
        problems.add(path, f"{_reason(e)}; ignored")
        return {}
    return conform_config(raw, str(path), problems)


def load_jsonl(path: Path, fixed: Mapping[str, Type], problems: Problems) -> list[dict[str, Any]]:
    """The lines of a JSON-lines file whose ``fixed`` keys conform; every other key kept only if it is a number.

    A partial last line (a run killed mid-write) is skipped silently; other unreadable lines and dropped values are
    counted into one problem line per file.
    """
    if not path.exists() and not path.is_symlink():
        return []
    try:
        text = read_text_bounded(path, METRICS_LIMIT)
    except (OSError, ValueError) as e:
        problems.add(path, f"{_reason(e)}; ignored")
        return []
    rows, bad = [], 0
    lines = text.splitlines()
    for i, line in enumerate(lines):
        row, dropped = _jsonl_row(line, fixed)
        bad += dropped
        if row is None:
            bad += i < len(lines) - 1  # the last line may be a killed writer's partial line
        elif row:
            rows.append(row)
    if bad:
        problems.add(path, f"{bad} line(s) or value(s) of the wrong type skipped")
    return rows


_NON_FINITE = ("nan", "inf", "-inf")
"""How the metrics logger writes non-finite floats (JSON has no NaN); such values are left out silently."""


def _jsonl_row(line: str, fixed: Mapping[str, Type]) -> tuple[dict[str, Any] | None, int]:
    """One JSON line: (its ``fixed`` keys conformed — ``step`` required — and its other keys' numbers, the count of
    values left out for their type). The row is None when the line is not JSON, not an object, or a fixed key has the
    wrong type. Non-finite numbers written as ``"nan"``/``"inf"`` and ``null`` are left out without being counted,
    as they always were."""
    line = line.strip()
    if not line:
        return {}, 0
    try:
        raw = json.loads(line)
    except (ValueError, RecursionError):
        return None, 0
    if not isinstance(raw, dict) or "step" not in raw:
        return None, 0
    quiet = Problems()
    row = conform({k: raw[k] for k in fixed if k in raw}, dict(fixed), "", quiet)
    if quiet:
        return None, 0
    dropped = 0
    for k, v in raw.items():
        if k in fixed or v is None or v in _NON_FINITE:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, int) and abs(v) > _INT_BOUND):
            dropped += 1
            continue
        row[str(k)] = float(v)
    return row, dropped


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e)
    return text.split(": ", 1)[1] if text.startswith(("/", ".")) and ": " in text else text
