"""Stiefel manifold {W : WᵀW = I} (W tall; wide matrices use WWᵀ = I): P = Id in the Gram-space family.

Tangent space at W: {A : WᵀA + AᵀW = 0}; orthogonal projection A − W·sym(WᵀA). Retraction: the polar factor
msign(W) (Polar Express iteration in W's precision, or the exact SVD polar factor).
"""

from __future__ import annotations

import torch

from weightgeom.manifolds.base import CheckResult, Manifold, gram_check, polar, tall, tall_pair, untall

__all__ = ["Stiefel", "sym", "stiefel_proj_tangent"]

_METHODS = ("polar_express", "svd")


def sym(M: torch.Tensor) -> torch.Tensor:
    """Symmetric part (M + Mᵀ)/2 of a batch of square matrices."""
    return 0.5 * (M + M.mT)


def stiefel_proj_tangent(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """Tangent projection on the tall view: Y − X·sym(XᵀY). Exact (orthogonal) when XᵀX = I."""
    return Y - X @ sym(X.mT @ Y)


class Stiefel(Manifold):
    """Matrices with orthonormal columns (tall view), i.e. all singular values equal to 1.

    Args:
        method: retraction: ``"polar_express"`` (default; msign iteration in float64 for float64 input, float32
            otherwise; converges to machine precision for well-conditioned W, e.g. a point after a small step) or
            ``"svd"`` (exact polar factor by float64 SVD; rank-deficient W gets an arbitrary orthonormal
            completion, so it always lands on the manifold).
        steps: Polar Express steps (default 10).

    A rank-deficient W retracted with ``"polar_express"`` gives a partial isometry (zero singular values stay
    zero; a zero W stays zero): never NaN, but not on the manifold — ``check`` reports it.
    """

    name = "stiefel"

    def __init__(self, method: str = "polar_express", steps: int | None = None) -> None:
        if method not in _METHODS:
            raise ValueError(f"stiefel: unknown retraction method {method!r}; choose one of {list(_METHODS)}")
        if steps is not None and int(steps) < 1:
            raise ValueError(f"stiefel: steps must be ≥ 1, got {steps}")
        self.method = method
        self.steps = None if steps is None else int(steps)

    def P(self, S: torch.Tensor) -> torch.Tensor:
        """Identity: every Gram entry is constrained."""
        return S

    def retract(self, W: torch.Tensor) -> torch.Tensor:
        """Polar factor msign(W) (U Vᵀ for W = U S Vᵀ), in W's dtype and orientation."""
        tall(W)  # validates the shape
        return polar(W, self.method, self.steps)

    def proj_tangent(self, W: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        """A − W·sym(WᵀA) on the tall view (orthogonal projection when W is on the manifold)."""
        X, Y, t = tall_pair(W, A)
        return untall(stiefel_proj_tangent(X, Y), t)

    def check(self, W: torch.Tensor, tol: float = 1e-5) -> CheckResult:
        """Unit column norms and pairwise |cos| ≤ tol on the tall view; the reason names the worst column pair."""
        return gram_check(self.name, W, tol, unit_norms=True, orthogonal=True)

    def random_point(self, *shape: int, generator: torch.Generator | None = None,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Haar-distributed point: Q of the QR of a Gaussian matrix, signs fixed by diag(R) > 0."""
        return haar_orthonormal(shape, generator, dtype)


def haar_orthonormal(shape: tuple[int, ...], generator: torch.Generator | None, dtype: torch.dtype) -> torch.Tensor:
    """Random matrix of ``shape`` with orthonormal columns (tall) or rows (wide), Haar-distributed."""
    if len(shape) < 2:
        raise ValueError(f"random_point: shape must have at least 2 dims (..., m, n), got {tuple(shape)}")
    *batch, m, n = shape
    wide = m < n
    rows, cols = (n, m) if wide else (m, n)
    G = torch.randn(*batch, rows, cols, generator=generator, dtype=torch.float64)
    Q, R = torch.linalg.qr(G)
    sign = torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))
    Q = Q * torch.where(sign == 0, torch.ones_like(sign), sign).unsqueeze(-2)
    return (Q.mT if wide else Q).to(dtype)
