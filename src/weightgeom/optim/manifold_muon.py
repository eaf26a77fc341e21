"""Manifold Muon direction by dual ascent (SPEC §C; Bernstein 2025, "Modular Manifolds"; seed 000).

For a tall W ∈ R^{m×n} on a Gram-space manifold {W : P(WᵀW) = P(I)} and a gradient-like G, the direction solves

    minimise tr(GᵀA)  s.t.  ‖A‖₂ ≤ 1,  P(AᵀW + WᵀA) = 0.

With a symmetric multiplier Λ the Lagrangian's minimiser over the spectral ball is A(Λ) = −msign(G + 2W·P(Λ)); we
return the sign-flipped A = msign(G + 2W·P(Λ)) (the optimizer steps W − η·A, as in the seed code). The dual is
concave with (super)gradient −H, H = P(WᵀA + AᵀW), so dual ascent is Λ ← Λ − α_k·H. The map Λ → A is invariant
under scaling G and Λ together, so G is first normalised by its Frobenius norm (the step α then has fixed units).

``manifold_direction`` is a pure function (no state); the optimizer keeps Λ between steps as a warm start.
``manifold_direction_reference`` is the slow float64 SVD version for tests. Derivation: ``docs/muon.md``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from weightgeom.linalg import msign, msign_reference
from weightgeom.manifolds.base import Manifold, tall, untall

__all__ = ["manifold_direction", "manifold_direction_reference", "initial_multiplier", "DUAL_SCHEDULES"]

DUAL_SCHEDULES = ("linear", "constant")

# Added to ‖G‖_F before dividing: a zero gradient gives a zero-normalised G (the direction is then msign(2W·P(Λ)),
# harmless since the optimizer multiplies nothing by it: see Muon, which skips parameters whose update is zero).
_NORM_EPS = 1e-30


def _sym(S: torch.Tensor) -> torch.Tensor:
    return 0.5 * (S + S.mT)


def initial_multiplier(W: torch.Tensor, G: torch.Tensor, manifold: Manifold) -> torch.Tensor:
    """Cold start Λ₀ = −¼·P(WᵀG + GᵀW) on the tall views (exact for square Stiefel W; SPEC §C)."""
    X, t = tall(W)
    Y = G.mT if t else G
    S = X.mT @ Y
    return -0.25 * manifold.P(S + S.mT)


def manifold_direction(
    W: torch.Tensor,
    G: torch.Tensor,
    manifold: Manifold,
    Lambda0: torch.Tensor | None = None,
    steps: int = 20,
    lr: float = 0.1,
    tol: float = 1e-4,
    msign_fn: Callable[[torch.Tensor], torch.Tensor] = msign,
    schedule: str = "linear",
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """Steepest unit-spectral-norm direction tangent to ``manifold`` at W, by dual ascent on Λ.

    Args:
        W: point on the manifold, (m, n) in either orientation (wide matrices are transposed internally).
        G: gradient-like matrix of W's shape (typically the Nesterov momentum).
        manifold: the constraint (only ``P`` is used here).
        Lambda0: warm-start multiplier (n, n), n = min(m, n), in units of the *normalised* G; None → cold start
            ``initial_multiplier``.
        steps: maximum number of dual iterations K (each costs one ``msign_fn`` call).
        lr: dual step α (units of normalised G per unit residual); iteration k uses α·(1 − k/K) with the
            ``"linear"`` schedule (seed 000's code) or α with ``"constant"``.
        tol: stop as soon as the tangent residual ‖H‖_F/n ≤ tol (same measure as ``Manifold.tangent_residual``).
        msign_fn: orthogonaliser, called on (m, n) tall matrices.
        schedule: ``"linear"`` or ``"constant"``.
        normalize: divide G by ‖G‖_F first (recommended; Λ is then scale-free).

    Returns:
        (A, Lambda, residual, iters): A in W's orientation and dtype with ‖A‖₂ ≈ 1; the final multiplier Λ (n, n) to
        warm-start the next call; the tangent residual of the returned A; the number of msign calls made.
    """
    if schedule not in DUAL_SCHEDULES:
        raise ValueError(f"dual_schedule: unknown value {schedule!r}; choose one of {DUAL_SCHEDULES}")
    if W.shape != G.shape:
        raise ValueError(f"manifold_direction: W {tuple(W.shape)} and G {tuple(G.shape)} differ in shape")
    steps = max(1, int(steps))
    X, t = tall(W)
    Y = G.mT if t else G
    if normalize:
        Y = Y / (torch.linalg.vector_norm(Y, dim=(-2, -1), keepdim=True) + _NORM_EPS)
    n = X.shape[-1]
    Lam = initial_multiplier(X, Y, manifold) if Lambda0 is None else Lambda0.to(X.dtype)
    residual = float("inf")
    A = X
    iters = 0
    for k in range(steps):
        M = torch.addmm(Y, X, manifold.P(Lam), alpha=2.0) if X.ndim == 2 else Y + 2.0 * X @ manifold.P(Lam)
        A = msign_fn(M).to(X.dtype)
        iters = k + 1
        S = X.mT @ A
        H = manifold.P(S + S.mT)
        residual = float(torch.linalg.matrix_norm(H).max()) / n
        if residual <= tol or k == steps - 1:
            break
        alpha = lr * (1.0 - k / steps) if schedule == "linear" else lr
        Lam = Lam - alpha * H
    return untall(A, t), Lam, residual, iters


def manifold_direction_reference(
    W: torch.Tensor, G: torch.Tensor, manifold: Manifold, steps: int = 2000, lr: float = 0.05, tol: float = 1e-9
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """Slow float64 reference: dual ascent with an exact SVD msign and many constant-α steps, then linear decay.

    For tests on small matrices only. Same return convention as ``manifold_direction`` (A in float64).
    """
    W64, G64 = W.to(torch.float64), G.to(torch.float64)
    A, Lam, res, it = manifold_direction(
        W64, G64, manifold, None, steps=steps, lr=lr, tol=tol, msign_fn=msign_reference, schedule="constant"
    )
    if res > tol:
        A, Lam, res, it2 = manifold_direction(
            W64, G64, manifold, Lam, steps=steps, lr=lr, tol=tol, msign_fn=msign_reference, schedule="linear"
        )
        it += it2
    return A, Lam, res, it
