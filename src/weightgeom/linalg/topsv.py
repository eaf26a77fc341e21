"""Top-k singular triplets of (batched) matrices by power iteration, randomised SVD or full SVD.

``top_singular(W, k)`` returns ``(u, s, v)`` with ``W v_i ≈ s_i u_i``: u (..., m, k), s (..., k), v (..., n, k),
singular values in decreasing order. Layout is PyTorch's (out, in): v lives in the input space R^n, u in the output
space R^m.

Sign convention: each column of ``v`` is flipped so that its largest-|entry| component is positive, and ``u`` follows
(u_i = W v_i / s_i), so the triplet is unique whenever s_i is simple. Continuity metrics still take |⟨·,·⟩|.

Methods:
    * ``"svd"``: ``torch.linalg.svd`` (reference; O(mn·min(m,n)) per matrix).
    * ``"power"``: block power (subspace) iteration on the smaller Gram matrix, re-orthonormalised by QR each step,
      stopped when the Ritz values change by < ``tol`` (relative) or after ``iters`` steps. Accuracy of v_i depends on
      the gap σ_i/σ_{k+1}; with a near-degenerate top pair the *vector* is ill-conditioned for any method.
    * ``"randomized"``: Halko–Martinsson–Tropp range finder with ``oversample`` extra columns and ``iters`` power
      steps, then an exact SVD of the small projected matrix. The default for the analysis (fast, gap-tolerant):
      with the defaults (16 extra columns, 8 steps) 1 − |⟨v1, v1_svd⟩| ≤ 1.1e-4 on all 36 MiniLM-L6 matrices,
      whose σ1/σ2 gaps are as small as 1.009.
Zero matrices give s = 0 (u, v are then arbitrary unit vectors).
"""

from __future__ import annotations

import torch

__all__ = ["top_singular", "fix_signs"]

_METHODS = ("power", "randomized", "svd")


def fix_signs(u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flip each (u_i, v_i) pair so that the largest-|entry| component of v_i is positive.

    Args:
        u: (..., m, k) left singular vectors.
        v: (..., n, k) right singular vectors.

    Returns:
        (u, v) with consistent signs (new tensors).
    """
    idx = v.abs().argmax(dim=-2, keepdim=True)  # (..., 1, k)
    sign = torch.sign(torch.gather(v, -2, idx))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    return u * sign, v * sign


def _qr(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(x, mode="reduced").Q


def _finish(W: torch.Tensor, v: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rayleigh–Ritz on span(v) (orthonormal (..., n, p)): exact SVD of W v, keep the top k."""
    Wv = W @ v  # (..., m, p)
    uu, s, vh = torch.linalg.svd(Wv, full_matrices=False)
    u = uu[..., :k]
    s = s[..., :k]
    vv = v @ vh.mT[..., :, :k]
    return u, s, vv


def top_singular(
    W: torch.Tensor,
    k: int = 1,
    method: str = "randomized",
    iters: int | None = None,
    oversample: int = 16,
    tol: float = 1e-7,
    seed: int = 0,
    gram: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k singular triplets of ``W`` (..., m, n).

    Args:
        W: real matrix or batch of matrices, (out, in) layout. Computed in its dtype if float64, else float32.
        k: number of triplets (1 ≤ k ≤ min(m, n)).
        method: ``"power"`` | ``"randomized"`` | ``"svd"`` (see module docstring).
        iters: power steps (default 8 for randomized, max 200 for power).
        oversample: extra random directions for ``"randomized"`` (and the block size bonus for ``"power"``).
        tol: relative change of the Ritz values that stops ``"power"``.
        seed: seed of the random start (deterministic results; the global RNG is not touched).
        gram: optional precomputed Gram of the smaller side (WᵀW if n ≤ m else W Wᵀ, (..., k, k)). When given,
            ``randomized`` iterates on it (each step = two passes over W, cache-friendly) and finishes with one
            Rayleigh–Ritz pass over W; ``power`` uses it instead of forming its own.

    Returns:
        (u, s, v): u (..., m, k), s (..., k) descending, v (..., n, k); signs per :func:`fix_signs`.
    """
    if method not in _METHODS:
        raise ValueError(f"top_singular: unknown method {method!r}; expected one of {', '.join(_METHODS)}")
    if W.ndim < 2:
        raise ValueError(f"top_singular: need a matrix (..., m, n), got shape {tuple(W.shape)}")
    m, n = W.shape[-2], W.shape[-1]
    r = min(m, n)
    if not 1 <= k <= r:
        raise ValueError(f"top_singular: k={k} must be in [1, min(m, n)={r}] for shape {tuple(W.shape)}")
    dtype = torch.float64 if W.dtype == torch.float64 else torch.float32
    A = W.to(dtype)
    if method == "svd":
        uu, s, vh = torch.linalg.svd(A, full_matrices=False)
        u, s, v = uu[..., :k], s[..., :k], vh.mT[..., :k]
        return (*_signed(u, s, v),)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    p = min(r, k + oversample)
    batch = A.shape[:-2]
    omega = torch.randn(*batch, n, p, generator=gen, dtype=dtype).to(A.device)
    use_in = n <= m
    if gram is not None:
        want = (*batch, min(m, n), min(m, n))
        if tuple(gram.shape) != want:
            raise ValueError(f"top_singular: gram has shape {tuple(gram.shape)}, expected {want}")
        gram = gram.to(dtype)
    if method == "randomized" and gram is not None:
        q = 8 if iters is None else iters
        X = omega if use_in else torch.randn(*batch, m, p, generator=gen, dtype=dtype).to(A.device)
        X = _qr(gram @ X)
        for _ in range(q):
            X = _qr(gram @ X)
        return _rayleigh_ritz(A, X, k, use_in)
    if method == "randomized":
        q = 8 if iters is None else iters
        Y = _qr(A @ omega)  # (..., m, p): range finder
        for _ in range(q):
            Z = _qr(A.mT @ Y)
            Y = _qr(A @ Z)
        B = Y.mT @ A  # (..., p, n)
        ub, s, vh = torch.linalg.svd(B, full_matrices=False)
        u = Y @ ub[..., :, :k]
        return (*_signed(u, s[..., :k], vh.mT[..., :, :k]),)
    # power: subspace iteration on the smaller Gram (n×n or m×m), block size p
    q = 200 if iters is None else iters
    G = gram if gram is not None else (A.mT @ A if use_in else A @ A.mT)
    X = _qr(omega if use_in else torch.randn(*batch, m, p, generator=gen, dtype=dtype).to(A.device))
    prev = None
    for _ in range(q):
        X = _qr(G @ X)
        ritz = torch.linalg.vector_norm(G @ X[..., :k], dim=-2)
        if prev is not None and bool(((ritz - prev).abs() <= tol * ritz.clamp_min(1e-30)).all()):
            break
        prev = ritz
    return _rayleigh_ritz(A, X, k, use_in)


def _rayleigh_ritz(A, X, k, use_in):
    """Top-k triplets of A from an orthonormal basis X of (approximately) its top right (use_in) / left vectors."""
    if use_in:
        u, s, v = _finish(A, X, k)
    else:
        ut, s, vt = _finish(A.mT, X, k)
        u, v = vt, ut
    return (*_signed(u, s, v),)


def _signed(u, s, v):
    u, v = fix_signs(u, v)
    return u, s, v
