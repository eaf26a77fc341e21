"""``DualAscent``: manifold Muon's dual-ascent settings as one typed value (``Muon(..., dual=...)``).

A manifold group's direction is found by dual ascent on the constraint's multiplier Λ (docs/muon.md, "Manifold Muon by
dual ascent"). Its nine settings travel together: ``Muon(params, dual=DualAscent(steps=5))``, per group
``{"params": ..., "dual": "published"}``, in a config file ``[optim.muon] dual = "published"`` or a
``[optim.muon.dual]`` table. Named presets (``DUAL_PRESETS``):

- ``"default"``: one warm-started dual step, projected onto the tangent space (``DualAscent()``).
- ``"published"``: the published dual ascent of the manifold-assignment paper (K. Yoshihara, arXiv:2606.13276): 20
  cold-started steps of α = 0.1·(1 − k/20), no normalisation or projection, early stop below 1e-6, the last iterate;
  what ``optim.preset = "paper"`` uses.

Inside ``Muon`` a group keeps the value flattened as ``dual_<field>`` keys (``group_keys``: ``dual_steps``,
``dual_lr``, …), so ``state_dict()``'s param groups and older checkpoints keep their layout. Those keys, written by
hand as keywords, group keys or config keys, are the older spelling: they still work, with one DeprecationWarning line
naming the new one (``legacy_message``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from weightgeom.optim.checks import as_number
from weightgeom.optim.manifold_muon import DUAL_KEEP, DUAL_SCHEDULES
from weightgeom.schema import ConfigError, Section, setting, suggest

__all__ = ["DualAscent", "DUAL_PRESETS", "DUAL_FIELDS", "GROUP_KEYS", "dual_problem", "resolve_dual", "take_legacy",
           "legacy_message"]

DualSchedule = Literal[DUAL_SCHEDULES]  # type: ignore[valid-type]
DualKeep = Literal[DUAL_KEEP]  # type: ignore[valid-type]


@dataclass(frozen=True)
class DualAscent(Section):
    """Manifold Muon's dual ascent (ignored by groups without a manifold). Frozen; compare with ``==``.

    Args:
        steps: maximum dual-ascent iterations per optimizer step (each costs one msign), ≥ 1. The default 1 with
            ``project``: the warm-started (predicted) multiplier's direction projected onto the tangent space.
        lr: dual step α, > 0 (units of the momentum normalised to unit RMS singular value when ``normalize``);
            halved whenever the residual grows with ``keep="best"``.
        tol: stop once the tangent residual ‖P(WᵀA + AᵀW)‖_F/n ≤ tol (≥ 0; unitless).
        schedule: ``"linear"`` (α_k = α(1 − k/K), as published) or ``"constant"``.
        ns_steps: msign steps inside the dual loop (None: the group's ``ns_steps``); when set, one accurate msign
            recomputes the direction at the best Λ.
        project: project the final direction onto the tangent space (exactly tangent) and rescale it to unit
            spectral norm.
        normalize: divide the momentum by its RMS singular value before the ascent (scale-free α and Λ). False: the
            published code. Part of the state's meaning: a checkpoint resumes only with the same value.
        warm_start: start from the previous step's (predicted) multiplier; False: cold start Λ₀ = −¼·P(WᵀU + UᵀW).
        keep: ``"best"`` (halve α when the residual grows, use the smallest-residual iterate) or ``"last"`` (the
            published loop: fixed schedule, the last iterate).

    Raises:
        ValueError (``ConfigError``): a field out of range or of the wrong type, one line naming it.
    """

    _prefix: ClassVar[str] = "optim.muon.dual"

    steps: int = setting(1, "maximum dual-ascent iterations per step (one msign each)", gt=0)
    lr: float = setting(0.1, "dual step α (momentum normalised to unit RMS singular value)", gt=0)
    tol: float = setting(1e-4, "stop once the tangent residual ‖P(WᵀA + AᵀW)‖_F/n ≤ tol", ge=0)
    schedule: DualSchedule = setting("linear", "α_k = α(1 − k/K) (linear) or α (constant)")
    ns_steps: int | None = setting(None, "msign steps inside the dual loop (unset: the group's ns_steps)", gt=0)
    project: bool = setting(True, "project the final direction onto the tangent space, rescaled to unit spectral "
                                  "norm")
    normalize: bool = setting(True, "divide the momentum by its RMS singular value first (false: as published)")
    warm_start: bool = setting(True, "start from the previous step's multiplier (false: cold start, as published)")
    keep: DualKeep = setting("best", "best (halve α when the residual grows, keep the smallest-residual iterate) | "
                                     "last (the published loop's last iterate)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            why = dual_problem(f.name, value)
            if why:
                raise ConfigError(f"DualAscent: {f.name}={value!r} is invalid: {why}")
            if f.name in ("steps", "ns_steps", "lr", "tol") and value is not None:  # a plain int / float
                object.__setattr__(self, f.name, as_number(value, integer=f.name in ("steps", "ns_steps")))

    @classmethod
    def preset(cls, name: str) -> DualAscent:
        """The named preset (``DUAL_PRESETS``); ValueError naming the choices for an unknown name."""
        if name not in DUAL_PRESETS:
            raise ConfigError(f"DualAscent preset {name!r} is unknown: choose one of {list(DUAL_PRESETS)}"
                              f"{suggest(str(name), DUAL_PRESETS)}")
        return DUAL_PRESETS[name]

    @classmethod
    def from_group(cls, group: Mapping[str, Any]) -> DualAscent:
        """The value a Muon param group (or its ``defaults``) holds as ``dual_<field>`` keys."""
        return cls(**{f: group[f"dual_{f}"] for f in DUAL_FIELDS})

    def group_keys(self) -> dict[str, Any]:
        """This value as Muon's flattened param-group keys ``{"dual_steps": ..., ...}``."""
        return {f"dual_{f}": getattr(self, f) for f in DUAL_FIELDS}

    def replace(self, **changes: Any) -> DualAscent:
        """A copy with ``changes`` (field names); the fields this value was written with stay written."""
        out = dataclasses.replace(self, **changes)
        object.__setattr__(out, "_explicit", frozenset(getattr(self, "_explicit", frozenset())).union(changes))
        return out

    def spelled(self) -> str:
        """Python source for this value, only the fields that differ from the default: ``DualAscent(steps=5)``."""
        base = DualAscent()
        args = ", ".join(f"{f}={getattr(self, f)!r}" for f in DUAL_FIELDS if getattr(self, f) != getattr(base, f))
        return f"DualAscent({args})"


DUAL_FIELDS = tuple(f.name for f in dataclasses.fields(DualAscent))
"""The field names, in order: steps, lr, tol, schedule, ns_steps, project, normalize, warm_start, keep."""
GROUP_KEYS = tuple(f"dual_{f}" for f in DUAL_FIELDS)
"""Muon's flattened param-group keys (``dual_steps``, …): what ``state_dict()`` and older checkpoints hold."""


def dual_problem(field: str, value: Any) -> str:
    """Why ``value`` is not a valid ``field`` of :class:`DualAscent` ("" when it is): the one definition of the rules,
    also applied by ``muon_checks.validate_values`` to a group's ``dual_<field>`` keys."""
    if field in ("steps", "ns_steps"):
        if value is None and field == "ns_steps":
            return ""
        ok = (as_number(value, integer=True) or 0) >= 1
        return "" if ok else ("must be an int ≥ 1" + (" or None" if field == "ns_steps" else ""))
    if field in ("lr", "tol"):
        x = as_number(value)
        good = x is not None and math.isfinite(x) and (x > 0.0 if field == "lr" else x >= 0.0)
        return "" if good else f"must be a finite number {'> 0' if field == 'lr' else '≥ 0'}"
    if field in ("project", "normalize", "warm_start"):
        return "" if isinstance(value, bool) else "must be True or False"
    if field in ("schedule", "keep"):
        allowed = DUAL_SCHEDULES if field == "schedule" else DUAL_KEEP
        return "" if value in allowed else f"choose one of {list(allowed)}"
    raise KeyError(field)


DUAL_PRESETS: dict[str, DualAscent] = {
    "default": DualAscent(),
    "published": DualAscent(steps=20, lr=0.1, tol=1e-6, schedule="linear", ns_steps=None, project=False,
                            normalize=False, warm_start=False, keep="last"),
}
"""The named values ``"default"`` and ``"published"`` (module docstring)."""


def resolve_dual(value: DualAscent | str | Mapping[str, Any] | None, base: DualAscent | None = None) -> DualAscent:
    """A ``dual=`` argument as a :class:`DualAscent`: a value as it is, a preset name, a mapping of fields over ``base``
    (a partial table changes only the fields it names), None → ``base`` (or the default).

    Raises:
        ValueError: an unknown preset or field, or a field value out of range (one line naming it).
        TypeError: any other type.
    """
    base = DualAscent() if base is None else base
    if value is None:
        return base
    if isinstance(value, DualAscent):
        return value
    if isinstance(value, str):
        return DualAscent.preset(value)
    if isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in DUAL_FIELDS)
        if unknown:
            raise ConfigError(f"DualAscent has no field {unknown[0]!r}: its fields are {list(DUAL_FIELDS)}"
                              f"{suggest(unknown[0], DUAL_FIELDS)}")
        return base.replace(**dict(value))
    raise TypeError(f"dual= takes a DualAscent, a preset name {list(DUAL_PRESETS)}, a dict of its fields or None, "
                    f"got {type(value).__name__}")


def legacy_message(where: str, legacy: Mapping[str, Any], new: str = "dual=") -> str:
    """The one-line deprecation for ``dual_<field>`` keys ``legacy`` ({key: value}) written at ``where``, naming the
    new spelling: ``Muon(): dual_steps= is deprecated; use dual=DualAscent(steps=5)``."""
    keys = ", ".join(f"{k}=" for k in legacy)
    args = ", ".join(f"{k.removeprefix('dual_')}={v!r}" for k, v in legacy.items())
    verb = "is" if len(legacy) == 1 else "are"
    return f"{where}: {keys} {verb} deprecated; use {new}DualAscent({args})"


def take_legacy(mapping: dict[str, Any], where: str | None = None) -> dict[str, Any]:
    """Remove and return the ``dual_<field>`` keys of ``mapping`` ({field: value}, in field order); in place. With
    ``where``, each value is checked first: ValueError ``"{where}: dual_steps=0 is invalid: ..."`` names the key as
    written (nothing removed then)."""
    if where is not None:
        for k in GROUP_KEYS:
            if k in mapping and (why := dual_problem(k.removeprefix("dual_"), mapping[k])):
                raise ValueError(f"{where}: {k}={mapping[k]!r} is invalid: {why}")
    return {k.removeprefix("dual_"): mapping.pop(k) for k in GROUP_KEYS if k in mapping}
