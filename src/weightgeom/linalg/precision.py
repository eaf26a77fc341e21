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
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["full_precision", "with_full_precision"]

_F = TypeVar("_F", bound=Callable[..., Any])
_FULL = ("ieee", "none")  # "none": inherits the backend's default, which is IEEE unless set otherwise


def _backends() -> list[Any]:
    """The per-backend matmul settings objects that have ``fp32_precision`` (torch ≥ 2.9), else []."""
    out = []
    for name in ("mkldnn", "cuda"):
        matmul = getattr(getattr(torch.backends, name, None), "matmul", None)
        if matmul is not None and hasattr(matmul, "fp32_precision"):
            out.append(matmul)
    return out


def _inherits_full() -> bool:
    """Whether an op-level "none" inherits IEEE: the backend and global levels are unset or IEEE too."""
    levels = [getattr(torch.backends, "fp32_precision", "none")]
    levels += [getattr(getattr(torch.backends, n, None), "fp32_precision", "none") for n in ("mkldnn", "cuda")]
    return all(v in _FULL for v in levels)


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """Inside: float32 matmuls at full IEEE precision on every backend; the previous settings come back on exit."""
    backends = _backends()
    if backends:
        saved = [b.fp32_precision for b in backends]
        if all(v == "ieee" for v in saved) or (all(v in _FULL for v in saved) and _inherits_full()):
            yield  # already full precision: touch nothing
            return
        try:
            for b in backends:
                b.fp32_precision = "ieee"
            yield
        finally:
            for b, v in zip(backends, saved):
                b.fp32_precision = v
        return
    old = torch.get_float32_matmul_precision()  # torch < 2.9: the process-wide legacy setting
    if old == "highest":
        yield
        return
    try:
        torch.set_float32_matmul_precision("highest")
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def with_full_precision(fn: _F) -> _F:
    """Decorator: ``fn`` runs inside ``full_precision()`` (marked, so wrapping twice is a no-op)."""
    if getattr(fn, "_full_precision", False):
        return fn

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with full_precision():
            return fn(*args, **kwargs)

    wrapped._full_precision = True  # type: ignore[attr-defined]
    return wrapped  # type: ignore[return-value]
