"""Euclidean "manifold" (no constraint): P = 0 in the Gram-space family; what ``manifold=None`` means."""

from __future__ import annotations

import math

import torch

from weightgeom.manifolds.base import CheckResult, Manifold, tall, tall_pair

__all__ = ["Euclidean"]


class Euclidean(Manifold):
    """All of R^{m×n}: P = 0, the retraction and the tangent projection are the identity."""

    name = "euclidean"
    entrywise_P = True  # P keeps or zeroes each Gram entry

    def P(self, S: torch.Tensor) -> torch.Tensor:
        """Zero: no Gram entry is constrained."""
        return torch.zeros_like(S)

    def retract(self, W: torch.Tensor, products: str = "ieee") -> torch.Tensor:
        """Identity (returns W itself, not a copy; ``products`` is ignored)."""
        tall(W)  # validates the shape
        return W

    def retract_host_free(self, X: torch.Tensor, far: bool = False) -> torch.Tensor:
        """``Manifold.retract_host_free``: the identity, as ``retract``."""
        return X

    def proj_tangent(self, W: torch.Tensor, A: torch.Tensor, products: str = "ieee") -> torch.Tensor:
        """Identity (returns A itself): every direction is tangent (``products`` is ignored)."""
        tall_pair(W, A)  # validates the shapes
        return A

    def check(self, W: torch.Tensor, tol: float = 1e-5) -> CheckResult:
        """Every finite matrix is on the manifold."""
        tall(W)
        if not torch.isfinite(W).all():
            bad = int((~torch.isfinite(W)).sum())
            return CheckResult(False, f"{self.name}: point has {bad} NaN/Inf entries", math.inf)
        return CheckResult(True, "", 0.0)

    def random_point(self, *shape: int, generator: torch.Generator | None = None,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """A standard Gaussian matrix."""
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)
