"""Host-free manifold-Muon arithmetic: the dual ascent, the norm estimate and the retractions with fixed loop counts and
per-matrix device-side masks, on batches of tall matrices (docs/muon.md §6, "One compiled step").

The eager functions (``manifold_direction``, ``polar_near``, ``spectral_norm_estimate``, the DGram column-polar
retraction) decide on the host: the dual ascent compares its residual with ``dual_tol`` and halves its step, the
near-manifold retraction picks the order of its series and stops, Lanczos ends in ``eigvalsh``. Here every such test is
a boolean tensor per matrix and every update goes through ``torch.where``, so

* a matrix takes exactly the iterations the eager path takes alone (its own early stop, step halving and best
  iterate): a stopped matrix's values are carried unchanged through the remaining iterations, which are computed and
  discarded (they cost time, not accuracy);
* nothing is read on the host, nothing calls a C kernel (``kernels.load_kernel`` is None inside a trace), and the
  number of operations does not depend on the number of matrices in a batch — what ``torch.compile(opt.step,
  fullgraph=True)`` and CUDA graphs need.

What differs from the eager path, numerically:

* the largest eigenvalue of Lanczos' k×k tridiagonal matrix comes from ``SQUARINGS`` repeated squarings and a Rayleigh
  quotient in float64 instead of ``eigvalsh`` (agreement to ~1e-13 relative on the optimizer's matrices, tested);
* far from the manifold (‖XᵀX − I‖_F > ``NEAR_TOL``) the eager retraction switches to Polar Express; here only the
  first step (known on the host: a matrix without momentum) does, and later steps keep iterating the third-order series
  for its ``NEAR_MAX_ITERS`` iterations, which converges for singular values in about (0.3, 1.5) — a step of
  spectral size lr moves them by ≤ lr, so this holds for lr ≲ 0.3;
* the DGram column-polar retraction assumes no zero column (a zero column of a fresh point is completed exactly by the
  eager path; here it gives NaN, which ``on_nonfinite="skip"`` then skips);
* products run batched (``bmm``) where the CPU's eager path steps one matrix at a time: rounding-level differences
  (≤ 1e-6 after 5 steps in float32, ``tests/test_compiled_step.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from weightgeom.linalg import msign
from weightgeom.linalg.gemm import addmm_batched
from weightgeom.manifolds.base import Manifold, compute_dtype, polar
from weightgeom.manifolds.dgram import dgram_retract_paper
from weightgeom.manifolds.oblique import normalize_columns, normalize_columns_paper
from weightgeom.manifolds.stiefel import NEAR_MAX_ITERS, NEAR_REMAINDER, ORDER_REMAINDER
from weightgeom.optim.manifold_muon import (
    _NORM_EPS,
    PROJECT_NORM_ITERS,
    RESIDUAL_SAMPLE_COLUMNS,
    _lanczos_coefficients,
    _residual,
    _shifted,
    initial_multiplier,
    warm_multiplier,
)

__all__ = ["supports", "lanczos_start", "top_eigenvalue_psd", "spectral_norm", "near_polar", "retract",
           "direction", "SQUARINGS"]

# Repeated squarings of Lanczos' tridiagonal T (normalised each time) before its Rayleigh quotient: T^(2^24) separates
# the top eigenvalue from one a relative 1e-6 below it by a factor e^-16; closer eigenvalues are within that gap of each
# other anyway, so the quotient is the top one to ~gap·(λ₂/λ₁)^(2^24) — float64 rounding for every T we see (tested
# against ``eigvalsh``).
SQUARINGS = 24

# Lanczos start vectors by (n, dtype, device): the eager ``spectral_norm_estimate``'s (seed 0), made outside the step
# (``lanczos_start``, called when a manifold group is added) because a trace cannot run a ``torch.Generator``.
_STARTS: dict[tuple[int, torch.dtype, str], torch.Tensor] = {}


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
    normalised squarings of T, then the Rayleigh quotient of its largest column. 0 for a zero matrix."""
    tiny = torch.finfo(T.dtype).tiny
    M = T
    for _ in range(SQUARINGS):
        M = M @ M
        M = M / M.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(tiny)
    col = torch.linalg.vector_norm(M, dim=-2).argmax(dim=-1)  # (...,)
    v = torch.take_along_dim(M, col[..., None, None], dim=-1)  # (..., k, 1)
    return ((v.mT @ T @ v) / (v.mT @ v).clamp_min(tiny))[..., 0, 0]


def spectral_norm(A: torch.Tensor, iters: int = PROJECT_NORM_ITERS, gram_dtype: torch.dtype | None = None
                  ) -> torch.Tensor:
    """``spectral_norm_estimate`` of a batch (B, m, n) without host reads: the same Lanczos recurrence (torch path),
    the top Ritz value by ``top_eigenvalue_psd``. Returns (B, 1, 1) in A's dtype."""
    if A.shape[-2] < A.shape[-1]:
        A = A.mT
    n = A.shape[-1]
    k = max(1, min(int(iters), n))
    coef, unit = _lanczos_coefficients(A, lanczos_start(n, A.dtype, A.device), k=k, gram_dtype=gram_dtype)
    finite = torch.isfinite(coef).all(dim=-1)
    coef = torch.where(finite[..., None], coef, 0.0)
    diag, off = coef[..., :k], coef[..., k:2 * k - 1]
    T = torch.diag_embed(diag) + torch.diag_embed(off, offset=1) + torch.diag_embed(off, offset=-1)
    top = torch.where(finite, top_eigenvalue_psd(T), float("nan"))
    return (top.clamp_min(0).sqrt().reshape(-1, 1, 1) * unit.to(torch.float64).sqrt()).to(A.dtype)


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


def _sampled_residuals(X: torch.Tensor, A: torch.Tensor, manifold: Manifold,
                       columns: int = RESIDUAL_SAMPLE_COLUMNS) -> torch.Tensor:
    """``manifold_muon._sampled_residuals`` (B,) without its mask cache (the mask is built in the step)."""
    n = X.shape[-1]
    if n <= columns or not manifold.entrywise_P:
        return _residual(X, A, manifold)[2]
    j0 = (n - columns) // 2
    J = slice(j0, j0 + columns)
    block = A[..., J].contiguous().mT @ X + X[..., J].contiguous().mT @ A
    rows = manifold.P(torch.ones(n, n, dtype=X.dtype, device=X.device))[J] != 0
    return torch.linalg.matrix_norm(torch.where(rows, block, 0.0)) * ((n / columns) ** 0.5 / n)


def direction(
    X: torch.Tensor, G: torch.Tensor, manifold: Manifold, Lambda0: torch.Tensor | None, cold0: torch.Tensor | None, *,
    steps: int, lr: float, tol: float, msign_fn: Callable[[torch.Tensor], torch.Tensor], schedule: str,
    normalize: bool, project: bool, final_msign_fn: Callable[[torch.Tensor], torch.Tensor] | None,
    final_continues: bool, keep: str, feed_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``manifold_direction`` on a batch (B, m, n) of tall matrices, every host-side test a per-matrix mask.

    Arguments as ``manifold_direction``'s (X, G tall, in the compute dtype; Λ₀ and its cold start (B, n, n) or None).

    Returns:
        (A, Λ, cold start, residuals (B,), dual residuals (B,), dual iterations (B,) int64): A tall, 0 where G = 0.
    """
    n = X.shape[-1]
    b = X.shape[0]
    gnorm = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True)
    scale = n**0.5 / (gnorm + _NORM_EPS) if normalize else None
    if feed_dtype is not None and feed_dtype != X.dtype:
        Xf = X.to(feed_dtype)
        Yf = G.to(feed_dtype) if scale is None else torch.mul(G, scale).to(feed_dtype)
    else:
        Xf, Yf = X, (G if scale is None else G * scale)
    # the cold start from the narrow copies' exact values, accumulated in X's dtype (the eager CPU path's split
    # product; a narrow product would round XᵀĜ to bf16)
    cold = initial_multiplier(Xf.to(X.dtype), Yf.to(X.dtype), manifold) if Xf.dtype != X.dtype else \
        initial_multiplier(Xf, Yf, manifold)
    Lam = warm_multiplier(cold.to(X.dtype), Lambda0, cold0)
    last = keep == "last"
    dev = X.device
    active = torch.ones(b, dtype=torch.bool, device=dev)
    best_r = torch.full((b,), float("inf"), dtype=X.dtype, device=dev)
    prev = best_r
    shrink = torch.ones(b, 1, 1, dtype=torch.float64, device=dev)
    iters = torch.zeros(b, dtype=torch.int64, device=dev)
    best_A, best_L, best_S = X, Lam, torch.zeros(b, n, n, dtype=X.dtype, device=dev)
    for k in range(steps):
        A = msign_fn(_shifted(Xf, Yf, manifold.P(Lam).to(Xf.dtype))).to(X.dtype)
        S, H, rv = _residual(X, A, manifold)
        take = active if last else active & (rv < best_r)
        t3 = take[:, None, None]
        best_r = torch.where(take, rv, best_r)
        best_A, best_L, best_S = torch.where(t3, A, best_A), torch.where(t3, Lam, best_L), torch.where(t3, S, best_S)
        iters = iters + active
        if k == steps - 1:
            break
        go = active & ~((rv < tol) if last else (rv <= tol))
        if not last:
            shrink = torch.where((go & (rv > prev))[:, None, None], shrink * 0.5, shrink)
            prev = torch.where(go, rv, prev)
        alpha = (lr * ((1.0 - k / steps) if schedule == "linear" else 1.0) * shrink).to(X.dtype)
        Lam = torch.where(go[:, None, None], Lam - alpha * H, Lam)
        active = go
    A, Lam, S, rv = best_A, best_L, best_S, best_r
    if final_msign_fn is not None:
        A = final_msign_fn(A if final_continues else _shifted(Xf, Yf, manifold.P(Lam).to(Xf.dtype))).to(X.dtype)
        S, _, rv = _residual(X, A, manifold)
    dual = rv
    if project:
        Ap = manifold.proj_tangent_tall(X, A, S)
        norm = spectral_norm(Ap, gram_dtype=feed_dtype)
        A = Ap * torch.where(norm == 0, 0.0, 1.0 / norm)
        rv = _sampled_residuals(X, A, manifold)
    A = torch.where(gnorm > 0, A, 0.0)  # zero gradient → zero step
    return A, Lam, cold, rv, dual, iters
