"""Typed optimizer configuration: one definition of every optimizer setting, for Python, files and the CLI.

- :class:`MuonConfig` — every hyperparameter keyword of :class:`weightgeom.optim.Muon`, with the same defaults
  (a test keeps them equal). In a config file: ``[optim.muon]``.
- :class:`AdamWConfig` — the AdamW path: embeddings, LM head, norms and biases inside Muon, or every parameter for the
  ``adamw`` names. ``[optim.adamw]``.
- :class:`MDConfig` — the magnitude–direction wrapper's options (:class:`weightgeom.optim.MagnitudeDirection`).
  ``[optim.md]``.
- :class:`OptimConfig` — which optimizer (``name``), which parameters go where (``strategy``, ``rules``,
  ``split_qkv``) and the three component configs. ``[optim]``.

``weight_decay`` always means the decay of the component it sits in (Muon's decoupled decay on its matrices in
``[optim.muon]``, AdamW's in ``[optim.adamw]``); ``lr`` likewise. A file in the older flat layout (``optim.lr``,
``optim.adamw_lr``, ``optim.muon_weight_decay`` …) is refused with one line saying where each key moved.

:func:`weightgeom.optim.build_optimizer` takes an :class:`OptimConfig`.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from weightgeom.manifolds import retraction_names
from weightgeom.optim.dual import DUAL_FIELDS, DUAL_PRESETS, GROUP_KEYS, DualAscent, legacy_message, resolve_dual
from weightgeom.optim.functional import ADJUST_LR_FNS, MOMENTUM_FORMS
from weightgeom.optim.md_functional import EMBEDDINGS, GAINS, PARAMETERIZATIONS, SPHERES
from weightgeom.optim.muon import ON_NONFINITE
from weightgeom.optim.muon_checks import INIT_MODES, LOOSE_MSIGN, MSIGN_METHODS
from weightgeom.optim.muon_checks import MUON_DEFAULTS as _D
from weightgeom.optim.param_groups import STRATEGIES
from weightgeom.schema import (
    ConfigError,
    Section,
    check_bounds,
    coerce,
    explicit_fields,
    field_types,
    replace_filled,
    setting,
    suggest,
)

__all__ = ["MuonConfig", "AdamWConfig", "MDConfig", "OptimConfig", "OPTIMIZER_NAMES", "MSIGN_DTYPES", "MOVED_KEYS",
           "PRESETS", "PAPER_MUON"]

OPTIMIZER_NAMES = ("adamw", "muon", "adamw-md", "muon-md")
PRESETS = ("ours", "paper")
MSIGN_DTYPES = ("float32", "bfloat16", "float16", "float64")

MsignDtype = Literal[MSIGN_DTYPES]  # type: ignore[valid-type]
MsignMethod = Literal[MSIGN_METHODS]  # type: ignore[valid-type]
AdjustLr = Literal[ADJUST_LR_FNS]  # type: ignore[valid-type]
MomentumForm = Literal[MOMENTUM_FORMS]  # type: ignore[valid-type]
Preset = Literal[PRESETS]  # type: ignore[valid-type]
Gains = Literal[GAINS]  # type: ignore[valid-type]
Parameterization = Literal[PARAMETERIZATIONS]  # type: ignore[valid-type]
Sphere = Literal[SPHERES]  # type: ignore[valid-type]
Embeddings = Literal[EMBEDDINGS]  # type: ignore[valid-type]
OptimizerName = Literal[OPTIMIZER_NAMES]  # type: ignore[valid-type]
Init = Literal[INIT_MODES]  # type: ignore[valid-type]
OnNonfinite = Literal[ON_NONFINITE]  # type: ignore[valid-type]
_ON_NONFINITE_DOC = ("a NaN/Inf gradient: raise (naming the parameter; one host sync per step) | skip (the whole step "
                     "becomes a no-op on the device, counted in skipped_steps; no host sync)")


class _Unset:
    """An older ``dual_<field>`` keyword of MuonConfig that was not given (read ``cfg.dual.<field>`` instead)."""

    def __repr__(self) -> str:
        return "<unset: the field moved to MuonConfig.dual>"


_UNSET: Any = _Unset()


@dataclass
class MuonConfig(Section):
    """Muon and manifold Muon (``[optim.muon]``); the fields are :class:`weightgeom.optim.Muon`'s keywords, with its
    defaults (``muon_checks.MUON_DEFAULTS``). ``dual`` is a :class:`~weightgeom.optim.dual.DualAscent`: in a file a
    preset name (``dual = "published"``) or a ``[optim.muon.dual]`` table. The older ``dual_<field>`` keys (files,
    ``--set``, keyword arguments) still load, with one DeprecationWarning naming the new key."""

    _prefix: ClassVar[str] = "optim.muon"

    lr: float = setting(_D["lr"], "step size: ‖ΔW‖₂ = lr·s per step, s the shape scale (spectral-norm units)", ge=0)
    momentum: float = setting(_D["momentum"], "momentum coefficient β", ge=0, lt=1)
    nesterov: bool = setting(_D["nesterov"], "Nesterov look-ahead U = (1−β)G + βM (ema) / G + βM (sum)")
    weight_decay: float = setting(_D["weight_decay"], "decoupled decay W ← W(1 − lr·wd) on Muon matrices (per step, "
                                                      "unitless)", ge=0)
    ns_steps: int | None = setting(_D["ns_steps"], "msign polynomial steps (unset: the method's default; 5 with "
                                                   "ns_coefficients)", gt=0)
    ns_coefficients: tuple[float, float, float] | None = setting(
        _D["ns_coefficients"], "torch.optim.Muon's (a, b, c): plain Muon orthogonalises by ns_steps steps of this one "
                               "quintic in torch's bf16 arithmetic instead of msign_method (unset: msign_method; "
                               "torch's default [3.4445, -4.775, 2.0315])")
    eps: float = setting(_D["eps"], "torch.optim.Muon's ε: lower bound of the norm the ns_coefficients iteration "
                                    "divides by (the AdamW ε is optim.adamw.eps)", gt=0)
    msign_method: MsignMethod = setting(_D["msign_method"], "msign polynomial: polar_express | muon | svd")
    msign_dtype: MsignDtype | None = setting(_D["msign_dtype"], "msign compute dtype (unset: chosen per device by a "
                                                                "cached micro-benchmark, bf16 only where faster; "
                                                                "manifold groups too with dual.project, else fp32)")
    adjust_lr_fn: AdjustLr | None = setting(_D["adjust_lr_fn"], "shape scale s: original sqrt(max(1, rows/cols)) | "
                                                                "match_rms_adamw | none (unset: original without a "
                                                                "manifold, none with one, so a manifold step is "
                                                                "‖ΔW‖₂ = lr)")
    momentum_form: MomentumForm = setting(_D["momentum_form"], "ema M ← βM + (1−β)G (torch.optim.Muon) | sum "
                                                               "M ← βM + G")
    dual: DualAscent = setting(_D["dual"], "manifold Muon's dual ascent: a preset (default | published) or a table of "
                                           "its fields (steps, lr, tol, schedule, ns_steps, project, normalize, "
                                           "warm_start, keep)")
    retraction: str | None = setting(_D["retraction"], "manifold retraction variant (unset: the manifold's default; "
                                                       "paper: the published retraction of every manifold)")
    init: Init = setting(_D["init"], "first step of a constrained matrix: auto (retract a fresh initialisation "
                                     "silently; refuse a pretrained-looking matrix far from the manifold, naming "
                                     "retract and keep) | retract (onto the manifold) | keep (the given, e.g. "
                                     "pretrained, weights)")
    on_nonfinite: OnNonfinite = setting(_D["on_nonfinite"], _ON_NONFINITE_DOC)
    # the older spelling of ``dual``'s fields (keyword arguments only: never fields, never written out)
    dual_steps: dataclasses.InitVar[Any] = _UNSET
    dual_lr: dataclasses.InitVar[Any] = _UNSET
    dual_tol: dataclasses.InitVar[Any] = _UNSET
    dual_schedule: dataclasses.InitVar[Any] = _UNSET
    dual_ns_steps: dataclasses.InitVar[Any] = _UNSET
    dual_project: dataclasses.InitVar[Any] = _UNSET
    dual_normalize: dataclasses.InitVar[Any] = _UNSET
    dual_warm_start: dataclasses.InitVar[Any] = _UNSET
    dual_keep: dataclasses.InitVar[Any] = _UNSET

    def __post_init__(self, *legacy_values: Any) -> None:  # type: ignore[override]
        legacy = {f: v for f, v in zip(DUAL_FIELDS, legacy_values) if v is not _UNSET}
        object.__setattr__(self, "dual", _dual_value(self.dual, "optim.muon.dual"))
        if legacy:
            warnings.warn(legacy_message("MuonConfig()", {f"dual_{k}": v for k, v in legacy.items()}),
                          DeprecationWarning, stacklevel=3)
            try:
                object.__setattr__(self, "dual", self.dual.replace(**legacy))
            except ValueError as e:
                raise ConfigError(f"config key optim.muon.dual: {e}") from None
        # the older keywords count as writing ``dual`` (dataclasses.replace passes them all, unset)
        written = explicit_fields(self) - set(GROUP_KEYS)
        object.__setattr__(self, "_explicit", written | {"dual"} if legacy else written)
        super().__post_init__()

    @classmethod
    def _upgrade(cls, data: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
        """``from_dict``'s hook: a preset name for ``dual`` as its value, and the older ``dual_<field>`` keys moved
        into the ``dual`` table with one DeprecationWarning naming the new keys."""
        legacy = {k: data[k] for k in GROUP_KEYS if k in data}
        if not legacy and not isinstance(data.get("dual"), str):
            return data
        out = {k: v for k, v in data.items() if k not in legacy}
        if "dual" in out:
            out["dual"] = _dual_value(out["dual"], f"{prefix}.dual", table=True)
        if legacy:
            old = ", ".join(f"{prefix}.{k}" for k in legacy)
            new = ", ".join(f"{prefix}.dual.{k.removeprefix('dual_')}={v!r}" for k, v in legacy.items())
            warnings.warn(f"config key{'s' if len(legacy) > 1 else ''} {old} {'are' if len(legacy) > 1 else 'is'} "
                          f"deprecated; use {new} (a [{prefix}.dual] table in a file)", DeprecationWarning,
                          stacklevel=4)
            fields = {k.removeprefix("dual_"): v for k, v in legacy.items()}
            base = out.get("dual")
            if isinstance(base, DualAscent):
                try:
                    out["dual"] = base.replace(**fields)
                except ValueError as e:
                    raise ConfigError(f"config key {prefix}.dual: {e}") from None
            else:
                out["dual"] = {**(base if isinstance(base, Mapping) else {}), **fields}
        return out

    def check(self) -> None:
        names = retraction_names()
        if self.retraction is not None and self.retraction not in names:
            raise ConfigError(f"config key optim.muon.retraction={self.retraction!r}: must be one of "
                              f"{', '.join(names)} (or unset: each manifold's default)"
                              f"{suggest(self.retraction, names)}")

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`weightgeom.optim.Muon` (``msign_dtype`` as a torch dtype)."""
        import torch

        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if kw["ns_coefficients"] is not None:
            kw["ns_coefficients"] = tuple(kw["ns_coefficients"])
        if kw["msign_dtype"] is not None:
            kw["msign_dtype"] = getattr(torch, kw["msign_dtype"])
        return kw


def _dual_value(value: Any, key: str, table: bool = False) -> Any:
    """``dual`` as written: a preset name → its :class:`DualAscent` (ConfigError naming ``key`` when unknown); anything
    else as it is (a table is coerced by the field's type)."""
    if not isinstance(value, str):
        return value
    if value not in DUAL_PRESETS:
        raise ConfigError(f"config key {key}={value!r}: must be one of {', '.join(DUAL_PRESETS)} or a table of "
                          f"DualAscent fields{suggest(value, DUAL_PRESETS)}")
    return DUAL_PRESETS[value]


@dataclass
class AdamWConfig(Section):
    """The AdamW path (``[optim.adamw]``): every parameter for the ``adamw`` names; embeddings, LM head, norms and
    biases inside Muon."""

    _prefix: ClassVar[str] = "optim.adamw"

    lr: float = setting(6e-4, "AdamW step size (parameter units per step)", ge=0)
    betas: tuple[float, float] = setting(_D["betas"], "AdamW (β1, β2)", ge=0, lt=1)
    eps: float = setting(_D["adamw_eps"], "AdamW denominator ε", gt=0)
    weight_decay: float = setting(0.1, "decoupled decay on ≥2-D AdamW parameters (1-D ones get none)", ge=0)


@dataclass
class MDConfig(Section):
    """The magnitude–direction wrapper W = diag(γ_r) Ŵ diag(γ_c) (``[optim.md]``), for the ``-md`` names."""

    _prefix: ClassVar[str] = "optim.md"

    gains: Gains = setting("row+col", "learned gains: row+col | row | col | scalar | none")
    parameterization: Parameterization = setting("softplus", "gain = softplus(θ) | exp(θ) | θ (direct)")
    sphere: Sphere = setting("frobenius", "norm the direction Ŵ keeps: frobenius | row | col")
    gain_lr: float = setting(1e-3, "Adam step size of the gain parameters", ge=0)
    gain_betas: tuple[float, float] = setting((0.9, 0.95), "Adam (β1, β2) of the gains", ge=0, lt=1)
    gain_eps: float = setting(1e-8, "Adam ε of the gains", gt=0)
    params: list[str] | None = setting(None, "names or fnmatch globs (whole name, e.g. '*.mlp.*') of the "
                                                   "matrices to decouple (unset: every hidden matrix)")
    exclude: list[str] = setting([], "names or fnmatch globs (whole name) of matrices never decoupled; each must "
                                         "match a parameter")
    embeddings: Embeddings = setting("exclude", "embeddings: exclude | unit_rows | decouple")
    embedding_radius: float = setting(1.0, "row norm of unit_rows embeddings", gt=0)
    fused: bool | None = setting(None, "use the fused C kernel (unset: when it is built and faster)")
    on_nonfinite: OnNonfinite = setting("raise", _ON_NONFINITE_DOC)

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`weightgeom.optim.MagnitudeDirection` (unset ``params`` left out)."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if kw["params"] is None:
            del kw["params"]
        return kw


_RULE_GROUP_KEYS = ("manifold", "algorithm")


def _check_rules(rules: dict[str, Any]) -> dict[str, Any]:
    """``optim.rules`` with every pattern a valid regex, every target a string or a table of group keys, and every
    group key checked and coerced like the field of the same name (MuonConfig's, or AdamWConfig's for an AdamW rule)."""
    out: dict[str, Any] = {}
    muon_types, adamw_types = field_types(MuonConfig), field_types(AdamWConfig)
    for pat, target in rules.items():
        key = f"optim.rules[{pat!r}]"
        if not isinstance(pat, str):
            raise ConfigError(f"config key optim.rules: a pattern must be a string (a regex), got {pat!r}")
        try:
            re.compile(pat)
        except re.error as e:
            raise ConfigError(f"config key {key}: not a valid regex ({e})") from None
        if isinstance(target, str):
            out[pat] = target
            continue
        if not isinstance(target, dict):
            raise ConfigError(f"config key {key}: expected 'adamw', 'muon', a manifold name or a table of group "
                              f"keys, got {target!r}")
        group: dict[str, Any] = {}
        adamw = target.get("algorithm") == "adamw"
        types, meta = (adamw_types, AdamWConfig) if adamw else (muon_types, MuonConfig)
        fields = {f.name: f for f in dataclasses.fields(meta)}
        legacy = {k.removeprefix("dual_"): target[k] for k in GROUP_KEYS if k in target and not adamw}
        if legacy:
            warnings.warn(legacy_message(f"config key {key}", {f"dual_{k}": v for k, v in legacy.items()},
                                         new="the key dual = "), DeprecationWarning, stacklevel=4)
            base = target.get("dual", {})
            target = {**{k: v for k, v in target.items() if k not in GROUP_KEYS},
                      "dual": {**base, **legacy} if isinstance(base, Mapping) else
                      resolve_dual(_dual_value(base, f"{key}.dual")).replace(**legacy)}
        for k, v in target.items():
            if k == "dual" and not adamw:  # kept as written (Muon takes a table over the optimizer's value)
                try:
                    resolve_dual(_dual_value(v, f"{key}.dual"))
                except (ValueError, TypeError) as e:
                    raise ConfigError(f"config key {key}.dual: {e}") from None
                group[k] = dict(v) if isinstance(v, Mapping) else v
            elif k in _RULE_GROUP_KEYS:
                if not isinstance(v, str):
                    raise ConfigError(f"config key {key}.{k}: expected a string, got {v!r}")
                group[k] = v
            elif k in fields:
                group[k] = coerce(f"{key}.{k}", v, types[k])
                check_bounds(f"{key}.{k}", group[k], fields[k].metadata)
            else:
                raise ConfigError(f"unknown config key {key}.{k}{suggest(k, [*fields, *_RULE_GROUP_KEYS])}")
        out[pat] = group
    return out


PAPER_MUON: dict[str, Any] = {
    "momentum": 0.95,
    "nesterov": True,
    "momentum_form": "sum",
    "weight_decay": 0.1,
    "adjust_lr_fn": "none",
    "msign_method": "polar_express_paper",
    "ns_steps": 10,
    "msign_dtype": "bfloat16",
    "dual": DUAL_PRESETS["published"],
    "retraction": "paper",
    "init": "retract",
}
"""``optim.preset = "paper"``: the [optim.muon] values of the manifold-assignment paper's published code. Constrained
matrices: SGD-sum momentum 0.95 with Nesterov, no normalisation, cold-started dual ascent of 20 steps with α = 0.1
decaying linearly, early stop below 1e-6, the last iterate; Polar Express (10 steps, bf16, the reference arithmetic);
the published retractions; no shape scale (η = lr·schedule); no weight decay (``build.from_config`` gives manifold
groups weight_decay 0 unless a rule sets it). Unconstrained Muon matrices: W ← W(1 − lr·0.1) − lr·msign(U). ``lr``
is not part of the preset."""


def apply_preset(muon: MuonConfig) -> MuonConfig:
    """``muon`` with every key of ``PAPER_MUON`` the user did not write (:func:`weightgeom.schema.explicit_fields`:
    not in the config file, ``--set`` or the constructor's arguments) set to the preset's value; written keys keep
    the user's value, even one equal to the default (reported by ``OptimConfig.preset_overrides``). Idempotent."""
    written = explicit_fields(muon)
    changes = {k: v for k, v in PAPER_MUON.items() if k != "dual" and k not in written and getattr(muon, k) != v}
    dual_written = explicit_fields(muon.dual) if "dual" in written else frozenset()
    dual = {f: getattr(PAPER_MUON["dual"], f) for f in DUAL_FIELDS
            if f not in dual_written and getattr(muon.dual, f) != getattr(PAPER_MUON["dual"], f)}
    if dual:  # field by field: a written dual.steps keeps its value, the other fields take the preset's
        changes["dual"] = replace_filled(muon.dual, **dual)
    return replace_filled(muon, **changes) if changes else muon


def paper_keys(muon: MuonConfig) -> dict[str, tuple[Any, Any]]:
    """{key: (value in ``muon``, the preset's value)} for every [optim.muon] key ``PAPER_MUON`` names, ``dual``'s
    fields as ``dual.<field>`` (the keys a preset report lists)."""
    out = {k: (getattr(muon, k), v) for k, v in PAPER_MUON.items() if k != "dual"}
    out.update({f"dual.{f}": (getattr(muon.dual, f), getattr(PAPER_MUON["dual"], f)) for f in DUAL_FIELDS})
    return out


MOVED_KEYS: dict[str, str] = {
    "lr": "moved to optim.muon.lr (Muon matrices); AdamW's is optim.adamw.lr",
    "adamw_lr": "moved to optim.adamw.lr",
    "weight_decay": "moved: AdamW's decay is optim.adamw.weight_decay, Muon's optim.muon.weight_decay",
    "adamw_weight_decay": "moved to optim.adamw.weight_decay",
    "muon_weight_decay": "moved to optim.muon.weight_decay",
    "betas": "moved to optim.adamw.betas",
    "eps": "moved to optim.adamw.eps",
    **{k: f"moved to optim.muon.{k}" for k in ("momentum", "nesterov", "ns_steps", "msign_method", "msign_dtype",
                                               "adjust_lr_fn", "momentum_form", "retraction")},
    **{k: f"moved to optim.muon.dual.{k.removeprefix('dual_')}" for k in GROUP_KEYS},
}
"""Keys of the older flat ``[optim]`` layout → where they live now (used in the unknown-key message)."""


@dataclass
class OptimConfig(Section):
    """Which optimizer, which parameters go where, and the component settings (``[optim]``)."""

    _prefix: ClassVar[str] = "optim"
    _moved: ClassVar[dict[str, str]] = MOVED_KEYS

    name: OptimizerName = setting("muon", "adamw | muon | adamw-md | muon-md")
    preset: Preset = setting("ours", "ours | paper: paper sets every [optim.muon] key the config does not write "
                                     "to the manifold-assignment paper's published algorithm (keys the config or "
                                     "--set writes keep their value; the trainer prints both)")
    strategy: str = setting("unconstrained", "manifold assignment for Muon names (weightgeom.optim.STRATEGIES)")
    split_qkv: bool = setting(False, "treat a fused QKV weight as three matrices (Q, K, V each constrained)")
    rules: dict[str, Any] = setting({}, "extra name rules {regex: adamw | muon | manifold | {group keys}} applied "
                                        "before the strategy")
    muon: MuonConfig = setting(MuonConfig(), "Muon / manifold Muon settings")
    adamw: AdamWConfig = setting(AdamWConfig(), "AdamW settings")
    md: MDConfig = setting(MDConfig(), "magnitude–direction wrapper settings (for the -md names)")

    def check(self) -> None:
        object.__setattr__(self, "rules", _check_rules(self.rules))
        if self.preset == "paper":
            object.__setattr__(self, "muon", apply_preset(self.muon))
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"config key optim.strategy={self.strategy!r}: must be one of {', '.join(STRATEGIES)}"
                              f"{suggest(self.strategy, STRATEGIES)}")
        if self.strategy == "auto" and self.name.endswith("-md"):
            raise ConfigError(f"config key optim.strategy='auto': moves attention matrices between Muon groups, "
                              f"which the magnitude–direction wrapper of optim.name={self.name!r} does not allow; "
                              "use optim.name='muon'")
        if self.name.startswith("adamw") and self.strategy != "unconstrained":
            raise ConfigError(f"config key optim.strategy={self.strategy!r}: needs a Muon name (manifold groups are "
                              f"Muon groups); optim.name={self.name!r} supports only 'unconstrained'")
        if self.strategy not in ("unconstrained", "adamw") and self.muon.msign_method in LOOSE_MSIGN:
            raise ConfigError(f"config key optim.muon.msign_method={self.muon.msign_method!r}: strategy "
                              f"{self.strategy!r} has manifold groups, which need a direction inside the unit "
                              "spectral ball, but the Muon quintic leaves singular values up to ≈1.13; use "
                              "'polar_express'")

    def preset_overrides(self) -> dict[str, tuple[Any, Any]]:
        """{key: (value used, the preset's value)} for every [optim.muon] key the preset sets but the config overrides
        (empty for preset "ours")."""
        if self.preset != "paper":
            return {}
        return {k: (v, p) for k, (v, p) in paper_keys(self.muon).items() if v != p}

    def preset_values(self) -> dict[str, Any]:
        """{key: value} of the [optim.muon] keys that have the preset's value (empty for preset "ours"): with
        :meth:`preset_overrides`, every key the preset names."""
        if self.preset != "paper":
            return {}
        return {k: v for k, (v, p) in paper_keys(self.muon).items() if v == p}
