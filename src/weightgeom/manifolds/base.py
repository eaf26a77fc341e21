"""The one abstract class behind every matrix manifold (Gram-space family; see docs/manifolds.md).

A manifold here is a constraint on the Gram matrix of a *tall* W ∈ R^{m×n} (m ≥ n):
    P(WᵀW) = P(I)
with P a self-adjoint linear projector on symmetric n×n matrices (Stiefel: P = Id; DGram: P = Off; Oblique:
P = Diag; Euclidean: P = 0, no constraint). Its tangent space at W is {A : P(WᵀA + AᵀW) = 0}.

Wide matrices (m < n) are handled by transposing: every public method accepts either orientation and works on the
tall view (``tall(W)``), returning results in the caller's orientation. Leading dims are batched.

Subclasses implement ``P``, ``retract`` and ``proj_tangent`` (and may override the rest); ``retract_host_free`` (a
batched retraction without host reads) lets an optimizer step on the manifold compile. Adding a manifold is one
file, one line in ``manifolds/__init__.py``'s registry and one line in the test table; optimizers use only this API
and never branch on the manifold's type.
"""

from __future__ import annotations

import functools
import inspect
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from weightgeom.linalg.autotune import PRODUCTS
from weightgeom.linalg.gemm import ieee_addmm, ieee_mm
from weightgeom.linalg.layout import sym_sum
from weightgeom.linalg.msign import msign
from weightgeom.linalg.precision import with_full_precision
from weightgeom.linalg.split import Pieces, split_available, split_bf16, split_column_sumsq, split_matmul

__all__ = ["Manifold", "CheckResult", "Products", "products_of", "tall", "untall", "tall_pair", "compute_dtype",
           "polar", "gram_check", "constraint_mm", "constraint_addmm", "constraint_gram", "small_mm", "near_update",
           "split_here", "SPLIT_MIN_DIM"]


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


def tall_pair(W: torch.Tensor, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Tall views of a point W and a direction A of the same shape, and whether they were transposed."""
    if A.shape != W.shape:
        raise ValueError(f"direction A has shape {tuple(A.shape)} but the point W has shape {tuple(W.shape)}")
    X, t = tall(W)
    return X, (A.mT if t else A), t


# Constraint products run split-bf16 only when every dimension of the matrices is at least this: smaller products are
# cheap in IEEE float32 anyway, and their split errors are the largest — a Gram entry of m rows averages m rounding
# errors of 2⁻¹⁷, so a 20×8 point after a zero step moved by 1.3e-6 (IEEE: 0) while 768-row ones move by ≤ 2e-7.
SPLIT_MIN_DIM = 256


class Products:
    """The constraint products of one call (a retraction, a projection, a dual ascent): ``kind``, one of
    ``weightgeom.linalg.autotune.PRODUCTS`` — ``"ieee"`` (``torch.matmul``), ``"ieee_onednn"`` (the same IEEE float32
    products through oneDNN, ``weightgeom.linalg.gemm``) or ``"split_bf16"`` (``weightgeom.linalg.split``) — and, for
    the split, ``memo``: the pieces of the tensors split in this call, so a matrix used in several products is split
    once. The split (a ``ctypes`` call) and oneDNN apply only outside a ``torch.compile`` trace and where available;
    elsewhere the products are IEEE.

    Raises:
        ValueError: ``kind`` is not one of ``PRODUCTS``.
    """

    __slots__ = ("kind", "memo")

    def __init__(self, kind: str = "ieee") -> None:
        if kind not in PRODUCTS:
            raise ValueError(f"products={kind!r} is not one of {PRODUCTS}")
        self.kind = kind
        self.memo: dict | None = {} if kind == "split_bf16" else None

    @property
    def split(self) -> bool:
        """Whether split-bf16 products run here (asked for, available, not inside a compile trace)."""
        return self.kind == "split_bf16" and not torch.compiler.is_compiling() and split_available()

    @property
    def onednn(self) -> bool:
        """Whether IEEE products go through oneDNN (``weightgeom.linalg.gemm`` checks availability and shapes)."""
        return self.kind == "ieee_onednn"


def products_of(products: str | Products) -> Products:
    """``products`` as a ``Products``: a kind name gets a new one (its own memo), a ``Products`` is passed through."""
    return products if isinstance(products, Products) else Products(products)


def split_here(products: str | Products, *ts: torch.Tensor | None) -> bool:
    """Whether the constraint products of these tensors run as split-bf16 products: ``products`` asks for the split
    and it runs here (``Products.split``), on CPU float32 matrices of at least ``SPLIT_MIN_DIM`` rows and columns."""
    return products_of(products).split and all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32
                                                and not (t.requires_grad and torch.is_grad_enabled())
                                                and min(t.shape[-2:]) >= SPLIT_MIN_DIM)
                                  for t in ts)


def constraint_mm(A: torch.Tensor, B: torch.Tensor, b_pieces: Pieces | None = None,
                  products: str | Products = "ieee") -> torch.Tensor:
    """A@B for the constraint arithmetic (e.g. S = XᵀA): IEEE float32 (or A's dtype; through oneDNN for ``products``
    ``"ieee_onednn"``, ``weightgeom.linalg.gemm``), or for ``"split_bf16"`` on the CPU the split-bf16 product
    (``weightgeom.linalg.split``; ~1e-6 relative instead of ~1e-7, 3–5× faster with AMX). ``b_pieces``: B's
    ``(hi, lo)`` when the caller has them (lo None: B is exactly bf16). ``products``: a kind or the caller's
    ``Products`` (its memo shared)."""
    pr = products_of(products)
    if not split_here(pr, A, B):
        return ieee_mm(A, B, onednn=pr.onednn)
    return split_matmul(A, b_pieces if b_pieces is not None else B, memo=pr.memo)


def constraint_addmm(C: torch.Tensor, A: torch.Tensor, B: torch.Tensor, alpha: float = 1.0,
                     a_pieces: Pieces | None = None, small: bool = False, overwrite_c: bool = False,
                     products: str | Products = "ieee") -> torch.Tensor:
    """C + α·A@B for the constraint arithmetic (a projection Y − X·L, a retraction X + X·F): ``addmm_batched`` (for
    ``products`` ``"ieee_onednn"`` ``ieee_addmm``: oneDNN's product, then one add), or for ``"split_bf16"`` on the CPU
    the split-bf16 product accumulated into a float32 copy of C (each matrix of a batch alone: the same bits as one call
    per matrix).

    ``small``: B (square) is a small correction (its entries ≪ 1 against A's unit-scale columns, as the multiplier of a
    near-tangent direction or a near-manifold retraction's p(E) − I): B's diagonal is applied exactly, as a float32
    column scaling, and only its off-diagonal part as one bf16 product — whose error, 2⁻⁸ of a small term, is below the
    three-product split's (``docs/muon.md``).

    ``overwrite_c``: the caller no longer needs C, so a row-major C of the result's shape and dtype accumulates the
    result in place (returned) instead of in a copy — with ``small`` when C is A (X + X·F, ``near_update``: X's bf16
    piece is taken before X is scaled), else when C shares no memory with A or B; otherwise ignored."""
    pr = products_of(products)
    memo = pr.memo
    if overwrite_c and not small and _writable_result(C, A, B):
        if not split_here(pr, C, A, B):
            return ieee_addmm(C, A, B, alpha=alpha, inplace=C.ndim == 2, onednn=pr.onednn)
        pa = a_pieces if a_pieces is not None else split_bf16(A, memo=memo)
        return split_matmul(pa, B, out=C, alpha=alpha, beta=1.0, memo=memo)
    if not split_here(pr, C, A, B):
        return ieee_addmm(C, A, B, alpha=alpha, onednn=pr.onednn)
    same = C is A
    lead = torch.broadcast_shapes(C.shape[:-2], A.shape[:-2], B.shape[:-2])
    A, B = A.expand(*lead, *A.shape[-2:]), B.expand(*lead, *B.shape[-2:])
    if small:
        d = B.diagonal(dim1=-2, dim2=-1).unsqueeze(-2)
        Bo = B.to(torch.bfloat16)
        Bo.diagonal(dim1=-2, dim2=-1).zero_()
        hi = a_pieces[0] if a_pieces is not None else None
        if C.shape == A.shape and C.data_ptr() == A.data_ptr() and C.stride() == A.stride():  # C is A (a view of)
            # X + X·diag(F) = X·(1 + diag(F)): one read of X, not two; into X itself when C is the tensor A
            return near_update(A, d, Bo, alpha, overwrite=overwrite_c and same, hi=hi, memo=memo)
        out = torch.addcmul(C.expand(*lead, *C.shape[-2:]), A, d, value=alpha).contiguous()  # C + α·A·diag(B), new
        hi = hi if hi is not None else split_bf16(A, lo=False, memo=memo)[0]
        return split_matmul((hi, None), (Bo, None), out=out, alpha=alpha, beta=1.0)
    out = C.expand(*lead, *C.shape[-2:]).clone(memory_format=torch.contiguous_format)
    pa = a_pieces if a_pieces is not None else split_bf16(A, memo=memo)
    return split_matmul(pa, B, out=out, alpha=alpha, beta=1.0, memo=memo)


def near_update(X: torch.Tensor, d: torch.Tensor, Bo: torch.Tensor, alpha: float = 1.0, overwrite: bool = False,
                hi: torch.Tensor | None = None, memo: dict | None = None) -> torch.Tensor:
    """X + α·(X·diag(d) + X_hi·Bo) for a CPU float32 X under split-bf16 products: a near-manifold retraction's
    update X·(I + F) with F's diagonal d (..., 1, n) applied exactly and its bf16 off-diagonal part Bo as one product
    (``constraint_addmm(X, X, F, small=True)``; ``polar_near`` with F split by ``kernels.near_correction``).
    ``overwrite``: into X itself when it is row-major and writable (X's bf16 piece ``hi`` is taken first). ``memo``:
    ``split_bf16``'s (the call's ``Products.memo``)."""
    hi = hi if hi is not None else split_bf16(X, lo=False, memo=memo)[0]
    if overwrite and X.is_contiguous() and _writable_in_place(X):
        out = X.mul_(1.0 + alpha * d)
    else:
        out = (X * (1.0 + alpha * d)).contiguous()
    return split_matmul((hi, None), (Bo, None), out=out, alpha=alpha, beta=1.0)


def _writable_in_place(C: torch.Tensor) -> bool:
    """Whether torch allows an in-place write to C here: not a tensor autograd tracks (grad mode on and C requiring
    grad), not an inference tensor outside inference mode."""
    if C.requires_grad and torch.is_grad_enabled():
        return False
    return not (C.is_inference() and not torch.is_inference_mode_enabled())


def _writable_result(C: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> bool:
    """Whether C + A@B may be accumulated into C itself: C row-major, of the broadcast result's shape and of the
    dtype the product gives, sharing no memory with A or B."""
    if C.ndim < 2 or A.ndim < 2 or B.ndim < 2 or not C.is_contiguous() or not _writable_in_place(C):
        return False
    try:
        lead = torch.broadcast_shapes(C.shape[:-2], A.shape[:-2], B.shape[:-2])
    except RuntimeError:
        return False
    if C.shape != (*lead, A.shape[-2], B.shape[-1]) or not C.dtype == A.dtype == B.dtype:
        return False
    mem = C.untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() != mem for t in (A, B))


def small_mm(A: torch.Tensor, B: torch.Tensor, products: str | Products = "ieee") -> torch.Tensor:
    """A@B of two small corrections (e.g. powers of a near-manifold Gram deviation E, ‖E‖ ≪ 1) added to unit-scale
    terms: for ``products`` ``"split_bf16"`` on the CPU one bf16 product accumulated in float32 — its error, 2⁻⁸ of a
    product of two small factors, is far below float32 rounding of the terms it is added to; else ``ieee_mm``."""
    pr = products_of(products)
    if not split_here(pr, A, B):
        return ieee_mm(A, B, onednn=pr.onednn)
    return split_matmul(split_bf16(A, lo=False, memo=pr.memo), split_bf16(B, lo=False, memo=pr.memo))


def constraint_gram(X: torch.Tensor, pieces: Pieces | None = None, products: str | Products = "ieee") -> torch.Tensor:
    """XᵀX for the constraint arithmetic: IEEE (``ieee_mm``), or for ``products`` ``"split_bf16"`` X_hiᵀX_hi + T + Tᵀ
    with T = X_hiᵀX_lo (two bf16 products) and the diagonal, the columns' squared norms, summed in float32 from X
    itself (the dropped X_loᵀX_lo is 2⁻¹⁸ of it but all of one sign there)."""
    pr = products_of(products)
    if not split_here(pr, X):
        return ieee_mm(X.mT, X, onednn=pr.onednn)
    hi, lo = pieces if pieces is not None else split_bf16(X, memo=pr.memo)
    G = split_matmul((hi.mT, None), (hi, None))
    if lo is not None:
        T = split_matmul((hi.mT, None), (lo, None))
        sym_sum(T, out=G)  # G + T + Tᵀ
    G.diagonal(dim1=-2, dim2=-1).copy_(split_column_sumsq(X, pr.memo))  # summed in X's split pass
    return G


def _takes_products(fn: object) -> bool:
    """Whether a method accepts a ``products`` keyword (by name or through ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    return any(p.name == "products" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _ignoring_products(fn: object) -> object:
    """``fn`` accepting a ``products`` keyword that it ignores."""

    @functools.wraps(fn)
    def wrapped(self: object, *args: object, products: object = "ieee", **kwargs: object) -> object:
        return fn(self, *args, **kwargs)

    return wrapped


def compute_dtype(W: torch.Tensor) -> torch.dtype:
    """Dtype used for retractions: float64 for float64 input, float32 for everything else (incl. bf16/fp16)."""
    return torch.float64 if W.dtype == torch.float64 else torch.float32


def polar(W: torch.Tensor, method: str = "polar_express", steps: int | None = None) -> torch.Tensor:
    """Polar factor U Vᵀ of W (either orientation, batched), returned in W's dtype.

    Args:
        W: (..., m, n) tensor.
        method: ``"polar_express"`` (msign iteration in ``compute_dtype(W)``; a rank-deficient W gives a partial
            isometry, a zero W gives zero) or ``"svd"`` (exact, float64 SVD; rank-deficient W gets an arbitrary
            orthonormal completion from the SVD, so the result always has orthonormal columns/rows).
        steps: polynomial steps for ``"polar_express"`` (its default, 10, when None).
    """
    if method == "svd":
        U, _, Vh = torch.linalg.svd(W.to(torch.float64), full_matrices=False)
        return (U @ Vh).to(W.dtype)
    return msign(W, method=method, steps=steps, dtype=compute_dtype(W)).to(W.dtype)


def _argmax_index(E: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    """Value and full multi-index of the largest entry of E."""
    flat = int(torch.argmax(E.reshape(-1)))
    idx: list[int] = []
    rest = flat
    for size in reversed(E.shape):
        idx.append(rest % size)
        rest //= size
    return float(E.reshape(-1)[flat]), tuple(reversed(idx))


def _batch_prefix(batch: tuple[int, ...]) -> str:
    """"matrix [i, j]: " for a batched tensor's matrix index, "" for a single matrix."""
    return f"matrix {list(batch)}: " if batch else ""


def gram_check(name: str, W: torch.Tensor, tol: float, unit_norms: bool, orthogonal: bool) -> CheckResult:
    """Entrywise check of a Gram-space constraint that names the worst column (or row, for wide input).

    Conditions on the tall view X (Gram G = XᵀX computed in float64; dimensionless):
        unit_norms: |‖x_j‖ − 1| ≤ tol for every column j.
        orthogonal: |cos θ_ij| = |G_ij| / (‖x_i‖‖x_j‖) ≤ tol for i ≠ j (a zero column is orthogonal to all).

    Returns:
        CheckResult: error is the largest violation; reason names the worst one (and which matrix, when batched).
    """
    if not torch.isfinite(W).all():
        bad = int((~torch.isfinite(W)).sum())
        return CheckResult(False, f"{name}: point has {bad} NaN/Inf entries", math.inf)
    X, t = tall(W)
    word = "row" if t else "column"
    X = X.to(torch.float64)
    G = X.mT @ X
    norms = torch.diagonal(G, dim1=-2, dim2=-1).clamp_min(0).sqrt()
    worst: list[tuple[float, str]] = [(0.0, "")]
    if unit_norms:
        err, idx = _argmax_index((norms - 1).abs())
        worst.append((err, f"{name}: {_batch_prefix(idx[:-1])}{word} {idx[-1]} has norm {float(norms[idx]):.6g}, "
                           f"not 1 (|‖w‖ − 1| = {err:.3g} > tol {tol:g})"))
    if orthogonal and G.shape[-1] > 1:
        outer = norms.unsqueeze(-1) * norms.unsqueeze(-2)
        cos = torch.where(outer > 0, G / outer.clamp_min(torch.finfo(G.dtype).tiny), torch.zeros_like(G))
        cos = cos - torch.diag_embed(torch.diagonal(cos, dim1=-2, dim2=-1))
        err, idx = _argmax_index(cos.abs())
        i, j = sorted(idx[-2:])
        worst.append((err, f"{name}: {_batch_prefix(idx[:-2])}{word}s {i} and {j} not orthogonal: "
                           f"|cos| = {err:.3g} > tol {tol:g}"))
    err, reason = max(worst, key=lambda e: e[0])
    if err <= tol:
        return CheckResult(True, "", err)
    return CheckResult(False, reason, err)


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
        retractions: the retraction variants the constructor's ``retraction`` accepts (first: the default).
        entrywise_P: whether ``P`` acts entry by entry (keeps or zeroes each Gram entry, as Stiefel, DGram and
            Oblique do). The optimizer's sampled tangent residual (a few Gram rows) is exact only then; for any
            other self-adjoint projector it measures the full residual. False unless a subclass says so.
    """

    name: str = "manifold"
    retractions: tuple[str, ...] = ()
    entrywise_P: bool = False

    # Methods that run inside ``full_precision()`` in every subclass (wrapped at class creation): a process-wide
    # TF32/bf16 float32-matmul mode would otherwise leave retracted points ~1e-3 off the manifold and make ``check``
    # measure with that error (weightgeom.linalg.precision).
    FULL_PRECISION_METHODS = ("retract", "retract_", "proj_tangent", "proj_tangent_tall", "constraint_violation",
                              "tangent_residual", "check", "random_point")

    # Methods that take the constraint products' kind (``products=``, by keyword from every caller here): a subclass
    # whose override does not accept it (one written before the argument existed) gets it accepted and ignored — its
    # own arithmetic is whatever it computes.
    PRODUCTS_METHODS = ("retract", "retract_", "proj_tangent", "proj_tangent_tall")

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for name in Manifold.PRODUCTS_METHODS:
            fn = cls.__dict__.get(name)
            if inspect.isfunction(fn) and not _takes_products(fn):
                setattr(cls, name, _ignoring_products(fn))
        for name in Manifold.FULL_PRECISION_METHODS:
            fn = cls.__dict__.get(name)
            if isinstance(fn, (staticmethod, classmethod)):  # wrap the function inside, keep the descriptor
                setattr(cls, name, type(fn)(with_full_precision(fn.__func__)))
            elif callable(fn):
                setattr(cls, name, with_full_precision(fn))

    # ---- the projector that defines the manifold -------------------------------------------------------------
    @abstractmethod
    def P(self, S: torch.Tensor) -> torch.Tensor:
        """Self-adjoint projector on symmetric (..., n, n) matrices selecting the constrained Gram entries."""

    def target(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """P(I): the value the constrained Gram entries must take (n×n)."""
        return self.P(torch.eye(n, dtype=like.dtype, device=like.device))

    # ---- geometry ----------------------------------------------------------------------------------------------
    @abstractmethod
    def retract(self, W: torch.Tensor, products: str = "ieee") -> torch.Tensor:
        """Map W (either orientation, batched) onto the manifold; idempotent on manifold points. ``products``: the kind
        of its constraint products (one of ``weightgeom.linalg.autotune.PRODUCTS``; ``Products``), for manifolds
        whose retraction takes any (Stiefel, DGram); others ignore it."""

    def retract_(self, W: torch.Tensor, products: str = "ieee") -> torch.Tensor:
        """In place: W ← ``retract(W)``, returned (torch's trailing-underscore convention; W writable, float32 or
        float64). The default computes ``retract(W)`` and copies it in; Stiefel and DGram write their near-manifold
        retraction's last update into W directly — no m×n result allocated and copied (the optimizer retracts its
        parameters this way every step). Same values as ``retract`` (with the same ``products``)."""
        R = self.retract(W, products=products)
        if R is not W:
            W.copy_(R)
        return W

    def retract_host_free(self, X: torch.Tensor, far: bool = False) -> torch.Tensor:
        """The retraction of a batch (B, m, n) of tall matrices with no host reads: fixed loop counts, every per-matrix
        decision a device-side mask, a constant number of operations whatever B — what a compiled optimizer step
        (``torch.compile(opt.step)``, ``Muon.host_free``) runs after each step. Returns the retracted batch in X's
        dtype (computed in at least float32). ``far``: X may be far from the manifold (a fresh matrix's first step):
        take it to rounding level from there.

        Not implemented here: a manifold that implements it compiles (``host_free_retraction`` then says which of its
        configurations do); one that does not is refused by a compiled step with a TypeError naming this method."""
        raise TypeError(f"{type(self).__name__} ({self.name!r}) does not implement retract_host_free(X, far), the "
                        "host-free retraction a compiled step needs: implement it, or step this manifold eagerly")

    def host_free_retraction(self) -> bool:
        """Whether this manifold, as configured, has a host-free retraction (``retract_host_free``); a configuration
        without one (e.g. an SVD retraction) steps eagerly inside a compiled step (one graph break). False where
        ``retract_host_free`` is not implemented."""
        return type(self).retract_host_free is not Manifold.retract_host_free

    def retract_far(self, W: torch.Tensor) -> torch.Tensor:
        """Retract a point that may be far from the manifold (a fresh matrix's first step) to rounding level: twice by
        default — a far start lands within ~1e-5 of the manifold, the second (near-manifold, cheap) retraction takes
        it to rounding level, where the tangent projection is exact; once with a published retraction (``retraction
        == "paper"``), as the published code initialises. Computed in at least float32, in W's dtype."""
        X = W.float() if W.dtype in (torch.float16, torch.bfloat16) else W
        R = self.retract(X).to(W.dtype)
        if getattr(self, "retraction", None) == "paper":
            return R
        X = R.float() if R.dtype in (torch.float16, torch.bfloat16) else R
        return self.retract(X).to(W.dtype)

    @abstractmethod
    def proj_tangent(self, W: torch.Tensor, A: torch.Tensor, products: str = "ieee") -> torch.Tensor:
        """Euclidean-orthogonal projection of A onto the tangent space at the manifold point W; ``products`` as
        ``retract``'s."""

    @with_full_precision
    def proj_tangent_tall(self, X: torch.Tensor, A: torch.Tensor, S: torch.Tensor | None = None,
                          overwrite_a: bool = False, products: str | Products = "ieee") -> torch.Tensor:
        """``proj_tangent`` on tall views X, A (m ≥ n), given S = XᵀA when the caller has computed it already (the dual
        ascent has: its residual is P(S + Sᵀ)). Manifolds whose projection is A − X·L(S) override this to skip that
        m×n×n product (and must accept ``overwrite_a``); the default ignores S.

        ``overwrite_a``: the caller no longer needs A, so the result may be written into A's memory (a projection
        A − X·L then accumulates into A instead of into a copy of it: one m×n pass fewer); the result may or may not
        be A. X is never written. Same values either way. ``products``: the kind of the constraint products, or the
        caller's ``Products`` (its memo shared with the caller's other products)."""
        return self.proj_tangent(X, A, products=products_of(products).kind)

    @with_full_precision
    def constraint_violation(self, W: torch.Tensor) -> torch.Tensor:
        """‖P(WᵀW) − P(I)‖_F / sqrt(n²) per matrix (batched), computed on the tall view."""
        X, _ = tall(W)
        n = X.shape[-1]
        G = X.mT @ X
        return torch.linalg.matrix_norm(self.P(G) - self.target(n, G)) / n

    @with_full_precision
    def tangent_residual(self, W: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        """‖P(WᵀA + AᵀW)‖_F / sqrt(numel) per matrix: 0 iff A is tangent at W (the dual ascent's stop metric)."""
        X, t = tall(W)
        Y = A.mT if t else A
        H = X.mT @ Y
        H = self.P(H + H.mT)
        return torch.linalg.matrix_norm(H) / H.shape[-1]

    @with_full_precision
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

    @with_full_precision
    def random_point(self, *shape: int, generator: torch.Generator | None = None,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """A random point of the manifold with the given shape (retraction of a Gaussian matrix)."""
        return self.retract(torch.randn(*shape, generator=generator, dtype=dtype))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))
