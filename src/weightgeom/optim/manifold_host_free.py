"""Host-free retractions of manifold Muon's step: fixed loop counts and per-matrix device-side masks on batches of
tall matrices (docs/muon.md §6, "One compiled step"); the dual ascent itself is ``manifold_muon.dual_ascent``.

The eager ``polar_near`` picks the order of its series and stops on the host; here every such test is a boolean tensor
per matrix. Differences from the eager retractions: far from the manifold (‖XᵀX − I‖_F > ``NEAR_TOL``) the eager
retraction switches to Polar Express; here only the first step (known on the host: a matrix without momentum) does,
and later steps keep iterating the third-order series for its ``NEAR_MAX_ITERS`` iterations, which converges for
singular values in about (0.3, 1.5) — a step of spectral size lr moves them by ≤ lr, so this holds for lr ≲ 0.3; the
DGram column-polar retraction assumes no zero column (a zero column of a fresh point is completed exactly by the
eager path; here it gives NaN, which ``on_nonfinite="skip"`` then skips)."""

from __future__ import annotations

import torch

from weightgeom.linalg import msign
from weightgeom.linalg.gemm import addmm_batched
from weightgeom.manifolds.base import Manifold, compute_dtype, polar
from weightgeom.manifolds.dgram import dgram_retract_paper
from weightgeom.manifolds.oblique import normalize_columns, normalize_columns_paper
from weightgeom.manifolds.stiefel import NEAR_MAX_ITERS, NEAR_REMAINDER, ORDER_REMAINDER

__all__ = ["supports", "near_polar", "retract"]


def supports(manifold: Manifold) -> bool:
    """Whether ``retract`` has a host-free form of this manifold's retraction (Stiefel polar/paper with Polar Express,
    DGram column_polar/paper, Oblique normalize/paper); others step through the eager path."""
    name, retraction = getattr(manifold, "name", None), getattr(manifold, "retraction", None)
    method = getattr(manifold, "method", "polar_express")
    if name == "stiefel":
        return retraction == "paper" or (retraction == "polar" and method == "polar_express")
    if name == "dgram":
        return retraction == "paper" or (retraction == "column_polar" and method == "polar_express")
    return name == "oblique" and retraction in ("normalize", "paper")


def near_polar(X: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``stiefel.polar_near`` of a batch (B, m, n) of tall matrices with a fixed count: ``NEAR_MAX_ITERS``
    iterations, each matrix choosing its series order and stopping where ``polar_near`` does alone (its later
    iterations are masked out). ``scale``: column scales s (B, 1, n), as ``polar_near``'s. In compute dtype."""
    Xc = X.to(compute_dtype(X))
    tol = NEAR_REMAINDER[Xc.dtype]
    n = Xc.shape[-1]
    eye = torch.eye(n, dtype=Xc.dtype, device=Xc.device)
    s = None if scale is None else scale.to(Xc.dtype)
    active = torch.ones(Xc.shape[0], 1, 1, dtype=torch.bool, device=Xc.device)
    for _ in range(NEAR_MAX_ITERS):
        G = Xc.mT @ Xc
        E = (G if s is None else G / (s.mT * s)) - eye
        # the order test in float64, as polar_near takes it on the host
        e = torch.linalg.matrix_norm(E).to(torch.float64)
        rho = torch.minimum(e, E.abs().sum(dim=-1).amax(dim=-1).to(torch.float64))
        o1, o2, o3 = ((c * rho**k * e <= tol).reshape(-1, 1, 1) for k, c in enumerate(ORDER_REMAINDER, 1))
        F1 = E * -0.5
        E2 = E @ E
        F2 = torch.add(F1, E2, alpha=0.375)
        F3 = torch.add(F2, E2 @ E, alpha=-0.3125)
        F = torch.where(o1, F1, torch.where(o2, F2, F3))
        if s is not None:
            F = F * (s / s.mT)
        Xc = torch.where(active, addmm_batched(Xc, Xc, F), Xc)
        active = active & ~(o1 | o2 | o3)
    return Xc


def retract(manifold: Manifold, X: torch.Tensor, far: bool = False) -> torch.Tensor:
    """The manifold's retraction of a batch (B, m, n) of tall matrices, host-free, in X's dtype (computed in at least
    float32). ``far``: X is far from the manifold (a fresh matrix's first retraction): Stiefel and DGram take the
    polar factor by Polar Express, as the eager retraction does for a far point (a second, near retraction then takes it
    to rounding level, as in the eager first step)."""
    Z = X.to(compute_dtype(X))
    name, kind = manifold.name, manifold.retraction
    if name == "stiefel":
        if kind == "paper":
            return msign(X, method="polar_express_paper").to(X.dtype)
        R = polar(Z, "polar_express", manifold.steps) if far else near_polar(Z)
    elif name == "dgram":
        if kind == "paper":
            return dgram_retract_paper(X)
        norms = torch.linalg.vector_norm(Z, dim=-2, keepdim=True)
        R = polar(Z / norms, "polar_express", manifold.steps) * norms if far else near_polar(Z, scale=norms)
    elif name == "oblique":
        R = normalize_columns_paper(Z) if kind == "paper" else normalize_columns(Z)
    else:  # pragma: no cover -- callers check ``supports`` first
        raise NotImplementedError(f"no host-free retraction for {manifold!r}")
    return R.to(X.dtype)
