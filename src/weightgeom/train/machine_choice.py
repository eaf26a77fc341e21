"""A run's per-device msign and constraint-products choice: recorded in ``meta.json``, kept when the run resumes.

Muon's msign dtype and Polar Express step count (unless the config sets both) and manifold Muon's constraint
products on a CPU are chosen per machine (:mod:`weightgeom.linalg.autotune`: measured, cached, or forced by
``WEIGHTGEOM_MSIGN`` / ``WEIGHTGEOM_PRODUCTS`` / ``WEIGHTGEOM_SPLIT_PRODUCTS``). A run records what it used in
``meta.json`` (:data:`MSIGN_KEY`, :data:`PRODUCTS_KEY`, and the same keys in each ``resumes`` entry), and a resumed
run adopts its first session's choice (:func:`resume_choice`), so it computes what an uninterrupted run would have;
an environment that forces another choice is refused with one line.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from weightgeom.linalg.autotune import (
    ENV_VAR,
    PRODUCTS,
    adopted_msign_choice,
    forced_msign_choice,
    forced_products,
    msign_choice,
    products_for,
)
from weightgeom.optim.muon import uses_msign_choice

__all__ = ["MSIGN_KEY", "PRODUCTS_KEY", "NUMERICS_KEY", "choice_record", "resume_choice"]

MSIGN_KEY = "msign_default"
"""``meta.json`` key of the msign choice (``MsignChoice.as_dict()``; its ``products`` is what the run used)."""
PRODUCTS_KEY = "constraint_products"
"""``meta.json`` key of manifold Muon's constraint products on a CPU (one of ``autotune.PRODUCTS``)."""
NUMERICS_KEY = "numerics"
"""``meta.json`` key of the optimizer's numerics per device (``Numerics.as_dict()``: msign, constraint products, C
kernels, CUDA graphs, each with where it came from)."""

_DTYPES = ("float32", "bfloat16", "float64")


def choice_record(optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, Any]:
    """What ``optimizer`` takes from the per-device choice on ``device``: ``{MSIGN_KEY: {...}}`` when a group's msign
    does, ``{PRODUCTS_KEY: kind}`` when it has manifold groups on a CPU, ``{NUMERICS_KEY: {device: {...}}}`` for a
    Muon (or an optimizer over one) — empty when none applies."""
    groups = optimizer.param_groups
    out: dict[str, Any] = {}
    manifold_cpu = device.type == "cpu" and any(g.get("algorithm") == "muon" and g.get("manifold") is not None
                                                for g in groups)
    products = products_for(device) if manifold_cpu else "ieee"
    if any(uses_msign_choice(g) for g in groups):
        out[MSIGN_KEY] = {**msign_choice(device).as_dict(), "products": products}
    if manifold_cpu:
        out[PRODUCTS_KEY] = products
    holder = next((o for o in (optimizer, getattr(optimizer, "base_optimizer", None)) if hasattr(o, "numerics")), None)
    if holder is not None and holder.numerics:  # the arithmetic per device (``weightgeom.linalg.numerics.Numerics``)
        out[NUMERICS_KEY] = {dev: n.as_dict() for dev, n in holder.numerics.items()}
    return out


def _recorded(meta: dict[str, Any], meta_path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the recorded msign choice, the recorded products kind), each None where the run did not record one.

    Raises:
        ValueError: a record this module would not write (one line naming ``meta_path`` and the key).
    """
    rec, products = meta.get(MSIGN_KEY), meta.get(PRODUCTS_KEY)
    if rec is not None:
        steps = rec.get("steps") if isinstance(rec, dict) else None
        if not isinstance(rec, dict) or rec.get("dtype") not in _DTYPES or type(steps) is not int or steps < 1:
            raise ValueError(f"{meta_path}: {MSIGN_KEY} is not an msign choice weightgeom writes ({rec!r:.200}); "
                             "use --fresh to start over")
    if products is not None and products not in PRODUCTS:
        raise ValueError(f"{meta_path}: {PRODUCTS_KEY}={products!r:.100} is not one of {', '.join(PRODUCTS)}; use "
                         "--fresh to start over")
    return rec, products


def _refuse(run_dir: Path, recorded: str, variable: str, requested: str, unset: str) -> ValueError:
    return ValueError(f"run directory {run_dir} was trained with {recorded} (meta.json), but {variable} asks for "
                      f"{requested}: a resumed run keeps its first session's choice; unset {unset} to resume with "
                      "it, or use --fresh to start over")


def _check_msign(rec: dict[str, Any], device: torch.device, run_dir: Path) -> None:
    forced = forced_msign_choice(device)
    if forced is None:
        return
    name = str(forced.dtype).replace("torch.", "")
    if (name, forced.steps) != (rec["dtype"], rec["steps"]):
        raise _refuse(run_dir, f"msign {rec['dtype']}, {rec['steps']} Polar Express steps",
                      f"{ENV_VAR}={name}:{forced.steps}", f"{name}, {forced.steps} steps", ENV_VAR)


def _check_products(products: str, device: torch.device, run_dir: Path) -> None:
    forced = forced_products(device)
    if forced is None:
        return
    variable, kind = forced
    if kind == products or (kind == "no-split" and products != "split_bf16"):
        return
    requested = "no split-bf16 products" if kind == "no-split" else f"constraint products {kind}"
    raise _refuse(run_dir, f"constraint products {products}", variable, requested, variable.split("=")[0])


@contextlib.contextmanager
def resume_choice(meta: dict[str, Any], meta_path: Path, device: torch.device) -> Iterator[None]:
    """Inside: the msign and constraint-products choice a resumed run recorded in ``meta`` (its ``meta.json``) is
    this process's choice on ``device`` (the one it had comes back after). A run that recorded none, or recorded
    one for another kind of device (one line on stderr), takes this machine's.

    Raises:
        ValueError: the environment forces another choice than the recorded one (one line naming the variable, both
            choices and the ways out: unset it, or ``--fresh``), or the record is malformed.
    """
    rec, products = _recorded(meta, meta_path)
    run_dir = meta_path.parent
    if rec is not None and torch.device(rec.get("device", str(device))).type != device.type:
        print(f"weightgeom: {meta_path} records the msign choice of a {rec.get('device')} device; this session "
              f"runs on {device} and takes its own", file=sys.stderr)
        rec = None
    if rec is not None:
        _check_msign(rec, device, run_dir)
    if products is not None and device.type == "cpu":
        _check_products(products, device, run_dir)
    else:
        products = None
    if rec is None and products is None:
        yield
        return
    if rec is not None:
        dtype, steps = getattr(torch, rec["dtype"]), rec["steps"]
    else:  # only the products were recorded: msign as this machine chooses (the run's groups do not use it)
        now = msign_choice(device)
        dtype, steps = now.dtype, now.steps
    with adopted_msign_choice(device, dtype, steps, products or "ieee"):
        yield
