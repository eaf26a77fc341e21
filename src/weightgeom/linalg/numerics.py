"""``Numerics``: which arithmetic the optimizers run on one device, as one value, and ``resolve_numerics``, its one
producer.

The msign compute dtype and Polar Express step count, manifold Muon's constraint-product kind, the C kernels and
msign's CUDA-graph replay used to be ambient (an on-disk autotune cache, six ``WEIGHTGEOM_*`` variables read where
they were used). ``resolve_numerics(device)`` reads them once — the overrides through ``weightgeom._numerics_env``,
the only module that reads those variables, and the autotuner's measured or cached choice
(``weightgeom.linalg.autotune.msign_choice`` / ``products_for``) — into a frozen ``Numerics`` that records where each
setting came from. ``Muon`` resolves it once per device when its groups are added, keeps it (``opt.numerics``), shows
it (``describe(opt)``, ``opt.summary()``), saves it in its state dict and the run's ``meta.json``, and passes its
settings to the maths as arguments.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from weightgeom._numerics_env import (
    CUDA_GRAPHS_VAR,
    DEFAULT_CUDA_GRAPHS_MAX_MB,
    MSIGN_DTYPES,
    MSIGN_VAR,
    NO_KERNELS_VAR,
    cuda_graphs_enabled,
    cuda_graphs_max_mb,
    kernels_enabled,
)
from weightgeom.linalg.autotune import PRODUCTS, forced_products, msign_choice, products_for

__all__ = ["Numerics", "resolve_numerics", "MSIGN_SOURCES", "NOT_RESOLVED"]

# MsignChoice.source → where the msign setting came from, as Numerics names it
MSIGN_SOURCES = {"env": MSIGN_VAR, "cache": "autotune cache", "benchmark": "autotune benchmark",
                 "rank0": "rank 0's choice", "run": "the resumed run's meta.json"}
_DTYPES = {name: getattr(torch, name) for name in MSIGN_DTYPES}
NOT_RESOLVED = "not resolved (no manifold group on this device)"


@dataclass(frozen=True)
class Numerics:
    """The arithmetic on one device: what each setting is and where it came from.

    Attributes:
        device: the device (``"cpu"``, ``"cuda:0"``, ...).
        msign_dtype: msign's compute dtype where a Muon group leaves it to the device (``msign_dtype=None``).
        msign_steps: Polar Express steps where a group leaves ``ns_steps`` to the device.
        products: manifold Muon's constraint products: ``"ieee"`` (float32 through torch's BLAS), ``"ieee_onednn"``
            (float32 through oneDNN) or ``"split_bf16"`` (``weightgeom.linalg.split``); always ``"ieee"`` off the
            CPU.
        kernels: whether the C kernels may be used (``MagnitudeDirection``'s fused paths).
        cuda_graphs: whether msign replays CUDA graphs (on CUDA devices only).
        cuda_graphs_max_mb: the largest call captured, MiB of tensor arguments (``inf``: no cap).
        msign_source, products_source, kernels_source, cuda_graphs_source: where each came from: ``"autotune
            cache"``, ``"autotune benchmark"``, a variable (``WEIGHTGEOM_MSIGN``, ``WEIGHTGEOM_PRODUCTS=ieee``,
            ...), ``"default"``, ...
    """

    device: str
    msign_dtype: torch.dtype
    msign_steps: int
    products: str = "ieee"
    kernels: bool = True
    cuda_graphs: bool = False
    cuda_graphs_max_mb: float = DEFAULT_CUDA_GRAPHS_MAX_MB
    msign_source: str = "default"
    products_source: str = "default"
    kernels_source: str = "default"
    cuda_graphs_source: str = "default"

    @property
    def graphs_max_mb(self) -> float:
        """msign's ``cuda_graphs_max_mb`` argument: the cap where CUDA graphs are on, 0 (never capture) where off."""
        return self.cuda_graphs_max_mb if self.cuda_graphs else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain strings, ints, floats and bools (state dicts, ``meta.json``); ``from_dict`` reads it back."""
        d = dataclasses.asdict(self)
        d["msign_dtype"] = str(self.msign_dtype).replace("torch.", "")
        d["cuda_graphs_max_mb"] = "inf" if math.isinf(self.cuda_graphs_max_mb) else self.cuda_graphs_max_mb
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Numerics:
        """The value ``as_dict`` wrote.

        Raises:
            ValueError: one line naming the field that is not one ``as_dict`` writes.
        """
        if not isinstance(d, dict):
            raise ValueError(f"numerics: expected a dict, got {type(d).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown or d.get("msign_dtype") not in _DTYPES:
            raise ValueError(f"numerics: unknown field(s) {unknown} or msign_dtype={d.get('msign_dtype')!r}")
        steps = d.get("msign_steps")
        if type(steps) is not int or steps < 1 or d.get("products", "ieee") not in PRODUCTS:
            raise ValueError(f"numerics: msign_steps={steps!r} or products={d.get('products')!r} is invalid")
        mb = d.get("cuda_graphs_max_mb", DEFAULT_CUDA_GRAPHS_MAX_MB)
        return cls(**{**d, "msign_dtype": _DTYPES[d["msign_dtype"]],
                      "cuda_graphs_max_mb": math.inf if mb == "inf" else float(mb)})

    def describe(self) -> str:
        """One line: each setting with where it came from."""
        dtype = str(self.msign_dtype).replace("torch.", "")
        graphs = "off" if not self.cuda_graphs else (
            "on" + ("" if math.isinf(self.cuda_graphs_max_mb) else f" ≤ {self.cuda_graphs_max_mb:g} MiB"))
        products = "constraint products not resolved (no manifold group here)" if \
            self.products_source == NOT_RESOLVED else f"constraint products {self.products} ({self.products_source})"
        return (f"numerics on {self.device}: msign {dtype}, {self.msign_steps} Polar Express steps "
                f"({self.msign_source}); {products}; C kernels "
                f"{'on' if self.kernels else 'off'} ({self.kernels_source}); CUDA graphs {graphs} "
                f"({self.cuda_graphs_source})")


def resolve_numerics(device: torch.device | str, *, constraint_products: bool = True) -> Numerics:
    """The numerics on ``device``: the ``WEIGHTGEOM_*`` overrides where set, else the autotuner's choice (measured at
    first use on this machine, then read from its disk cache), else the defaults.

    Args:
        device: where the optimizer's tensors live.
        constraint_products: resolve manifold Muon's constraint products (on a CPU this may time them, ~3 s once per
            process where ``WEIGHTGEOM_MSIGN`` forces the msign choice); False leaves ``"ieee"`` marked
            ``NOT_RESOLVED`` (an optimizer without manifold groups on the device).

    Returns:
        A frozen ``Numerics``.

    Raises:
        ValueError: a variable holds a value it does not accept (one line naming it).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    choice = msign_choice(device)
    msign_source = MSIGN_SOURCES.get(choice.source, choice.source.replace("fallback", "default", 1))
    if device.type != "cpu":
        products, products_source = "ieee", "default (not a CPU)"
    elif not constraint_products:
        products, products_source = "ieee", NOT_RESOLVED
    else:
        products = products_for(device)
        forced = forced_products(device)
        products_source = forced[0] if forced is not None else (
            "autotune benchmark" if choice.source == "env" else msign_source)
    kernels = kernels_enabled()
    graphs = device.type == "cuda" and cuda_graphs_enabled()
    max_mb = cuda_graphs_max_mb()
    graphs_source = "not CUDA" if device.type != "cuda" else (
        f"{CUDA_GRAPHS_VAR}=0" if not graphs else "default")
    return Numerics(str(device), choice.dtype, choice.steps, products, kernels, graphs, max_mb, msign_source,
                    products_source, "default" if kernels else f"{NO_KERNELS_VAR} set", graphs_source)
