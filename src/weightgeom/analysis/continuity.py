"""Geometric-continuity metrics between adjacent same-role weight matrices (the continuity paper,
arXiv:2605.04971; derivations in docs/continuity.md).

Layout is PyTorch's (out, in): W ∈ R^{m×n}; the input space is R^n (right singular vectors v), the output space R^m
(left singular vectors u). All metrics are sign-invariant and dimensionless in [0, 1].

* ``C_v = |⟨v1(W_a), v1(W_b)⟩|``, ``C_u = |⟨u1(W_a), u1(W_b)⟩|``; random level sqrt(2/(π d)) for d = n resp. m
  (E|⟨a, b⟩| of independent uniform unit vectors, large-d form).
* Gram alignment (σ²-weighted, SVD-free): ``tr(S_a S_b) / (‖S_a‖_F ‖S_b‖_F)`` with S = WᵀW (input) or W Wᵀ (output).
  Computed in the cheapest form: per-layer Grams of the smaller side, e.g. tr(W_aᵀW_a W_bᵀW_b) = ‖W_a W_bᵀ‖_F² when
  m < n. Random level: E over an independent Haar rotation of one input space, tr(S_a) tr(S_b) / (d ‖S_a‖ ‖S_b‖)
  (exact for the given spectra; ≈ m/(m+n+1) for independent Gaussian m×n matrices, input space).
* Index-matched alignment: Σ_i w_i |⟨v_i, v'_i⟩| / Σ_i w_i with w_i = σ_i σ'_i (= σ_i² when the spectra match;
  symmetric in the pair). Needs the singular vectors (full SVD, or the top k). Random level ≈ sqrt(2/(π d)).
* Dominance ratio ``‖ΔW‖_F / ‖W_0‖_F`` for accumulated updates ΔW = W_t − W_0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from weightgeom.linalg.topsv import top_singular

__all__ = [
    "random_level_cos",
    "gram_random_level",
    "gram_alignment",
    "gram_alignment_svd",
    "index_matched_alignment",
    "top_cos",
    "dominance_ratio",
    "stack_continuity",
    "powerlaw_alpha",
    "SPACES",
]

SPACES = ("input", "output")


def random_level_cos(d: int) -> float:
    """Random level of |⟨a, b⟩| for independent uniform unit vectors in R^d: sqrt(2/(π d)) (large-d form).

    The exact value Γ(d/2)/(√π Γ((d+1)/2)) differs by < 1% for d ≥ 40.
    """
    return math.sqrt(2.0 / (math.pi * d))


def _dt(W: torch.Tensor) -> torch.dtype:
    return torch.float64 if W.dtype == torch.float64 else torch.float32


def _orient(W: torch.Tensor, space: str) -> torch.Tensor:
    """Return W such that the requested space is its input (column) space."""
    if space not in SPACES:
        raise ValueError(f"unknown space {space!r}; expected 'input' or 'output'")
    return W if space == "input" else W.mT


class _GramStack:
    """Per-layer quantities for the Gram alignment of a stack (L, m, n), computed once and shared by both spaces.

    Only the Gram of the smaller side is formed (k×k, k = min(m, n)); ‖S‖_F² = Σσ⁴ and tr S = ‖W‖_F² are the same for
    WᵀW and W Wᵀ. In the space of dimension k, tr(S_a S_b) = Σ G_a ⊙ G_b; in the other space it is the squared
    Frobenius norm of the cross product of the long sides, e.g. tr(W_aW_aᵀ W_bW_bᵀ) = ‖W_aᵀW_b‖_F² for tall W
    (cost k²·max(m, n) per pair instead of forming max(m, n)² matrices).
    """

    def __init__(self, W: torch.Tensor):
        self.W = W
        m, n = W.shape[-2], W.shape[-1]
        self.m, self.n = m, n
        self.tall = n <= m  # small Gram is WᵀW (input space) when tall, W Wᵀ (output space) when wide
        G = W.mT @ W if self.tall else W @ W.mT
        self.G = G
        self.sq = (G * G).sum(dim=(-2, -1))  # ‖S_l‖_F² (same for both Grams)
        self.tr = torch.diagonal(G, dim1=-2, dim2=-1).sum(-1)  # tr S_l = ‖W_l‖_F²

    def dim(self, space: str) -> int:
        return self.n if space == "input" else self.m

    def inner(self, a: int, b: int, space: str) -> torch.Tensor:
        if (space == "input") == self.tall:
            return (self.G[a] * self.G[b]).sum()
        X = self.W[a].mT @ self.W[b] if self.tall else self.W[a] @ self.W[b].mT
        return (X * X).sum()

    def alignment(self, a: int, b: int, space: str) -> tuple[float, float]:
        """(alignment, random level) of layers a, b in ``space``."""
        den = torch.sqrt(self.sq[a] * self.sq[b])
        if den <= 0:
            return 0.0, 0.0
        return float(self.inner(a, b, space) / den), float(self.tr[a] * self.tr[b] / (self.dim(space) * den))


def gram_alignment(Wa: torch.Tensor, Wb: torch.Tensor, space: str = "input") -> float:
    """σ²-weighted alignment tr(S_a S_b)/(‖S_a‖_F ‖S_b‖_F), S = WᵀW (input) or W Wᵀ (output), without an SVD.

    Args:
        Wa, Wb: (m, n) matrices in (out, in) layout; must share the dimension of ``space``.
        space: ``"input"`` (R^n, needs equal n) or ``"output"`` (R^m, needs equal m).

    Returns:
        Alignment in [0, 1]; 1 iff the Grams are proportional; 0 if either matrix is zero.
    """
    A, B = _orient(Wa, space), _orient(Wb, space)
    if A.shape[-1] != B.shape[-1]:
        raise ValueError(f"gram_alignment({space}): dimension mismatch {tuple(Wa.shape)} vs {tuple(Wb.shape)}")
    if A.shape != B.shape:  # different other dimension: use the cross form directly
        dt = _dt(A)
        A, B = A.to(dt), B.to(dt)
        X = A @ B.mT
        ga, gb = (A.mT @ A), (B.mT @ B)
        den = torch.sqrt((ga * ga).sum() * (gb * gb).sum())
        return float((X * X).sum() / den) if den > 0 else 0.0
    return _GramStack(torch.stack([Wa, Wb]).to(_dt(Wa))).alignment(0, 1, space)[0]


def gram_alignment_svd(Wa: torch.Tensor, Wb: torch.Tensor, space: str = "input") -> float:
    """The same quantity via full SVDs: Σ_ij σ_i² σ'_j² ⟨v_i, v'_j⟩² / sqrt(Σσ_i⁴ Σσ'_j⁴) (reference for tests)."""
    A, B = _orient(Wa, space).double(), _orient(Wb, space).double()
    _, sa, vha = torch.linalg.svd(A, full_matrices=False)
    _, sb, vhb = torch.linalg.svd(B, full_matrices=False)
    C = (vha @ vhb.mT) ** 2  # ⟨v_i, v'_j⟩²
    num = (sa[:, None] ** 2 * C * sb[None, :] ** 2).sum()
    den = torch.sqrt((sa**4).sum() * (sb**4).sum())
    return float(num / den) if den > 0 else 0.0


def gram_random_level(Wa: torch.Tensor, Wb: torch.Tensor, space: str = "input") -> float:
    """Expected Gram alignment if one input space were rotated at random (Haar): tr S_a tr S_b / (d ‖S_a‖ ‖S_b‖).

    For independent Gaussian m×n matrices this is ≈ m/(m+n+1) in the input space (n/(m+n+1) in the output space):
    it is high for tall matrices, so always read the alignment against this level.
    """
    A, B = _orient(Wa, space).to(_dt(Wa)), _orient(Wb, space).to(_dt(Wb))
    d = A.shape[-1]
    ga = A.mT @ A if A.shape[-1] <= A.shape[-2] else A @ A.mT
    gb = B.mT @ B if B.shape[-1] <= B.shape[-2] else B @ B.mT
    den = d * torch.sqrt((ga * ga).sum() * (gb * gb).sum())
    return float((A * A).sum() * (B * B).sum() / den) if den > 0 else 0.0


def index_matched_alignment(Wa: torch.Tensor, Wb: torch.Tensor, space: str = "input", k: int | None = None) -> float:
    """Σ_i σ_iσ'_i |⟨v_i, v'_i⟩| / Σ_i σ_iσ'_i over the top ``k`` (default all) singular pairs, by full SVD."""
    A, B = _orient(Wa, space).double(), _orient(Wb, space).double()
    _, sa, vha = torch.linalg.svd(A, full_matrices=False)
    _, sb, vhb = torch.linalg.svd(B, full_matrices=False)
    r = min(sa.numel(), sb.numel(), k or 10**9)
    w = sa[:r] * sb[:r]
    c = (vha[:r] * vhb[:r]).sum(-1).abs()
    return float((w * c).sum() / w.sum()) if w.sum() > 0 else 0.0


def top_cos(Wa: torch.Tensor, Wb: torch.Tensor, space: str = "input", method: str = "randomized") -> float:
    """C_v (space="input") or C_u (space="output"): |⟨x1(W_a), x1(W_b)⟩| of the top singular vectors."""
    A, B = _orient(Wa, space), _orient(Wb, space)
    if A.shape[-1] != B.shape[-1]:
        raise ValueError(f"top_cos({space}): dimension mismatch {tuple(Wa.shape)} vs {tuple(Wb.shape)}")
    _, _, va = top_singular(A, 1, method=method)
    _, _, vb = top_singular(B, 1, method=method)
    return float((va[:, 0] * vb[:, 0]).sum().abs())


def dominance_ratio(W: torch.Tensor, W0: torch.Tensor) -> float:
    """‖W − W0‖_F / ‖W0‖_F (inf if W0 = 0)."""
    W, W0 = W.double(), W0.double()
    n0 = torch.linalg.matrix_norm(W0)
    return float(torch.linalg.matrix_norm(W - W0) / n0) if n0 > 0 else math.inf


def _idx_matched_stack(U: torch.Tensor, S: torch.Tensor, a: int, b: int, k: int | None) -> float:
    r = S.shape[-1] if k is None else min(k, S.shape[-1])
    w = S[a, :r] * S[b, :r]
    c = (U[a, :, :r] * U[b, :, :r]).sum(0).abs()
    return float((w * c).sum() / w.sum()) if w.sum() > 0 else 0.0


def stack_continuity(
    Ws: Sequence[torch.Tensor] | torch.Tensor,
    metrics: Sequence[str] = ("cv", "cu", "gram"),
    method: str = "randomized",
    idx_k: int | None = None,
    prefix: str = "",
    iters: int | None = None,
) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    """All adjacent-pair metrics of a same-shape stack of matrices W_0..W_{L-1} (out, in).

    Args:
        Ws: L ≥ 2 matrices of one shape (m, n), or a tensor (L, m, n).
        metrics: subset of ``"cv"``, ``"cu"``, ``"gram"`` (input and output), ``"idx"`` (index-matched, full SVD).
        method: top-singular-vector method for cv/cu (see :func:`weightgeom.linalg.top_singular`).
        idx_k: restrict the index-matched sum to the top k pairs (None = all).
        prefix: prepended to every column name (e.g. ``"grad_"``).
        iters: power steps of the top-singular-vector method (None: its default, 8 for ``"randomized"``). Near-equal
            top singular values need more: at σ1/σ2 ≈ 1.004 (random 256×256 matrices) 8 steps leave
            1 − |⟨v1, v1_svd⟩| ≈ 1e-2, 32 steps ≈ 2e-8 (at 3× the cost of 8).

    Returns:
        (columns, vectors): columns maps metric name → list of L−1 values (pair l, l+1), including the random levels
        ``*_rand``; vectors holds ``v1`` (L, n), ``u1`` (L, m) and ``sigma1`` (L,) when cv/cu were requested.
    """
    W = torch.stack(list(Ws)) if not isinstance(Ws, torch.Tensor) else Ws
    if W.ndim != 3 or W.shape[0] < 2:
        raise ValueError(f"stack_continuity: need (L ≥ 2, m, n) matrices, got shape {tuple(W.shape)}")
    bad = set(metrics) - {"cv", "cu", "gram", "idx"}
    if bad:
        raise ValueError(f"stack_continuity: unknown metrics {sorted(bad)}; expected cv, cu, gram, idx")
    W = W.to(_dt(W))
    L, m, n = W.shape
    pairs = range(L - 1)
    cols: dict[str, list[float]] = {}
    vecs: dict[str, torch.Tensor] = {}
    p = prefix
    gs = _GramStack(W) if ("gram" in metrics or method != "svd") else None
    if "cv" in metrics or "cu" in metrics:
        u, s, v = top_singular(W, 1, method=method, gram=gs.G if gs is not None else None, iters=iters)
        vecs["v1"], vecs["u1"], vecs["sigma1"] = v[..., 0], u[..., 0], s[..., 0]
        if "cv" in metrics:
            cols[p + "cv"] = [float((v[a, :, 0] * v[a + 1, :, 0]).sum().abs()) for a in pairs]
            cols[p + "cv_rand"] = [random_level_cos(n)] * (L - 1)
        if "cu" in metrics:
            cols[p + "cu"] = [float((u[a, :, 0] * u[a + 1, :, 0]).sum().abs()) for a in pairs]
            cols[p + "cu_rand"] = [random_level_cos(m)] * (L - 1)
    if "gram" in metrics:
        for space, tag in (("input", "in"), ("output", "out")):
            vals = [gs.alignment(a, a + 1, space) for a in pairs]
            cols[f"{p}gram_{tag}"] = [v[0] for v in vals]
            cols[f"{p}gram_{tag}_rand"] = [v[1] for v in vals]
    if "idx" in metrics:
        uu, ss, vh = torch.linalg.svd(W, full_matrices=False)
        V = vh.mT
        cols[p + "idx_in"] = [_idx_matched_stack(V, ss, a, a + 1, idx_k) for a in pairs]
        cols[p + "idx_in_rand"] = [random_level_cos(n)] * (L - 1)
        cols[p + "idx_out"] = [_idx_matched_stack(uu, ss, a, a + 1, idx_k) for a in pairs]
        cols[p + "idx_out_rand"] = [random_level_cos(m)] * (L - 1)
    return cols, vecs


def powerlaw_alpha(eigs, min_tail: int = 10, max_candidates: int = 1000) -> dict[str, float]:
    """Power-law exponent α of the tail of an eigenvalue density, p(λ) ∝ λ^(−α) for λ ≥ λ_min (the WeightWatcher-style
    heavy-tail metric of a weight matrix's empirical spectral density, eigenvalues of WᵀW = σ²).

    Method (Clauset, Shalizi and Newman, "Power-law distributions in empirical data"): for each candidate λ_min among
    the eigenvalues, the maximum-likelihood α = 1 + n / Σ_{λ_i ≥ λ_min} ln(λ_i / λ_min) over the n eigenvalues in the
    tail; the candidate whose fitted CDF is closest to the empirical one (Kolmogorov–Smirnov distance) wins. α is
    scale-free (the same for cW). Random (Marchenko–Pastur) matrices give large α; well-trained layers typically
    2–6, per "Implicit Self-Regularization in Deep Neural Networks" (Martin and Mahoney).

    Args:
        eigs: eigenvalues (any order; non-positive ones are dropped).
        min_tail: fewest eigenvalues a tail may have.
        max_candidates: at most this many λ_min candidates, evenly spaced in rank (bounds the cost for large k).

    Returns:
        ``{"alpha", "alpha_xmin", "alpha_ks", "alpha_tail"}`` (tail = number of eigenvalues fitted); NaNs when fewer
        than ``min_tail`` positive eigenvalues.
    """
    import numpy as np

    x = np.sort(np.asarray(eigs, dtype=np.float64).ravel())
    x = x[x > x[-1] * 1e-12] if x.size and x[-1] > 0 else x[:0]
    N = x.size
    nan = float("nan")
    if N < max(min_tail, 2):
        return {"alpha": nan, "alpha_xmin": nan, "alpha_ks": nan, "alpha_tail": float(N)}
    logs = np.log(x)
    suffix = np.cumsum(logs[::-1])[::-1]  # Σ_{j ≥ i} ln x_j
    last = N - min_tail
    cand = np.unique(np.linspace(0, last, min(max_candidates, last + 1)).round().astype(int))
    best = (np.inf, nan, nan, 0)
    for i in cand:
        n = N - i
        denom = suffix[i] - n * logs[i]
        if denom <= 0:
            continue
        a = 1.0 + n / denom
        tail = x[i:]
        fit = 1.0 - (tail / x[i]) ** (1.0 - a)
        emp_hi = np.arange(1, n + 1) / n
        ks = float(max(np.abs(emp_hi - fit).max(), np.abs(emp_hi - 1.0 / n - fit).max()))
        if ks < best[0]:
            best = (ks, a, float(x[i]), n)
    return {"alpha": float(best[1]), "alpha_xmin": best[2], "alpha_ks": float(best[0]), "alpha_tail": float(best[3])}
