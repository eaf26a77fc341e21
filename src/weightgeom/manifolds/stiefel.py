"""Stiefel manifold {W : WᵀW = I} (W tall; wide matrices use WWᵀ = I): P = Id in the Gram-space family.

Tangent space at W: {A : WᵀA + AᵀW = 0}; orthogonal projection A − W·sym(WᵀA). Retraction: the polar factor
msign(W) (Polar Express iteration in W's precision, or the exact SVD polar factor). A point already close to the
manifold — the usual case, W − η·A after an optimizer step — takes a shortcut: W(WᵀW)^{-1/2} by iterating its
Taylor series (``polar_near``), a fraction of the Polar Express cost.
"""

from __future__ import annotations

import torch

from weightgeom import kernels
from weightgeom.linalg.gemm import addmm_batched
from weightgeom.linalg.layout import sym_sum
from weightgeom.linalg.msign import msign
from weightgeom.linalg.norms import plain
from weightgeom.linalg.split import split_bf16, split_matmul
from weightgeom.manifolds.base import (
    CheckResult,
    Manifold,
    Products,
    compute_dtype,
    constraint_addmm,
    constraint_gram,
    constraint_mm,
    gram_check,
    near_update,
    polar,
    products_of,
    small_mm,
    split_here,
    tall,
    tall_pair,
    untall,
)

__all__ = ["Stiefel", "sym", "stiefel_proj_tangent", "gram_deviation", "scaled_gram_deviation", "polar_near",
           "polar_near_masked",
           "NEAR_TOL", "NEAR_REMAINDER", "ORDER_REMAINDER", "NEAR_MAX_ITERS"]

_METHODS = ("polar_express", "svd")
_RETRACTIONS = ("polar", "paper")

# ``polar_near`` iterates X ← X·p(E), E = XᵀX − I, p the Taylor series of (I + E)^{-1/2} cut after E^k: p₁ = I − E/2,
# p₂ = p₁ + 3E²/8, p₃ = p₂ − 5E³/16. For an eigenvalue x of E (x = s² − 1, s a singular value of X) the new deviation
# is (1 + x)·p_k(x)² − 1 = c_k·x^{k+1} + O(x^{k+2}), c = (3/4, 5/8, 35/128) (``ORDER_REMAINDER``); with p₃,
# |x| ≤ 0.5 → ≤ 0.044 → ≤ 1e-6, so from ‖E‖_F ≤ NEAR_TOL three iterations always suffice. Each iteration takes the
# lowest order k whose remainder bound c_k·ρ^k·‖E‖_F (ρ ≤ min(‖E‖_F, ‖E‖_∞), the spectral radius bounds of a
# symmetric E) is below NEAR_REMAINDER[dtype] — that dtype's rounding — and then stops; when none is, it applies p₃
# and iterates. Each order below 3 saves one n×n×n product.
# Typical use: after a manifold-Muon step W − η·A with A tangent, E ≈ η²AᵀA: ρ ≈ η²‖A‖₂² but ‖E‖_F ≈ η²·sqrt(n). At
# η = 0.02 on GPT-2-small shapes (measured): ‖E‖_F ≈ 8e-3, ‖E‖_∞ ≈ 1.6e-3, ρ = 4e-4 → p₂ (bound 1.3e-8), one
# iteration: 2 m×n×n + 1 n×n×n products, against ~30 m×n×n-sized ones for 10 Polar Express steps.
NEAR_TOL = 0.5
NEAR_REMAINDER = {torch.float32: 5e-8, torch.float64: 5e-16}
ORDER_REMAINDER = (0.75, 0.625, 35 / 128)
"""c_k of the remainder c_k·x^{k+1} of ``polar_near``'s order-k step, k = 1, 2, 3 (see the comment above)."""
NEAR_MAX_ITERS = 4
"""Iterations ``polar_near`` (and its host-free batched form ``polar_near_masked``) run at most."""


def sym(M: torch.Tensor) -> torch.Tensor:
    """Symmetric part (M + Mᵀ)/2 of a batch of square matrices."""
    return sym_sum(M, 0.5)


def gram_deviation(X: torch.Tensor, products: str | Products = "ieee") -> torch.Tensor:
    """E = XᵀX − I for a tall X, in ``compute_dtype(X)`` (float64 for float64 input, else float32); ``products``: the
    Gram's (``constraint_gram``)."""
    return gram_deviation_of(constraint_gram(X.to(compute_dtype(X)), products=products), inplace=True)


def gram_deviation_of(G: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """G − I for a Gram matrix G: a new tensor, or G itself with ``inplace``."""
    E = G if inplace else G.clone()
    E.diagonal(dim1=-2, dim2=-1).sub_(1.0)
    return E


def scaled_gram_deviation(G: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """S⁻¹GS⁻¹ − I (a new tensor) for a Gram matrix G = XᵀX and column scales s (..., 1, n), S = diag(s): the Gram
    deviation of X·S⁻¹ without forming it."""
    E = G / (s.mT * s)
    E.diagonal(dim1=-2, dim2=-1).sub_(1.0)
    return E


def polar_near(X: torch.Tensor, E: torch.Tensor | None = None,
               scale: torch.Tensor | None = None, inplace: bool = False,
               gram: torch.Tensor | None = None, products: str | Products = "ieee") -> torch.Tensor | None:
    """Polar factor of a tall X with ‖XᵀX − I‖_F ≤ ``NEAR_TOL``, by the iteration X ← X·p_k(E) (see the constants).

    Args:
        X: tall (..., m, n) matrix (a batch is iterated until its worst matrix is done).
        E: the deviation the first iteration would form, when the caller has it already: ``gram_deviation(X)``, or
            with ``scale`` S⁻¹XᵀXS⁻¹ − I (``scaled_gram_deviation``).
        scale: positive column scales s (..., 1, n): return polar(X·S⁻¹)·S, S = diag(s), without forming X·S⁻¹ — the
            iteration runs on X with E = S⁻¹XᵀXS⁻¹ − I and the step X ← X + X·S⁻¹(p(E) − I)S, the same maths in
            scaled coordinates (DGram's column-polar retraction: s = the column norms; two passes over X fewer).
        inplace: write the last update into X itself (returned) when X is already in the compute dtype — only the
            update the iteration knows to be its last: a call that returns None leaves X untouched.
        gram: X's Gram matrix XᵀX when the caller has it (instead of E; not written).
        products: the constraint products (``manifolds.base.Products``, or its kind).

    Under split-bf16 products a 2-D float32 CPU X takes the n×n arithmetic of a step in two C passes
    (``kernels.near_deviation``, ``kernels.near_correction``: the bits of the torch expressions) and the update
    X + X·diag(F) + X_hi·bf16(F off its diagonal) directly — the same result but where ‖E‖ sits on a threshold of
    the series order (the kernel sums its norms in double, torch in float32; either order meets the tolerance).

    Raises:
        ValueError: ``scale`` is not of shape (..., 1, n).

    Returns:
        The polar factor (times S) in ``compute_dtype(X)``, or None if X is too far from the manifold
        (‖E‖_F > NEAR_TOL) or did not converge in ``NEAR_MAX_ITERS`` iterations — callers then use the Polar
        Express iteration.
    """
    Xc = X.to(compute_dtype(X))
    if Xc.numel() == 0:  # no columns (or rows): nothing to orthonormalise
        return Xc
    tol = NEAR_REMAINDER[Xc.dtype]
    if scale is not None and (scale.ndim < 2 or scale.shape[-2:] != (1, Xc.shape[-1])):
        raise ValueError(f"polar_near: scale must have shape (..., 1, n) with n = {Xc.shape[-1]} columns, got "
                         f"{tuple(scale.shape)}")
    s = None if scale is None else scale.to(Xc.dtype)
    pr = products_of(products)
    fused = Xc.ndim == 2 and Xc.dtype == torch.float32 and split_here(pr, Xc) and plain(Xc) \
        and (s is None or (s.numel() == Xc.shape[-1] and plain(s))) and kernels.load_kernel("linalg") is not None
    for _ in range(NEAR_MAX_ITERS):
        got = None
        if E is None:
            G = gram if gram is not None else constraint_gram(Xc, products=pr)
            own = G is not gram  # this call's Gram may become E in place; the caller's is never written
            got = kernels.near_deviation(G, s, inplace=own) if fused else None
            if got is None:
                E = gram_deviation_of(G, inplace=own) if s is None else scaled_gram_deviation(G, s)
        if got is not None:
            E, E_hi, e, inf = got
        else:  # worst ‖E‖_F and ‖E‖_∞ (max absolute row sum) of the batch, one host read: both bound ρ(E)
            e, inf = torch.stack([torch.linalg.matrix_norm(E).amax(), E.abs().sum(dim=-1).amax()]).tolist()
        gram = None
        if not e <= NEAR_TOL:  # also NaN
            return None
        rho = min(e, inf)
        order = next((k for k, c in enumerate(ORDER_REMAINDER, 1) if c * rho**k * e <= tol), None)
        last = order is not None
        parts = None
        if got is not None:  # the powers of E as small_mm forms them, then F, its diagonal and bf16 rest in one pass
            k = order or 3
            E2 = split_matmul((E_hi, None), (E_hi, None)) if k >= 2 else None
            E3 = split_matmul(split_bf16(E2, lo=False, memo=pr.memo), (E_hi, None)) if k == 3 else None
            parts = kernels.near_correction(E, E2, E3, s)
        if parts is not None:
            Xc = near_update(Xc, parts[1], parts[0], overwrite=inplace and last and Xc is X, memo=pr.memo)
        else:
            F = _near_correction(E, order or 3, pr)
            if s is not None:
                F = F * (s / s.mT)  # S⁻¹FS: F_ij·s_j/s_i
            # X·p(E) = X + X·(p(E) − I), fused; p(E) − I is a small correction (‖E‖_F ≤ NEAR_TOL)
            Xc = constraint_addmm(Xc, Xc, F, small=True, overwrite_c=inplace and last and Xc is X, products=pr)
        if last:
            return Xc
        E = None
    return None


def polar_near_masked(X: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``polar_near`` of a batch (B, m, n) of tall matrices without host reads, with a fixed count:
    ``NEAR_MAX_ITERS`` iterations, each matrix choosing its series order and stopping where ``polar_near`` does alone
    (its later iterations are masked out). ``scale``: column scales s (B, 1, n), as ``polar_near``'s. In compute
    dtype. Unlike ``polar_near`` it never switches to Polar Express far from the manifold: the series converges for
    singular values in about (0.3, 1.5) — a step of spectral size lr moves them by ≤ lr, so this holds after an
    optimizer step for lr ≲ 0.3; a far point takes ``retract_host_free(X, far=True)``."""
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


def _near_correction(E: torch.Tensor, order: int, products: str | Products = "ieee") -> torch.Tensor:
    """p_order(E) − I = −E/2 (+ 3E²/8 (− 5E³/16)) for order 1, 2 or 3 (order − 1 n×n×n products, each of small
    factors only — ``small_mm``, one bf16 product under split-bf16 ``products`` — added to the exact first-order
    term)."""
    F = E * -0.5
    if order == 1:
        return F
    E2 = small_mm(E, E, products)
    F.add_(E2, alpha=0.375)
    if order == 3:
        F.add_(small_mm(E2, E, products), alpha=-0.3125)
    return F


def stiefel_proj_tangent(X: torch.Tensor, Y: torch.Tensor, S: torch.Tensor | None = None,
                         overwrite_y: bool = False, products: str | Products = "ieee") -> torch.Tensor:
    """Tangent projection on the tall view: Y − X·sym(XᵀY) (S: XᵀY when known). Exact (orthogonal) when XᵀX = I.
    ``overwrite_y``: Y may be overwritten with the result (``constraint_addmm``'s ``overwrite_c``). ``products``: the
    constraint products (``manifolds.base.Products``, or its kind)."""
    pr = products_of(products)
    L = sym(constraint_mm(X.mT, Y, products=pr) if S is None else S)
    return constraint_addmm(Y, X, L, alpha=-1.0, overwrite_c=overwrite_y, products=pr)


class Stiefel(Manifold):
    """Matrices with orthonormal columns (tall view), i.e. all singular values equal to 1.

    Args:
        method: retraction: ``"polar_express"`` (default; msign iteration in float64 for float64 input, float32
            otherwise; converges to machine precision for well-conditioned W, e.g. a point after a small step) or
            ``"svd"`` (exact polar factor by float64 SVD; rank-deficient W gets an arbitrary orthonormal
            completion, so it always lands on the manifold).
        steps: Polar Express steps (default 10).
        retraction: ``"polar"`` (default: the polar factor computed as ``method`` says) or ``"paper"`` (the
            manifold-assignment paper's published code: msign(W) by Polar Express, 10 steps, in bfloat16 with the
            published arithmetic — ``msign(W, "polar_express_paper")`` — returned in W's dtype; ``method``
            and ``steps`` are then unused). Both are the polar factor; "paper" is accurate to bf16 only.

    A rank-deficient W retracted with ``"polar_express"`` gives a partial isometry (zero singular values stay
    zero; a zero W stays zero): never NaN, but not on the manifold — ``check`` reports it.
    """

    name = "stiefel"
    entrywise_P = True  # P keeps or zeroes each Gram entry
    retractions = _RETRACTIONS

    def __init__(self, method: str = "polar_express", steps: int | None = None, retraction: str = "polar") -> None:
        if method not in _METHODS:
            raise ValueError(f"stiefel: unknown retraction method {method!r}; choose one of {list(_METHODS)}")
        if steps is not None and int(steps) < 1:
            raise ValueError(f"stiefel: steps must be ≥ 1, got {steps}")
        if retraction not in _RETRACTIONS:
            raise ValueError(f"stiefel: unknown retraction {retraction!r}; choose one of {list(_RETRACTIONS)}")
        self.method = method
        self.steps = None if steps is None else int(steps)
        self.retraction = retraction

    def P(self, S: torch.Tensor) -> torch.Tensor:
        """Identity: every Gram entry is constrained."""
        return S

    def retract(self, W: torch.Tensor, products: str = "ieee") -> torch.Tensor:
        """Polar factor msign(W) (U Vᵀ for W = U S Vᵀ), in W's dtype and orientation.

        With ``"polar_express"``, a W within ‖WᵀW − I‖_F ≤ ``NEAR_TOL`` of the manifold (every matrix of a batch) is
        retracted by ``polar_near`` instead (its products as ``products`` says): same result to float32 rounding, a
        fraction of the cost.
        """
        X, t = tall(W)  # validates the shape
        if self.retraction == "paper":
            return msign(W, method="polar_express_paper").to(W.dtype)
        if self.method == "polar_express" and X.numel() > 0:
            R = polar_near(X, products=products)
            if R is not None:
                return untall(R, t).to(W.dtype)
        return polar(W, self.method, self.steps)

    def retract_(self, W: torch.Tensor, products: str = "ieee") -> torch.Tensor:
        """``retract`` in place (``Manifold.retract_``): a near-manifold W takes its last polar update in place."""
        X, _ = tall(W)
        if self.retraction != "paper" and self.method == "polar_express" and X.numel() > 0 \
                and X.dtype == compute_dtype(X):
            # X itself where its last update ran in place, else a new tensor
            R = polar_near(X, inplace=True, products=products)
            if R is not None:
                if R is not X:
                    X.copy_(R)
                return W
        return super().retract_(W, products=products)

    def retract_host_free(self, X: torch.Tensor, far: bool = False) -> torch.Tensor:
        """``Manifold.retract_host_free``: ``polar_near_masked``; ``far``: Polar Express first (as ``retract`` does
        for a far point), then the near series to rounding level; ``"paper"``: msign(X) by the published iteration."""
        if self.retraction == "paper":
            return msign(X, method="polar_express_paper").to(X.dtype)
        if far:
            X = polar(X.to(compute_dtype(X)), "polar_express", self.steps).to(X.dtype)
        return polar_near_masked(X.to(compute_dtype(X))).to(X.dtype)

    def host_free_retraction(self) -> bool:
        """Polar Express or the published retraction (an SVD polar factor steps eagerly)."""
        return self.retraction == "paper" or self.method == "polar_express"

    def proj_tangent(self, W: torch.Tensor, A: torch.Tensor, products: str = "ieee") -> torch.Tensor:
        """A − W·sym(WᵀA) on the tall view (orthogonal projection when W is on the manifold)."""
        X, Y, t = tall_pair(W, A)
        return untall(stiefel_proj_tangent(X, Y, products=products), t)

    def proj_tangent_tall(self, X: torch.Tensor, A: torch.Tensor, S: torch.Tensor | None = None,
                          overwrite_a: bool = False, products: str | Products = "ieee") -> torch.Tensor:
        """A − X·sym(S) on tall views, S = XᵀA (computed when None); ``overwrite_a``, ``products`` as ``Manifold``'s."""
        return stiefel_proj_tangent(X, A, S, overwrite_y=overwrite_a, products=products)

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
