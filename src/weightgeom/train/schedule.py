"""Learning-rate schedules as pure functions of the step: a multiplier on every param group's base LR.

The same factor scales every group — AdamW groups, Muon groups (the manifold-assignment paper: "Muon lr 0.02
scaled by the same schedule") and the magnitude–direction wrapper's gain LR — so the shapes stay identical. Warmup
follows nanoGPT: ``(step + 1) / (warmup + 1)`` for ``step < warmup``, then decay over ``[warmup, decay_steps]`` down to
``min_lr_ratio`` and constant afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from weightgeom.train.config import ScheduleConfig

__all__ = ["lr_factor", "make_lr_fn", "apply_lr", "capture_base_lrs"]

# group keys that hold a learning rate scaled by the schedule
LR_KEYS = ("lr", "adamw_lr", "gain_lr")


def lr_factor(step: int, kind: str = "cosine", warmup: int = 0, decay_steps: int = 1000,
              min_lr_ratio: float = 0.1) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based).

    Args:
        step: optimizer steps taken so far.
        kind: ``cosine`` | ``linear`` | ``constant``.
        warmup: steps of linear warmup (factor (step+1)/(warmup+1)).
        decay_steps: the step at which the decay reaches ``min_lr_ratio`` (nanoGPT ``lr_decay_iters``).
        min_lr_ratio: final factor of the decay.

    Returns:
        Factor in (0, 1].

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind not in ("cosine", "linear", "constant"):
        raise ValueError(f"schedule kind {kind!r}: must be cosine, linear or constant")
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    if step >= decay_steps:
        return min_lr_ratio
    span = max(1, decay_steps - warmup)
    ratio = min(1.0, max(0.0, (step - warmup) / span))
    if kind == "cosine":
        coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    else:
        coeff = 1.0 - ratio
    return min_lr_ratio + coeff * (1.0 - min_lr_ratio)


def make_lr_fn(schedule_cfg: ScheduleConfig, max_steps: int) -> Callable[[int], float]:
    """``step -> factor`` from the ``[schedule]`` config section (``decay_steps = 0`` means ``max_steps``)."""
    decay = schedule_cfg.decay_steps or max_steps
    kind, warmup, ratio = schedule_cfg.kind, schedule_cfg.warmup, schedule_cfg.min_lr_ratio
    return lambda step: lr_factor(step, kind, warmup, decay, ratio)


def capture_base_lrs(optimizer: torch.optim.Optimizer) -> None:
    """Store each group's peak learning rates as ``initial_<key>`` (idempotent, kept in the optimizer state dict).

    ``optimizer.param_groups`` are all the groups: a ``MagnitudeDirection``'s are its base's followed by its gains
    group."""
    for g in optimizer.param_groups:
        for k in LR_KEYS:
            if k in g and g[k] is not None and f"initial_{k}" not in g:
                g[f"initial_{k}"] = g[k]


def apply_lr(optimizer: torch.optim.Optimizer, factor: float) -> float:
    """Set every group's LR keys to ``initial × factor``; returns ``factor``."""
    capture_base_lrs(optimizer)
    for g in optimizer.param_groups:
        for k in LR_KEYS:
            base = g.get(f"initial_{k}")
            if base is not None:
                v = base * factor
                g[k] = v if not isinstance(g[k], torch.Tensor) else g[k].fill_(v)
    return factor
