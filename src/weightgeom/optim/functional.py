"""Pure update stages of the Muon family (SPEC §B): momentum → direction → shape scale → decay → lr.

Every stage is a small function of tensors and floats, so the optimizer class (``muon.py``) is one loop that calls
them in order, and tests can check each stage alone. Derivations are in ``docs/muon.md``.

Conventions: matrices in PyTorch (out, in) layout; "rows" and "cols" are ``W.shape[-2]`` and ``W.shape[-1]``.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "MOMENTUM_FORMS",
    "ADJUST_LR_FNS",
    "momentum_direction",
    "shape_scale",
    "apply_update",
    "adamw_update",
]

MOMENTUM_FORMS = ("ema", "sum")
ADJUST_LR_FNS = ("original", "match_rms_adamw", "none")


def momentum_direction(
    buf: torch.Tensor, grad: torch.Tensor, beta: float, nesterov: bool = True, form: str = "ema"
) -> torch.Tensor:
    """Update the momentum buffer in place and return the vector to orthogonalise.

    Forms (β = ``beta``):
        - ``"ema"`` (SPEC §B, torch.optim.Muon): M ← βM + (1−β)G; Nesterov U = (1−β)G + βM, else U = M.
        - ``"sum"`` (SGD form, seed 000's code): M ← βM + G; Nesterov U = G + βM, else U = M.
    Started from M = 0 the two buffers differ by the constant factor (1−β), so after a scale-invariant msign the
    directions are identical; the forms differ only in what the buffer stores (and hence in checkpoints).

    Args:
        buf: momentum buffer M, modified in place.
        grad: gradient G (same shape as ``buf``).
        beta: momentum coefficient in [0, 1).
        nesterov: use the Nesterov look-ahead.
        form: ``"ema"`` or ``"sum"``.

    Returns:
        U (a new tensor, or ``buf`` itself when not Nesterov — do not modify it).
    """
    if form == "ema":
        buf.lerp_(grad, 1.0 - beta)
        return grad.lerp(buf, beta) if nesterov else buf
    if form == "sum":
        buf.mul_(beta).add_(grad)
        return grad.add(buf, alpha=beta) if nesterov else buf
    raise ValueError(f"momentum_form: unknown value {form!r}; choose one of {MOMENTUM_FORMS}")


def shape_scale(shape: tuple[int, ...] | torch.Size, adjust_lr_fn: str | None = "original") -> float:
    """Multiplier s of the orthogonalised update so its size is consistent across shapes.

    Args:
        shape: parameter shape (..., rows, cols).
        adjust_lr_fn: ``"original"`` (Keller Jordan): s = sqrt(max(1, rows/cols)); ``"match_rms_adamw"``
            (Moonshot): s = 0.2·sqrt(max(rows, cols)), giving the update the RMS of a typical AdamW step;
            ``"none"``: s = 1 (the step has spectral norm exactly lr). ``None`` means ``"original"``.

    Returns:
        s (dimensionless).
    """
    rows, cols = int(shape[-2]), int(shape[-1])
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn == "none":
        return 1.0
    raise ValueError(f"adjust_lr_fn: unknown value {adjust_lr_fn!r}; choose one of {ADJUST_LR_FNS}")


def apply_update(param: torch.Tensor, direction: torch.Tensor, lr: float, scale: float, weight_decay: float) -> None:
    """W ← W·(1 − lr·wd) − lr·s·O, in place (decoupled weight decay, then the step).

    Args:
        param: W, modified in place.
        direction: O (unit spectral norm for Muon), same shape as W; cast to W's dtype.
        lr: learning rate (spectral-norm units per step for Muon).
        scale: shape scale s from ``shape_scale``.
        weight_decay: decoupled decay coefficient (multiplied by lr).
    """
    if weight_decay != 0.0:
        param.mul_(1.0 - lr * weight_decay)
    param.add_(direction.to(param.dtype), alpha=-lr * scale)


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step in place (Loshchilov & Hutter; same arithmetic as torch.optim.AdamW, bias-corrected).

    Args:
        param: parameter, modified in place.
        grad: its gradient.
        exp_avg, exp_avg_sq: first and second moment buffers, modified in place.
        step: 1-based step count after this update (for bias correction).
        lr: learning rate (parameter units per step, as in AdamW).
        betas: (β1, β2).
        eps: added to sqrt(v̂).
        weight_decay: decoupled decay coefficient (multiplied by lr).
    """
    beta1, beta2 = betas
    if weight_decay != 0.0:
        param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bc1)
