"""One-line optimizer builders: ``build_optimizer(model, "muon-md", strategy="hetero")`` or
``build_optimizer(model, config=OptimConfig(...))``.

Names (case-insensitive; ``_``, ``+`` and a missing dash are accepted, e.g. ``"MuonMD"``, ``"adamw+md"``):

- ``"adamw"``: ``torch.optim.AdamW``; weight decay on ≥2-D params, none on 1-D (the nanoGPT convention).
- ``"muon"``: ``weightgeom.optim.Muon`` over ``param_groups(model, strategy)`` — Muon (or manifold Muon, per the
  strategy) on the hidden matrices, the AdamW path on embeddings, head, norms and biases.
- ``"adamw-md"``, ``"muon-md"``: the same, wrapped in ``MagnitudeDirection``. With a manifold strategy (e.g.
  ``"muon-md"`` + ``strategy="all-stiefel"`` or ``"hetero"``) the constrained matrices are stepped by manifold Muon
  inside MD (docs/md.md, "Manifold groups").

Every setting is a field of :class:`weightgeom.optim.config.OptimConfig` (``[optim]`` in a config file), whose
defaults are the one set of defaults for Python, files and the CLI; :func:`build_optimizer`'s keyword arguments are
shorthands onto that config (its Args say which field each sets; the :class:`~weightgeom.optim.config.MuonConfig`
fields are ignored by the AdamW names, so one call can drive every name).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from weightgeom.optim.config import OPTIMIZER_NAMES, AdamWConfig, MDConfig, MuonConfig, OptimConfig
from weightgeom.optim.dual import legacy_message, resolve_dual, take_legacy
from weightgeom.optim.magnitude_direction import MagnitudeDirection
from weightgeom.optim.muon import Muon
from weightgeom.optim.param_groups import param_groups
from weightgeom.schema import ConfigError, from_dict, suggest

__all__ = ["build_optimizer", "OPTIMIZER_NAMES", "MD_OPTIONS", "adamw_groups", "canonical_name"]

MD_OPTIONS = tuple(f.name for f in dataclasses.fields(MDConfig))
_MUON_FIELDS = tuple(f.name for f in dataclasses.fields(MuonConfig))
_GROUP_KEYS = ("split_qkv", "rules")


def canonical_name(name: str) -> str:
    """``"MuonMD"``, ``"muon_md"``, ``"muon+md"`` → ``"muon-md"``; raises ValueError on an unknown name."""
    key = str(name).strip().lower().replace("_", "-").replace("+", "-")
    if key.endswith("md") and not key.endswith("-md"):
        key = key[:-2] + "-md"
    if key not in OPTIMIZER_NAMES:
        raise ValueError(f"build_optimizer: unknown optimizer name {name!r}; choose from {list(OPTIMIZER_NAMES)}"
                         f"{suggest(key, OPTIMIZER_NAMES)}")
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


def resolve_config(
    name: str | None = None,
    strategy: str | None = None,
    md: MDConfig | Mapping[str, Any] | None = None,
    *,
    config: OptimConfig | Mapping[str, Any] | None = None,
    lr: float | None = None,
    adamw_lr: float | None = None,
    weight_decay: float | None = None,
    adamw_weight_decay: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    **hp: Any,
) -> OptimConfig:
    """The :class:`OptimConfig` that :func:`build_optimizer` builds from ``config`` and the shorthands.

    Raises:
        ValueError: unknown name, MD option, group key, or a value that does not fit (one line naming it).
        TypeError: an unknown keyword argument.
    """
    cfg = OptimConfig() if config is None else (
        config if isinstance(config, OptimConfig) else from_dict(OptimConfig, config))
    legacy = take_legacy(hp)
    if legacy:
        warnings.warn(legacy_message("build_optimizer()", {f"dual_{k}": v for k, v in legacy.items()}),
                      DeprecationWarning, stacklevel=3)
    if legacy or "dual" in hp:  # a preset name, a DualAscent, or fields over the config's value
        try:
            hp["dual"] = resolve_dual(hp.get("dual"), base=cfg.muon.dual).replace(**legacy)
        except (ValueError, TypeError) as e:
            raise ValueError(f"build_optimizer: {e}") from None
    unknown = sorted(set(hp) - set(_MUON_FIELDS) - set(_GROUP_KEYS))
    if unknown:
        names = (*_MUON_FIELDS, *_GROUP_KEYS, "lr", "adamw_lr", "weight_decay", "adamw_weight_decay", "betas", "eps")
        raise TypeError(f"build_optimizer: unknown keyword argument(s) {unknown}{suggest(unknown[0], names)}")
    key = canonical_name(cfg.name if name is None else name)
    if md and not key.endswith("-md"):
        raise ValueError(f"build_optimizer: md options given but name={key!r} has no magnitude–direction wrapper; "
                         f"use {key + '-md'!r}")
    if md is not None and not isinstance(md, MDConfig):
        bad = sorted(set(md) - set(MD_OPTIONS))
        if bad:
            raise ValueError(f"build_optimizer: unknown md option(s) {bad}{suggest(bad[0], MD_OPTIONS)}; "
                             f"known: {list(MD_OPTIONS)}")
        md = from_dict(MDConfig, {**dataclasses.asdict(cfg.md), **md})
    adamw_name = key.startswith("adamw")
    a_lr = adamw_lr if adamw_lr is not None else (lr if adamw_name else None)
    a_wd = adamw_weight_decay if adamw_weight_decay is not None else (weight_decay if adamw_name else None)
    adamw = {k: v for k, v in (("lr", a_lr), ("weight_decay", a_wd), ("betas", betas), ("eps", eps)) if v is not None}
    muon = {k: v for k, v in hp.items() if k in _MUON_FIELDS}
    if isinstance(muon.get("msign_dtype"), torch.dtype):  # Muon(msign_dtype=torch.bfloat16) spelling
        muon["msign_dtype"] = str(muon["msign_dtype"]).removeprefix("torch.")
    if not adamw_name:
        muon.update({k: v for k, v in (("lr", lr), ("weight_decay", weight_decay)) if v is not None})
    top = {k: v for k, v in hp.items() if k in _GROUP_KEYS}
    try:
        return dataclasses.replace(
            cfg, name=key, strategy=cfg.strategy if strategy is None else strategy, **top,
            muon=dataclasses.replace(cfg.muon, **muon) if muon else cfg.muon,
            adamw=dataclasses.replace(cfg.adamw, **adamw) if adamw else cfg.adamw,
            md=cfg.md if md is None else md)
    except ConfigError as e:
        raise ValueError(f"build_optimizer: {e}") from None


def build_optimizer(
    model: nn.Module,
    name: str | None = None,
    strategy: str | None = None,
    md: MDConfig | Mapping[str, Any] | None = None,
    *,
    config: OptimConfig | Mapping[str, Any] | None = None,
    lr: float | None = None,
    adamw_lr: float | None = None,
    weight_decay: float | None = None,
    adamw_weight_decay: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    verbose: bool = False,
    **hp: Any,
) -> torch.optim.Optimizer:
    """Build a named optimizer for ``model`` in one line.

    Args:
        model: the model; its parameters (``requires_grad``) are all optimised.
        name: ``"adamw"``, ``"muon"``, ``"adamw-md"`` or ``"muon-md"`` (None: ``config.name``, default ``"muon"``).
        strategy: ``param_groups`` strategy for the Muon names (``"unconstrained"``, ``"all-stiefel"``,
            ``"all-dgram"``, ``"hetero"``, ``"hetero-inv"``, ...). The AdamW names accept only ``"unconstrained"``.
        md: ``MagnitudeDirection`` options (an :class:`MDConfig` or a dict of its fields) for the ``-md`` names.
        config: the full optimizer config (an :class:`OptimConfig` or a nested dict as in ``[optim]``); the other
            arguments override it.
        lr: the step size of the optimizer the name runs (Muon's for Muon names; AdamW's for AdamW names when
            ``adamw_lr`` is None).
        adamw_lr: AdamW's step size (AdamW groups inside Muon, every group of the AdamW names).
        weight_decay: Muon's decoupled decay for Muon names; AdamW's for AdamW names when ``adamw_weight_decay`` is
            None.
        adamw_weight_decay: AdamW weight decay on ≥2-D params. Under MD the decoupled matrices get none regardless
            (MD fixes their norm).
        betas: AdamW betas.
        eps: AdamW epsilon.
        verbose: print the parameter-group table (Muon names).
        **hp: :class:`MuonConfig` fields (``momentum``, ``ns_steps``, ``msign_dtype``, ``dual``, ``init``, ...;
            ignored by the AdamW names; ``dual`` may be a preset name or a dict of the fields it changes over
            ``config``'s) and ``split_qkv`` / ``rules``.

    Returns:
        A ``torch.optim.Optimizer`` (``MagnitudeDirection`` for the ``-md`` names).

    Raises:
        ValueError: unknown name, unknown MD option, ``md`` given for a name without MD, a strategy other than
            ``"unconstrained"`` for an AdamW name, or a value that does not fit its field.
        TypeError: an unknown keyword argument.
    """
    cfg = resolve_config(name, strategy, md, config=config, lr=lr, adamw_lr=adamw_lr, weight_decay=weight_decay,
                         adamw_weight_decay=adamw_weight_decay, betas=betas, eps=eps, **hp)
    return from_config(model, cfg, verbose=verbose)


def from_config(model: nn.Module, cfg: OptimConfig, verbose: bool = False) -> torch.optim.Optimizer:
    """The optimizer an :class:`OptimConfig` describes (see :func:`build_optimizer`)."""
    a: AdamWConfig = cfg.adamw
    if cfg.name.startswith("adamw"):
        base: torch.optim.Optimizer = torch.optim.AdamW(adamw_groups(model, a.weight_decay), lr=a.lr,
                                                        betas=tuple(a.betas), eps=a.eps)
    else:
        adamw_hp = {"lr": a.lr, "weight_decay": a.weight_decay, "betas": tuple(a.betas), "eps": a.eps}
        groups = param_groups(model, cfg.strategy, rules=cfg.rules or None, split_qkv=cfg.split_qkv, verbose=verbose,
                              adamw_hparams=adamw_hp)
        if cfg.preset == "paper":  # the published code decays only unconstrained matrices (a rule's value wins)
            for g in groups:
                if g.get("algorithm") == "muon" and g.get("manifold") is not None:
                    g.setdefault("weight_decay", 0.0)
        base = Muon(groups, **cfg.muon.kwargs(), betas=tuple(a.betas), adamw_eps=a.eps, adamw_lr=a.lr)
    if not cfg.name.endswith("-md"):
        return base
    return MagnitudeDirection(base, model=model, **cfg.md.kwargs())
