"""Recipe ``manifolds`` (the manifold-assignment paper, arXiv:2606.13276): which manifold for which module, plus
two arms the paper did not run.

Variants (identical model, data, schedule and hyperparameters; only the assignment changes):

* the paper's five strategies ``unconstrained``, ``all-stiefel``, ``all-dgram``, ``hetero`` (attention Stiefel,
  MLP DGram), ``hetero-inv`` (attention DGram, MLP Stiefel) — Muon (manifold Muon on the hidden matrices, AdamW on
  the rest);
* ``all-dgram-capped`` — ALL-DGRAM with an explicit scale control: σ_max(W_Q)·σ_max(W_K) ≤ ``sigma_cap`` per layer,
  enforced by scalar rescaling after each step (the trainer callback :class:`weightgeom.train.callbacks.SigmaCap`,
  declared as the control ``sigma_cap``). The paper says DGram attention is unstable *without additional scale
  control*; this arm tests that sentence;
* ``hetero-md`` — HETERO inside the magnitude–direction wrapper (``optim.name = "muon-md"``): the
  manifold-assignment paper × the MD paper.

The preset's ``[sweep]`` table may set ``seeds`` and ``sigma_cap`` (default 2.0: twice the Stiefel bound of 1 for
a fused c_attn). The base config must switch diagnostics on (``[diagnostics] every``) for the mechanism curves.
"""

from __future__ import annotations

from typing import Any

from weightgeom.experiments.runner import Recipe, Variant
from weightgeom.optim.param_groups import STRATEGIES

PAPER_STRATEGIES = ("unconstrained", "all-stiefel", "all-dgram", "hetero", "hetero-inv")
"""The paper's five arms; their manifolds per role are :data:`weightgeom.optim.param_groups.STRATEGIES`."""

_LABEL = {"stiefel": "Stiefel", "dgram": "DGram", "oblique": "Oblique"}


def describe_strategy(name: str) -> str:
    """One line for a strategy, from its manifolds in ``param_groups.STRATEGIES`` (e.g. ``"attention Stiefel, MLP
    DGram (HETERO)"``)."""
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


def variants(parts: dict[str, dict[str, Any]], sweep: dict[str, Any], steps: int | None = None) -> list[Variant]:
    """The seven arms as override dicts on the base config (part ``main``)."""
    base_name = str(parts["main"].get("optim", {}).get("name", "muon"))
    name = base_name if base_name.startswith("muon") and not base_name.endswith("-md") else "muon"
    cap = float(sweep.get("sigma_cap", DEFAULT_SIGMA_CAP))
    out = [Variant(s, {"optim.name": name, "optim.strategy": s}, d, group=s) for s, d in STRATEGY_DESCRIPTIONS.items()]
    out.append(Variant("all-dgram-capped", {"optim.name": name, "optim.strategy": "all-dgram"},
                       f"ALL-DGRAM + scale control σ_max(W_Q)·σ_max(W_K) ≤ {cap:g} (not in the paper)",
                       controls={"sigma_cap": cap}, group="all-dgram"))
    out.append(Variant("hetero-md", {"optim.name": f"{name}-md", "optim.strategy": "hetero"},
                       "HETERO inside the magnitude–direction wrapper (not in the paper)", group="hetero"))
    return out


RECIPE = Recipe(
    name="manifolds",
    default_config="tiny-shakespeare",
    default_seeds=(0, 1, 2),
    variants=variants,
    doc="manifold-assignment paper: UNCONSTRAINED/ALL-STIEFEL/ALL-DGRAM/HETERO/HETERO-INV, σ-capped DGram, HETERO+MD",
)
