"""Manifold Muon direction by dual ascent (Bernstein 2025, "Modular Manifolds"; the manifold-assignment paper).

The manifold-assignment paper: K. Yoshihara, "Different Layers, Different Manifolds: Module-Wise Weight-Space Geometry
in Transformer Optimization", arXiv:2606.13276; derivation in docs/muon.md.

For a tall W ∈ R^{m×n} on a Gram-space manifold {W : P(WᵀW) = P(I)} and a gradient-like G, the direction solves

    minimise tr(GᵀA)  s.t.  ‖A‖₂ ≤ 1,  P(AᵀW + WᵀA) = 0.

With a symmetric multiplier Λ the Lagrangian's minimiser over the spectral ball is A(Λ) = −msign(G + 2W·P(Λ)); we
return the sign-flipped A = msign(G + 2W·P(Λ)) (the optimizer steps W − η·A, as in that paper's code). The dual is
concave with (super)gradient −H, H = P(WᵀA + AᵀW), so dual ascent is Λ ← Λ − α_k·H. The map Λ → A is invariant
under scaling G and Λ together, so G is first normalised to unit RMS singular value (‖G‖_F/sqrt(n)): α then has fixed
units and Λ can be warm-started across steps whatever the gradient scale.

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
    """Cold start Λ₀ = −¼·P(WᵀG + GᵀW) on the tall views (exact for square Stiefel W; docs/muon.md §3)."""
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
    project: bool = False,
    final_msign_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    stats: dict | None = None,
    cold0: torch.Tensor | None = None,
    final_continues: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """Steepest unit-spectral-norm direction tangent to ``manifold`` at W, by dual ascent on Λ.

    Iteration k: A_k = msign(Ĝ + 2X·P(Λ_k)), H_k = P(XᵀA_k + A_kᵀX), stop if ‖H_k‖_F/n ≤ tol, else
    Λ_{k+1} = Λ_k − α_k·H_k. Safeguard: whenever the residual grows, the step is halved for the rest of the call;
    the iterate with the smallest residual is returned (so more steps never give a worse answer).

    Args:
        W: point on the manifold, (..., m, n) in either orientation (wide matrices are transposed internally).
        G: gradient-like matrix of W's shape (typically the Nesterov momentum).
        manifold: the constraint (``P``; ``proj_tangent`` when ``project``).
        Lambda0: warm-start multiplier (..., n, n), n = min(m, n), in units of the *normalised* G; None → cold
            start ``initial_multiplier`` (exact for square Stiefel W).
        steps: maximum number of dual iterations K (each costs one ``msign_fn`` call).
        lr: dual step α in units of the normalised G per unit residual; iteration k uses α·(1 − k/K) with the
            ``"linear"`` schedule (the manifold-assignment paper's code) or α with ``"constant"``.
        tol: stop as soon as the tangent residual ‖H‖_F/n ≤ tol (same measure as ``Manifold.tangent_residual``).
        msign_fn: orthogonaliser used inside the loop, called on tall (..., m, n) matrices.
        schedule: ``"linear"`` or ``"constant"``.
        normalize: divide G by its RMS singular value ‖G‖_F/sqrt(n) first, so Λ and α are scale-free
            (recommended; then α = 0.1, the manifold-assignment paper's value, is in the stable range for
            typical spectra).
        project: finally replace A by ``manifold.proj_tangent(W, A)``: exactly tangent (residual at rounding
            level) at the cost of ‖A‖₂ = 1 + O(dual residual). The returned residual is then the projected one;
            ``stats["dual_residual"]`` keeps the dual ascent's.
        final_msign_fn: if given, A is recomputed once at the best Λ with this (more accurate) orthogonaliser —
            for cheap ``msign_fn`` inside the loop.
        stats: optional dict that receives ``dual_residual`` (before projection), ``dual_lr_final`` and
            ``cold_multiplier`` (this call's cold start, to pass as ``cold0`` next time).
        cold0: the cold start of the call that produced ``Lambda0``. When given with ``Lambda0`` the warm start is
            predicted as Lambda0 + (cold start now − cold0): first-order tracking of the moving optimum, exact for
            square Stiefel W (where the cold start is the solution). Costs one XᵀG product.
        final_continues: ``final_msign_fn`` continues the inner iteration: it is applied to the best iterate A
            (``msign_fn``'s output at the best Λ) instead of to Ĝ + 2X·P(Λ) — e.g. ``msign(·, steps=10,
            start_step=5)`` after a 5-step inner ``msign``, which gives the 10-step result for 5 more steps.

    Returns:
        (A, Lambda, residual, iters): A in W's orientation and dtype with ‖A‖₂ ≈ 1; the best multiplier Λ to
        warm-start the next call; the tangent residual of the returned A; the number of dual iterations (msign
        calls in the loop, not counting ``final_msign_fn``).
    """
    if schedule not in DUAL_SCHEDULES:
        raise ValueError(f"dual_schedule: unknown value {schedule!r}; choose one of {DUAL_SCHEDULES}")
    if W.shape != G.shape:
        raise ValueError(f"manifold_direction: W {tuple(W.shape)} and G {tuple(G.shape)} differ in shape")
    steps = max(1, int(steps))
    X, t = tall(W)
    Y = G.mT if t else G
    n = X.shape[-1]
    if normalize:
        Y = Y * (n**0.5 / (torch.linalg.vector_norm(Y, dim=(-2, -1), keepdim=True) + _NORM_EPS))
    cold = initial_multiplier(X, Y, manifold)
    if Lambda0 is None:
        Lam = cold
    elif cold0 is not None:
        Lam = Lambda0.to(X.dtype) + (cold - cold0.to(X.dtype))
    else:
        Lam = Lambda0.to(X.dtype)
    best = (float("inf"), X, Lam)  # (residual, A, Λ)
    prev = float("inf")
    shrink = 1.0
    iters = 0
    for k in range(steps):
        A = msign_fn(_shifted(X, Y, manifold.P(Lam))).to(X.dtype)
        iters = k + 1
        H = _residual_matrix(X, A, manifold)
        residual = float(torch.linalg.matrix_norm(H).max()) / n
        if residual < best[0]:
            best = (residual, A, Lam)
        if residual <= tol or k == steps - 1:
            break
        if residual > prev:
            shrink *= 0.5
        prev = residual
        alpha = lr * shrink * ((1.0 - k / steps) if schedule == "linear" else 1.0)
        Lam = Lam - alpha * H
    residual, A, Lam = best
    if final_msign_fn is not None:
        A = final_msign_fn(A if final_continues else _shifted(X, Y, manifold.P(Lam))).to(X.dtype)
        residual = float(torch.linalg.matrix_norm(_residual_matrix(X, A, manifold)).max()) / n
    if stats is not None:
        stats["dual_residual"] = residual
        stats["dual_lr_final"] = lr * shrink
        stats["cold_multiplier"] = cold
    if project:
        A = manifold.proj_tangent(X, A)
        residual = float(torch.linalg.matrix_norm(_residual_matrix(X, A, manifold)).max()) / n
    return untall(A, t), Lam, residual, iters


def _shifted(X: torch.Tensor, Y: torch.Tensor, PL: torch.Tensor) -> torch.Tensor:
    """Y + 2·X·P(Λ) (one fused addmm for plain matrices)."""
    return torch.addmm(Y, X, PL, alpha=2.0) if X.ndim == 2 else Y + 2.0 * (X @ PL)


def _residual_matrix(X: torch.Tensor, A: torch.Tensor, manifold: Manifold) -> torch.Tensor:
    """H = P(XᵀA + AᵀX) on tall views."""
    S = X.mT @ A
    return manifold.P(S + S.mT)


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
