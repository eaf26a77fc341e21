"""IEEE float32 products through oneDNN ("ieee_onednn"): the same arithmetic as ``torch.matmul``, another library.

Why: torch's CPU float32 matmul calls MKL, which on AMD CPUs runs its AVX2 code even where the CPU has AVX-512, while
oneDNN (also inside torch's CPU library, behind ``torch.ops.mkldnn._linear_pointwise``, the op torch's own compiler
emits for CPU linear layers) uses the full vector width there. Measured on a 2-core AMD EPYC with AVX512-BF16 (no
AMX), torch 2.13: 3072×768 @ 768×768 17–24 ms through MKL against 7.7–8.0 ms through oneDNN; XᵀA of two 3072×768
matrices 20 vs 11.7 ms; 768³ 4.6 vs 2.0 ms; 32×3072 @ 3072×768 0.98 vs 0.46 ms. Both are IEEE float32 products
(float32 inputs, float32 accumulation; results differ only in summation order: max |C − AB| 1.2e-4 for both against
float64 on 3072×768×768 Gaussian factors). Neither library rounds the inputs inside ``full_precision()``, which every
caller here runs in (oneDNN honours ``torch.backends.mkldnn.matmul.fp32_precision``, which it sets to IEEE).

Which library a device's manifold Muon uses for its constraint products is measured at first use with the msign
choice (``weightgeom.linalg.autotune``, ``MsignChoice.products == "ieee_onednn"``); the optimizer passes
``onednn=True`` only where oneDNN won. With it, ``ieee_mm`` and ``ieee_addmm`` send CPU float32 products of at least
``ONEDNN_MIN_DIM`` in every dimension that autograd does not track to oneDNN, one matrix at a time (a matrix of a batch
gets the bits it gets alone); everything else, and everything without it, is ``torch.matmul`` / ``addmm`` as before.
"""

from __future__ import annotations

import threading

import torch

from weightgeom.linalg.layout import matrix_layout
from weightgeom.linalg.norms import plain
from weightgeom.linalg.precision import full_precision

__all__ = ["onednn_available", "ieee_mm", "ieee_addmm", "addmm_batched",
           "unavailable_reason", "ONEDNN_MIN_DIM"]

# Products with a dimension below this stay with torch: a matrix-vector product gains nothing (768×768 @ 768×1: 0.033
# vs 0.034 ms), while from 32 up oneDNN was faster at every shape measured (32×3072 @ 3072×768 0.46 vs 0.98 ms,
# 768×768 @ 768×32 0.096 vs 0.195 ms, 128³ 0.022 vs 0.023 ms; AMD EPYC above).
ONEDNN_MIN_DIM = 32

_lock = threading.Lock()
_op: object | None = None  # torch.ops.mkldnn._linear_pointwise, False when unavailable, None before the first look
_reason = ""


def _load() -> object | None:
    """The oneDNN linear op, checked once on small products against float64 (a transposed input, a weight view);
    None (with a reason) where it is missing or wrong."""
    global _op, _reason
    with _lock:
        if _op is not None:
            return _op or None
        _op = False
        try:
            if not torch.backends.mkldnn.is_available():
                _reason = "torch was built without oneDNN (mkldnn)"
                return None
            op = torch.ops.mkldnn._linear_pointwise
            g = torch.Generator().manual_seed(0)
            A = torch.randn(48, 40, generator=g, device="cpu")  # whatever torch's default device
            B = torch.randn(40, 36, generator=g, device="cpu")
            with full_precision(), torch.no_grad():
                got = [op(A, B.mT, None, "none", [], ""), op(A.mT.contiguous().mT, B.mT, None, "none", [], "")]
            want = A.double() @ B.double()
            scale = float((A.double().abs() @ B.double().abs()).max())
            for C in got:
                if C.shape != want.shape or C.dtype != torch.float32 or \
                        float((C.double() - want).abs().max()) > 1e-5 * scale:
                    _reason = "oneDNN's float32 linear failed its self-test"
                    return None
        except (AttributeError, RuntimeError, TypeError, NotImplementedError) as e:
            _reason = f"no oneDNN float32 linear in this torch ({str(e).splitlines()[0][:80] if str(e) else e!r})"
            return None
        _op = op
        return op


def unavailable_reason() -> str:
    """Why oneDNN products are unavailable in this process ("" when they are, or before the first look)."""
    _load()
    return _reason


def onednn_available(device: torch.device | str = "cpu") -> bool:
    """Whether IEEE float32 products can run through oneDNN on ``device`` (a CPU, with torch built with oneDNN)."""
    return torch.device(device).type == "cpu" and _load() is not None


def addmm_batched(C: torch.Tensor, A: torch.Tensor, B: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """C + α·A@B as one fused multiply-add (``addmm``, or ``baddbmm`` over any number of leading dims), so a matrix
    gets bitwise the same result alone as inside a batch (an unfused C + α·(A@B) rounds the product first: in bf16
    that differs by ~1e-2, which the msign that follows would carry into the step)."""
    if C.ndim == 2 and A.ndim == 2 and B.ndim == 2:
        return torch.addmm(C, A, B, alpha=alpha)
    lead = torch.broadcast_shapes(C.shape[:-2], A.shape[:-2], B.shape[:-2])
    m, n, k = A.shape[-2], B.shape[-1], A.shape[-1]

    def flat(T: torch.Tensor, r: int, c: int) -> torch.Tensor:
        return T.expand(*lead, r, c).reshape(-1, r, c)

    out = torch.baddbmm(flat(C, m, n), flat(A, m, k), flat(B, k, n), alpha=alpha)
    return out.reshape(*lead, m, n)


def _eligible(A: torch.Tensor, B: torch.Tensor, onednn: bool) -> bool:
    """Whether A @ B goes to oneDNN: ``onednn`` asked, oneDNN available and enabled (``torch.backends.mkldnn.flags``),
    outside a ``torch.compile`` trace,
    CPU float32 factors of at least ``ONEDNN_MIN_DIM`` in every dimension, plain tensors no autograd mode tracks
    (``norms.plain``: the op has no derivative, backward or forward), row- or column-major matrices
    (``layout.matrix_layout``: oneDNN refuses a sliding-window or interleaved view — "could not construct a memory
    descriptor")."""
    if not onednn or torch.compiler.is_compiling() or not torch.backends.mkldnn.enabled or _load() is None:
        return False
    for T in (A, B):
        if T.device.type != "cpu" or T.dtype != torch.float32 or T.ndim < 2 or not plain(T) \
                or matrix_layout(T) is None:
            return False
    if A.shape[-1] != B.shape[-2]:
        return False  # torch's error message
    return min(A.shape[-2], A.shape[-1], B.shape[-1]) >= ONEDNN_MIN_DIM


def _mm2(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """A @ B of two 2-D eligible factors: oneDNN's linear of A with the weight Bᵀ, at IEEE precision."""
    with full_precision():
        return _op(A, B.mT, None, "none", [], "")  # type: ignore[operator]  # A @ (Bᵀ)ᵀ, row-major float32


def ieee_mm(A: torch.Tensor, B: torch.Tensor, onednn: bool = False) -> torch.Tensor:
    """A @ B (``torch.matmul``'s batch broadcasting): with ``onednn`` through oneDNN for CPU float32
    factors of at least ``ONEDNN_MIN_DIM`` in every dimension that autograd does not track (each matrix of a batch
    alone), else ``A @ B``. Returns a new row-major tensor."""
    if not _eligible(A, B, onednn):
        return A @ B
    if A.ndim == 2 and B.ndim == 2:
        return _mm2(A, B)
    lead = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    m, k, n = A.shape[-2], A.shape[-1], B.shape[-1]
    a = A.expand(*lead, m, k).reshape(-1, m, k)
    b = B.expand(*lead, k, n).reshape(-1, k, n)
    out = torch.empty(a.shape[0], m, n, dtype=torch.float32, device=A.device)
    for i in range(a.shape[0]):
        out[i] = _mm2(a[i], b[i])
    return out.reshape(*lead, m, n)


def ieee_addmm(C: torch.Tensor, A: torch.Tensor, B: torch.Tensor, alpha: float = 1.0,
               inplace: bool = False, onednn: bool = False) -> torch.Tensor:
    """C + α·A@B: with ``onednn``, for factors ``ieee_mm`` sends to oneDNN, a nonzero α and a plain float32
    C of the result's shape, the product through oneDNN then one add (C + α·P, computed into P's memory, or into C's
    when ``inplace``); else ``addmm`` (``baddbmm`` for batches). ``inplace``: the result is written into C (returned)
    either way; it requires C writable and sharing no memory with A or B (the caller's check)."""
    fits = alpha != 0 and _eligible(A, B, onednn) and C.dtype == torch.float32 and C.device.type == "cpu" \
        and plain(C) and C.shape == torch.broadcast_shapes(A.shape[:-2], B.shape[:-2]) + (A.shape[-2], B.shape[-1])
    if not fits:  # torch's fused multiply-add (α = 0 leaves C as it is, NaN in A·B or not)
        if not inplace:
            return addmm_batched(C, A, B, alpha=alpha)
        if C.ndim == 2 and A.ndim == 2 and B.ndim == 2:
            return C.addmm_(A, B, alpha=alpha)
        return C.copy_(addmm_batched(C, A, B, alpha=alpha))
    P = ieee_mm(A, B, onednn=True)
    if inplace:
        return C.add_(P, alpha=alpha)
    return torch.add(C, P, alpha=alpha, out=P)
