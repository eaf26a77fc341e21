"""Oblique manifold {W : diag(WᵀW) = 1} (unit columns of the tall view): P = Diag in the Gram-space family.

Tangent space at W: {A : ⟨w_j, a_j⟩ = 0 ∀j}; orthogonal projection A − W·diag(diag(WᵀA)/diag(WᵀW)).
Retraction: normalise each column; a zero column becomes the standard basis vector e_j (never NaN).
"""

from __future__ import annotations

import torch

from weightgeom.linalg.norms import column_norms
from weightgeom.manifolds.base import CheckResult, Manifold, compute_dtype, gram_check, tall, tall_pair, untall

__all__ = ["Oblique", "normalize_columns", "normalize_columns_paper", "oblique_proj_tangent", "PAPER_NORM_FLOOR"]

_RETRACTIONS = ("normalize", "paper")
# The published code divides each column by max(‖w_j‖, PAPER_NORM_FLOOR).
PAPER_NORM_FLOOR = 1e-8


def normalize_columns(X: torch.Tensor) -> torch.Tensor:
    """Scale each column of tall X (..., m, n), m ≥ n, to unit L2 norm; a zero column j becomes e_j.

    The replacement e_j (the j-th standard basis vector of R^m) is deterministic and keeps several replaced
    columns mutually orthogonal. Computed in float32/float64, returned in X's dtype.
    """
    Z = X.to(compute_dtype(X))
    norms = column_norms(Z, keepdim=True)
    eye = torch.eye(Z.shape[-2], Z.shape[-1], dtype=Z.dtype, device=Z.device)
    out = torch.where(norms > 0, Z / norms.clamp_min(torch.finfo(Z.dtype).tiny), eye)
    return out.to(X.dtype)


def normalize_columns_paper(X: torch.Tensor) -> torch.Tensor:
    """The manifold-assignment paper's published retraction: each column of tall X divided by max(‖x_j‖, 1e-8)
    (a zero column stays zero, so it is not on the manifold). Computed in float32/float64, returned in X's dtype."""
    Z = X.to(compute_dtype(X))
    norms = column_norms(Z, keepdim=True)
    return (Z / norms.clamp_min(PAPER_NORM_FLOOR)).to(X.dtype)


def oblique_proj_tangent(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """Y − X·diag(⟨x_j, y_j⟩/‖x_j‖²) on the tall view: exact orthogonal projection for any X without zero
    columns (zero columns: nothing is subtracted)."""
    d = (X * X).sum(dim=-2, keepdim=True)
    lam = torch.where(d > 0, (X * Y).sum(dim=-2, keepdim=True) / d.clamp_min(torch.finfo(d.dtype).tiny),
                      torch.zeros_like(d))
    return Y - X * lam


class Oblique(Manifold):
    """Matrices with unit-norm columns (tall view; rows of a wide matrix). No orthogonality constraint.

    Args:
        retraction: ``"normalize"`` (default: unit columns, a zero column becomes e_j) or ``"paper"`` (the
            manifold-assignment paper's published code: columns divided by max(‖w_j‖, 1e-8); a zero column stays
            zero).
    """

    name = "oblique"
    entrywise_P = True  # P keeps or zeroes each Gram entry
    retractions = _RETRACTIONS

    def __init__(self, retraction: str = "normalize") -> None:
        if retraction not in _RETRACTIONS:
            raise ValueError(f"oblique: unknown retraction {retraction!r}; choose one of {list(_RETRACTIONS)}")
        self.retraction = retraction

    def P(self, S: torch.Tensor) -> torch.Tensor:
        """Diagonal part: only the column norms are constrained."""
        return torch.diag_embed(torch.diagonal(S, dim1=-2, dim2=-1))

    def retract(self, W: torch.Tensor, products: str = "ieee") -> torch.Tensor:
        """Normalise each column of the tall view (zero column → e_j; ``"paper"``: ÷ max(‖w_j‖, 1e-8)). No matrix
        products: ``products`` is ignored."""
        X, t = tall(W)
        return untall(normalize_columns_paper(X) if self.retraction == "paper" else normalize_columns(X), t)

    def retract_host_free(self, X: torch.Tensor, far: bool = False) -> torch.Tensor:
        """``Manifold.retract_host_free``: each column normalised (``retract``'s arithmetic, host-free already;
        ``far``: twice, as ``retract_far``)."""
        f = normalize_columns_paper if self.retraction == "paper" else normalize_columns
        R = f(X.to(compute_dtype(X))).to(X.dtype)
        if far and self.retraction != "paper":
            R = f(R.to(compute_dtype(R))).to(R.dtype)
        return R

    def proj_tangent(self, W: torch.Tensor, A: torch.Tensor, products: str = "ieee") -> torch.Tensor:
        """A − W·diag(diag(WᵀA)/diag(WᵀW)) on the tall view (column sums, no matrix products: ``products`` is
        ignored)."""
        X, Y, t = tall_pair(W, A)
        return untall(oblique_proj_tangent(X, Y), t)

    def check(self, W: torch.Tensor, tol: float = 1e-5) -> CheckResult:
        """|‖w_j‖ − 1| ≤ tol for every column of the tall view; the reason names the worst column."""
        return gram_check(self.name, W, tol, unit_norms=True, orthogonal=False)

    def random_point(self, *shape: int, generator: torch.Generator | None = None,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Uniform on the product of spheres: a Gaussian matrix with normalised columns."""
        return self.retract(torch.randn(*shape, generator=generator, dtype=torch.float64)).to(dtype)
