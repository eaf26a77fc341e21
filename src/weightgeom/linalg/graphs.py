"""A pure tensor function replayed as a CUDA graph: one launch instead of hundreds of small ones.

Scope: loops of many small kernels with no host synchronisation inside (Lanczos on an n×n Gram matrix: ~13 kernels
per step, 32 steps), which on a GPU are bound by the CPU's launch rate (~5–10 µs per kernel), not by the GPU. On
an H200 the 32-step Lanczos of manifold Muon's spectral-norm estimate made up about 1650 of the ~2560 kernels of one
GPT-2-small layer's step (45 ms). ``replay`` captures such a function once per argument signature (shapes, strides,
dtypes, device, keyword arguments and the float32 matmul mode) and replays the graph afterwards.

Contract of a replayed function: it reads only its tensor arguments (all on one CUDA device) and keyword arguments
(hashable, e.g. ints and dtypes), creates no CPU tensors that it copies to the device, never reads a tensor's value
on the host, and returns a tensor or a tuple of tensors. The arguments are copied into the graph's own input
buffers on each call and the outputs are returned as fresh clones, so callers see ordinary tensors.

Memory: each captured signature keeps its input copies and a private memory pool for its intermediates (for the
Lanczos of 12 stacked 3072×768 directions about 0.2 GB) for the life of the process; ``clear()`` frees them. So
only signatures whose tensor arguments hold at most ``max_input_bytes()`` together (256 MiB; the environment variable
``WEIGHTGEOM_CUDA_GRAPHS_MAX_MB`` changes it) are captured: larger arguments are compute-bound anyway (the launches
are then a small part of the time), and a model's whole stacked layer bucket (80 × 8192×28672 float32 is 75 GB)
must not be copied into a graph's buffers. New signatures stop being captured once the captured ones' inputs hold
4 × that (1 GiB by default); later ones run eagerly.

``WEIGHTGEOM_CUDA_GRAPHS=0`` turns replay off (everything runs eagerly). Replay is also skipped on the CPU, while
``torch.compile`` traces, inside another capture, under ``torch.inference_mode`` or CUDA autocast, and for a
signature whose capture failed once (a warning names it). A capture synchronizes the device once and empties the
allocator's cache (``torch.cuda.graph`` does), so none is made under a CUDA sync debug mode
(``torch.cuda.set_sync_debug_mode``); replays never synchronize. Calls from several streams are ordered: a call waits
for the previous call's use of the buffers (an event), so they cannot overwrite each other's inputs.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weightgeom._numerics_env import CUDA_GRAPHS_MAX_MB_VAR, CUDA_GRAPHS_VAR, cuda_graphs_enabled, cuda_graphs_max_mb

__all__ = ["replay", "enabled", "clear", "max_input_bytes", "ENV_VAR", "MAX_MB_ENV_VAR"]

ENV_VAR = CUDA_GRAPHS_VAR
MAX_MB_ENV_VAR = CUDA_GRAPHS_MAX_MB_VAR


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: tuple[torch.Tensor, ...]
    done: torch.cuda.Event | None = None  # recorded after the last call's clones: a call on another stream waits


_lock = threading.Lock()
_entries: dict[tuple, _Entry | None] = {}  # None: capture failed for that signature, run eagerly
_TOTAL_FACTOR = 4  # all captured signatures' inputs together stay within this many times max_input_bytes()


def enabled() -> bool:
    """Whether graph replay is on (``WEIGHTGEOM_CUDA_GRAPHS`` is not ``"0"``; read by ``weightgeom._numerics_env``,
    recorded per device in ``weightgeom.linalg.numerics.Numerics``)."""
    return cuda_graphs_enabled()


def max_input_bytes() -> int:
    """Largest total size of a call's tensor arguments that is captured (``WEIGHTGEOM_CUDA_GRAPHS_MAX_MB``, default
    256 MiB; a value that is not a number ≥ 0 raises ValueError naming the variable)."""
    return _bytes(cuda_graphs_max_mb())


def _bytes(mb: float) -> int:
    return sys.maxsize if math.isinf(mb) else int(mb * (1 << 20))  # "inf": no cap


def clear() -> None:
    """Drop every captured graph (their memory is freed once no replay is in flight)."""
    with _lock:
        _entries.clear()


def _matmul_mode() -> tuple:
    """The float32 matmul settings a capture bakes in (its kernels are chosen then). Each read is guarded: torch
    raises on reading the legacy ``allow_tf32`` once the legacy and the new (``fp32_precision``) APIs were mixed."""
    out = []
    for read in (torch.get_float32_matmul_precision, lambda: torch.backends.cuda.matmul.fp32_precision,
                 lambda: torch.backends.cuda.matmul.allow_tf32):
        try:
            out.append(read())
        except (AttributeError, RuntimeError) as e:
            out.append(type(e).__name__)
    return tuple(out)


def _buffer(a: torch.Tensor) -> torch.Tensor:
    """An input buffer with ``a``'s strides where they describe dense memory (so the captured kernels see the same
    layout as an eager call), else contiguous."""
    if a.is_contiguous() or a.mT.is_contiguous():
        return torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
    return torch.empty(a.shape, dtype=a.dtype, device=a.device)


def _capture(name: str, fn: Callable, args: tuple[torch.Tensor, ...], kw: dict) -> _Entry | None:
    dev = args[0].device
    try:
        with torch.cuda.device(dev):
            inputs = [_buffer(a) for a in args]
            for buf, a in zip(inputs, args):
                buf.copy_(a)
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                fn(*inputs, **kw)  # warm-up: library handles and workspaces are created outside the capture
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: only this thread's capture-unsafe calls fail; another thread of the training process
            # (a DataLoader's pin-memory thread copying a batch) must not be refused while this one captures
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = fn(*inputs, **kw)
            outputs = out if isinstance(out, tuple) else (out,)
            return _Entry(graph, inputs, outputs)
    except Exception as e:  # noqa: BLE001 -- any capture failure means: run this signature eagerly
        warnings.warn(f"weightgeom: CUDA graph capture of {name} failed ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:120]}); it runs eagerly", RuntimeWarning, stacklevel=3)
        return None


def replay(name: str, fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], *args: torch.Tensor,
           max_mb: float | None = None, **kw) -> tuple[torch.Tensor, ...] | None:
    """``fn(*args, **kw)`` through a CUDA graph captured on first use of this signature.

    Args:
        name: the function's name in warnings and in the cache key.
        fn: a capturable pure function (module docstring).
        *args: its tensor arguments, plain tensors (not subclasses) on one CUDA device.
        max_mb: the caller's resolved setting (``Numerics``: 0 when CUDA graphs are off, else their size cap in MiB,
            ``inf`` for none); None: the environment's (``enabled()``, ``max_input_bytes()``).
        **kw: its other arguments (hashable; part of the signature).

    Returns:
        The outputs as a tuple of fresh tensors, or None where replay does not apply (graphs off, not CUDA, inside
        ``torch.compile`` or another capture, arguments over ``max_input_bytes()``, a signature whose capture
        failed): the caller then runs ``fn`` itself.
    """
    if max_mb is None:
        max_mb = cuda_graphs_max_mb() if enabled() else 0.0
    if not args or not max_mb or any(type(a) is not torch.Tensor or a.device.type != "cuda" for a in args):
        return None  # the CPU; tensor subclasses (DTensor, Parameter) run eagerly
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return None
    # inference mode would make the graph's buffers inference tensors (unwritable outside it later); autocast would
    # change the captured kernels' dtypes without being part of the signature: both run eagerly
    if torch.is_inference_mode_enabled() or torch.is_autocast_enabled("cuda"):
        return None
    size, cap = sum(a.numel() * a.element_size() for a in args), _bytes(max_mb)
    if size > cap:
        return None
    key = (name, fn, args[0].device.index, tuple((a.shape, a.stride(), a.dtype, a.device) for a in args),
           tuple(sorted(kw.items(), key=lambda kv: kv[0])), _matmul_mode())
    with _lock, torch.no_grad(), torch.cuda.device(args[0].device):
        if key not in _entries:
            if torch.cuda.get_sync_debug_mode() != 0:  # a capture synchronizes the device (torch.cuda.graph does)
                return None
            held = sum(b.numel() * b.element_size() for e in _entries.values() if e is not None for b in e.inputs)
            if held + size > _TOTAL_FACTOR * cap:  # the graphs held so far are enough memory: run this one eagerly
                return None
            _entries[key] = _capture(name, fn, args, kw)
        entry = _entries[key]
        if entry is None:
            return None
        stream = torch.cuda.current_stream()
        if entry.done is not None:  # a call on another stream may still be reading the buffers
            stream.wait_event(entry.done)
        for buf, a in zip(entry.inputs, args):
            buf.copy_(a)
        entry.graph.replay()
        out = tuple(o.clone() for o in entry.outputs)
        if entry.done is None:
            entry.done = torch.cuda.Event()
        entry.done.record(stream)
        return out
