"""The ``WEIGHTGEOM_*`` environment overrides of the numerics, parsed: the only module that reads them.

Which arithmetic the optimizers run (msign dtype and steps, manifold Muon's constraint products, the C kernels, CUDA
graph replay) is one value, ``weightgeom.linalg.numerics.Numerics``, resolved once per device when an optimizer is
built; these variables are one of its producers (the autotuner's on-disk choice is the other). Each function reads
its variable now and raises ``ValueError`` naming it for a value it does not accept.

Variables:
    WEIGHTGEOM_MSIGN: ``auto`` (unset) or a dtype name (``float32``, ``bfloat16``, ``float64``), optionally
        ``:STEPS``, e.g. ``bfloat16:6``: the msign choice, not measured.
    WEIGHTGEOM_PRODUCTS: ``auto`` or one of ``PRODUCTS``: manifold Muon's constraint products on a CPU.
    WEIGHTGEOM_SPLIT_PRODUCTS: the older switch: ``1`` the split-bf16 products, ``0`` never them.
    WEIGHTGEOM_NO_KERNELS: anything but empty or ``0`` turns the C kernels off.
    WEIGHTGEOM_CUDA_GRAPHS: ``0`` turns msign's CUDA-graph replay off.
    WEIGHTGEOM_CUDA_GRAPHS_MAX_MB: the largest call (MiB of tensor arguments) captured; ``inf`` for no cap.
"""

from __future__ import annotations

import math
import os

__all__ = ["MSIGN_VAR", "PRODUCTS_VAR", "SPLIT_VAR", "NO_KERNELS_VAR", "CUDA_GRAPHS_VAR", "CUDA_GRAPHS_MAX_MB_VAR",
           "PRODUCTS", "MSIGN_DTYPES", "DEFAULT_CUDA_GRAPHS_MAX_MB", "msign_override", "products_override",
           "kernels_enabled", "cuda_graphs_enabled", "cuda_graphs_max_mb"]

MSIGN_VAR = "WEIGHTGEOM_MSIGN"
PRODUCTS_VAR = "WEIGHTGEOM_PRODUCTS"
SPLIT_VAR = "WEIGHTGEOM_SPLIT_PRODUCTS"
NO_KERNELS_VAR = "WEIGHTGEOM_NO_KERNELS"
CUDA_GRAPHS_VAR = "WEIGHTGEOM_CUDA_GRAPHS"
CUDA_GRAPHS_MAX_MB_VAR = "WEIGHTGEOM_CUDA_GRAPHS_MAX_MB"
PRODUCTS = ("ieee", "ieee_onednn", "split_bf16")
"""Manifold Muon's constraint-product kinds (``weightgeom.linalg.autotune``)."""
MSIGN_DTYPES = ("float32", "bfloat16", "float64")
DEFAULT_CUDA_GRAPHS_MAX_MB = 256.0


def _get(var: str) -> str:
    return os.environ.get(var, "").strip()


def msign_override() -> tuple[str, int | None] | None:
    """(dtype name, steps or None for the preset's default) that ``WEIGHTGEOM_MSIGN`` forces, or None (unset/auto)."""
    raw = _get(MSIGN_VAR)
    if not raw or raw == "auto":
        return None
    name, _, steps = raw.partition(":")
    if name not in MSIGN_DTYPES or (steps and not (steps.isdigit() and int(steps) >= 1)):
        raise ValueError(f"{MSIGN_VAR}={raw!r} is invalid: use auto, float32, bfloat16 or float64, optionally "
                         f"followed by :STEPS (an int ≥ 1), e.g. bfloat16:6")
    return name, int(steps) if steps else None


def products_override() -> tuple[str, str] | None:
    """(``"VARIABLE=value"``, kind) that the environment forces for the constraint products: a kind of ``PRODUCTS``
    (``WEIGHTGEOM_PRODUCTS``, else ``WEIGHTGEOM_SPLIT_PRODUCTS=1``: ``"split_bf16"``) or ``"no-split"``
    (``WEIGHTGEOM_SPLIT_PRODUCTS=0``); None where neither forces one."""
    raw, old = _get(PRODUCTS_VAR), _get(SPLIT_VAR)
    if raw not in ("", "auto", *PRODUCTS):
        raise ValueError(f"{PRODUCTS_VAR}={raw!r} is invalid: use auto, " + ", ".join(PRODUCTS))
    if old not in ("", "auto", "0", "1"):
        raise ValueError(f"{SPLIT_VAR}={old!r} is invalid: use auto, 0 or 1")
    if raw not in ("", "auto"):
        return f"{PRODUCTS_VAR}={raw}", raw
    kind = {"1": "split_bf16", "0": "no-split"}.get(old)
    return None if kind is None else (f"{SPLIT_VAR}={old}", kind)


def kernels_enabled() -> bool:
    """Whether the C kernels may be used (``WEIGHTGEOM_NO_KERNELS`` unset, empty or ``0``)."""
    return _get(NO_KERNELS_VAR) in ("", "0")


def cuda_graphs_enabled() -> bool:
    """Whether msign may replay CUDA graphs (``WEIGHTGEOM_CUDA_GRAPHS`` is not ``0``)."""
    return _get(CUDA_GRAPHS_VAR) != "0"


def cuda_graphs_max_mb() -> float:
    """The largest call captured, in MiB of tensor arguments (``WEIGHTGEOM_CUDA_GRAPHS_MAX_MB``, default 256;
    ``inf``: no cap; 0: never capture)."""
    raw = _get(CUDA_GRAPHS_MAX_MB_VAR)
    if not raw:
        return DEFAULT_CUDA_GRAPHS_MAX_MB
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb >= 0:
        raise ValueError(f"{CUDA_GRAPHS_MAX_MB_VAR}={raw!r} is invalid: use a number of MiB >= 0 (0: never capture)")
    return mb if math.isfinite(mb) else math.inf
