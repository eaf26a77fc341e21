"""Shared helpers of the benchmarks in :mod:`weightgeom.benchmarks`: shapes, device sync, interleaved timing, machine
description. Not a benchmark itself (the leading underscore keeps it out of ``weightgeom bench``'s list).
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from weightgeom._device import capped_kind, cpu_kind
from weightgeom._files import write_atomic

__all__ = ["GPT2_SMALL_SHAPES", "sync", "time_call", "interleaved_medians", "machine_info", "matmul_gflops", "cpu_kind",
           "capped_kind", "hardware_tag", "steady_allocator", "markdown_block", "write_markdown", "bench_command"]

# GPT-2 small block matrices in PyTorch (out, in) layout, per layer.
GPT2_SMALL_SHAPES: dict[str, tuple[int, int]] = {
    "attn.c_attn": (2304, 768),
    "attn.c_proj": (768, 768),
    "mlp.c_fc": (3072, 768),
    "mlp.c_proj": (768, 3072),
}


# Seconds between two progress lines of a long timing loop (``interleaved_medians``).
PROGRESS_EVERY = 10.0


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
    fns: dict[str, Callable[[], object]], iters: int, warmup: int = 1, device: str | torch.device = "cpu",
    cpu_seconds: dict[str, float] | None = None, progress: str | None = None,
) -> dict[str, float]:
    """Median wall-clock seconds per call of each function, calls interleaved round-robin so load drift hits all
    alike.

    Args:
        fns: name → zero-argument callable.
        iters: timed rounds (each calls every function once).
        warmup: untimed rounds first.
        device: synchronised around each call.
        cpu_seconds: if given, filled with each function's median process CPU seconds per call (all threads; on a
            CPU shared with other jobs this measures the work done, while wall clock also counts the waiting).
        progress: a label: then a line on stderr at most every ``PROGRESS_EVERY`` seconds with the calls done, the
            time elapsed and an estimate of the time left (nothing for runs shorter than that).
    """
    total, done, start, last = (warmup + iters) * len(fns), 0, time.perf_counter(), time.perf_counter()

    def tick(name: str, secs: float) -> None:
        nonlocal done, last
        done += 1
        now = time.perf_counter()
        if progress is not None and now - last >= PROGRESS_EVERY and done < total:
            last = now
            left = (now - start) / done * (total - done)
            print(f"  {progress}: {done}/{total} steps, {now - start:.0f} s elapsed, about {left:.0f} s left "
                  f"(last: {name}, {secs:.1f} s)", file=sys.stderr, flush=True)

    for _ in range(warmup):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            tick(k, time.perf_counter() - t)
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            c = time.process_time()
            times[k].append(time_call(fn, device))
            cpu[k].append(time.process_time() - c)
            tick(k, times[k][-1])
    if cpu_seconds is not None:
        cpu_seconds.update({k: statistics.median(v) for k, v in cpu.items()})
    return {k: statistics.median(v) for k, v in times.items()}


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                  iters: int = 3) -> float:
    """Achieved GFLOP/s of a plain (m×k)@(k×n) matmul (2mkn flops), median of ``iters`` after one warm-up."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    secs = interleaved_medians({"mm": lambda: a @ b}, iters=iters, warmup=1, device=device)["mm"]
    return 2.0 * m * k * n / secs / 1e9


# glibc malloc settings of ``steady_allocator`` (mallopt parameter numbers from glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # bytes: glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 1 << 30  # bytes of free heap top kept before returning memory to the OS
ALLOCATOR_ENV = "WEIGHTGEOM_BENCH_MALLOC"
_steady = False


def steady_allocator() -> bool:
    """Hold glibc's malloc thresholds fixed for this (benchmark) process, so step timings measure the work.

    By default glibc serves a large block (above an adaptive threshold, at most 32 MiB) with a fresh ``mmap`` and
    returns freed memory at the heap top to the OS, so a CPU optimizer step that allocates a few MB-sized temporaries
    page-faults them in again, step after step, by how much depending on the allocation history: measured on the
    2-core AMX Xeon, ``md_overhead --quick`` timed torch's AdamW base at 11.7 to 72 ms in rows of one run, and a
    Stiefel step faulted 22 600 pages (39 ms of system time) per step. With the mmap threshold at its 32 MiB maximum
    and a 1 GiB trim threshold the same rows are steady (11–13.6 ms). Peer and ours run in the same process, so
    both get it; ``hardware_tag`` then says "steady malloc". Set ``WEIGHTGEOM_BENCH_MALLOC=default`` to measure
    glibc's default behaviour instead. Returns whether the setting is in force (False off glibc).
    """
    global _steady
    if _steady:
        return True
    if os.environ.get(ALLOCATOR_ENV, "").strip().lower() == "default" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
        _steady = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):
        _steady = False
    return _steady


def hardware_tag(device: str | torch.device = "cpu") -> str:
    """One short label for the hardware a figure was measured on, printed next to every figure: ``"CPU AVX2, 2
    threads"`` (``", steady malloc"`` added once ``steady_allocator`` is in force), or the GPU's name on CUDA."""
    if torch.device(device).type == "cuda":
        return f"GPU {torch.cuda.get_device_name()}"
    n = torch.get_num_threads()
    return f"CPU {cpu_kind()}, {n} thread{'s' if n != 1 else ''}{', steady malloc' if _steady else ''}"


def machine_info(device: str | torch.device = "cpu") -> dict[str, object]:
    """Torch version, device name, thread count and CPU capability (bf16 matmul speed depends on it)."""
    info: dict[str, object] = {
        "torch": torch.__version__,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_kind": cpu_kind(),
        "malloc": "steady" if _steady else "default",
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


# ------------------------------------------------------------------------------------------ markdown output
Table = tuple[str, list[str], list[list[str]]]
"""(title, header, rows) of one markdown table; cells already formatted."""


def bench_command(name: str, argv: list[str] | None) -> str:
    """The command that reproduces a benchmark run: ``weightgeom bench NAME ARGS`` without the output options
    (``--markdown``, ``--json`` and their values)."""
    args, skip = [], False
    for a in list(sys.argv[1:] if argv is None else argv):
        if skip:
            skip = False
            continue
        if a in ("--markdown", "--json"):
            skip = True
            continue
        if a.startswith(("--markdown=", "--json=")):
            continue
        args.append(a)
    return "weightgeom bench " + shlex.join([name, *args])


def _markers(name: str, hardware: str) -> tuple[str, str]:
    return f"<!-- bench {name} on {hardware} -->", f"<!-- end bench {name} on {hardware} -->"


def markdown_block(name: str, hardware: str, command: str, tables: list[Table]) -> str:
    """A benchmark's result as markdown: the device kind, the torch version and the command that reproduces it,
    then its tables, between markers naming the benchmark and the device kind (:func:`write_markdown` replaces the
    block with the same markers)."""
    begin, end = _markers(name, hardware)
    lines = [begin, f"`{command}` on {hardware}, {os.cpu_count()} CPU cores, torch {torch.__version__}:", ""]
    for title, header, rows in tables:
        if not rows:
            continue
        lines += [f"*{title}*", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        lines.append("")
    lines.append(end)
    return "\n".join(lines)


def write_markdown(path: str, name: str, hardware: str, command: str, tables: list[Table]) -> str:
    """Put a benchmark's markdown block into ``path``: in place of the block of the same benchmark and device kind
    when the file has one (the rest of the file kept as it is), else appended (the file created if missing);
    written atomically. Returns what was done, for the benchmark's last line."""

    block = markdown_block(name, hardware, command, tables)
    begin, end = _markers(name, hardware)
    p = Path(path)
    text = p.read_text(encoding="utf-8") if p.is_file() else ""
    i, j = text.find(begin), text.find(end)
    if i >= 0 and j > i:
        text, how = text[:i] + block + text[j + len(end):], "replaced its block in"
    else:
        text, how = (text.rstrip("\n") + "\n\n" if text.strip() else "") + block + "\n", "appended to"
    write_atomic(p, text)
    return f"markdown: {how} {path}"
