"""The plain-Muon step as one batched function: stacked matrices, gradients and momentum buffers in, new matrices and
buffers out (docs/muon.md §1).

``muon_update`` is the one implementation of a plain-Muon step. ``Muon`` gathers each bucket of same-shape
parameters, stacks them along a new leading dim (a bucket of one is B = 1), calls it and writes the results back with
one ``torch._foreach_copy_`` per tensor list; the eager step, a ``torch.compile``'d step and ``compile_step`` all run
it. It reads nothing back to the host: a step skipped for a NaN/Inf gradient is a device-side mask ``ok``, and every
setting (learning rate, momentum, the msign or Newton–Schulz numerics) is an argument.

Arithmetic: every stage is elementwise per matrix except the orthogonalisation, which normalises and iterates each
matrix of the batch on its own; a bucket of one is orthogonalised as the 2-D matrix it is (``mm``, not a batch of
one through ``bmm``), so its bits are those of torch.optim.Muon's per-parameter step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightgeom.linalg import msign
from weightgeom.optim.functional import decoupled_step, momentum_step, newton_schulz, shape_scale
from weightgeom.optim.muon_layout import blocks, stored

__all__ = ["Orthogonaliser", "muon_update"]


@dataclass(frozen=True)
class Orthogonaliser:
    """How a plain-Muon direction is computed from the momentum direction U: a resolved value, no defaults left.

    Attributes:
        method: an msign preset name (``"polar_express"``, ``"muon"``, ``"polar_express_paper"``) or ``"svd"``;
            ignored when ``coefficients`` is set.
        steps: polynomial steps (None: the preset's default).
        dtype: compute dtype (None: msign's default for the device).
        coefficients: None, or torch.optim.Muon's fixed quintic (a, b, c), run by ``functional.newton_schulz``
            in torch's arithmetic for ``steps`` steps in ``dtype`` with Frobenius floor ``eps``.
        eps: the Newton–Schulz normalisation's floor (unused by the msign presets).
        cuda_graphs_max_mb: msign's CUDA-graph replay (``Numerics.graphs_max_mb``: 0 off; None: the environment's).
    """

    method: str = "polar_express"
    steps: int | None = None
    dtype: torch.dtype | None = None
    coefficients: tuple[float, float, float] | None = None
    eps: float = 1e-7
    cuda_graphs_max_mb: float | None = None

    def __call__(self, U: torch.Tensor) -> torch.Tensor:
        """The direction of U (..., m, n), of U's shape and dtype."""
        if self.coefficients is not None:
            return newton_schulz(U, self.coefficients, int(self.steps), self.eps, self.dtype or torch.bfloat16)
        return msign(U, method=self.method, steps=self.steps, dtype=self.dtype,
                     cuda_graphs_max_mb=self.cuda_graphs_max_mb)


def muon_update(params: torch.Tensor, grads: torch.Tensor, bufs: torch.Tensor, *, lr: float, momentum: float,
                nesterov: bool, momentum_form: str, weight_decay: float, adjust_lr_fn: str | None,
                layout: str, split: int | None, orthogonalise: Orthogonaliser,
                ok: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One plain-Muon step of B same-shape matrices: momentum → msign → shape scale → decoupled decay → lr step.

    Args:
        params: (B, *stored) stacked weights W (stored layout, ``layout``), not modified.
        grads: (B, *stored) their gradients G.
        bufs: (B, *stored) their momentum buffers M, not modified.
        lr: step size (spectral-norm units: ‖ΔW‖₂ = lr·s per matrix, s the shape scale).
        momentum: β in [0, 1).
        nesterov: the Nesterov look-ahead.
        momentum_form: ``"ema"`` or ``"sum"`` (``functional.momentum_step``).
        weight_decay: decoupled decay coefficient: W ← W(1 − lr·wd) before the step.
        adjust_lr_fn: shape scale s (``functional.shape_scale``; None: ``"original"``).
        layout: ``"out_in"`` or ``"in_out"`` (the stored matrices are (in, out)).
        split: None, or k: each matrix is k blocks stacked along its output dim, each orthogonalised alone.
        orthogonalise: the resolved numerics of the direction.
        ok: optional 0-dim bool device tensor: where False, the returned weights and buffers are bitwise the inputs
            (``torch.where``; a NaN in G reaches neither).

    Returns:
        (new weights, new momentum buffers), each (B, *stored), new tensors.
    """
    new_m, U = momentum_step(bufs, grads, momentum, nesterov, momentum_form)
    X = blocks(U, layout, split)
    D = orthogonalise(X[0]).unsqueeze(0) if X.shape[0] == 1 else orthogonalise(X)  # B = 1: the 2-D path
    W = blocks(params, layout, split)
    new = stored(decoupled_step(W, D, lr, shape_scale(W.shape, adjust_lr_fn), weight_decay), layout, split)
    if ok is not None:
        new, new_m = torch.where(ok, new, params), torch.where(ok, new_m, bufs)
    return new, new_m
