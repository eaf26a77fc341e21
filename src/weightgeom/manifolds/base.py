"""The one abstract class behind every matrix manifold (Gram-space family, SPEC §C).

A manifold here is a constraint on the Gram matrix of a *tall* W ∈ R^{m×n} (m ≥ n):
    P(WᵀW) = P(I)
with P a self-adjoint linear projector on symmetric n×n matrices (Stiefel: P = Id; DGram: P = Off; Oblique:
P = Diag; Euclidean: P = 0, no constraint). Its tangent space at W is {A : P(WᵀA + AᵀW) = 0}.

Wide matrices (m < n) are handled by transposing: every public method accepts either orientation and works on the
tall view (``tall(W)``), returning results in the caller's orientation. Leading dims are batched.

Subclasses implement ``P``, ``retract`` and ``proj_tangent`` (and may override the rest). Adding a manifold is one
file, one line in ``manifolds/__init__.py``'s registry and one line in the test table; optimizers use only this API
and never branch on the manifold's type.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

__all__ = ["Manifold", "CheckResult", "tall", "untall"]


def tall(W: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Return (tall view of W, whether it was transposed). Tall means rows ≥ cols."""
    if W.ndim < 2:
        raise ValueError(f"manifold points must be matrices (..., m, n); got shape {tuple(W.shape)}")
    if W.shape[-2] < W.shape[-1]:
        return W.mT, True
    return W, False


def untall(X: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Undo ``tall``: transpose back if the input was wide."""
    return X.mT if transposed else X


@dataclass(frozen=True)
class CheckResult:
    """Outcome of ``Manifold.check``: truthy iff the point is on the manifold.

    Attributes:
        ok: whether every condition holds within tolerance.
        reason: empty when ok, else a one-line explanation naming the violated condition and its size.
        error: the largest normalised violation measured.
    """

    ok: bool
    reason: str
    error: float

    def __bool__(self) -> bool:
        return self.ok


class Manifold(ABC):
    """Gram-space matrix manifold {W : P(WᵀW) = P(I)} (W tall; see module docstring).

    Class attributes:
        name: registry name (``"stiefel"``, ``"dgram"``, ...).
    """

    name: str = "manifold"

    # ---- the projector that defines the manifold -------------------------------------------------------------
    @abstractmethod
    def P(self, S: torch.Tensor) -> torch.Tensor:
        """Self-adjoint projector on symmetric (..., n, n) matrices selecting the constrained Gram entries."""

    def target(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """P(I): the value the constrained Gram entries must take (n×n)."""
        return self.P(torch.eye(n, dtype=like.dtype, device=like.device))

    # ---- geometry ----------------------------------------------------------------------------------------------
    @abstractmethod
    def retract(self, W: torch.Tensor) -> torch.Tensor:
        """Map W (either orientation, batched) onto the manifold; idempotent on manifold points."""

    @abstractmethod
    def proj_tangent(self, W: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        """Euclidean-orthogonal projection of A onto the tangent space at the manifold point W."""

    def constraint_violation(self, W: torch.Tensor) -> torch.Tensor:
        """‖P(WᵀW) − P(I)‖_F / sqrt(n²) per matrix (batched), computed on the tall view."""
        X, _ = tall(W)
        n = X.shape[-1]
        G = X.mT @ X
        return torch.linalg.matrix_norm(self.P(G) - self.target(n, G)) / n

    def tangent_residual(self, W: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        """‖P(WᵀA + AᵀW)‖_F / sqrt(numel) per matrix: 0 iff A is tangent at W (the dual ascent's stop metric)."""
        X, t = tall(W)
        Y = A.mT if t else A
        H = X.mT @ Y
        H = self.P(H + H.mT)
        return torch.linalg.matrix_norm(H) / H.shape[-1]

    def check(self, W: torch.Tensor, tol: float = 1e-5) -> CheckResult:
        """Whether W is on the manifold within ``tol`` (normalised violation), and if not, why.

        Subclasses may override to give a more specific reason (which column, which condition).
        """
        if not torch.isfinite(W).all():
            return CheckResult(False, f"{self.name}: point has NaN/Inf entries", math.inf)
        err = float(self.constraint_violation(W).max())
        if err <= tol:
            return CheckResult(True, "", err)
        return CheckResult(False, f"{self.name}: ‖P(WᵀW) − P(I)‖_F/n = {err:.3g} > tol {tol:g}", err)

    def random_point(self, *shape: int, generator: torch.Generator | None = None,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """A random point of the manifold with the given shape (retraction of a Gaussian matrix)."""
        return self.retract(torch.randn(*shape, generator=generator, dtype=dtype))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
