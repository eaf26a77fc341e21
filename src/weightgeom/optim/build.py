"""One-line optimizer builders: ``build_optimizer(model, "muon-md", strategy="hetero")``.

Names (case-insensitive; ``_``, ``+`` and a missing dash are accepted, e.g. ``"MuonMD"``, ``"adamw+md"``):

- ``"adamw"``: ``torch.optim.AdamW``; weight decay on ≥2-D params, none on 1-D (nanoGPT / seed 000 convention).
- ``"muon"``: ``weightgeom.optim.Muon`` over ``param_groups(model, strategy)`` — Muon (or manifold Muon, per the
  strategy) on the hidden matrices, the AdamW path on embeddings, head, norms and biases.
- ``"adamw-md"``, ``"muon-md"``: the same, wrapped in ``MagnitudeDirection`` (options from ``md``). With a manifold
  strategy (e.g. ``"muon-md"`` + ``strategy="all-stiefel"`` or ``"hetero"``) the constrained matrices are stepped by
  manifold Muon inside MD (docs/md.md, "Manifold groups").

Learning-rate and weight-decay keys follow the trainer's config (``[optim]``): ``lr`` is the Muon (matrix) LR,
``adamw_lr`` the AdamW LR (AdamW groups inside Muon, or every group of ``"adamw"``/``"adamw-md"``; when it is None
``"adamw"`` falls back to ``lr``); ``weight_decay`` is Muon's decoupled decay, ``adamw_weight_decay`` AdamW's (for
``"adamw"`` it falls back to ``weight_decay``). Muon-only keys are accepted and ignored by the AdamW names so one config
can drive every name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from weightgeom.optim.magnitude_direction import MagnitudeDirection

__all__ = ["build_optimizer", "OPTIMIZER_NAMES", "MD_OPTIONS", "adamw_groups", "canonical_name"]

OPTIMIZER_NAMES = ("adamw", "muon", "adamw-md", "muon-md")
MD_OPTIONS = ("gains", "parameterization", "sphere", "gain_lr", "gain_betas", "gain_eps", "params", "exclude",
              "embeddings", "embedding_radius", "fused")
# Muon / param_groups hyperparameters (ARCHITECTURE.md, optim): passed to them, ignored by the AdamW names.
_MUON_KEYS = ("momentum", "nesterov", "ns_steps", "msign_method", "msign_dtype", "adjust_lr_fn", "momentum_form",
              "dual_steps", "dual_lr", "dual_tol", "retraction", "split_qkv", "rules", "adamw_hparams")

# AdamW defaults when nothing is given: seed 000's AdamW (SPEC §C): lr 6e-4, betas (0.9, 0.95), wd 0.1 on 2-D.
_ADAMW_LR = 6e-4
_ADAMW_WD = 0.1


def canonical_name(name: str) -> str:
    """``"MuonMD"``, ``"muon_md"``, ``"muon+md"`` → ``"muon-md"``; raises ValueError on an unknown name."""
    key = str(name).strip().lower().replace("_", "-").replace("+", "-")
    if key.endswith("md") and not key.endswith("-md"):
        key = key[:-2] + "-md"
    if key not in OPTIMIZER_NAMES:
        raise ValueError(f"build_optimizer: unknown optimizer name {name!r}; choose from {list(OPTIMIZER_NAMES)}")
    return key


def adamw_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two named AdamW groups: ≥2-D params with ``weight_decay``, the rest (norms, biases) without."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append((n, p))
    groups = []
    for items, wd in ((decay, weight_decay), (no_decay, 0.0)):
        if items:
            groups.append({"params": [p for _, p in items], "names": [n for n, _ in items],
                           "weight_decay": float(wd)})
    return groups


def build_optimizer(
    model: nn.Module,
    name: str = "muon",
    strategy: str = "unconstrained",
    md: dict[str, Any] | None = None,
    *,
    lr: float | None = None,
    adamw_lr: float | None = None,
    weight_decay: float | None = None,
    adamw_weight_decay: float | None = None,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    verbose: bool = False,
    **hp: Any,
) -> torch.optim.Optimizer:
    """Build a named optimizer for ``model`` in one line.

    Args:
        model: the model; its parameters (``requires_grad``) are all optimised.
        name: ``"adamw"``, ``"muon"``, ``"adamw-md"`` or ``"muon-md"`` (see module docstring for spellings).
        strategy: ``param_groups`` strategy for the Muon names (``"unconstrained"``, ``"all-stiefel"``,
            ``"all-dgram"``, ``"hetero"``, ``"hetero-inv"``, ...). The AdamW names accept only ``"unconstrained"``.
        md: ``MagnitudeDirection`` options (``gains``, ``parameterization``, ``sphere``, ``gain_lr``, ``gain_betas``,
            ``gain_eps``, ``params``, ``exclude``, ``embeddings``, ``embedding_radius``, ``fused``) for the ``-md``
            names.
        lr: Muon matrix LR (default 0.02); for ``"adamw"`` names only when ``adamw_lr`` is None.
        adamw_lr: AdamW LR (default 6e-4).
        weight_decay: Muon's decoupled weight decay (default 0); for AdamW names only when ``adamw_weight_decay``
            is None.
        adamw_weight_decay: AdamW weight decay on ≥2-D params (default 0.1). Under MD the decoupled matrices get
            none regardless (MD fixes their norm).
        betas: AdamW betas.
        eps: AdamW epsilon.
        verbose: print the parameter-group table (Muon names).
        **hp: Muon / ``param_groups`` keys (``momentum``, ``nesterov``, ``msign_method``, ``dual_steps``, ``rules``,
            ``split_qkv``, ...); ignored by the AdamW names.

    Returns:
        A ``torch.optim.Optimizer`` (``MagnitudeDirection`` for the ``-md`` names).

    Raises:
        ValueError: unknown name, unknown MD option, ``md`` given for a name without MD, or a strategy other than
            ``"unconstrained"`` for an AdamW name.
        TypeError: an unknown keyword argument.
    """
    key = canonical_name(name)
    unknown = sorted(set(hp) - set(_MUON_KEYS))
    if unknown:
        raise TypeError(f"build_optimizer: unknown keyword argument(s) {unknown}")
    use_md = key.endswith("-md")
    if md and not use_md:
        raise ValueError(f"build_optimizer: md options given but name={name!r} has no magnitude–direction wrapper; "
                         f"use {key + '-md'!r}")
    md = dict(md or {})
    bad = sorted(set(md) - set(MD_OPTIONS))
    if bad:
        raise ValueError(f"build_optimizer: unknown md option(s) {bad}; known: {list(MD_OPTIONS)}")

    if key.startswith("adamw"):
        if strategy not in (None, "unconstrained", "none"):
            raise ValueError(f"build_optimizer: strategy={strategy!r} needs a Muon name (manifold groups are Muon "
                             f"groups); {name!r} supports only 'unconstrained'")
        a_lr = adamw_lr if adamw_lr is not None else (lr if lr is not None else _ADAMW_LR)
        a_wd = adamw_weight_decay if adamw_weight_decay is not None else (
            weight_decay if weight_decay is not None else _ADAMW_WD)
        base: torch.optim.Optimizer = torch.optim.AdamW(adamw_groups(model, a_wd), lr=a_lr, betas=tuple(betas),
                                                        eps=eps)
    else:
        base = _build_muon(model, strategy, lr, adamw_lr, weight_decay, adamw_weight_decay, betas, eps, verbose, hp)

    if not use_md:
        return base
    return MagnitudeDirection(base, model=model, **md)


def _build_muon(model, strategy, lr, adamw_lr, weight_decay, adamw_weight_decay, betas, eps, verbose, hp):
    try:
        from weightgeom.optim.muon import Muon
        from weightgeom.optim.param_groups import param_groups
    except ImportError as e:  # pragma: no cover - only while the Muon module is missing
        raise ValueError(f"build_optimizer: the Muon names need weightgeom.optim.muon / param_groups ({e})") from e
    group_keys = {"split_qkv", "rules", "adamw_hparams"}
    pg_kw = {k: v for k, v in hp.items() if k in group_keys}
    muon_kw = {k: v for k, v in hp.items() if k not in group_keys}
    adamw_hp = dict(pg_kw.pop("adamw_hparams", None) or {})
    adamw_hp.setdefault("lr", adamw_lr if adamw_lr is not None else _ADAMW_LR)
    adamw_hp.setdefault("weight_decay", adamw_weight_decay if adamw_weight_decay is not None else _ADAMW_WD)
    adamw_hp.setdefault("betas", tuple(betas))
    adamw_hp.setdefault("eps", eps)
    groups = param_groups(model, strategy, verbose=verbose, adamw_hparams=adamw_hp, **pg_kw)
    muon_kw.update(lr=0.02 if lr is None else lr, weight_decay=0.0 if weight_decay is None else weight_decay,
                   betas=tuple(betas), eps=eps)
    if adamw_lr is not None:
        muon_kw["adamw_lr"] = adamw_lr
    return Muon(groups, **muon_kw)
