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
* Spread over the top k singular directions (:func:`topk_spread`): C_v of each v_i (i = 1..k, index-matched), the
  share of v1 in Σ_i C_v(i)², and the overlap of the two top-k subspaces — does continuity live in v1 alone (an
  element-wise activation, per the continuity paper) or in several directions (LayerNorm)?
* Sketched Gram alignment (:func:`gram_alignment_sketch`, the default for large matrices): the same quantity without
  any k×k product — exact on the span of both layers' top-r singular vectors, a Gaussian-probe (Hutchinson) estimate
  of the rest (Hutch++-style deflation). Cost ≈ 750·m·n multiply-adds per matrix (r = 16, p = 32) instead of
  ≈ 3·m·n·min(m, n); measured error within :data:`SKETCH_TOL`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightgeom.linalg.topsv import fix_signs, top_singular

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
    "topk_spread",
    "gram_alignment_sketch",
    "sketch_layer",
    "sketch_pair",
    "SketchLayer",
    "SPACES",
    "SKETCH_RANK",
    "SKETCH_PROBES",
    "SKETCH_ITERS",
    "SKETCH_TOL",
    "SKETCH_TOL_SMALL",
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


def topk_spread(Ws: Sequence[torch.Tensor] | torch.Tensor, k: int = 8, space: str = "input", method: str = "svd",
                iters: int | None = None) -> dict[str, list[float] | list[list[float]]]:
    """How adjacent-layer continuity spreads over the top ``k`` singular directions of a same-shape stack.

    For each adjacent pair (W_l, W_l+1) with singular vectors v_i, v'_i of ``space`` (float64 for float64 input, else
    float32; descending σ):

    * ``cv_dirs``: [C_v(1), …, C_v(k)] with C_v(i) = |⟨v_i, v'_i⟩| (index-matched; C_v(1) is the usual C_v);
    * ``v1_share``: C_v(1)² / Σ_{i≤k} C_v(i)² — 1 when only v1 is continuous, 1/k when all k directions are equally
      continuous (also the value for unrelated layers, so read it with ``cv_rest``);
    * ``cv_rest``: the mean of C_v(2..k) — the continuity carried outside v1;
    * ``overlap``: ‖V_kᵀ V'_k‖_F² / k, the shared fraction of the two top-k subspaces (1: same subspace; insensitive
      to the order or mixing of near-equal singular values inside it), with its random level ``overlap_rand`` = k/d;
    * ``cv_rand``: the random level sqrt(2/(π d)) of every C_v(i).

    All numbers are dimensionless in [0, 1]. Scope: one role's stack; cost one full SVD per layer (``method="svd"``)
    or k + 16 randomized power directions (``"randomized"``, what the training-time recorder uses).

    Args:
        Ws: L ≥ 2 matrices of one shape (m, n) in (out, in) layout, or a tensor (L, m, n).
        k: number of top directions (≥ 2; clipped to min(m, n)).
        space: ``"input"`` (right singular vectors v, R^n) or ``"output"`` (left singular vectors u, R^m).
        method: ``"svd"`` (exact) or a :func:`weightgeom.linalg.top_singular` method (``"randomized"``, ``"power"``).
        iters: power steps for the non-SVD methods (None: their default).

    Returns:
        dict of lists with one entry per pair (l, l+1); ``cv_dirs`` holds a list of k values per pair; ``k`` is the
        number of directions used.

    Raises:
        ValueError: fewer than two matrices, mismatched shapes, k < 2, or an unknown space.
    """
    W = torch.stack(list(Ws)) if not isinstance(Ws, torch.Tensor) else Ws
    if W.ndim != 3 or W.shape[0] < 2:
        raise ValueError(f"topk_spread: need (L ≥ 2, m, n) matrices, got shape {tuple(W.shape)}")
    if int(k) < 2:
        raise ValueError(f"topk_spread: k must be >= 2, got {k}")
    W = _orient(W.to(_dt(W)), space)
    d = W.shape[-1]
    k = min(int(k), W.shape[-2], d)
    if method == "svd":
        V = torch.linalg.svd(W, full_matrices=False)[2][:, :k, :]  # (L, k, d): rows v_1..v_k
    else:
        V = top_singular(W, k, method=method, iters=iters)[2].mT
    out: dict[str, list] = {"cv_dirs": [], "v1_share": [], "cv_rest": [], "overlap": [], "overlap_rand": [],
                            "cv_rand": [], "k": []}
    for a in range(W.shape[0] - 1):
        M = V[a] @ V[a + 1].mT  # (k, k): ⟨v_i, v'_j⟩
        c = torch.diagonal(M).abs()
        tot = float((c * c).sum())
        out["cv_dirs"].append([float(x) for x in c])
        out["v1_share"].append(float(c[0] ** 2) / tot if tot > 0 else float("nan"))
        out["cv_rest"].append(float(c[1:].mean()))
        out["overlap"].append(float((M * M).sum()) / k)
        out["overlap_rand"].append(k / d)
        out["cv_rand"].append(random_level_cos(d))
        out["k"].append(k)
    return out


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


# --- Sketched Gram alignment (large matrices) -------------------------------------------------------------------------

SKETCH_RANK = 16  # top singular pairs per layer that are treated exactly (the deflation basis)
SKETCH_PROBES = 32  # Gaussian probe vectors for the remainder (the same probes for every layer of a space)
SKETCH_ITERS = 6  # power steps of the randomised top-r singular subspace (block r + SKETCH_OVERSAMPLE)
SKETCH_OVERSAMPLE = 16
# Named tolerances of the sketch: |sketched − exact| Gram alignment and random level, with the defaults above.
# SKETCH_TOL: spaces of ≥ 1024 dimensions, where ``gram="auto"`` sketches — measured max 2.4e-3 over the seven roles
# of the generated 8B-shaped checkpoint (1024 to 14336 wide) and 2e-3 on planted 3584×1024 stacks.
# SKETCH_TOL_SMALL: spaces of a few hundred dimensions (forced ``gram="sketch"``): the probe estimate of the remainder
# has fewer directions to average over — measured max 8.6e-3 on the bundled MiniLM-L6 (d = 384) and 7.1e-3 on
# heavy-tailed 200–600-wide stacks. The error falls as r and p grow (tests/test_analysis.py).
SKETCH_TOL = 5e-3
SKETCH_TOL_SMALL = 1e-2


def _probes(d: int, p: int, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Deterministic standard-Gaussian (d, p) probes: equal for every matrix with the same d, p, seed."""
    g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + d)
    return torch.randn(d, p, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


def _gram_in(W: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """(WᵀW) X without forming WᵀW: two passes over W."""
    return W.mT @ (W @ X)


def _gram_out(W: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """(W Wᵀ) X without forming W Wᵀ."""
    return W @ (W.mT @ X)


@dataclass
class SketchLayer:
    """What the sketched Gram alignment keeps of one matrix W (m, n).

    Attributes:
        W: the matrix (its pair with the next layer applies it to that layer's bases).
        u, s, v: top-r singular triplets, u (m, r), s (r,), v (n, r) (signs per ``top_singular``: the largest-|entry|
            component of each v_i positive).
        gq_in, go_in: (WᵀW) v (n, r) and (WᵀW) Ω_n (n, p); gq_out, go_out: (W Wᵀ) u (m, r) and (W Wᵀ) Ω_m (m, p).
        tr: ‖W‖_F² = tr S (exact; the same in both spaces).
        probes, seed: p and the probe seed (a pair needs equal ones).
        prev_in, prev_out: (WᵀW) v_prev and (W Wᵀ) u_prev for the previous layer's bases when ``prev`` was given
            (computed in the same passes over W), else None.
    """

    W: torch.Tensor
    u: torch.Tensor
    s: torch.Tensor
    v: torch.Tensor
    gq_in: torch.Tensor
    go_in: torch.Tensor
    gq_out: torch.Tensor
    go_out: torch.Tensor
    tr: float
    probes: int
    seed: int
    prev_in: torch.Tensor | None = None
    prev_out: torch.Tensor | None = None


def _qr(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(x, mode="reduced").Q


def sketch_layer(W: torch.Tensor, rank: int = SKETCH_RANK, probes: int = SKETCH_PROBES, iters: int = SKETCH_ITERS,
                 method: str = "randomized", seed: int = 0, prev: SketchLayer | None = None) -> SketchLayer:
    """Per-layer part of :func:`gram_alignment_sketch` (computed once per matrix, used by both of its pairs).

    Every product with W is batched into as few passes over W as possible (a pass over a large matrix costs about the
    same for 16 or 100 columns on a CPU): 1 + 2·iters passes for the randomised top-r subspace, then 4 passes for the
    probes, the bases' Gram products and, with ``prev``, this layer's side of the pair with the previous layer.

    Args:
        W: (m, n) matrix, (out, in) layout; float64 stays float64, anything else is computed in float32.
        rank: top singular pairs r kept exactly (capped at min(m, n)).
        probes: Gaussian probes p for the remainder.
        iters: power steps of the randomised top-r subspace (block r + 16, Rayleigh–Ritz at the end).
        method: ``"randomized"`` (the above) or another :func:`weightgeom.linalg.top_singular` method for the top-r
            triplets (e.g. ``"svd"``, exact but O(m·n·min(m, n))).
        seed: seed of the probes and of the random start.
        prev: the previous layer's sketch (same shape), whose bases this layer's passes also apply its Gram to.

    Returns:
        :class:`SketchLayer`.
    """
    W = W.to(_dt(W))
    m, n = W.shape
    r = min(rank, m, n)
    dt, dev = W.dtype, W.device
    o_in, o_out = _probes(n, probes, seed, dt, dev), _probes(m, probes, seed, dt, dev)
    if method == "randomized":
        b = min(r + SKETCH_OVERSAMPLE, m, n)
        g = torch.Generator(device="cpu").manual_seed(seed)
        Y = _qr(W @ torch.randn(n, b, generator=g, dtype=torch.float64).to(device=dev, dtype=dt))
        for _ in range(iters):
            Y = _qr(W @ _qr(W.mT @ Y))
        P = W.mT @ torch.cat([Y, o_out], 1)  # one pass: Wᵀ Y (Rayleigh–Ritz) and Wᵀ Ω_m
        ub, s, vh = torch.linalg.svd(P[:, :b].mT, full_matrices=False)  # Yᵀ W = ub diag(s) vh
        u, v = fix_signs(Y @ ub[:, :r], vh[:r].mT)
        s = s[:r]
        wt_o = P[:, b:]
    else:
        u, s, v = top_singular(W, r, method=method, seed=seed)
        wt_o = W.mT @ o_out
    has_prev = prev is not None
    if has_prev and prev.W.shape != W.shape:
        raise ValueError(f"sketch_layer: previous layer has shape {tuple(prev.W.shape)}, this one {tuple(W.shape)}")
    cols = [v, o_in, wt_o] + ([prev.v] if has_prev else [])
    N = W @ torch.cat(cols, 1)  # W v, W Ω_n, W Wᵀ Ω_m, W v_prev
    go_out = N[:, r + probes:r + 2 * probes]
    right = [N[:, :r], N[:, r:r + probes], u] + ([N[:, r + 2 * probes:], prev.u] if has_prev else [])
    K = W.mT @ torch.cat(right, 1)  # WᵀW v, WᵀW Ω_n, Wᵀ u, WᵀW v_prev, Wᵀ u_prev
    gq_in, go_in = K[:, :r], K[:, r:r + probes]
    o = r + probes
    if has_prev:
        rp = prev.v.shape[1]
        prev_in = K[:, o + r:o + r + rp]
        D = W @ torch.cat([K[:, o:o + r], K[:, o + r + rp:]], 1)  # W Wᵀ u, W Wᵀ u_prev
        gq_out, prev_out = D[:, :r], D[:, r:]
    else:
        prev_in = prev_out = None
        gq_out = W @ K[:, o:o + r]
    return SketchLayer(W, u, s, v, gq_in, go_in, gq_out, go_out, float(torch.linalg.vector_norm(W)) ** 2, probes,
                       seed, prev_in, prev_out)


def _sketch_space(qa, qb, gaqa, gaqb, gbqa, gbqb, o, gao, gbo) -> tuple[float, float, float]:
    """(tr(S_a S_b), ‖S_a‖_F², ‖S_b‖_F²) estimated in one space.

    Exact on Q = orth([Q_a, Q_b]) (the two layers' top-r bases), Hutchinson with the shared probes Ω on the
    complement: tr(S_a S_b) = ⟨S_a Q, S_b Q⟩ + E⟨S_a P⊥ω, S_b P⊥ω⟩, P⊥ = I − QQᵀ (unbiased for Gaussian ω); the
    squared norms the same way with a = b, so the ratio's errors are correlated and largely cancel. When Q spans the
    whole space (2r ≥ d) the result is exact.
    """
    M = torch.cat([qa, qb], 1).double()
    _, sv, vh = torch.linalg.svd(M, full_matrices=False)
    keep = sv > sv[0] * 1e-6 if sv.numel() and sv[0] > 0 else sv > 0
    T = vh[keep].mT / sv[keep]  # Q = M T has orthonormal columns (rank-deficient M, e.g. equal layers, is fine)
    Q = M @ T
    gaq = torch.cat([gaqa, gaqb], 1).double() @ T
    gbq = torch.cat([gbqa, gbqb], 1).double() @ T
    o = o.double()
    C = Q.mT @ o
    ra = gao.double() - gaq @ C
    rb = gbo.double() - gbq @ C
    p = o.shape[1]
    num = float((gaq * gbq).sum() + (ra * rb).sum() / p)
    da = float((gaq * gaq).sum() + (ra * ra).sum() / p)
    db = float((gbq * gbq).sum() + (rb * rb).sum() / p)
    return num, da, db


def sketch_pair(a: SketchLayer, b: SketchLayer) -> dict[str, tuple[float, float]]:
    """Sketched Gram alignment of adjacent layers in both spaces.

    Args:
        a, b: :func:`sketch_layer` results of two matrices of one shape, made with the same probes and seed (``b``
            preferably with ``prev=a``, which saves four passes over W_b).

    Returns:
        ``{"input": (alignment, random level), "output": (...)}``; alignments clipped to [0, 1]; (0, 0) when either
        matrix is zero. The random level tr S_a tr S_b / (d ‖S_a‖_F ‖S_b‖_F) uses the same estimated norms.
    """
    if a.W.shape != b.W.shape or a.probes != b.probes or a.seed != b.seed:
        raise ValueError(f"sketch_pair: layers differ in shape {tuple(a.W.shape)} vs {tuple(b.W.shape)} or probes")
    m, n = a.W.shape
    rb = b.v.shape[1]
    # layer a's side: (W_aᵀW_a) v_b and (W_a W_aᵀ) u_b in three passes over W_a
    X = a.W @ b.v
    K = a.W.mT @ torch.cat([X, b.u], 1)
    ga_vb, ga_ub = K[:, :rb], a.W @ K[:, rb:]
    gb_va = b.prev_in if b.prev_in is not None else _gram_in(b.W, a.v)
    gb_ua = b.prev_out if b.prev_out is not None else _gram_out(b.W, a.u)
    est = {"input": _sketch_space(a.v, b.v, a.gq_in, ga_vb, gb_va, b.gq_in,
                                  _probes(n, a.probes, a.seed, a.W.dtype, a.W.device), a.go_in, b.go_in),
           "output": _sketch_space(a.u, b.u, a.gq_out, ga_ub, gb_ua, b.gq_out,
                                   _probes(m, a.probes, a.seed, a.W.dtype, a.W.device), a.go_out, b.go_out)}
    # ‖S‖_F² = Σσ⁴ is the same in both spaces: the random level uses the mean of its two independent estimates
    da2 = max(0.0, (est["input"][1] + est["output"][1]) / 2)
    db2 = max(0.0, (est["input"][2] + est["output"][2]) / 2)
    out = {}
    for space, d in (("input", n), ("output", m)):
        num, da, db = est[space]
        den = math.sqrt(max(da, 0.0) * max(db, 0.0))
        if den <= 0 or da2 * db2 <= 0 or a.tr <= 0 or b.tr <= 0:
            out[space] = (0.0, 0.0)
        else:
            out[space] = (min(1.0, max(0.0, num / den)), a.tr * b.tr / (d * math.sqrt(da2 * db2)))
    return out


def gram_alignment_sketch(Wa: torch.Tensor, Wb: torch.Tensor, space: str = "input", rank: int = SKETCH_RANK,
                          probes: int = SKETCH_PROBES, iters: int = SKETCH_ITERS, seed: int = 0) -> float:
    """:func:`gram_alignment` estimated without forming any Gram or cross product (for large matrices).

    Exact on the span of both matrices' top-``rank`` singular vectors, a Gaussian-probe estimate (``probes`` vectors)
    of the remainder. Within :data:`SKETCH_TOL` of the exact value with the defaults (measured); exact when
    2·rank ≥ the space's dimension. Deterministic for a given ``seed``.

    Args:
        Wa, Wb: (m, n) matrices of one shape, (out, in) layout.
        space: ``"input"`` (S = WᵀW) or ``"output"`` (S = W Wᵀ).
        rank, probes, iters, seed: see :func:`sketch_layer`.

    Returns:
        Alignment in [0, 1].
    """
    if space not in SPACES:
        raise ValueError(f"unknown space {space!r}; expected 'input' or 'output'")
    if Wa.shape != Wb.shape:
        raise ValueError(f"gram_alignment_sketch: shapes differ {tuple(Wa.shape)} vs {tuple(Wb.shape)}")
    a = sketch_layer(Wa, rank, probes, iters, seed=seed)
    return sketch_pair(a, sketch_layer(Wb, rank, probes, iters, seed=seed, prev=a))[space][0]
