"""Full-precision float32 matmuls where the geometry needs them, whatever the process asked for.

``torch.set_float32_matmul_precision("high")`` or ``("medium")`` — a line many training scripts start with — lets
float32 matmuls run in TF32 on recent GPUs and, on CPUs with AMX or AVX512-BF16, in bf16 arithmetic (oneDNN): about
1e-3 relative error per product (a 768×768 float32 product was off by 0.32 against 1e-4 at full precision, measured on
a 2-core Xeon with AMX). The manifold constraints cannot take that: manifold-Muon weights ended 3.4e-3 off the Stiefel
manifold after 20 steps (2.9e-7 at full precision), and ``Manifold.check`` would measure with the same error.

``full_precision()`` sets the matmul backends to IEEE float32 for its duration and restores what was there (the
per-backend settings of torch ≥ 2.9, ``torch.backends.{mkldnn,cuda}.matmul.fp32_precision``; the process-wide
``torch.set_float32_matmul_precision`` on older torch). It only ever raises precision, so another thread's products in
that window are at worst slower, never less accurate. Used around every manifold method (``Manifold`` subclasses are
wrapped automatically), manifold-Muon's step and the msign micro-benchmark (whose cached choice must not depend on
the mode of the process that measured it).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["full_precision", "with_full_precision"]

_F = TypeVar("_F", bound=Callable[..., Any])
# IEEE float32 already: an op-level getter resolves inheritance, so "none" means nothing above it is set either
_FULL = ("ieee", "none")


def _levels() -> list[tuple[Any, Callable[[], str]]]:
    """(op-level settings object, its parent's effective value) for the matmul ops that have ``fp32_precision``
    (torch ≥ 2.9), else []. An op-level getter reports the inherited value when the op itself is unset ("none")."""
    out = []
    generic = getattr(torch.backends, "fp32_precision", "none")
    for name in ("mkldnn", "cuda"):
        backend = getattr(torch.backends, name, None)
        matmul = getattr(backend, "matmul", None)
        if matmul is not None and hasattr(matmul, "fp32_precision"):
            out.append((matmul, lambda b=backend: getattr(b, "fp32_precision", generic)))
    return out


# One process-wide switch shared by every thread: the first guard to enter raises the precision, the last to leave
# restores it (a thread leaving early must not lower it under another thread still inside).
_LOCK = threading.Lock()
_depth = 0
_restore: Callable[[], None] | None = None


def _raise() -> Callable[[], None] | None:
    """Set IEEE float32 matmuls; return the function that undoes it, or None when nothing had to change."""
    levels = _levels()
    if levels:
        saved = [(m, m.fp32_precision, parent()) for m, parent in levels]
        if all(v in _FULL for _, v, _ in saved):
            return None
        for m, _, _ in saved:
            m.fp32_precision = "ieee"

        def undo() -> None:
            for m, v, inherited in saved:  # a value equal to the parent's was (almost surely) inherited: unset it
                m.fp32_precision = "none" if v == inherited else v

        return undo
    old = torch.get_float32_matmul_precision()  # torch < 2.9: the process-wide legacy setting
    if old == "highest":
        return None
    torch.set_float32_matmul_precision("highest")
    return lambda: torch.set_float32_matmul_precision(old)


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """Inside: float32 matmuls at full IEEE precision on every backend; the previous settings come back when the last
    guard of the process (any thread, nested or not) leaves. Settings changed by another thread while a guard is
    active are overwritten by that restore."""
    global _depth, _restore
    with _LOCK:
        if _depth == 0:
            _restore = _raise()
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0 and _restore is not None:
                undo, _restore = _restore, None
                undo()


def with_full_precision(fn: _F) -> _F:
    """Decorator: ``fn`` runs inside ``full_precision()`` (marked, so wrapping twice is a no-op). For functions that
    return their result: a generator function would run its body after the guard has left."""
    if getattr(fn, "_full_precision", False):
        return fn

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # a trace cannot switch backend flags: ``compile_step`` sets them around it
            return fn(*args, **kwargs)
        with full_precision():
            return fn(*args, **kwargs)

    wrapped._full_precision = True  # type: ignore[attr-defined]
    return wrapped  # type: ignore[return-value]
