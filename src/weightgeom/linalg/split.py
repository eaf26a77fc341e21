"""Float32 products from bf16 pieces ("split-bf16"): near-float32 accuracy at bf16 matmul speed on CPUs with AMX.

Why: manifold Muon's constraint arithmetic (XᵀA, the tangent projection A − X·L, the retraction's Gram XᵀX and
X + X·F) must be accurate far below bf16's 2⁻⁹, so it ran as IEEE float32 products — on a CPU with AMX about 5× slower
per flop than bf16 ones, and ~40 % of a manifold step. Here a float32 matrix is split into two bf16 pieces,
X = X_hi + X_lo + r with X_hi = bf16(X), X_lo = bf16(X − X_hi) and |r| ≤ 2⁻¹⁷|X| entrywise, and a product is the sum
of the pieces' products (hi·hi + hi·lo + lo·hi; lo·lo is 2⁻¹⁸ of it and dropped), each a bf16 matmul that
accumulates and returns float32 (MKL's ``cblas_gemm_bf16bf16f32``, which ships inside torch's CPU library on x86).
A piece that is zero (a factor that is already bf16, like the output of a bf16 msign) is skipped.

Accuracy (``SPLIT_REL_ERROR``: < 2⁻¹⁵ of (|A|·|B|)_ij per entry in the worst case, tested against float64): measured,
the largest entry error relative to the largest entry of |A|·|B| is ~1e-6 on GPT-2-sized Gaussian factors (IEEE
float32: ~1.5e-7; one bf16 product: ~8e-4); with an exactly-bf16 factor (two products) ~6e-7.

Speed (2-core Xeon with AMX, 3072×768 @ 768×768): IEEE float32 10.3–12.3 ms, one bf16→float32 product 2.1 ms, so
three products 6.5 ms and two 4.3 ms. On a CPU without AMX a bf16 product is not 3× faster than float32 and the split
loses: ``weightgeom.linalg.autotune`` times both at first use and records which one the device uses
(``MsignChoice.products``); the optimizer asks for ``"split_bf16"`` products only where the split won.

Everything here is CPU-only and float32-only; ``split_matmul`` falls back to the IEEE product (``torch.matmul`` inside
``full_precision``) where the MKL routine is missing, for other devices or dtypes and for inputs autograd tracks; the
``constraint_*`` helpers of ``weightgeom.manifolds.base`` take the split only when passed ``products="split_bf16"``.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import torch

from weightgeom import kernels
from weightgeom.linalg.layout import matrix_layout
from weightgeom.linalg.norms import COLUMN_KERNEL_MIN, column_norms, plain
from weightgeom.linalg.precision import full_precision

__all__ = ["split_available", "split_bf16", "split_matmul", "bf16_gemm_",
           "split_column_sumsq",
           "SPLIT_REL_ERROR", "BF16_MAX", "unavailable_reason"]

# Worst-case error of one entry of a split product relative to (|A|·|B|)_ij, apart from float32 accumulation (≤ k·2⁻²⁴
# for an inner dimension k, as in any float32 product): each factor's pieces miss ≤ 2⁻¹⁷ of it and the dropped lo·lo
# term is ≤ 2⁻¹⁸, so < 2⁻¹⁵. Measured, as max|C − AB| / max(|A|·|B|) on float32 Gaussian factors of GPT-2-small
# shapes: 0.55–1.07e-6 (IEEE float32 0.6–1.6e-7, one bf16 product 4.8–8.7e-4; an exactly-bf16 factor 3.0–6.4e-7).
SPLIT_REL_ERROR = 2.0**-15

_RowMajor, _NoTrans, _Trans = 101, 111, 112
_L, _P, _F = ctypes.c_longlong, ctypes.c_void_p, ctypes.c_float
_lock = threading.Lock()
_gemm: object | None = None  # the ctypes function, False when unavailable, None before the first look
_reason = ""

SplitMemo = dict
"""The pieces of the tensors split during one call (``split_bf16``'s ``memo``): keyed by storage, view and in-place
version; a new empty dict per call that owns it (a manifold method, the dual ascent)."""


def _load() -> object | None:
    """MKL's cblas_gemm_bf16bf16f32 from torch's CPU library, checked on a small product; None (with a reason)
    where it is missing or wrong. Integer arguments are passed as 64-bit values: on x86-64 that reads correctly for
    both MKL's 32-bit (LP64) and 64-bit (ILP64) interfaces."""
    global _gemm, _reason
    with _lock:
        if _gemm is not None:
            return _gemm or None
        _gemm = False
        try:
            lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", _libname()))
            fn = lib.cblas_gemm_bf16bf16f32
        except (OSError, AttributeError) as e:
            _reason = f"no MKL bf16 gemm in torch's CPU library ({str(e).splitlines()[0][:80]})"
            return None
        fn.argtypes = [_L, _L, _L, _L, _L, _L, _F, _P, _L, _P, _L, _F, _P, _L]
        fn.restype = None
        g = torch.Generator().manual_seed(0)
        a = torch.randn(5, 7, generator=g).bfloat16()
        b = torch.randn(7, 3, generator=g).bfloat16()
        c = torch.full((5, 3), 1.0)
        fn(_RowMajor, _NoTrans, _NoTrans, 5, 3, 7, 2.0, a.data_ptr(), 7, b.data_ptr(), 3, 0.5, c.data_ptr(), 3)
        ref = 2.0 * (a.double() @ b.double()) + 0.5
        if not torch.allclose(c.double(), ref, rtol=1e-5, atol=1e-5):
            _reason = "MKL bf16 gemm failed its self-test"
            return None
        _gemm = fn
        return fn


def _libname() -> str:
    return {"win32": "torch_cpu.dll", "darwin": "libtorch_cpu.dylib"}.get(sys.platform, "libtorch_cpu.so")


def unavailable_reason() -> str:
    """Why ``split_available`` is False on a CPU ("" when it is True or not yet looked up)."""
    _load()
    return _reason


def split_available(device: torch.device | str = "cpu") -> bool:
    """Whether bf16→float32 products can run on ``device`` (a CPU whose torch carries MKL's bf16 gemm)."""
    return torch.device(device).type == "cpu" and _load() is not None


# bf16's largest finite value: hi pieces are clamped to it, so a float32 above it (which would round to inf) keeps a
# finite hi and the rest in lo, and ±inf becomes ±this + ±inf (the sum stays ±inf).
BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def _memo_key(X: torch.Tensor) -> tuple[tuple, object] | None:
    """(key, the storage to keep alive) of X's pieces in the memo: the storage object itself (a tensor re-pointed
    with ``set_`` or ``.data =`` gets another), its data address, the view and the in-place version."""
    try:
        version = X._version
    except RuntimeError:  # an inference tensor has no version counter: not remembered
        return None
    st = X.untyped_storage()
    return (st._cdata, st.data_ptr(), X.storage_offset(), tuple(X.shape), X.stride(), version, X.dtype), st


def split_bf16(X: torch.Tensor, lo: bool = True,
               memo: SplitMemo | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(X_hi, X_lo) in bf16 with X ≈ X_hi + X_lo to 2⁻¹⁷ relative per entry (float32 X; hi = bf16(X) clamped to
    ±``BF16_MAX``, lo = bf16(X − hi)); ``lo=False``: (X_hi, None). With a ``memo`` the pieces of a tensor split before
    with it (same storage, view and in-place version) are returned again instead of recomputed — writes that bypass
    the version counter (through ``.data`` or a NumPy view) are not seen, so do not make them to a tensor while its
    memo is in use."""
    if X.ndim >= 2 and not X.is_contiguous() and X.mT.is_contiguous():  # a transposed view: split the row-major
        hi, low = split_bf16(X.mT, lo, memo)  # matrix (elementwise passes over a transposed view are ~4× slower)
        return hi.mT, (low.mT if low is not None else None)
    found = _memo_key(X) if memo is not None else None
    key = found[0] if found is not None else None
    hi = low = None
    sums = None
    if key is not None and key in memo:
        _, hi, low, sums = memo[key]
        if low is not None or not lo:
            return hi, (low if lo else None)
    fused = None
    if lo and key is not None and X.ndim == 2 and X.numel() >= COLUMN_KERNEL_MIN:
        # remembered: its column sums of squares in the same pass (column_norms' bits: its kernel's sizes only)
        fused = kernels.split_with_column_sumsq(X)
    if fused is not None:
        hi, low, sums = fused
    elif (lo or hi is None) and X.device.type == "cpu" and X.dtype == torch.float32 and X.is_contiguous() \
            and kernels.load_kernel("linalg") is not None:
        hi, low = kernels.split_bf16_kernel(X, lo)  # one pass (kernels/linalg.c), the same bits
    else:
        hi = X.clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16) if hi is None else hi
        if lo:
            low = hi.float()  # X − hi in same-dtype passes: a mixed-dtype subtraction is 4× slower on the CPU
            torch.sub(X, low, out=low)
            low = low.to(torch.bfloat16)
    if key is not None:
        memo[key] = (found[1], hi, low, sums)  # the storage kept alive: its address cannot be reused while remembered
    return hi, low


def split_column_sumsq(X: torch.Tensor, memo: SplitMemo | None = None) -> torch.Tensor:
    """Σ_i X_ij² per column of a (batch of) matrices, (..., n), in X's dtype, a new tensor — ``column_norms(X,
    squared=True)``'s bits: with a ``memo`` those of a matrix split with it, summed in the split's
    pass (``kernels.split_with_column_sumsq``; matrices of at least ``COLUMN_KERNEL_MIN`` entries, where column_norms
    sums in double too), else column_norms itself (also for an X that autograd tracks)."""
    found = _memo_key(X) if memo is not None and plain(X) else None
    if found is not None and found[0] in memo and memo[found[0]][3] is not None:
        return memo[found[0]][3].clone()  # the caller's own: an in-place edit of it cannot reach the memo
    return column_norms(X, squared=True)


def _operand(T: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(tensor, transpose flag, leading dimension) for a 2-D bf16 operand: row-major or a transposed row-major view
    as they are, anything else copied row-major."""
    lay = matrix_layout(T)
    if lay is not None:
        return T, (_Trans if lay[0] else _NoTrans), lay[1]
    return T.contiguous(), _NoTrans, max(1, T.shape[1])


def bf16_gemm_(C: torch.Tensor, A: torch.Tensor, B: torch.Tensor, alpha: float = 1.0,
               beta: float = 0.0) -> torch.Tensor:
    """C ← α·A@B + β·C in place, A (m, k) and B (k, n) bf16, C (m, n) float32 row-major (2-D; no broadcasting).
    β = 0 ignores C's old values (NaN included). Requires ``split_available()``."""
    fn = _load()
    if fn is None:
        raise RuntimeError(f"bf16_gemm_: unavailable: {_reason}")
    if any(t.device.type != "cpu" for t in (C, A, B)) or A.ndim != 2 or B.ndim != 2 or C.ndim != 2:
        raise ValueError(f"bf16_gemm_: C, A and B must be 2-D CPU tensors, got {C.device.type} {tuple(C.shape)}, "
                         f"{A.device.type} {tuple(A.shape)}, {B.device.type} {tuple(B.shape)}")
    m, k = A.shape
    n = B.shape[1]
    if B.shape[0] != k or C.shape != (m, n) or C.dtype != torch.float32 or A.dtype != torch.bfloat16 \
            or B.dtype != torch.bfloat16 or C.stride(1) != 1 or C.stride(0) < max(1, n):
        raise ValueError(f"bf16_gemm_: shapes/dtypes/layout do not fit: C {tuple(C.shape)} {C.dtype} "
                         f"stride {C.stride()}, A {tuple(A.shape)} {A.dtype}, B {tuple(B.shape)} {B.dtype}")
    if m == 0 or n == 0:
        return C
    if k == 0:
        return C.mul_(beta) if beta != 0.0 else C.zero_()
    A, ta, lda = _operand(A)
    B, tb, ldb = _operand(B)
    fn(_RowMajor, ta, tb, m, n, k, float(alpha), A.data_ptr(), lda, B.data_ptr(), ldb, float(beta),
       C.data_ptr(), C.stride(0))
    torch.autograd.graph.increment_version(C)  # written behind torch's back: remembered pieces of C are stale
    return C


Pieces = tuple[torch.Tensor, torch.Tensor | None]


def _ieee(T: torch.Tensor | Pieces) -> torch.Tensor:
    return T if not isinstance(T, tuple) else T[0].float() + (T[1].float() if T[1] is not None else 0)


def _splittable(T: torch.Tensor | Pieces) -> bool:
    """A CPU float32 tensor that autograd does not track here (no grad required, or grad mode off), or bf16 CPU
    pieces."""
    if isinstance(T, tuple):
        return all(x is None or (x.device.type == "cpu" and x.dtype == torch.bfloat16) for x in T)
    return T.device.type == "cpu" and T.dtype == torch.float32 and not (T.requires_grad and torch.is_grad_enabled())


def split_matmul(A: torch.Tensor | Pieces, B: torch.Tensor | Pieces, out: torch.Tensor | None = None,
                 alpha: float = 1.0, beta: float = 0.0, memo: SplitMemo | None = None) -> torch.Tensor:
    """α·A@B (+ β·out) in float32 from the split-bf16 pieces of A and B, with ``torch.matmul``'s batch broadcasting.

    Args:
        A, B: float32 tensors (..., m, k) and (..., k, n), or their pieces ``(hi, lo)`` from ``split_bf16`` (lo None
            when the factor is exactly bf16: then its lo products are skipped).
        out: float32 (..., m, n) of the broadcast batch shape to accumulate into with β (written in place and
            returned); None: a new tensor (β unused).
        alpha, beta: scalars.
        memo: ``split_bf16``'s, for the factors split here.

    Returns:
        The product in float32. The IEEE product (``torch.matmul`` in full precision, in the inputs' dtype) instead
        where the MKL routine is missing, and for tensors that are not CPU float32 or that require grad (the split
        has no autograd). Range: the bound ``SPLIT_REL_ERROR`` holds for entries above ~1e-30 in magnitude; the lo
        pieces of smaller ones are subnormal and may be flushed, leaving bf16's 2⁻⁹.
    """
    if _load() is None or not (_splittable(A) and _splittable(B)) or (out is not None and not _splittable(out)):
        with full_precision():
            prod = torch.matmul(_ieee(A), _ieee(B))
        if out is None:
            return prod * alpha if alpha != 1.0 else prod
        return out.mul_(beta).add_(prod, alpha=alpha) if beta != 0.0 else out.copy_(prod.mul_(alpha))
    pa = A if isinstance(A, tuple) else split_bf16(A, memo=memo)
    pb = B if isinstance(B, tuple) else split_bf16(B, memo=memo)
    if pa[0].ndim < 2 or pb[0].ndim < 2 or pa[0].shape[-1] != pb[0].shape[-2]:
        raise ValueError(f"split_matmul: shapes {tuple(pa[0].shape)} and {tuple(pb[0].shape)} cannot be multiplied")
    lead = torch.broadcast_shapes(pa[0].shape[:-2], pb[0].shape[:-2])
    m, k, n = pa[0].shape[-2], pa[0].shape[-1], pb[0].shape[-1]
    if out is None:
        out = torch.empty(*lead, m, n, dtype=torch.float32)
        beta = 0.0
    elif out.shape != (*lead, m, n) or out.dtype != torch.float32 or out.device.type != "cpu":
        raise ValueError(f"split_matmul: out must be a CPU float32 tensor of shape {(*lead, m, n)}, got "
                         f"{out.device.type} {out.dtype} {tuple(out.shape)}")
    if out.numel() == 0:
        return out
    if k == 0:
        return out.mul_(beta) if beta != 0.0 else out.zero_()
    terms = [(pa[0], pb[0])]
    if pb[1] is not None:
        terms.append((pa[0], pb[1]))
    if pa[1] is not None:
        terms.append((pa[1], pb[0]))
    target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    if target is not out and beta != 0.0:
        target.copy_(out)
    flat = target.view(-1, m, n)
    fa = [(x.expand(*lead, m, k).reshape(-1, m, k), y.expand(*lead, k, n).reshape(-1, k, n)) for x, y in terms]
    for i in range(flat.shape[0]):
        for j, (x, y) in enumerate(fa):
            bf16_gemm_(flat[i], x[i], y[i], alpha, beta if j == 0 else 1.0)
    return out.copy_(target) if target is not out else out
