"""Memory-layout helpers for the optimizers' working copies on the CPU.

``copy_`` from a transposed view: torch's CPU copy of a matrix from its transpose walks one side with a large stride
and runs at ~4 GB/s (768×3072 float32: 2.2–2.5 ms, 2-core AMX Xeon); copied in blocks of ``BLOCK`` destination
columns — rows of the source's memory, each block small enough to stay in cache — it takes ~1 ms.

``sym_sum``: S + Sᵀ of the n×n matrices of the manifold constraint arithmetic (residuals, multipliers, Grams) reads
S.mT the same way (768×768 float32: 0.33 ms); a C kernel (``weightgeom.kernels.symsum``) turning 8×8 blocks in vector
registers takes 0.11 ms.
"""

from __future__ import annotations

import torch

from weightgeom import kernels
from weightgeom.linalg.norms import plain

__all__ = ["copy_", "stacked", "sym_sum", "matrix_layout", "BLOCK", "BLOCKED_MIN", "SYM_SUM_MIN"]

# Destination columns per block. Measured (ms, float32, AMX) for destinations 3072×768 / 768×3072 / 2304×768 /
# 768×2304: unblocked 2.32 / 2.45 / 1.69 / 1.72; 32 columns 1.00 / 2.46 / 0.96 / 1.79; 64: 1.16 / 1.03 / 0.65 / 0.81;
# 128: 1.40 / 1.47 / 1.22 / 1.12; blocks of destination rows 4.2–13.9.
BLOCK = 64
# Matrices with fewer entries than this are copied in one call (the per-block call overhead would dominate).
BLOCKED_MIN = 1 << 16
# Square matrices with fewer entries than this keep torch's S + S.mT (the kernel call's overhead would dominate).
SYM_SUM_MIN = 1 << 14


def matrix_layout(T: torch.Tensor) -> tuple[bool, int] | None:
    """How the last two dims (r, c) of T lie in memory, as a BLAS-style routine takes a matrix: (False, row stride)
    when rows are unit-stride and at least c apart (row-major, possibly a slice of a wider one), (True, column
    stride) when columns are (column-major: a transposed row-major view), else None (a sliding-window, interleaved
    or broadcast view: callers copy it, or keep torch)."""
    r, c = T.shape[-2], T.shape[-1]
    if T.stride(-1) == 1 and T.stride(-2) >= max(1, c):
        return False, T.stride(-2)
    if T.stride(-2) == 1 and T.stride(-1) >= max(1, r):
        return True, T.stride(-1)
    return None


def copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for same-shape tensors, blocked on the CPU when exactly one of them is a transposed view of
    row-major (..., r, c) memory and the matrices are large; the same values either way."""
    if (dst.device.type != "cpu" or src.device.type != "cpu" or dst.shape != src.shape or dst.ndim < 2
            or dst.shape[-2:].numel() < BLOCKED_MIN
            or dst.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()):  # aliased: torch's checks
        return dst.copy_(src)
    out = dst
    if not dst.is_contiguous() and dst.mT.is_contiguous() and src.is_contiguous():
        dst, src = dst.mT, src.mT  # the same copy, seen from the row-major side
    if dst.is_contiguous() and not src.is_contiguous() and src.mT.is_contiguous():
        for j in range(0, dst.shape[-1], BLOCK):  # dst columns j:j+B = rows of src's row-major memory
            dst[..., j:j + BLOCK].copy_(src[..., j:j + BLOCK])
        return out
    return dst.copy_(src)


def stacked(mats: list[torch.Tensor]) -> torch.Tensor:
    """A new row-major tensor holding ``mats`` (same shape) — ``torch.stack``, or a row-major copy of one matrix —
    filled with ``copy_``."""
    out = torch.empty(len(mats), *mats[0].shape, dtype=mats[0].dtype, device=mats[0].device)
    for o, m in zip(out.unbind(0), mats):
        copy_(o, m)
    return out


def sym_sum(S: torch.Tensor, alpha: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """alpha·(S + Sᵀ) of a (batch of) square matrices (..., n, n), new; or with ``out`` accumulated into it in place,
    out ← (out + alpha·S) + alpha·Sᵀ (broadcast to out's shape; returned; out must not share memory with S).

    The same values as torch's expressions — the same bits, but for accumulating with alpha ≠ 1, which torch rounds
    as one multiply-add. On the CPU, for float32 matrices of at least ``SYM_SUM_MIN`` entries that no autograd mode
    tracks here, a C kernel per matrix (the transposed read turned in vector registers).
    """
    if S.ndim < 2 or S.shape[-1] != S.shape[-2]:
        raise ValueError(f"sym_sum: S must be a (batch of) square matrices, got shape {tuple(S.shape)}")
    if out is None:
        if _kernel_fits(S):  # the result buffer only where the kernel fills it (a GPU step allocates nothing extra)
            res = torch.empty(S.shape, dtype=S.dtype, device=S.device)
            if _kernel_each(S, res, alpha, False):
                return res
        T = S + S.mT
        return T if alpha == 1.0 else alpha * T
    if out.shape != torch.broadcast_shapes(out.shape, S.shape) or out.dtype != S.dtype:
        raise ValueError(f"sym_sum: out {tuple(out.shape)} {out.dtype} cannot hold S {tuple(S.shape)} {S.dtype}")
    if out.untyped_storage().data_ptr() == S.untyped_storage().data_ptr():
        raise ValueError("sym_sum: out shares memory with S (S would be read after it is written)")
    Sb = S.expand(out.shape)
    if out.is_contiguous() and _kernel_each(Sb, out, alpha, True):
        return out
    if alpha == 1.0:
        return out.add_(Sb).add_(Sb.mT)
    return out.add_(Sb, alpha=alpha).add_(Sb.mT, alpha=alpha)


def _kernel_fits(S: torch.Tensor) -> bool:
    """Whether ``kernels.symsum`` takes S's matrices: CPU float32, row-major rows, at least ``SYM_SUM_MIN`` entries,
    untracked by autograd, and the kernel built."""
    return (S.device.type == "cpu" and S.shape[-1] * S.shape[-2] >= SYM_SUM_MIN and S.dtype == torch.float32
            and plain(S) and S.stride(-1) == 1 and S.stride(-2) >= S.shape[-1]
            and kernels.load_kernel("linalg") is not None)


def _kernel_each(S: torch.Tensor, out: torch.Tensor, alpha: float, accumulate: bool) -> bool:
    """Run ``kernels.symsum`` on every matrix of the batch; False (nothing written) where any does not fit."""
    if not (_kernel_fits(S) and plain(out) and out.is_contiguous()
            and out.untyped_storage().data_ptr() != S.untyped_storage().data_ptr()):
        return False
    n = S.shape[-1]
    mats = S.reshape(-1, n, n) if S.ndim > 2 else S.unsqueeze(0)  # a copy only for a batch that is not viewable
    outs = out.view(-1, n, n)
    for s, o in zip(mats.unbind(0), outs.unbind(0)):
        if kernels.symsum(s, o, alpha, accumulate) is None:  # not expected after the checks above: torch's values
            if accumulate:
                o.add_(s, alpha=alpha).add_(s.mT, alpha=alpha)
            else:
                torch.add(s, s.mT, out=o).mul_(alpha)
    return True
