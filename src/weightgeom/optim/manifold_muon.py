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

``dual_ascent`` is the one implementation, on batches of tall matrices, with no host reads (docs/muon.md §6);
``manifold_direction`` is its eager form (either orientation, the residual as a float). Both are pure functions; the
optimizer keeps Λ between steps as a warm start. ``manifold_direction_reference`` is the slow float64 SVD version for
tests.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch

from weightgeom import kernels
from weightgeom.linalg import column_norms, graphs, msign, msign_reference, with_full_precision
from weightgeom.linalg.gemm import addmm_batched, ieee_addmm, ieee_mm
from weightgeom.linalg.layout import sym_sum
from weightgeom.linalg.norms import COLUMN_KERNEL_MIN, plain
from weightgeom.linalg.split import split_bf16, split_matmul
from weightgeom.manifolds.base import Manifold, Products, constraint_mm, products_of, tall, untall

__all__ = ["dual_ascent", "DualResult", "manifold_direction", "manifold_direction_reference", "initial_multiplier",
           "spectral_norm_estimate", "lanczos_start", "top_eigenvalue_psd",
           "sampled_tangent_residual", "DUAL_SCHEDULES", "DUAL_KEEP", "PROJECT_NORM_ITERS", "PROJECT_NORM_TOL",
           "LANCZOS_BREAKDOWN", "RESIDUAL_SAMPLE_COLUMNS", "SQUARINGS"]

DUAL_SCHEDULES = ("linear", "constant")
# Which iterate the dual ascent returns: "best" (step halving when the residual grows, smallest-residual iterate) or
# "last" (the manifold-assignment paper's published loop: fixed schedule, the last iterate's A).
DUAL_KEEP = ("best", "last")
# Lanczos steps used to estimate ‖A‖₂ of a projected direction before rescaling it to unit spectral norm
# (``project=True``), and the bound the rescaled direction keeps: ‖A‖₂ ≤ 1 + PROJECT_NORM_TOL. The Lanczos estimate is
# a lower bound; measured after rescaling: ‖A‖₂ − 1 ≤ 1e-12 on 96×32 toys, ≤ 2.5e-4 on 3072×768 in float32 (spectra
# i^−0.5 and i^−1; tested on the toys); on projected directions of GPT-2-small shapes (768², 2304×768, 3072×768;
# Stiefel and DGram; Gaussian and rank-20 momenta; bf16 and fp32 msign) the estimate is low by ≤ 9.6e-4 relative
# with 32 steps, by up to 5.1e-3 with 16 (so 32 stay); from a bf16 Gram with the exact diagonal (the optimizer's
# choice when its msign computes in bf16) off by ≤ 4.3e-4 either way (docs/muon.md).
PROJECT_NORM_ITERS = 32
PROJECT_NORM_TOL = 2e-3
# A Lanczos coefficient β below this × eps(dtype) × sqrt(n) × max_j ‖AᵀA q_j‖ is rounding noise (an invariant Krylov
# subspace was found) and ends the recurrence (``spectral_norm_estimate``). Noise measured at ~1 eps of ‖AᵀA‖₂ on
# orthonormal 96×32 float32 matrices; a genuine β that small could still hide a top singular value (its Ritz value
# then converges to the cluster below), so the floor sits just above the noise: with a top gap of 1e-3 at n = 1024,
# β ~ 3e-5 against a float32 floor of ~8e-6 (at 8 instead of 2 a 3e-3 gap at n = 1024 was missed once in 6).
LANCZOS_BREAKDOWN = 2.0
# Columns sampled to measure the tangent residual of a projected direction (``sampled_tangent_residual``): after the
# projection it is at rounding level by construction, so the exact m×n×n product (as costly as the projection
# itself) is not spent on it every step; a matrix with n ≤ this many columns is measured exactly.
RESIDUAL_SAMPLE_COLUMNS = 32
# Repeated squarings of Lanczos' tridiagonal T (normalised each time) before its Rayleigh quotient
# (``top_eigenvalue_psd``): T^(2^24) separates the top eigenvalue from one a relative 1e-6 below it by a factor e^-16;
# closer eigenvalues are within that gap of each other anyway, so the quotient is the top one to ~gap·(λ₂/λ₁)^(2^24)
# — float64 rounding for every T we see (tested against ``eigvalsh``).
SQUARINGS = 24

# Added to ‖G‖_F before dividing (a zero gradient gives a zero direction: see ``manifold_direction``).
_NORM_EPS = 1e-30


@with_full_precision
def initial_multiplier(W: torch.Tensor, G: torch.Tensor, manifold: Manifold,
                       products: str | Products = "ieee") -> torch.Tensor:
    """Cold start Λ₀ = −¼·P(WᵀG + GᵀW) on the tall views (exact for square Stiefel W; docs/muon.md §3); ``products``:
    the kind of the product WᵀG (``manifolds.base.Products``)."""
    X, t = tall(W)
    Y = G.mT if t else G
    pr = products_of(products)
    if X.dtype == Y.dtype == torch.bfloat16 and pr.split and X.device.type == "cpu":
        S = split_matmul((X.mT, None), (Y, None))  # bf16 factors, the product accumulated and returned in float32
    else:
        S = ieee_mm(X.mT, Y, onednn=pr.onednn)
    return manifold.P(sym_sum(S, -0.25))  # P is entrywise: −¼·P(S + Sᵀ), the same values (+0 where that gave −0)


class DualResult(NamedTuple):
    """What ``dual_ascent`` returns, every field a device tensor (nothing read on the host).

    Attributes:
        direction: the direction A, tall (..., m, n), ‖A‖₂ ≈ 1; 0 where G = 0.
        multiplier: the multiplier Λ of the returned A (..., n, n), to warm-start the next call.
        cold: this call's cold start (..., n, n), to pass as ``cold0`` next time.
        residuals: the returned A's tangent residual per matrix (...,) (with ``project``: the projected one, sampled).
        dual_residuals: the dual ascent's residual per matrix (...,) (before the projection).
        iters: dual iterations each matrix took (...,) int64 (msign calls in the loop, not ``final_msign_fn``).
        lr_scale: each matrix's final step-halving factor (..., 1, 1) float64 (1 without halving).
        norm: with ``project``, the estimated ‖A‖₂ (..., 1, 1) of the projected direction before rescaling; else None.
    """

    direction: torch.Tensor
    multiplier: torch.Tensor
    cold: torch.Tensor
    residuals: torch.Tensor
    dual_residuals: torch.Tensor
    iters: torch.Tensor
    lr_scale: torch.Tensor
    norm: torch.Tensor | None


def dual_ascent(
    X: torch.Tensor, G: torch.Tensor, manifold: Manifold, Lambda0: torch.Tensor | None = None,
    cold0: torch.Tensor | None = None, *, steps: int = 20, lr: float = 0.1, tol: float = 1e-4,
    msign_fn: Callable[[torch.Tensor], torch.Tensor] = msign, schedule: str = "linear", normalize: bool = True,
    project: bool = False, final_msign_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    final_continues: bool = False, keep: str = "best", feed_dtype: torch.dtype | None = None, eager: bool = False,
    products: str = "ieee",
) -> DualResult:
    """The manifold-Muon direction of a batch of tall matrices: the one implementation of the dual ascent.

    Every matrix of the batch (leading dims of X) is its own problem: its early stop (residual under ``tol``), step
    halving and best iterate are boolean masks on the device, so the loop always runs ``steps`` iterations and a
    matrix that has stopped is carried unchanged through the rest (computed and discarded). Nothing is read on the
    host: what ``torch.compile(fullgraph=True)`` and CUDA graphs need. Arguments as ``manifold_direction``'s, on tall
    X, G (..., m, n) in the compute dtype (float32/float64) and Λ₀, its cold start (..., n, n) or None.

    ``eager``: the caller runs eagerly and may read the host. Then the loop ends once every matrix has stopped (one
    read per iteration), the zero-gradient mask is applied only where some G is zero, and the norm estimate of
    ``project`` takes ``eigvalsh`` and its C/CUDA-graph backends (``spectral_norm_estimate``). The same arithmetic:
    only the discarded iterations and the top eigenvalue's solver (≤ ~1e-13 relative) differ.

    ``products``: the kind of the constraint products (one of ``weightgeom.linalg.autotune.PRODUCTS``: ``"ieee"``,
    ``"ieee_onednn"``, ``"split_bf16"``; ``manifolds.base.Products``) — XᵀĜ, the shifted Ĝ + 2X·P(Λ), XᵀA and the
    projection; the split pieces of X are taken once for the whole call. Inside a ``torch.compile`` trace the split
    and oneDNN do not run (IEEE products there, whatever the kind).
    """
    pr = Products(products)
    lead = X.shape[:-2]
    n = X.shape[-1]
    gnorm = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True)
    scale = n**0.5 / (gnorm + _NORM_EPS) if normalize else None
    if feed_dtype is not None and feed_dtype != X.dtype:  # only the narrow copies are used: scale while narrowing
        # the bf16 copy is X's split piece X_hi: under split-bf16 products X is split into both pieces here, in one
        # pass, and the constraint products (XᵀA, the projection) reuse them
        Xf = split_bf16(X, memo=pr.memo)[0] if feed_dtype == torch.bfloat16 and pr.split else X.to(feed_dtype)
        Yf = _narrow_scaled(G, scale, feed_dtype)
    else:
        Xf = X
        Yf = G if scale is None else G * scale
    cold = initial_multiplier(Xf, Yf, manifold, pr).to(X.dtype)
    # the start: the cold start, or the previous Λ₀ moved by how much the cold start moved since (``cold0``), or Λ₀
    Lam = cold
    if Lambda0 is not None:
        Lam = Lambda0.to(cold.dtype) + (cold - cold0.to(cold.dtype)) if cold0 is not None else Lambda0.to(cold.dtype)

    def shifted(L: torch.Tensor) -> torch.Tensor:
        """Ĝ + 2X·P(Λ): one fused multiply-add, or for ``"ieee_onednn"`` products oneDNN's product and one add
        (either way the same bits for a matrix alone or in a batch)."""
        return ieee_addmm(Yf, Xf, manifold.P(L).to(Xf.dtype), alpha=2.0, onednn=pr.onednn)

    last = keep == "last"
    active = torch.ones(lead, dtype=torch.bool, device=X.device)
    shrink = torch.ones(*lead, 1, 1, dtype=torch.float64, device=X.device)
    iters = torch.zeros(lead, dtype=torch.int64, device=X.device)
    for k in range(steps):
        A = msign_fn(shifted(Lam))
        exact = (A, None) if A.dtype == torch.bfloat16 else None  # a bf16 A is its own split: XᵀA in two products
        A, owned = _widened(A, X.dtype)
        S, H, rv = _residual(X, A, manifold, exact, pr)
        iters = iters + active
        if k == 0:  # the first iterate is the best so far (also a non-finite one: reported as such)
            best_r, best_A, best_L, best_S, best_owned, prev = rv, A, Lam, S, owned, rv
        else:  # "last": every active matrix's newest iterate; "best": where the residual went down
            take = active if last else active & (rv < best_r)
            t3 = take[..., None, None]
            best_r = torch.where(take, rv, best_r)
            best_A, best_L = torch.where(t3, A, best_A), torch.where(t3, Lam, best_L)
            best_S = torch.where(t3, S, best_S)
            best_owned = True
        if k == steps - 1:
            break
        go = active & ~((rv < tol) if last else (rv <= tol))
        if not last and k > 0:  # halve the step for the rest of the call where the residual grew
            shrink = torch.where((go & (rv > prev))[..., None, None], shrink * 0.5, shrink)
            prev = torch.where(go, rv, prev)
        alpha = (lr * ((1.0 - k / steps) if schedule == "linear" else 1.0) * shrink).to(X.dtype)
        Lam = torch.where(go[..., None, None], Lam - alpha * H, Lam)
        active = go
        if eager and not bool(active.any()):  # eager only: every matrix has stopped (one host read)
            break
    A, Lam, S, rv, owned = best_A, best_L, best_S, best_r, best_owned
    if final_msign_fn is not None:
        A = final_msign_fn(A if final_continues else shifted(Lam))
        exact = (A, None) if A.dtype == torch.bfloat16 else None
        A, owned = _widened(A, X.dtype)
        S, _, rv = _residual(X, A, manifold, exact, pr)
    dual, norm = rv, None
    if project:
        Ap = manifold.proj_tangent_tall(X, A, S, overwrite_a=owned, products=pr)
        norm = spectral_norm_estimate(Ap, gram_dtype=feed_dtype, host_free=not eager, products=pr)
        # to unit spectral norm, up or down: the constrained optimum has ‖A‖₂ = 1, and a projection that removed a
        # large normal part (DGram after one dual step: ‖A‖₂ ≈ 0.15–0.9) would otherwise shorten the step
        inv = torch.where(norm == 0, 0.0, 1.0 / norm)  # a zero direction stays zero; NaN stays NaN
        # in place only on a tensor of this call's own: the projection's, or A's copy it may have written into
        A = Ap.mul_(inv) if Ap is not X and (owned or Ap is not A) else Ap * inv
        rv = _sampled_residuals(X, A, manifold, products=pr)
    if not eager or not bool((gnorm > 0).all()):  # zero gradient → zero step (the multiplier alone must not move W)
        A = torch.where(gnorm > 0, A, 0.0)
    return DualResult(A, Lam, cold, rv, dual, iters, shrink, norm)


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
    keep: str = "best",
    feed_dtype: torch.dtype | None = None,
    products: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """Steepest unit-spectral-norm direction tangent to ``manifold`` at W, by dual ascent on Λ (eager: ``dual_ascent``
    with host reads — the loop ends once every matrix has stopped, the residual comes back as a float).

    Iteration k: A_k = msign(Ĝ + 2X·P(Λ_k)), H_k = P(XᵀA_k + A_kᵀX), stop if ‖H_k‖_F/n ≤ tol, else
    Λ_{k+1} = Λ_k − α_k·H_k. With ``keep="best"`` (safeguard) the step is halved for the rest of the call whenever
    the residual grows, and the iterate with the smallest residual is returned (so more steps never give a worse
    answer); ``keep="last"`` is the manifold-assignment paper's published loop (no halving, stop when the residual
    is *below* tol, the last iterate's A). Each matrix of a batch (leading dims) stops, halves and keeps its best
    iterate on its own.

    A matrix (or batch entry) whose G is exactly zero gets A = 0: no gradient, no step, whatever Λ holds.

    Args:
        W: point on the manifold, (..., m, n) in either orientation (wide matrices are transposed internally).
        G: gradient-like matrix of W's shape (typically the Nesterov momentum).
        manifold: the constraint (``P``; ``proj_tangent`` when ``project``).
        Lambda0: warm-start multiplier (..., n, n), n = min(m, n), in the units of the (normalised, when
            ``normalize``) G; None → cold start ``initial_multiplier`` (exact for square Stiefel W).
        steps: maximum number of dual iterations K (each costs one ``msign_fn`` call).
        lr: dual step α per unit residual, in the units of the (normalised) G; iteration k uses α·(1 − k/K) with
            the ``"linear"`` schedule (the manifold-assignment paper's code) or α with ``"constant"``.
        tol: stop once the tangent residual ‖H‖_F/n ≤ tol (``keep="last"``: < tol); same measure as
            ``Manifold.tangent_residual``.
        msign_fn: orthogonaliser used inside the loop, called on tall (..., m, n) matrices.
        schedule: ``"linear"`` or ``"constant"``.
        normalize: divide G by its RMS singular value ‖G‖_F/sqrt(n) first, so Λ and α are scale-free
            (recommended; then α = 0.1, the manifold-assignment paper's value, is in the stable range for
            typical spectra). False: the published code, where α acts in the gradient's own units.
        project: finally replace A by ``manifold.proj_tangent(W, A)`` (exactly tangent: residual at rounding level)
            and rescale it to unit spectral norm, as the constrained optimum has: A ← A / ‖A‖₂ (up or down; a zero
            A stays zero), ‖A‖₂ estimated by ``PROJECT_NORM_ITERS`` Lanczos steps (``spectral_norm_estimate``), so
            1 ≤ ‖A‖₂ ≤ 1 + ``PROJECT_NORM_TOL`` in practice.
            The returned residual is then the projected one, measured on ``RESIDUAL_SAMPLE_COLUMNS`` columns
            (``sampled_tangent_residual``; exact for n ≤ that); ``stats["dual_residual"]`` keeps the dual ascent's.
        final_msign_fn: if given, A is recomputed once at the returned Λ with this (more accurate) orthogonaliser —
            for a cheap ``msign_fn`` inside the loop.
        stats: optional dict that receives ``dual_residual`` (before projection; ``dual_residuals`` per matrix of the
            batch, and ``residuals`` the returned residual's per-matrix values), ``dual_lr_final`` (worst matrix),
            ``dual_iters`` (per matrix), ``cold_multiplier`` (this call's cold start, to pass as ``cold0`` next time)
            and, with ``project``, ``norm_before_rescale`` (the estimated ‖A‖₂ of the projected direction, worst
            matrix).
        cold0: the cold start of the call that produced ``Lambda0``. When given with ``Lambda0`` the warm start is
            predicted as Lambda0 + (cold start now − cold0): first-order tracking of the moving optimum, exact for
            square Stiefel W (where the cold start is the solution). Costs one XᵀG product.
        final_continues: ``final_msign_fn`` continues the inner iteration: it is applied to the returned iterate A
            (``msign_fn``'s output at that Λ) instead of to Ĝ + 2X·P(Λ) — e.g. ``msign(·, steps=10,
            start_step=5)`` after a 5-step inner ``msign``, which gives the 10-step result for 5 more steps.
        keep: ``"best"`` or ``"last"`` (see above).
        feed_dtype: dtype of the two products that only feed ``msign_fn`` — the cold start XᵀĜ and the shifted
            Ĝ + 2X·P(Λ) — when ``msign_fn`` computes in a narrower dtype anyway (bfloat16: its input is rounded to
            bfloat16 first, so fp32 products there buy nothing). None: X's dtype. The residual, the projection and Λ
            stay in X's dtype.
        products: the kind of the constraint products (``dual_ascent``'s).

    Returns:
        (A, Lambda, residual, iters): A in W's orientation and dtype with ‖A‖₂ ≈ 1 (0 where G = 0); the multiplier
        Λ of the returned A, to warm-start the next call; the tangent residual of the returned A (worst matrix); the
        number of dual iterations (the most any matrix took; msign calls in the loop, not ``final_msign_fn``).
    """
    if schedule not in DUAL_SCHEDULES:
        raise ValueError(f"dual_schedule: unknown value {schedule!r}; choose one of {DUAL_SCHEDULES}")
    if keep not in DUAL_KEEP:
        raise ValueError(f"dual_keep: unknown value {keep!r}; choose one of {DUAL_KEEP}")
    if W.shape != G.shape:
        raise ValueError(f"manifold_direction: W {tuple(W.shape)} and G {tuple(G.shape)} differ in shape")
    X, t = tall(W)
    out = dual_ascent(X, G.mT if t else G, manifold, Lambda0, cold0, steps=max(1, int(steps)), lr=lr, tol=tol,
                      msign_fn=msign_fn, schedule=schedule, normalize=normalize, project=project,
                      final_msign_fn=final_msign_fn, final_continues=final_continues, keep=keep,
                      feed_dtype=feed_dtype, eager=True, products=products)
    residual = float(out.residuals.max())
    if stats is not None:
        stats["dual_residual"] = float(out.dual_residuals.max())
        stats["dual_residuals"] = out.dual_residuals
        stats["dual_iters"] = out.iters
        stats["dual_lr_final"] = lr * float(out.lr_scale.min())
        stats["cold_multiplier"] = out.cold
        stats["residuals"] = out.residuals
        if out.norm is not None:
            stats["norm_before_rescale"] = float(out.norm.max())
    return untall(out.direction, t), out.multiplier, residual, int(out.iters.max())


@with_full_precision
def sampled_tangent_residual(X: torch.Tensor, A: torch.Tensor, manifold: Manifold,
                             columns: int = RESIDUAL_SAMPLE_COLUMNS) -> float:
    """Tangent residual max over the batch of ‖P(XᵀA + AᵀX)‖_F / n (tall views), from a block of its columns.

    Columns J (``columns`` consecutive indices in the middle, a view: no gather) of XᵀA + AᵀX cost 2·m·n·|J| flops
    instead of m·n²; P acts entrywise (it selects the constrained Gram entries), so P's columns J are those of P
    applied to the matrix holding only those columns, and ‖P(·)‖_F² ≈ (n/|J|)·‖P(·)[:, J]‖_F². Exact (every column)
    when n ≤ ``columns``. Meant for residuals spread over all entries — the rounding-level residual of a projected
    direction (tested against the exact value); the dual ascent's residual is computed in full.
    """
    return float(_sampled_residuals(X, A, manifold, columns).max())


def _sampled_residuals(X: torch.Tensor, A: torch.Tensor, manifold: Manifold,
                       columns: int = RESIDUAL_SAMPLE_COLUMNS, products: str | Products = "ieee") -> torch.Tensor:
    """``sampled_tangent_residual`` per matrix of the batch (a tensor of the batch shape); no host read. ``products``:
    through oneDNN for ``"ieee_onednn"`` (its two thin products; IEEE either way)."""
    if int(columns) < 1:
        raise ValueError(f"sampled_tangent_residual: columns must be ≥ 1, got {columns!r}")
    if X.shape != A.shape or X.shape[-2] < X.shape[-1]:
        raise ValueError(f"sampled_tangent_residual: X {tuple(X.shape)} and A {tuple(A.shape)} must be the same "
                         "tall (m ≥ n) shape: pass tall views (weightgeom.manifolds.base.tall)")
    n = X.shape[-1]
    if n <= columns or not manifold.entrywise_P:  # rows of P(XᵀA + AᵀX) are a mask's only for an entrywise P
        return manifold.tangent_residual(X, A)
    j0 = (n - columns) // 2
    J = slice(j0, j0 + columns)
    # rows J of XᵀA + AᵀX (its columns J transposed: the same entries), as A_JᵀX + X_JᵀA with row-major copies of
    # the thin m×|J| factors: 0.67 against 0.95 ms per product for 3072×768 (AMX), where Xᵀ·A[:, J] reads both strided
    dnn = products_of(products).onednn
    block = ieee_mm(A[..., J].contiguous().mT, X, dnn) + ieee_mm(X[..., J].contiguous().mT, A, dnn)  # (..., |J|, n)
    # P acts entrywise: its selection of rows J (where, not a product: inf or NaN in a discarded entry stays out)
    H = torch.where(_rows_of_P(manifold, n, J, X.device), block, 0.0)
    return torch.linalg.matrix_norm(H) * ((n / columns) ** 0.5 / n)


def _rows_of_P(manifold: Manifold, n: int, J: slice, device: torch.device) -> torch.Tensor:
    """Rows J of P(1) ≠ 0 (1: n×n all-ones): the selection of the entrywise projector P as a boolean mask, remembered
    per manifold (weakly: a manifold object that goes away takes its masks along; built afresh inside a trace)."""
    if torch.compiler.is_compiling():
        return manifold.P(torch.ones(n, n, dtype=torch.float64, device=device))[J] != 0
    key = (n, J.start, J.stop, device)
    masks = _P_ROWS.setdefault(manifold, {})
    if key not in masks:
        masks[key] = (manifold.P(torch.ones(n, n, dtype=torch.float64, device=device))[J] != 0).contiguous()
    return masks[key]


_P_ROWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Lanczos start vectors by (n, dtype, device) (``lanczos_start``): made outside a compiled step (when a manifold group
# is added), because a trace cannot run a ``torch.Generator``.
_STARTS: dict[tuple[int, torch.dtype, str], torch.Tensor] = {}


def lanczos_start(n: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """The unit start vector (n, 1) of ``spectral_norm_estimate`` (float64 Gaussian, seed 0, cast), remembered."""
    key = (int(n), dtype, str(torch.device(device)))
    v = _STARTS.get(key)
    if v is None:
        g = torch.Generator(device="cpu").manual_seed(0)
        v = torch.randn(n, 1, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
        v = _STARTS[key] = v / torch.linalg.vector_norm(v)
    return v


def top_eigenvalue_psd(T: torch.Tensor) -> torch.Tensor:
    """The largest eigenvalue of each symmetric positive semi-definite (..., k, k) matrix, shape (...): ``SQUARINGS``
    normalised squarings of T, then the Rayleigh quotient of its largest column. 0 for a zero matrix. No host read
    (``eigvalsh`` synchronises on a GPU)."""
    tiny = torch.finfo(T.dtype).tiny
    M = T
    for _ in range(SQUARINGS):
        M = M @ M
        M = M / M.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(tiny)
    col = torch.linalg.vector_norm(M, dim=-2).argmax(dim=-1)  # (...,)
    v = torch.take_along_dim(M, col[..., None, None], dim=-1)  # (..., k, 1)
    return ((v.mT @ T @ v) / (v.mT @ v).clamp_min(tiny))[..., 0, 0]


@with_full_precision
def spectral_norm_estimate(A: torch.Tensor, iters: int = PROJECT_NORM_ITERS,
                           gram_dtype: torch.dtype | None = None, host_free: bool = False,
                           products: str | Products = "ieee") -> torch.Tensor:
    """‖A‖₂ of each matrix of a batch (..., m, n), (..., 1, 1): ``iters`` Lanczos steps on AᵀA from a fixed start.

    The largest Ritz value is a lower bound on ‖A‖₂² that converges much faster than power iteration when the
    singular values cluster near the top (a projected manifold-Muon direction: most σ ≈ 1, a few above). On a tall
    A (m ≥ 2n, n = A's smaller dim) the Gram matrix AᵀA is formed once — one m×n×n product, in ``gram_dtype`` when
    given (e.g. bfloat16, where that product is several times faster; the diagonal, the columns' squared norms, is
    then recomputed in A's dtype, so only the off-diagonal entries carry that dtype's rounding: measured ≤ 5e-4
    relative, ``docs/muon.md``) — and the steps are n×n products on it, cheaper than 2·``iters`` m×n
    matrix-vector products that stream all of A from memory each time; a near-square A is used directly (there
    forming AᵀA costs more than it saves; ``gram_dtype`` is then unused). Full reorthogonalisation (k ≤ ``iters``
    vectors of length n); the top eigenvalue of the k×k tridiagonal matrix by ``eigvalsh`` in float64, or with
    ``host_free`` by ``top_eigenvalue_psd`` (agreement ~1e-13 relative, tested), the batch in one recurrence and no C
    kernel or CUDA graph: a constant number of operations without host reads, as a compiled step needs.

    The steps run on AᵀA divided by its largest diagonal entry, so any scale of A works as long as that Gram is
    finite (float32 entries beyond ~1e19 overflow it: NaN; below ~1e-19 its entries lose digits). When the Krylov
    space becomes invariant early (A with few distinct singular values, e.g. orthonormal columns) the next Lanczos
    coefficient β is rounding noise; a β below ``LANCZOS_BREAKDOWN``·eps·sqrt(n)·max_j ‖AᵀA q_j‖ ends that matrix's
    recurrence (its later basis vectors are zero), since normalising the noise would lose orthogonality and
    overshoot ‖A‖₂ many-fold. A matrix holding NaN/Inf gets NaN (the others of the batch are unaffected); an empty
    one 0. Limits (adversarial, measured): the start vector is fixed, so a matrix built with its top right singular
    vector orthogonal to it and the rest one exact cluster is estimated at the cluster; in float32 a top gap below
    ~1e-4 at n ≥ 512 is not resolved (error ≤ the gap); a bf16 Gram of a constant-entry matrix, whose rounding errors
    all have one sign, is off by up to 4e-3.

    ``products``: the Gram's on a CPU (``manifolds.base.Products``): a bf16 ``gram_dtype`` under ``"split_bf16"`` is
    one bf16 product accumulated in float32 (also for a near-square A); ``"ieee_onednn"``: a float32 Gram through
    oneDNN.
    """
    pr = products_of(products)
    if A.shape[-2] < A.shape[-1]:
        A = A.mT  # the same singular values; the smaller Gram
    n = A.shape[-1]
    k = max(1, min(int(iters), n))
    lead = A.shape[:-2]
    if A.shape[-2] == 0 or n == 0:  # an empty matrix: norm 0
        return A.new_zeros(*lead, 1, 1)
    v = lanczos_start(n, A.dtype, A.device)
    # on a GPU the recurrence's ~13 small kernels per step are launch-bound: replayed as one CUDA graph
    out = None if host_free else graphs.replay("spectral_norm_estimate", _lanczos_coefficients, A, v, k=k,
                                                gram_dtype=gram_dtype)
    if out is not None:
        coef, unit = out
    elif not host_free and A.device.type == "cpu" and A.ndim > 2 and A.shape[:-2].numel() > 1:
        # one matrix at a time on a CPU: a batched matrix-vector product (bmm) is 2–3× slower there than one mm per
        # matrix (768² Grams: 183 µs against 2 × 40 µs, AMX), and the recurrence is those products
        parts = [_lanczos_coefficients(a, v, k=k, gram_dtype=gram_dtype, products=pr)
                 for a in A.reshape(-1, *A.shape[-2:])]
        coef = torch.stack([c for c, _ in parts]).reshape(*lead, -1)
        unit = torch.stack([u for _, u in parts]).reshape(*lead, 1, 1)
    else:
        coef, unit = _lanczos_coefficients(A, v, k=k, gram_dtype=gram_dtype, products=pr)
    finite = torch.isfinite(coef).all(dim=-1)
    coef = torch.where(finite[..., None], coef, 0.0)
    diag, off = coef[..., :k], coef[..., k:2 * k - 1]
    T = torch.diag_embed(diag) + torch.diag_embed(off, offset=1) + torch.diag_embed(off, offset=-1)
    top = top_eigenvalue_psd(T) if host_free else torch.linalg.eigvalsh(T)[..., -1]
    top = torch.where(finite, top, float("nan"))
    return (top.clamp_min(0).sqrt().reshape(*lead, 1, 1) * unit.to(torch.float64).sqrt()).to(A.dtype)


def _lanczos_coefficients(A: torch.Tensor, v: torch.Tensor, k: int, gram_dtype: torch.dtype | None,
                          products: Products | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``spectral_norm_estimate``'s recurrence on a tall, non-empty A from the unit start vector v (n, 1): the
    Lanczos coefficients (..., 2k) in float64 (α₁…α_k, β₁…β_{k−1}, 0) of AᵀA / unit, and unit (..., 1, 1), AᵀA's
    largest diagonal entry (or 1). No host synchronisation and no host-to-device copy: capturable as a CUDA graph."""
    n = A.shape[-1]
    lead = A.shape[:-2]
    # under split-bf16 products a bf16 Gram is one bf16 product accumulated in float32, cheaper than the 2·k m×n
    # matrix-vector products even for a square A (768²: 0.6 ms against ~4 ms, AMX)
    pr = products if products is not None else Products()
    split_gram = gram_dtype == torch.bfloat16 and pr.split and A.device.type == "cpu" \
        and A.dtype == torch.float32
    if A.shape[-2] >= 2 * n or split_gram:  # tall: form the Gram once, each step is an n×n product
        if gram_dtype is not None and gram_dtype != A.dtype:
            # the bf16 factor and the exact diagonal (column sums of squares) in one C pass over A where it can
            fused = (kernels.bf16_with_column_sumsq(A) if split_gram and A.ndim == 2 and plain(A)
                     and A.numel() >= COLUMN_KERNEL_MIN else None)  # column_norms' bits: its kernel's sizes
            An, diag = fused if fused is not None else (A.to(gram_dtype), None)
            G = split_matmul((An.mT, None), (An, None)) if split_gram else (An.mT @ An).to(A.dtype)
            G.diagonal(dim1=-2, dim2=-1).copy_(column_norms(A, squared=True) if diag is None else diag)
        else:
            G = ieee_mm(A.mT, A, onednn=pr.onednn)
        top_diag = G.diagonal(dim1=-2, dim2=-1).amax(dim=-1, keepdim=True).unsqueeze(-1)
    else:  # near-square: forming AᵀA costs more than the steps' products with A itself
        G = None
        top_diag = column_norms(A, squared=True).amax(dim=-1, keepdim=True).unsqueeze(-1)
    # AᵀA / its largest diagonal entry (which bounds every |entry| of a PSD matrix): the Lanczos vectors' norms
    # neither overflow nor underflow whatever A's scale
    unit = torch.where(top_diag > 0, top_diag, 1.0)
    if G is not None:
        G = G / unit
    noise = LANCZOS_BREAKDOWN * torch.finfo(A.dtype).eps * n**0.5
    if G is not None and G.ndim == 2 and G.device.type == "cpu" and G.dtype in (torch.float32, torch.float64) \
            and kernels.load_kernel("linalg") is not None:
        # one C loop (kernels/linalg.c, the same recurrence): ~1.4 ms per 768² Gram against ~5 ms of torch dispatch
        return kernels.lanczos(G.contiguous(), v.reshape(-1).contiguous(), k, noise).reshape(1, 2 * k)[0], unit

    def gram_times(x: torch.Tensor) -> torch.Tensor:
        return G @ x if G is not None else (A.mT @ (A @ x)) / unit

    # the Lanczos basis in one preallocated (..., n, k) buffer, filled a column per step (no concatenation)
    Q = A.new_zeros(*lead, n, k)
    q = Q[..., :, :1]
    q.copy_(v.expand(*lead, n, 1))
    alphas, betas = [], []  # T's diagonal and off-diagonal, (..., 1, 1) each
    # breakdown floor (``noise``): rounding noise left by the reorthogonalisation is ~eps·‖AᵀA q‖ per entry; a real β
    # of a small top gap (β ~ gap/sqrt(n)) must stay above it, so the floor tracks the largest ‖AᵀA q_j‖ seen
    scale = torch.zeros_like(q[..., :1, :])
    tiny = torch.finfo(A.dtype).tiny
    for j in range(k):
        w = gram_times(q)
        scale = torch.maximum(scale, torch.linalg.vector_norm(w, dim=-2, keepdim=True))
        alphas.append(q.mT @ w)
        Qj = Q[..., :, :j + 1]  # the basis so far (a view: no copy)
        for _ in range(2):  # full reorthogonalisation (twice is enough)
            w = addmm_batched(w, Qj, Qj.mT @ w, alpha=-1.0)
        if j == k - 1:
            break
        b = torch.linalg.vector_norm(w, dim=-2, keepdim=True)
        keep = b > noise * scale  # else breakdown: an invariant subspace is found, the recurrence ends here
        b = b * keep
        betas.append(b)
        q = Q[..., :, j + 1:j + 2]
        q.copy_((w * keep) / b.clamp_min(tiny))  # a zero vector after a breakdown: later α, β are zero
    coef = torch.cat(alphas + betas + [torch.zeros_like(alphas[0])], dim=-1).squeeze(-2).to(torch.float64)
    return coef, unit


def _narrow_scaled(Y: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A new row-major ``dtype`` copy of Y·scale (Y when scale is None), whatever Y's layout: on the CPU a bf16 copy
    of a row-major float32 Y in one C pass (``kernels.scaled_bf16``; torch's mixed-dtype multiply gives the same bits
    at ~4× the time, 3072×768: 2.1 ms in a step)."""
    if scale is not None and dtype == torch.bfloat16 and Y.is_contiguous() and not Y.requires_grad:
        out = kernels.scaled_bf16(Y, scale)
        if out is not None:
            return out
    Yf = torch.empty(Y.shape, dtype=dtype, device=Y.device)
    return Yf.copy_(Y) if scale is None else torch.mul(Y, scale, out=Yf)


def _widened(A: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """(A in ``dtype``, whether that is a new tensor of this call's own). An msign output already in ``dtype`` is not
    claimed: a caller's ``msign_fn`` may hand back memory it keeps."""
    W = A.to(dtype)
    return W, W is not A


def _residual(X: torch.Tensor, A: torch.Tensor, manifold: Manifold, a_pieces: tuple[torch.Tensor, None] | None,
              products: Products) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(S, H, r) on tall views: S = XᵀA, the residual matrix H = P(S + Sᵀ) and its size ‖H‖_F/n per matrix.
    ``a_pieces``: (A in bf16, None) when A is exactly bf16 (``constraint_mm``'s split then takes two products)."""
    S = constraint_mm(X.mT, A, a_pieces, products=products)
    H = manifold.P(sym_sum(S))
    return S, H, torch.linalg.matrix_norm(H) / X.shape[-1]


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
