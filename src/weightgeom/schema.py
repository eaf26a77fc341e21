"""Typed configuration: the machinery every component's config dataclass shares.

Each component (Muon, AdamW, the magnitude–direction wrapper, model, data, schedule, training loop, diagnostics)
defines its settings once, as a dataclass whose fields are declared with :func:`setting` (default, one-line
documentation with units, bounds). Files (TOML/YAML), ``--set section.key=value`` overrides, Python code and the CLI
all become these dataclasses through :func:`from_dict`, which coerces values to the field's annotated type and
rejects unknown keys with a "did you mean"; :func:`to_dict` turns them back into the nested dict written to a run
directory, which :func:`from_dict` reads back to equal objects.

Override values follow TOML literal syntax (:func:`parse_value`): ``1e-3`` is a float, ``true`` a bool, ``[0.9, 0.95]``
a list, ``"a b"`` a string; text that is not a TOML literal (``cosine``, ``all-dgram``) is taken as a string.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import difflib
import math
import numbers
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Union, get_args, get_origin

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the tomli backport (a dependency there)
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "Section",
    "setting",
    "from_dict",
    "to_dict",
    "parse_value",
    "suggest",
    "field_docs",
    "check_plain_data",
    "coerce",
    "field_types",
    "check_bounds",
    "explicit_fields",
    "replace_filled",
    "MAX_DEPTH",
    "MAX_NODES",
]

MAX_DEPTH = 32
"""Deepest nesting of tables/lists a config may have (a deeper one is refused, never a RecursionError)."""
MAX_NODES = 100_000
"""Most values a config may hold (YAML aliases can expand a small file exponentially: refused past this)."""


class ConfigError(ValueError):
    """A configuration value or key is wrong; ``str(e)`` is one line naming the key (``optim.muon.lr``)."""


def suggest(name: str, options: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``options`` to ``name``, or ``""``."""
    opts = list(dict.fromkeys(str(o) for o in options))
    m = difflib.get_close_matches(str(name), opts, n=3, cutoff=0.5)
    if not m:  # a case slip ("SVD") is the commonest typo
        low = {o.lower(): o for o in opts}
        m = [low[x] for x in difflib.get_close_matches(str(name).lower(), list(low), n=3, cutoff=0.5)]
    return f"; did you mean {' or '.join(repr(x) for x in m)}?" if m else ""


def setting(default: Any, doc: str, *, gt: float | None = None, ge: float | None = None, lt: float | None = None,
            le: float | None = None) -> Any:
    """A documented dataclass field.

    Args:
        default: the default value (lists, dicts and dataclass instances are copied per instance).
        doc: one line: meaning and units.
        gt, ge, lt, le: numeric bounds checked on construction (for lists: on every element).
    """
    meta = {"doc": doc, "gt": gt, "ge": ge, "lt": lt, "le": le}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        proto = default

        def factory() -> Any:
            if dataclasses.is_dataclass(proto):
                return copy.deepcopy(proto)  # a copy, keeping the record of which fields were given (none)
            return type(proto)(proto)

        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def parse_value(text: str) -> Any:
    """An override's value with TOML literal semantics; text that is not a TOML literal is returned as a string."""
    s = text.strip()
    try:
        doc = tomllib.loads(f"v = {s}")
    except tomllib.TOMLDecodeError:
        return s
    except RecursionError:
        raise ConfigError(f"value nested deeper than {MAX_DEPTH} levels") from None
    if set(doc) != {"v"}:  # "2\ntrain.eval_every=5" would smuggle in a second key
        raise ConfigError(f"value {s!r} must be one value on one line (give each key its own --set)")
    value = doc["v"]
    check_plain_data(value, "value")
    return value


def check_plain_data(data: Any, where: str) -> None:
    """ConfigError unless ``data`` nests at most :data:`MAX_DEPTH` deep and holds at most :data:`MAX_NODES` values
    (walked without recursion, so a self-referencing YAML alias or a bomb of aliases is refused, not followed)."""
    stack, nodes = [(data, 0)], 0
    while stack:
        obj, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise ConfigError(f"{where}: more than {MAX_NODES} values (YAML aliases expanding?)")
        if depth > MAX_DEPTH:
            raise ConfigError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(obj, Mapping):
            stack.extend((v, depth + 1) for v in obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend((v, depth + 1) for v in obj)


_HINTS: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    """Resolved field annotations of a dataclass (cached)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is type(None):
        return "nothing"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp) if a is not type(None))
    if origin in (list, tuple):
        return "a list (TOML: [a, b])"
    if origin in (dict, Mapping) or tp is dict:
        return "a table"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def coerce(key: str, value: Any, tp: Any) -> Any:
    """``value`` converted to the annotated type ``tp``; ConfigError naming ``key`` when it does not fit."""
    def bad() -> ConfigError:
        return ConfigError(f"config key {key}: expected {_type_name(tp)}, got {value!r}")

    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        real = [a for a in args if a is not type(None)]
        if len(real) == 1:
            return coerce(key, value, real[0])
        for a in real:
            try:
                return coerce(key, value, a)
            except ConfigError:
                pass
        raise bad()
    if origin is Literal:
        choices = get_args(tp)
        if value in choices and type(value) is type(choices[0]):
            return value
        raise ConfigError(f"config key {key}={value!r}: must be one of {', '.join(repr(c) for c in choices)}"
                          f"{suggest(str(value), [str(c) for c in choices])}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad()
    if tp is int:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
            return int(value)
        raise bad()
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise bad()
        return float(value)
    if tp is str:
        if isinstance(value, (int, float, datetime.date, datetime.time)) and not isinstance(value, bool):
            raise ConfigError(f"config key {key}: expected a string, got {value!r} "
                              f"(on the command line quote it: {key.rsplit('.', 1)[-1]}='{value}')")
        if not isinstance(value, str):
            raise bad()
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad()
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"config key {key}: expected {len(args)} values, got {value!r}")
            return tuple(coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
        elem = args[0] if args else Any
        out = [coerce(f"{key}[{i}]", v, elem) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise bad()
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise bad()
        return from_dict(tp, value, prefix=key)
    return value


def check_bounds(key: str, value: Any, meta: Mapping[str, Any]) -> None:
    """ConfigError naming ``key`` when ``value`` (or an element of it) is NaN or outside the field's bounds."""
    lower = [(sym, meta[b]) for b, sym in (("gt", ">"), ("ge", ">=")) if meta.get(b) is not None]
    upper = [(sym, meta[b]) for b, sym in (("lt", "<"), ("le", "<=")) if meta.get(b) is not None]
    if not lower and not upper:
        return
    rule = ", ".join(f"{sym} {b:g}" for sym, b in lower + upper)
    if lower and upper:
        rule = f"between {lower[0][1]:g} and {upper[0][1]:g} ({rule})"
    vals = value if isinstance(value, (list, tuple)) else [value]
    for v in vals:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        ok = math.isfinite(v) and all(v > b if sym == ">" else v >= b for sym, b in lower) and all(
            v < b if sym == "<" else v <= b for sym, b in upper)
        if not ok:  # NaN and ±inf are refused too
            raise ConfigError(f"config key {key}={value!r}: must be {'' if math.isfinite(v) else 'finite and '}{rule}")


class Section:
    """Base of every config dataclass: coerces and checks each field on construction (``MuonConfig(lr="x")``
    raises :class:`ConfigError` naming ``lr``). Subclasses may add cross-field checks in ``check()``.

    Each instance records which fields its constructor was given (:func:`explicit_fields`): a preset fills only the
    fields a user did not write, whatever their values."""

    _prefix: typing.ClassVar[str] = ""  # dotted path of the section in the full config, for messages
    _moved: typing.ClassVar[Mapping[str, str]] = {}  # old key → where it moved (for the unknown-key message)

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        self = super().__new__(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        object.__setattr__(self, "_explicit", frozenset(names[:len(args)]).union(kwargs))
        return self

    def __post_init__(self) -> None:
        hints = field_types(type(self))
        for f in dataclasses.fields(self):
            key = f"{self._prefix}.{f.name}" if self._prefix else f.name
            v = coerce(key, getattr(self, f.name), hints[f.name])
            check_bounds(key, v, f.metadata)
            object.__setattr__(self, f.name, v)
        self.check()

    def check(self) -> None:
        """Cross-field checks (raise ConfigError); none by default."""


def explicit_fields(section: Any) -> frozenset[str]:
    """The fields of a :class:`Section` that were written, not left to their defaults: for one built by
    :func:`from_dict`, the keys its data holds (a config file's and ``--set``'s keys); in Python, the arguments given
    to its constructor. ``dataclasses.replace`` passes every field, so a replaced copy counts every field as written
    (its values are already resolved); ``copy.copy``, ``copy.deepcopy`` and :func:`replace_filled` keep the record."""
    return getattr(section, "_explicit", frozenset())


def replace_filled(section: Any, **filled: Any) -> Any:
    """``dataclasses.replace(section, **filled)`` for values filled in on the user's behalf (a preset's): the copy
    keeps ``section``'s record of written fields, so the filled ones still count as not written."""
    out = dataclasses.replace(section, **filled)
    object.__setattr__(out, "_explicit", explicit_fields(section))
    return out


def field_docs(cls: type) -> dict[str, str]:
    """Field name → one-line documentation (from :func:`setting`), for ``--help`` and the dumped config."""
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}


def from_dict(cls: type, data: Mapping[str, Any], *, prefix: str | None = None) -> Any:
    """An instance of the config dataclass ``cls`` from a (partial) nested dict; missing keys take defaults.

    Args:
        cls: a dataclass (normally a :class:`Section`).
        data: key → value; nested dataclass fields take nested dicts.
        prefix: dotted path of this section, for messages (default: the class's ``_prefix``).

    Raises:
        ConfigError: an unknown key (with the closest valid names, or where it moved) or a value that does not fit.
    """
    if dataclasses.is_dataclass(data) and isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"config section {prefix or cls.__name__}: expected a table, got {data!r}")
    prefix = getattr(cls, "_prefix", "") if prefix is None else prefix
    upgrade = getattr(cls, "_upgrade", None)  # a section's older spellings rewritten (each warns, naming the new one)
    if upgrade is not None:
        data = upgrade(data, prefix)
    names = {f.name for f in dataclasses.fields(cls)}
    hints = field_types(cls)
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            hint = getattr(cls, "_moved", {}).get(str(k))  # a key that was renamed or moved: say where
            raise ConfigError(f"unknown config key {key}" + (f": {hint}" if hint else suggest(str(k), sorted(names))))
        kwargs[k] = coerce(key, v, hints[k])
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """A config dataclass as a plain nested dict (None values left out: TOML has no null, and a missing key loads
    back as its default, which is None for every optional field)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            v = to_dict(getattr(obj, f.name))
            if v is not None:
                out[f.name] = v
        return out
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj

