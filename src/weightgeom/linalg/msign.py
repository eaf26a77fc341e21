"""msign(G) ≈ U Vᵀ for G = U S Vᵀ: odd-polynomial (Newton–Schulz style) iterations and an exact SVD reference.

Each step is X ← a·X + b·(XXᵀ)X + c·(XXᵀ)²X on the wide orientation (rows ≤ cols), after pre-scaling by the
Frobenius norm (which bounds the spectral norm, so every singular value starts in (0, 1]). Derivation and the
error curves of the presets are in ``docs/msign.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from weightgeom import kernels
from weightgeom.linalg import graphs
from weightgeom.linalg.norms import plain

__all__ = ["NSPreset", "MSIGN_PRESETS", "msign", "msign_reference", "default_dtype"]


@dataclass(frozen=True)
class NSPreset:
    """A named polynomial iteration.

    Attributes:
        coeffs: per-step (a, b, c) triples; steps past the end repeat the last triple.
        steps: default number of steps.
        safety: the input is divided by ‖X‖_F·safety; all triples but the last are rescaled as
            (a/s, b/s³, c/s⁵) so that singular values slightly above 1 (rounding) are still mapped into range.
        source: where the coefficients come from.
        published: run the iteration with the manifold-assignment paper's published arithmetic instead of ours:
            the input cast to ``dtype`` (bfloat16 unless given) first and turned wide, divided by ‖X‖_F·safety
            computed in that dtype (no ε: a zero matrix gives NaN, which ``nan_to_num`` turns back into 0), each step
            evaluated as X ← (a·I + (b·I + c·S)·S)·X with S = XXᵀ — three products, the identity terms added to the
            diagonals —, ``nan_to_num`` on the result. Ours normalises in float32 and evaluates
            X ← a·X + (b·S + c·S²)·X as two fused matrix multiply-adds per step (docs/msign.md compares the orders'
            bf16 accuracy).
    """

    coeffs: tuple[tuple[float, float, float], ...]
    steps: int
    safety: float = 1.0
    source: str = ""
    published: bool = False

    def triples(self, steps: int) -> list[tuple[float, float, float]]:
        """The (a, b, c) used at each of ``steps`` steps, safety scaling applied."""
        s = self.safety
        out = []
        last = len(self.coeffs) - 1
        for k in range(steps):
            a, b, c = self.coeffs[min(k, last)]
            if k < last and s != 1.0:
                a, b, c = a / s, b / s**3, c / s**5
            out.append((a, b, c))
        return out


MSIGN_PRESETS: dict[str, NSPreset] = {
    # Keller Jordan's Muon quintic (github.com/KellerJordan/Muon); also torch.optim.Muon's default ns_coefficients.
    # Converges to singular values in roughly [0.7, 1.2], not to 1: fast, loose.
    "muon": NSPreset(coeffs=((3.4445, -4.7750, 2.0315),), steps=5, safety=1.0,
                     source="Keller Jordan, Muon (2024); torch.optim.Muon defaults"),
    # Polar Express, Amsel, Persson, Musco & Gower 2025 (arXiv:2505.16932), minimax-optimal per-step quintics,
    # safety factor 1.01; converges to 1 (accurate enough for retractions and dual ascent).
    "polar_express": NSPreset(
        coeffs=(
            (8.28721201814563, -23.595886519098837, 17.300387312530933),
            (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
            (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
            (3.3184196573706015, -2.488488024314874, 0.51004894012372),
            (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
            (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
            (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
            (1.875, -1.25, 0.375),
        ),
        steps=10,
        safety=1.01,
        source="Amsel et al. 2025, The Polar Express, arXiv:2505.16932",
    ),
}
"""Newton–Schulz presets of :func:`msign` by ``method`` name (``muon``, ``polar_express``, ``polar_express_paper``, …):
coefficients, steps and safety factor of each."""
# The same coefficients with the published arithmetic in bfloat16 (``NSPreset.published``): the msign of the
# manifold-assignment paper's code (Polar Express, 10 steps, bf16 after dividing by ‖X‖_F·1.01, each step as
# (a·I + (b·I + c·S)·S)·X, nan_to_num, returned as float32). Selected by ``msign_method="polar_express_paper"``; held
# to golden outputs of that code in tests/golden/published (bit for bit on the CPU).
MSIGN_PRESETS["polar_express_paper"] = NSPreset(
    coeffs=MSIGN_PRESETS["polar_express"].coeffs, steps=10, safety=1.01, published=True,
    source="the manifold-assignment paper's published msign (Polar Express coefficients, its own evaluation order)")

# Added to the Frobenius norm before dividing: keeps a zero input at exactly zero output (never 0/0 = NaN).
_NORM_EPS = 1e-30
# Matrices of at least this many entries are normalised by the C kernel on the CPU (``_normalise``); smaller ones keep
# torch's passes (the call's overhead would dominate).
NORMALISE_KERNEL_MIN = 1 << 16


def default_dtype(device: torch.device | str) -> torch.dtype:
    """Compute dtype msign uses when none is given: bfloat16 on CUDA, float32 elsewhere.

    On a CPU without bf16 units a bf16 matmul is several times slower than fp32, so fp32 is the
    CPU default; float64 inputs are also computed in float64 on the CPU.
    """
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def msign_reference(G: torch.Tensor) -> torch.Tensor:
    """Exact polar factor U Vᵀ by SVD in float64 (batched). Zero singular directions map to zero.

    Slow reference for tests and for the ``svd`` method. Returns float64.
    """
    X = G.to(torch.float64)
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    # Singular values at rounding level of the largest are treated as zero (rank-deficient inputs → partial isometry).
    tol = S.amax(dim=-1, keepdim=True) * max(X.shape[-2:]) * torch.finfo(torch.float64).eps
    keep = (S > tol).to(X.dtype)
    return (U * keep.unsqueeze(-2)) @ Vh


def msign(
    G: torch.Tensor,
    method: str = "polar_express",
    steps: int | None = None,
    dtype: torch.dtype | None = None,
    start_step: int = 0,
    cuda_graphs_max_mb: float | None = None,
) -> torch.Tensor:
    """Orthogonalise ``G``: return ≈ U Vᵀ where G = U S Vᵀ (the matrix sign / polar factor).

    Args:
        G: tensor of shape (..., m, n), m and n ≥ 1; leading dims are batched.
        method: ``"polar_express"`` (default, accurate), ``"muon"`` (Keller Jordan's 5-step quintic, loose),
            ``"polar_express_paper"`` (Polar Express in the manifold-assignment paper's published bf16 arithmetic
            and evaluation order; see ``NSPreset.published``) or ``"svd"`` (exact, float64 SVD;
            the slow reference).
        steps: number of polynomial steps; the preset's default when None.
        dtype: compute dtype; default bfloat16 on CUDA, float32 on CPU (float64 input stays float64);
            ``"polar_express_paper"``: bfloat16 everywhere unless given.
        start_step: continue an iteration: G is the output of ``msign(G0, method, steps=start_step, dtype)`` and
            only steps ``start_step … steps − 1`` are applied (no new normalisation), so
            ``msign(msign(G0, steps=k), steps=n, start_step=k)`` equals ``msign(G0, steps=n)`` — bitwise when G0's
            dtype holds the compute dtype's values exactly (at least as wide: float32 G0 with a bf16 or float32
            compute), else up to the rounding of the returned iterate to G0's dtype (bf16 G0 with a float32 compute,
            float32 G0 with a float64 one). Used to refine a cheap inner iterate into the accurate one without
            starting over.
        cuda_graphs_max_mb: on CUDA, replay the call as a CUDA graph when its input holds at most this many MiB
            (``Numerics``: 0 when CUDA graphs are off, ``inf`` for no cap); None: the environment's setting
            (``weightgeom.linalg.graphs``). Results are the same either way.

    Returns:
        Tensor of G's shape and dtype. A zero matrix maps to zero (never NaN).

    Raises:
        ValueError: unknown method, fewer than 2 dims, empty matrix, or steps < 1.
    """
    if G.ndim < 2:
        raise ValueError(f"msign: input must have at least 2 dims (..., m, n), got shape {tuple(G.shape)}")
    if G.shape[-1] == 0 or G.shape[-2] == 0:
        raise ValueError(f"msign: empty matrix of shape {tuple(G.shape)}")
    if method == "svd":
        return msign_reference(G).to(G.dtype)
    if method not in MSIGN_PRESETS:
        raise ValueError(f"msign: unknown method {method!r}; choose one of {sorted([*MSIGN_PRESETS, 'svd'])}")
    preset = MSIGN_PRESETS[method]
    steps = preset.steps if steps is None else int(steps)
    if steps < 1:
        raise ValueError(f"msign: steps must be ≥ 1, got {steps}")
    if not 0 <= int(start_step) <= steps:
        raise ValueError(f"msign: start_step must be in [0, steps={steps}], got {start_step}")
    start_step = int(start_step)
    if preset.published:
        return _msign_published(G, preset, steps, torch.bfloat16 if dtype is None else dtype, start_step)
    if dtype is None:
        dtype = torch.float64 if (G.dtype == torch.float64 and G.device.type != "cuda") else default_dtype(G.device)

    # Iterate in G's own orientation (no transposing copy in or out for a row-major G): the Gram matrix is min(m, n)²
    # either way, XXᵀ for a wide (or square) G, XᵀX for a tall one (the same polynomial with the transposed products).
    # The buffer is a fresh row-major copy of G's values whatever G's memory layout, and the norm is summed over that
    # buffer, so the result does not depend on the layout (an iteration that followed the layout changed results by
    # rounding, which msign amplifies ~1e4× in its small singular directions: DDP and single-process runs then
    # differed by 1e-3 after 5 steps).
    if G.requires_grad and torch.is_grad_enabled():
        X, tall, triples = _iteration_input(G, preset, steps, start_step)
        X0 = _normalise(X, preset.safety, dtype) if start_step == 0 else X.to(dtype).contiguous()
        return _iterate_autograd(X0, triples, tall).reshape(G.shape).to(G.dtype)
    # on a GPU the ~45 small kernels of a call are launch-bound for GPT-sized matrices: replayed as one CUDA graph
    out = graphs.replay("msign", _msign_inplace, G, max_mb=cuda_graphs_max_mb, method=method, steps=steps, dtype=dtype,
                        start_step=start_step)
    return out[0] if out is not None else _msign_inplace(G, method, steps, dtype, start_step)


def _msign_inplace(G: torch.Tensor, method: str, steps: int, dtype: torch.dtype, start_step: int) -> torch.Tensor:
    """``msign``'s no-grad path (validated arguments): preallocated buffers, nothing read on the host (capturable)."""
    preset = MSIGN_PRESETS[method]
    X, tall, triples = _iteration_input(G, preset, steps, start_step)
    if start_step == 0:
        X0 = _normalise(X, preset.safety, dtype, inplace=True)
    else:  # a fresh contiguous buffer: the in-place iteration must not write into the caller's tensor
        X0 = torch.empty(X.shape, dtype=dtype, device=X.device).copy_(X)
    return _iterate_inplace(X0, triples, tall).reshape(G.shape).to(G.dtype)


def _iteration_input(G: torch.Tensor, preset: NSPreset, steps: int, start_step: int
                     ) -> tuple[torch.Tensor, bool, list[tuple[float, float, float]]]:
    """(G as a 2-D or 3-D batch — one batched path for any number of lead dims —, whether it is tall, the
    polynomial steps still to apply)."""
    X = G.reshape(-1, *G.shape[-2:]) if G.ndim > 3 else G
    return X, G.shape[-2] > G.shape[-1], preset.triples(steps)[start_step:]


def _msign_published(G: torch.Tensor, preset: NSPreset, steps: int, dtype: torch.dtype,
                     start_step: int) -> torch.Tensor:
    """The published arithmetic (see ``NSPreset.published``), op for op, differentiable, G's dtype out.

    The published code divides its bf16 copy in place, which writes into a bf16 caller's tensor; here the quotient
    is a new tensor (the same values)."""
    X = G.to(dtype)
    tall = G.shape[-2] > G.shape[-1]
    if tall:
        X = X.mT
    if start_step == 0:
        X = X / (X.norm(dim=(-2, -1), keepdim=True) * preset.safety)
    for a, b, c in preset.triples(steps)[start_step:]:
        S = X @ X.mT
        Y = c * S
        Y.diagonal(dim1=-2, dim2=-1).add_(b)
        Y = Y @ S
        Y.diagonal(dim1=-2, dim2=-1).add_(a)
        X = Y @ X
    if tall:
        X = X.mT
    return torch.nan_to_num(X).to(G.dtype)


_WIDE_RANGE = (torch.bfloat16, torch.float32, torch.float64)  # dtypes with at least float32's exponent range


def _normalise(X: torch.Tensor, safety: float, dtype: torch.dtype, inplace: bool = False) -> torch.Tensor:
    """Contiguous copy of X in ``dtype`` divided by ‖X‖_F·safety per matrix; a zero matrix stays exactly zero.

    The norm is taken after an exact power-of-two prescale that brings each matrix's largest |entry| into [1, 2):
    a float32 sum of squares of tiny entries underflows (‖X‖_F ≈ 1e-21 came out 3× too small, leaving singular
    values near 3 and the iteration diverging to NaN — e.g. a momentum that decayed for ~1000 steps of zero
    gradient) and one of huge entries overflows. ``inplace=True`` writes into a fresh buffer with ``out=`` (not
    differentiable).
    """
    if inplace and dtype == torch.bfloat16 and X.device.type == "cpu" and X.dtype in (torch.float32, torch.bfloat16) \
            and X.shape[-2] * X.shape[-1] >= NORMALISE_KERNEL_MIN and plain(X):  # no forward-AD tangent, no vmap
        # one read pass for the norm (summed in double: no prescale) and one for the quotient, in C (kernels/linalg.c):
        # torch's five passes (max, prescale, norm, scale) and its mixed-dtype multiply took ~4× as long; a row-major
        # copy first for any other layout, so the sum's order, and the result, do not depend on it
        out = kernels.normalise_bf16(X.contiguous(), safety, _NORM_EPS)
        if out is not None:
            return out
    # Accumulate the norm in at least float32 (a bf16 sum of squares loses digits); never narrow float64.
    norm_dtype = torch.float64 if X.dtype == torch.float64 or dtype == torch.float64 else torch.float32
    # max |x|, exact in any dtype: ~6× faster on the CPU than vector_norm(ord=inf) (0.55 vs 3.7 ms, 3072×768); in
    # float32/64 as max(amax, −amin), which allocates no |X| temporary (0.35 ms); NaN propagates either way
    dims = (-2, -1)
    if X.dtype in (torch.float32, torch.float64):
        amax = torch.maximum(X.amax(dim=dims, keepdim=True), X.amin(dim=dims, keepdim=True).neg()).to(norm_dtype)
    else:
        amax = X.abs().amax(dim=dims, keepdim=True).to(norm_dtype)
    usable = (amax > 0) & torch.isfinite(amax)
    e_min = math.log2(torch.finfo(norm_dtype).tiny)  # -126 (float32), -1022 (float64): 2^-e stays finite
    e = torch.floor(torch.log2(torch.where(usable, amax, 1.0))).clamp(e_min, -e_min)
    pre = torch.where(usable, torch.exp2(-e), 1.0)
    # X·pre is computed before narrowing to ``dtype`` (whose range may not hold pre: float16 overflowed at 2^16) and in
    # X's own dtype where a power of two is exact there — float32's exponent range, not float16 — which avoids
    # promoting a bf16 X to float32 on the way (0.48 vs 1.07 ms, 3072×768)
    p = pre.to(X.dtype) if X.dtype in _WIDE_RANGE else pre
    if not inplace:
        Xp = (X * p).to(dtype).contiguous()
    else:
        Xp = torch.empty(X.shape, dtype=dtype, device=X.device)  # contiguous, even for a transposed view
        torch.mul(X, p, out=Xp)
    norm = torch.linalg.vector_norm(Xp, dim=(-2, -1), keepdim=True, dtype=norm_dtype)
    nonzero = norm > 0  # 1/norm only where it is finite, so a zero matrix's gradient is 0, not NaN (0·inf)
    scale = torch.where(nonzero, 1.0 / (torch.where(nonzero, norm, 1.0) * safety + _NORM_EPS), 0.0).to(dtype)
    if not inplace:
        return Xp * scale
    return Xp.mul_(scale)


def _iterate_inplace(X: torch.Tensor, triples: list[tuple[float, float, float]], tall: bool = False) -> torch.Tensor:
    """The polynomial steps with preallocated buffers (no allocation per step); X (2-D or 3-D) is overwritten.

    Per step on wide X (m ≤ n): A = XXᵀ (2m²n flops), B = bA + cA² (2m³), X ← aX + BX (2m²n). ``tall``: the same
    step on a tall X (m > n) written with its transposed products, A = XᵀX, X ← aX + XB (B is symmetric).
    """
    mm, addmm = (torch.mm, torch.addmm) if X.ndim == 2 else (torch.bmm, torch.baddbmm)
    k = X.shape[-1] if tall else X.shape[-2]
    A = X.new_empty(*X.shape[:-2], k, k)
    B = torch.empty_like(A)
    Y = torch.empty_like(X)
    for a, b, c in triples:
        if tall:
            mm(X.mT, X, out=A)
        else:
            mm(X, X.mT, out=A)
        addmm(A, A, A, beta=b, alpha=c, out=B)
        if tall:
            addmm(X, X, B, beta=a, out=Y)
        else:
            addmm(X, B, X, beta=a, out=Y)
        X, Y = Y, X
    return X


def _iterate_autograd(X: torch.Tensor, triples: list[tuple[float, float, float]], tall: bool = False) -> torch.Tensor:
    """The same steps without ``out=`` buffers, so that autograd can differentiate through them."""
    addmm = torch.addmm if X.ndim == 2 else torch.baddbmm
    for a, b, c in triples:
        A = X.mT @ X if tall else X @ X.mT
        B = addmm(A, A, A, beta=b, alpha=c)
        X = addmm(X, X, B, beta=a) if tall else addmm(X, B, X, beta=a)
    return X
