"""``compile_step``: an optimizer's step through ``torch.compile`` — the one switch (docs/muon.md §6; config key
``train.compile_optimizer``).

The first step runs eagerly: it creates the optimizer state and runs the checks a trace cannot (Muon's refusal of a
pretrained-looking matrix at ``init="auto"``, the far-retraction warning), and on a GPU it captures nothing. Later
steps run ``torch.compile(opt.step, fullgraph=...)`` inside ``full_precision()`` (a trace cannot switch the matmul
precision itself), so Muon's plain, manifold (host-free path) and AdamW groups are one graph, and so is a
MagnitudeDirection step over torch's Adam/AdamW or Muon (its host-free path, ``md_core``; docs/md.md, "On a
GPU"); on CUDA with ``mode="reduce-overhead"`` (CUDA graphs) by default. Inductor keeps its compiled kernels in its
on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, on by default), so a second run of the same configuration skips most of
the compilation; the one-off cost of this run is ``CompiledStep.compile_seconds``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from weightgeom.linalg import full_precision
from weightgeom.optim import md_core
from weightgeom.optim.magnitude_direction import MagnitudeDirection
from weightgeom.optim.muon import Muon

__all__ = ["compile_step", "CompiledStep", "default_mode", "COMPILE_OPTIMIZER", "WARM_CALLS"]

# ``train.compile_optimizer`` values: "auto" compiles on CUDA only (on the CPU the compiled step has not measured
# faster than the eager one with its C kernels: ``weightgeom bench optimizer_step``'s compiled column).
COMPILE_OPTIMIZER = ("auto", "on", "off")

WARM_CALLS = 3
"""Calls of a ``CompiledStep`` before it runs its compiled graph as every later step will: the eager first step,
then the two compiling calls (state created, then present). Benchmarks make these before they time it."""


def default_mode(opt: torch.optim.Optimizer) -> str | None:
    """``"reduce-overhead"`` (CUDA graphs) when the optimizer's parameters are on CUDA, else None (inductor's
    default)."""
    devices = {p.device.type for g in opt.param_groups for p in g["params"]}
    return "reduce-overhead" if devices == {"cuda"} else None


def wanted(setting: str, device: torch.device | str) -> bool:
    """Whether ``train.compile_optimizer = setting`` compiles the step on ``device`` ("auto": on CUDA only)."""
    if setting not in COMPILE_OPTIMIZER:
        raise ValueError(f"compile_optimizer={setting!r}: choose one of {list(COMPILE_OPTIMIZER)}")
    return setting == "on" or (setting == "auto" and torch.device(device).type == "cuda")


class CompiledStep:
    """A callable ``step(closure=None)``: the first call eagerly, later ones compiled (``compile_step``).

    Attributes:
        compiled: the ``torch.compile``'d ``opt.step``.
        compile_seconds: wall seconds of the calls that compiled (the second and third steps: state created, then
            present), each minus the previous eager step's time; None until both ran.
        fullgraph: whether a graph break is an error.
    """

    def __init__(self, opt: torch.optim.Optimizer, mode: str | None, backend: str | None, fullgraph: bool) -> None:
        self.opt = opt
        self.fullgraph = fullgraph
        self.compiled = torch.compile(opt.step, fullgraph=fullgraph, backend=backend, mode=mode)
        self.compile_seconds: float | None = None
        self._calls = 0
        self._eager_s = 0.0
        self._spent = 0.0

    def __call__(self, closure: Any = None) -> Any:
        self._calls += 1
        t0 = time.perf_counter()
        if self._calls == 1:
            out = self.opt.step(closure)
            self._eager_s = time.perf_counter() - t0
            return out
        for o in (self.opt, getattr(self.opt, "base_optimizer", None)):  # the checks a trace cannot make: values
            if hasattr(o, "check_groups"):  # a scheduler set since the last step (a NaN lr), one line, nothing changed
                o.check_groups()
        with full_precision():
            out = self.compiled(closure)
        if self._calls <= WARM_CALLS:
            self._spent += max(0.0, time.perf_counter() - t0 - self._eager_s)
            if self._calls == WARM_CALLS:
                self.compile_seconds = self._spent
        return out


def compile_step(opt: torch.optim.Optimizer, *, mode: str | None = "default", backend: str | None = None,
                 fullgraph: bool | None = None) -> CompiledStep:
    """The optimizer's step compiled: ``step = compile_step(opt)``, then ``step()`` where ``opt.step()`` was.

    Args:
        opt: a Muon, MagnitudeDirection or torch optimizer.
        mode: torch.compile's mode; ``"default"``: ``default_mode(opt)`` (CUDA graphs on CUDA).
        backend: torch.compile's backend (None: inductor).
        fullgraph: None: True when a step is one graph — a Muon with ``on_nonfinite="skip"`` whose manifolds all
            have a host-free retraction (``Muon.one_graph``), or a MagnitudeDirection with ``on_nonfinite="skip"``
            over torch's Adam/AdamW or such a Muon (``md_core.one_graph``: the trace runs its host-free step, the
            base included); False otherwise (torch's optimizers insert a graph break in ``step``).

    Returns:
        A ``CompiledStep`` (callable; ``compile_seconds`` after its third call).

    Raises:
        TypeError: a Muon manifold group (of ``opt`` or its base) whose manifold class does not implement
            ``retract_host_free`` (``Muon.check_host_free``), unless that Muon's ``host_free`` is False.
    """

    if mode == "default":
        mode = default_mode(opt)
    for o in (opt, getattr(opt, "base_optimizer", None)):  # a manifold without retract_host_free: refused now
        if isinstance(o, Muon) and o.host_free is not False:
            o.check_host_free()
    if fullgraph is None:
        fullgraph = (isinstance(opt, Muon) and opt.one_graph()) or (
            isinstance(opt, MagnitudeDirection) and md_core.one_graph(opt))
    return CompiledStep(opt, mode, backend, fullgraph)
