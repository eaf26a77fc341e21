"""Recipe ``manifolds`` (the manifold-assignment paper, arXiv:2606.13276): which manifold for which module, where
it stops training, which element of the published algorithm causes that, and an assignment chosen from measured
geometry.

The recipe's variants depend on the parts of the preset (each part a trainer config; a plain trainer config is the
part ``main``):

* ``main`` — the paper's comparison. Identical model, data, schedule and hyperparameters; only the assignment
  changes: the five strategies ``unconstrained``, ``all-stiefel``, ``all-dgram``, ``hetero`` (attention Stiefel, MLP
  DGram), ``hetero-inv`` (attention DGram, MLP Stiefel); ``all-dgram-capped`` (ALL-DGRAM with σ_max(W_Q)·σ_max(W_K)
  ≤ ``sigma_cap`` per layer by scalar rescaling, the control ``sigma_cap``: the paper calls DGram attention unstable
  *without additional scale control*); ``hetero-md`` (HETERO inside the magnitude–direction wrapper); with
  ``[sweep] auto = true``, ``auto`` (strategy ``auto``: ALL-DGRAM, and an attention layer moves to Stiefel once its
  logit bound σ_max(W_Q)·σ_max(W_K)·max‖x‖²/√d_head exceeds ``auto_threshold``, the control ``auto_assign``;
  :mod:`weightgeom.train.auto_assign`).
* ``boundary`` — the stability boundary: every strategy of ``strategies`` × every algorithm of ``algorithms``
  (``ours``: ``optim.preset = "ours"``; ``paper``: ``optim.preset = "paper"``, the published code's algorithm; with
  ``paper_msign_dtype`` its msign arithmetic in that dtype instead of bfloat16) × the Muon learning rates of
  ``ladder`` (default 0.005 × 2^k up to 0.64). Each rung runs after the rung below it
  with the same seed and is skipped once that one diverged (``stop_at_divergence``, default true), so a ladder
  stops at its first diverged rung.
* ``attribution`` — on ``attribution_strategies`` (default ALL-DGRAM and HETERO-INV) at Muon lr
  ``attribution_lr``: our algorithm, our algorithm with one element of the published one switched on
  (:data:`ATTRIBUTION_ARMS`), and the published algorithm as a whole, as published (bfloat16 msign) and with its
  msign in float32 (``paper-fp32-msign``: what the boundary and mechanism presets run, so the pair shows what bf16
  changes).
* ``long`` — the instability where the paper saw it, over a long run: the published algorithm (``paper``;
  ``paper_msign_dtype`` as for the boundary) on ``long_strategies`` (default ALL-DGRAM and HETERO-INV against HETERO
  and ALL-STIEFEL) × the part's Muon lr times each of ``long_lr_multipliers`` (default 1, 2, 4, 8), per-head
  statistics every ``head_stats_every`` steps. The report gives, per run, the step at which σ_max(W_Q)·σ_max(W_K),
  the logit max and the head saturation first cross their thresholds and whether divergence followed saturation.
  With ``long_scale_controls`` (any of :data:`SCALE_CONTROLS`), each DGram-attention arm (ALL-DGRAM, HETERO-INV) also
  runs once per control — ``qk-clip`` (QK-clip at τ = ``qk_clip_tau``) and ``sigma-cap`` (σ cap ``sigma_cap``) —
  tagged ``control``, so one sweep answers whether scale control removes the saturation or divergence and whether
  DGram attention then matches HETERO (preset ``long-const``: the learning rate held at its peak after warm-up).
* ``mechanism`` — long runs of ``mechanism_algorithms`` (default ``paper``; ``paper_msign_dtype`` as for the
  boundary) on ``mechanism_strategies`` with the
  softmax entropy and saturation of every attention head recorded every ``head_stats_every`` steps (the control
  ``head_stats_every``; :mod:`weightgeom.train.head_stats`).

An arm whose config keys this installation does not have (e.g. ``optim.preset``) is left out with one line on
stderr naming the key, so a preset keeps working while the published-algorithm keys are missing.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from weightgeom import manifolds
from weightgeom.experiments.runner import Recipe, Variant
from weightgeom.optim.config import PAPER_MUON
from weightgeom.optim.param_groups import STRATEGIES
from weightgeom.train.config import load_config, with_overrides
from weightgeom.train.qk_clip import DEFAULT_TAU

PAPER_STRATEGIES = ("unconstrained", "all-stiefel", "all-dgram", "hetero", "hetero-inv")
"""The paper's five arms; their manifolds per role are :data:`weightgeom.optim.param_groups.STRATEGIES`."""

_LABEL = {"stiefel": "Stiefel", "dgram": "DGram", "oblique": "Oblique"}


def describe_strategy(name: str) -> str:
    """One line for a strategy, from its manifolds in ``param_groups.STRATEGIES`` (e.g. ``"attention Stiefel, MLP
    DGram (HETERO)"``)."""
    if name == "auto":
        return "DGram everywhere; an attention layer moves to Stiefel when its logit bound crosses a threshold (AUTO)"
    attn, mlp = STRATEGIES[name]["attn"], STRATEGIES[name]["mlp"]
    if attn is None and mlp is None:
        what = "Muon, no manifold"
    elif attn == mlp:
        what = f"{_LABEL.get(str(attn), attn)} on attention and MLP"
    else:
        what = f"attention {_LABEL.get(str(attn), attn or 'none')}, MLP {_LABEL.get(str(mlp), mlp or 'none')}"
    return f"{what} ({name.upper()})"


STRATEGY_DESCRIPTIONS = {s: describe_strategy(s) for s in PAPER_STRATEGIES}
"""Strategy → description of the paper's five arms."""

DEFAULT_SIGMA_CAP = 2.0
DEFAULT_QK_CLIP_TAU = DEFAULT_TAU
DEFAULT_AUTO_THRESHOLD = 10.0
"""Logit-bound threshold of the ``auto`` arm (logit units; :class:`weightgeom.train.auto_assign.AutoAssignConfig`)."""
DEFAULT_LADDER = tuple(0.005 * 2 ** k for k in range(8))
"""Muon learning rates of the stability boundary: 0.005, 0.01, …, 0.64."""
DEFAULT_ALGORITHMS = ("ours", "paper")
DEFAULT_ATTRIBUTION_STRATEGIES = ("all-dgram", "hetero-inv")
DEFAULT_ATTRIBUTION_LR = 0.16
DEFAULT_MECHANISM_STRATEGIES = ("all-dgram", "hetero-inv", "hetero", "all-stiefel", "unconstrained")
DEFAULT_HEAD_STATS_EVERY = 50
DEFAULT_LONG_STRATEGIES = ("all-dgram", "hetero-inv", "hetero", "all-stiefel")
DEFAULT_LONG_LR_MULTIPLIERS = (1, 2, 4, 8)
SCALE_CONTROLS = ("qk-clip", "sigma-cap")
"""Scale controls ``long_scale_controls`` may add beside each DGram-attention arm of ``long``: QK-clip
(:mod:`weightgeom.train.qk_clip`, τ = ``qk_clip_tau``) and the σ cap (``sigma_cap``)."""

ALGORITHMS: dict[str, dict[str, Any]] = {
    "ours": {"optim.preset": "ours"},
    "paper": {"optim.preset": "paper", **{f"optim.muon.{k}": v for k, v in PAPER_MUON.items() if k != "dual"},
              **{f"optim.muon.dual.{k}": v for k, v in dataclasses.asdict(PAPER_MUON["dual"]).items()}},
}
"""Algorithm name → config overrides: our manifold Muon (the preset's ``[optim.muon]``), or the manifold-assignment
paper's published code — every ``[optim.muon]`` value of the published algorithm set explicitly, so a preset's own
``[optim.muon]`` settings (e.g. fewer dual steps for ours) cannot leak into it; ``lr`` stays the rung's."""

ATTRIBUTION_ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "no-g-normalisation": ("the momentum is not normalised before the dual ascent",
                           {"optim.muon.dual.normalize": False}),
    "sum-momentum": ("SGD-sum momentum B ← βB + g (Nesterov U = g + βB)", {"optim.muon.momentum_form": "sum"}),
    "sorted-sigma-retraction": ("retraction (UVᵀ)·diag(sorted σ), column norms handed out by index",
                                {"optim.muon.retraction": "paper"}),
    "bf16-msign": ("10-step Polar Express in bfloat16 with the published arithmetic",
                   {"optim.muon.msign_method": "polar_express_paper", "optim.muon.msign_dtype": "bfloat16",
                    "optim.muon.ns_steps": 10}),
    "dual-no-convergence": ("20 cold-started dual steps, stop only below 1e-6, last iterate kept (not projected)",
                            {"optim.muon.dual.keep": "last", "optim.muon.dual.warm_start": False,
                             "optim.muon.dual.tol": 1e-6, "optim.muon.dual.steps": 20,
                             "optim.muon.dual.project": False}),
}
"""Element of the published algorithm → (description, overrides switching on just that element on top of ours)."""


_NOTED: set[str] = set()


def _note(line: str) -> None:
    """One line on stderr (once per process) about an arm left out."""
    if line not in _NOTED:
        _NOTED.add(line)
        print(f"weightgeom sweep manifolds: {line}", file=sys.stderr)


def unsupported(base: dict[str, Any], overrides: dict[str, Any], strategy: str | None = None) -> str | None:
    """Why ``overrides`` cannot run on this installation (a config key it does not have, or a retraction variant a
    manifold of ``strategy`` does not offer), or None.

    Raises:
        ValueError: any other problem of the config (it is the preset's, and must not be hidden).
    """
    try:
        load_config(with_overrides(base, overrides))
    except ValueError as e:  # ConfigError, or the loader's one-line ValueError
        if "unknown config key" in str(e):
            return str(e).splitlines()[0]
        raise
    retraction = overrides.get("optim.muon.retraction")
    if retraction is not None and strategy in STRATEGIES:
        for m in {v for v in STRATEGIES[strategy].values() if v not in (None, "adamw")}:
            try:
                manifolds.get(str(m), retraction=retraction)
            except (TypeError, ValueError):
                return f"the {m} manifold has no retraction={retraction!r} in this installation"
    return None


def _algorithm(base: dict[str, Any], name: str, sweep: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Overrides of algorithm ``name``; ``ours`` without ``optim.preset`` is the plain config; None if unavailable.
    With ``sweep``, the published algorithm takes its ``paper_msign_dtype`` (CPU presets: the dual ascent's msign in
    another dtype than the published bfloat16)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
    ov = dict(ALGORITHMS[name])
    if name == "paper" and sweep and sweep.get("paper_msign_dtype"):
        ov["optim.muon.msign_dtype"] = str(sweep["paper_msign_dtype"])
    why = unsupported(base, ov)
    if why is None:
        return ov
    if name == "ours":
        return {}
    _note(f"algorithm {name!r} left out: {why}")
    return None


def _strategies(values: Sequence[str], key: str) -> list[str]:
    out = [str(s) for s in values]
    for s in out:
        if s not in STRATEGIES or s == "adamw":
            choices = ", ".join(k for k in STRATEGIES if k != "adamw")
            raise ValueError(f"{key}: unknown strategy {s!r}; choose from {choices}")
    return out


def _muon_name(part: dict[str, Any]) -> str:
    base_name = str(part.get("optim", {}).get("name", "muon"))
    return base_name if base_name.startswith("muon") and not base_name.endswith("-md") else "muon"


def _auto_variant(name: str, sweep: dict[str, Any], vname: str = "auto", extra: dict[str, Any] | None = None,
                  controls: dict[str, Any] | None = None, **kw: Any) -> Variant:
    """The ``auto`` arm: strategy ``auto`` with the ``auto_assign`` control (threshold ``[sweep] auto_threshold``)."""
    thr = float(sweep.get("auto_threshold", DEFAULT_AUTO_THRESHOLD))
    return Variant(vname, {"optim.name": name, "optim.strategy": "auto", **(extra or {})},
                   f"ALL-DGRAM; attention → Stiefel once its logit bound > {thr:g} (not in the paper)",
                   controls={"auto_assign": {"threshold": thr}, **(controls or {})}, **kw)


def main_variants(parts: dict[str, dict[str, Any]], sweep: dict[str, Any]) -> list[Variant]:
    """The paper's five arms, the σ-capped and MD arms and ``auto`` on part ``main``."""
    name = _muon_name(parts["main"])
    cap = float(sweep.get("sigma_cap", DEFAULT_SIGMA_CAP))
    out = [Variant(s, {"optim.name": name, "optim.strategy": s}, d, group=s) for s, d in STRATEGY_DESCRIPTIONS.items()]
    out.append(Variant("all-dgram-capped", {"optim.name": name, "optim.strategy": "all-dgram"},
                       f"ALL-DGRAM + scale control σ_max(W_Q)·σ_max(W_K) ≤ {cap:g} (not in the paper)",
                       controls={"sigma_cap": cap}, group="all-dgram"))
    out.append(Variant("hetero-md", {"optim.name": f"{name}-md", "optim.strategy": "hetero"},
                       "HETERO inside the magnitude–direction wrapper (not in the paper)", group="hetero"))
    if sweep.get("auto", False):
        out.append(_auto_variant(name, sweep, group="auto"))
    return out


def boundary_variants(base: dict[str, Any], sweep: dict[str, Any], part: str = "boundary") -> list[Variant]:
    """The LR ladder of every (strategy, algorithm) on part ``boundary``; each rung comes after the one below it."""
    ladder = sorted(float(x) for x in sweep.get("ladder", DEFAULT_LADDER))
    if not ladder or any(not x > 0 for x in ladder):
        raise ValueError(f"ladder must be a list of learning rates > 0, got {sweep.get('ladder')!r}")
    strategies = _strategies(sweep.get("strategies", PAPER_STRATEGIES), "strategies")
    stop = bool(sweep.get("stop_at_divergence", True))
    name = _muon_name(base)
    out = []
    for alg in [str(a) for a in sweep.get("algorithms", DEFAULT_ALGORITHMS)]:
        alg_ov = _algorithm(base, alg, sweep)
        if alg_ov is None:
            continue
        for s in strategies:
            prev = ""
            for k, lr in enumerate(ladder):
                vname = f"{s}-{alg}-lr{lr:g}"
                tags = {"study": "boundary", "strategy": s, "algorithm": alg, "lr": lr, "rung": k}
                common = {"part": part, "group": f"{s}-{alg}", "tags": tags, "after": prev if stop else ""}
                if s == "auto":
                    v = _auto_variant(name, sweep, vname=vname, extra={"optim.muon.lr": lr, **alg_ov}, **common)
                else:
                    v = Variant(vname, {"optim.name": name, "optim.strategy": s, "optim.muon.lr": lr, **alg_ov},
                                f"{describe_strategy(s)}, {alg} algorithm, Muon lr {lr:g}", **common)
                out.append(v)
                prev = vname
    return out


def attribution_variants(base: dict[str, Any], sweep: dict[str, Any], part: str = "attribution") -> list[Variant]:
    """Ours, ours + one element of the published algorithm, and the published algorithm, on part ``attribution``."""
    lr = float(sweep.get("attribution_lr", DEFAULT_ATTRIBUTION_LR))
    strategies = _strategies(sweep.get("attribution_strategies", DEFAULT_ATTRIBUTION_STRATEGIES),
                             "attribution_strategies")
    name = _muon_name(base)
    ours = _algorithm(base, "ours") or {}
    arms: list[tuple[str, str, dict[str, Any] | None]] = [("ours", "our manifold Muon", ours)]
    arms += [(arm, desc, {**ours, **ov}) for arm, (desc, ov) in ATTRIBUTION_ARMS.items()]
    paper = _algorithm(base, "paper")
    arms.append(("paper", "the published algorithm (every element)", paper))
    if paper is not None:  # what the boundary and mechanism presets run: the same with the msign in float32
        arms.append(("paper-fp32-msign", "the published algorithm with its dual-ascent msign in float32 "
                     "(paper_msign_dtype)", {**paper, "optim.muon.msign_dtype": "float32"}))
    out = []
    for s in strategies:
        for arm, desc, ov in arms:
            if ov is None:
                continue
            full = {"optim.name": name, "optim.strategy": s, "optim.muon.lr": lr, **ov}
            why = unsupported(base, full, s)
            if why is not None:
                _note(f"attribution arm {arm!r} on {s} left out: {why}")
                continue
            out.append(Variant(f"attr-{s}-{arm}", full, f"{s.upper()}, lr {lr:g}: {desc}", part=part,
                               group=f"attr-{s}", tags={"study": "attribution", "strategy": s, "arm": arm, "lr": lr}))
    return out


def mechanism_variants(base: dict[str, Any], sweep: dict[str, Any], part: str = "mechanism") -> list[Variant]:
    """Long runs with per-head entropy and saturation recorded, on part ``mechanism``."""
    strategies = _strategies(sweep.get("mechanism_strategies", DEFAULT_MECHANISM_STRATEGIES),
                             "mechanism_strategies")
    every = int(sweep.get("head_stats_every", DEFAULT_HEAD_STATS_EVERY))
    name = _muon_name(base)
    out = []
    for alg in [str(a) for a in sweep.get("mechanism_algorithms", ("paper",))]:
        ov = _algorithm(base, alg, sweep)
        if ov is None:
            continue
        for s in strategies:
            tags = {"study": "mechanism", "strategy": s, "algorithm": alg}
            if s == "auto":
                out.append(_auto_variant(name, sweep, vname=f"mech-auto-{alg}", extra=ov, part=part, group="mech-auto",
                                         tags=tags, controls={"head_stats_every": every}))
                continue
            out.append(Variant(f"mech-{s}-{alg}", {"optim.name": name, "optim.strategy": s, **ov},
                               f"{describe_strategy(s)}, {alg} algorithm, per-head statistics every {every} steps",
                               part=part, controls={"head_stats_every": every}, group=f"mech-{s}", tags=tags))
    return out


def long_variants(base: dict[str, Any], sweep: dict[str, Any], part: str = "long") -> list[Variant]:
    """The published algorithm on each strategy × Muon lr multiplier, with per-head statistics, on part ``long``."""
    strategies = _strategies(sweep.get("long_strategies", DEFAULT_LONG_STRATEGIES), "long_strategies")
    mults = [float(x) for x in sweep.get("long_lr_multipliers", DEFAULT_LONG_LR_MULTIPLIERS)]
    if not mults or any(not x > 0 for x in mults):
        raise ValueError(f"long_lr_multipliers must be a list of numbers > 0, got {sweep.get('long_lr_multipliers')!r}")
    every = int(sweep.get("head_stats_every", DEFAULT_HEAD_STATS_EVERY))
    scale = list(sweep.get("long_scale_controls", []))
    bad = [c for c in scale if c not in SCALE_CONTROLS]
    if bad:
        raise ValueError(f"long_scale_controls: unknown {bad[0]!r}; choose from {', '.join(SCALE_CONTROLS)}")
    control_of = {"qk-clip": {"qk_clip": {"tau": float(sweep.get("qk_clip_tau", DEFAULT_QK_CLIP_TAU))}},
                  "sigma-cap": {"sigma_cap": float(sweep.get("sigma_cap", DEFAULT_SIGMA_CAP))}}
    base_lr = float(base.get("optim", {}).get("muon", {}).get("lr", 0.02))
    name = _muon_name(base)
    ov = _algorithm(base, "paper", sweep)
    if ov is None:
        return []
    out = []
    for m in mults:  # by multiplier first: the runs most likely to diverge are spread over the jobs, not queued last
        for s in strategies:
            lr = base_lr * m
            tags = {"study": "long", "strategy": s, "algorithm": "paper", "lr": lr, "lr_multiplier": m,
                    "msign_dtype": str(ov["optim.muon.msign_dtype"])}
            overrides = {"optim.name": name, "optim.strategy": s, "optim.muon.lr": lr, **ov}
            what = f"{describe_strategy(s)}, published algorithm, Muon lr {lr:g} (×{m:g})"
            out.append(Variant(f"long-{s}-x{m:g}", overrides, f"{what}, per-head statistics every {every} steps",
                               part=part, controls={"head_stats_every": every}, group=f"long-{s}", tags=tags))
            if STRATEGIES[s]["attn"] != "dgram":
                continue
            for c in scale:
                (key, value), = control_of[c].items()
                out.append(Variant(f"long-{s}-x{m:g}-{c}", overrides, f"{what} with {key} = {value}, per-head "
                                   f"statistics every {every} steps", part=part,
                                   controls={"head_stats_every": every, key: value}, group=f"long-{s}-{c}",
                                   tags={**tags, "control": c}))
    return out


def variants(parts: dict[str, dict[str, Any]], sweep: dict[str, Any], steps: int | None = None) -> list[Variant]:
    """The variants of every part the preset has (module docstring): ``main``, ``boundary``, ``attribution``,
    ``mechanism``, ``long``.

    Raises:
        ValueError: a preset with none of these parts, or a ``[sweep]`` value that does not fit (naming it).
    """
    out: list[Variant] = []
    if "main" in parts:
        out += main_variants(parts, sweep)
    if "boundary" in parts:
        out += boundary_variants(parts["boundary"], sweep)
    if "attribution" in parts:
        out += attribution_variants(parts["attribution"], sweep)
    if "mechanism" in parts:
        out += mechanism_variants(parts["mechanism"], sweep)
    if "long" in parts:
        out += long_variants(parts["long"], sweep)
    if not any(k in parts for k in ("main", "boundary", "attribution", "mechanism", "long")):
        raise ValueError(f"the manifolds recipe needs a trainer config or the parts main, boundary, attribution, "
                         f"mechanism or long; the preset has {', '.join(sorted(parts))}")
    if not out:
        raise ValueError("every arm of this preset needs config keys this installation does not have (see the lines "
                         "above)")
    return out


RECIPE = Recipe(
    name="manifolds",
    default_config="tiny-shakespeare",
    default_seeds=(0, 1, 2),
    variants=variants,
    doc="manifold-assignment paper: UNCONSTRAINED/ALL-STIEFEL/ALL-DGRAM/HETERO/HETERO-INV, σ-capped DGram, HETERO+MD, "
        "AUTO; presets boundary (stability boundary + attribution), mechanism (long runs, per-head statistics) and "
        "long (the published algorithm, 3000 steps, lr ×1–×8: where the instability lives), long-const (10,000 "
        "steps at a constant lr ×8 and ×16, with QK-clip and σ-cap arms)",
)
