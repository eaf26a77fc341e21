"""Shared helpers of the benchmarks in :mod:`weightgeom.benchmarks`: shapes, device sync, interleaved timing, machine
description. Not a benchmark itself (the leading underscore keeps it out of ``weightgeom bench``'s list).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["GPT2_SMALL_SHAPES", "sync", "time_call", "interleaved_medians", "machine_info", "matmul_gflops"]

# GPT-2 small block matrices in PyTorch (out, in) layout, per layer.
GPT2_SMALL_SHAPES: dict[str, tuple[int, int]] = {
    "attn.c_attn": (2304, 768),
    "attn.c_proj": (768, 768),
    "mlp.c_fc": (3072, 768),
    "mlp.c_proj": (768, 3072),
}


def sync(device: str | torch.device) -> None:
    """Wait for queued kernels on CUDA (no-op on CPU) so wall-clock times are complete."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], device: str | torch.device = "cpu") -> float:
    """Seconds one call of ``fn`` takes, synchronising the device before and after."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def interleaved_medians(
    fns: dict[str, Callable[[], object]], iters: int, warmup: int = 1, device: str | torch.device = "cpu"
) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved round-robin so load drift hits all alike.

    Args:
        fns: name → zero-argument callable.
        iters: timed rounds (each calls every function once).
        warmup: untimed rounds first.
        device: synchronised around each call.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            times[k].append(time_call(fn, device))
    return {k: statistics.median(v) for k, v in times.items()}


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                  iters: int = 3) -> float:
    """Achieved GFLOP/s of a plain (m×k)@(k×n) matmul (2mkn flops), median of ``iters`` after one warm-up."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    secs = interleaved_medians({"mm": lambda: a @ b}, iters=iters, warmup=1, device=device)["mm"]
    return 2.0 * m * k * n / secs / 1e9


def machine_info(device: str | torch.device = "cpu") -> dict[str, object]:
    """Torch version, device name, thread count and CPU capability (bf16 matmul speed depends on it)."""
    info: dict[str, object] = {
        "torch": torch.__version__,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "platform": platform.platform(),
    }
    try:
        flags = open("/proc/cpuinfo").read()
        info["cpu_amx_bf16"] = "amx_bf16" in flags
        info["cpu_avx512_bf16"] = "avx512_bf16" in flags
    except OSError:
        pass
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info
