"""``MagnitudeDirection`` as torch users expect an optimizer to behave: its per-matrix state created (and created late,
for parameters built on the meta device), its base optimizer stepped once per MD step without the global step hooks
firing a second time, and a base group's ``maximize`` reaching the gains (docs/md.md, "torch.optim citizenship").

- ``init_state``: the MD state of one decoupled matrix — direction Ŵ = W, its radius, gains θ with φ(θ) = 1. Over a
  meta-device parameter (deferred initialisation: ``torch.device("meta")``, FSDP2 before ``to_empty``) the state is
  made on the meta device and nothing is read; ``materialize`` redoes it from the real values at the first step
  (``validate_matrix`` then refuses, naming the parameter, what the constructor would have refused).
- ``MDState`` and ``dcp_init_step``: ``state`` is falsy until the wrapper has stepped or loaded (as a torch
  optimizer's is empty until then, although MD keeps each matrix's direction and gains from construction), so
  ``torch.distributed.checkpoint`` creates the base's state by its zero step, which then changes no parameter and no
  MD state.
- ``step_base``: the base's ``step()`` with the hooks registered on the base itself (``base.register_step_pre_hook``)
  but not the global ones (``torch.optim.optimizer.register_optimizer_step_pre_hook``/``post_hook``): those fire
  around the MD step, once, as they do for any optimizer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from weightgeom.optim.md_functional import _ZERO_NORM, gain_init, normalize_rows_, sphere_norm
from weightgeom.optim.md_state import GAIN_KEYS
from weightgeom.optim.sharded import is_dtensor
from weightgeom.optim.state_checks import is_zero_step, kept

if TYPE_CHECKING:  # pragma: no cover
    from weightgeom.optim.magnitude_direction import MagnitudeDirection

__all__ = ["GAIN_SHAPES", "MDState", "dcp_init_step", "on_meta", "validate_matrix", "init_state", "materialize",
           "ascends", "step_base"]

# the gains each option keeps for an m×n matrix: (γ_r's shape, γ_c's shape), None where absent
GAIN_SHAPES = {"row+col": lambda m, n: ((m,), (n,)), "row": lambda m, n: ((m,), None),
               "col": lambda m, n: (None, (n,)), "scalar": lambda m, n: ((1,), None),
               "none": lambda m, n: (None, None)}


def on_meta(t: torch.Tensor) -> bool:
    """Whether a tensor (a DTensor: its local shard) is on the meta device: it has a shape but no values."""
    return t.device.type == "meta"


def validate_matrix(p: torch.Tensor, name: str, sphere: str) -> None:
    """Refuse a matrix MD cannot decouple: not 2-D, NaN/Inf entries, or no direction (a zero norm, row or column on
    its sphere). Meta tensors: only the shape is checked (``materialize`` checks the rest at the first step).

    Raises:
        ValueError: one line naming the parameter and what to do.
    """
    if p.ndim != 2:
        raise ValueError(f"MagnitudeDirection: parameter {name!r} has shape {tuple(p.shape)}; only 2-D matrices "
                         "can be decoupled (drop it from params=, or let the default rule pick 2-D params)")
    if on_meta(p):
        return
    if not bool(torch.isfinite(p).all()):
        raise ValueError(f"MagnitudeDirection: parameter {name!r} has NaN/Inf entries")
    norms = sphere_norm(p.detach(), sphere)
    if bool((norms <= _ZERO_NORM).any()):
        what = {"frobenius": "zero norm", "row": "a zero row", "col": "a zero column"}[sphere]
        raise ValueError(f"MagnitudeDirection: parameter {name!r} has {what}; its direction is undefined "
                         f"(initialise it non-zero, or exclude it from decoupling)")


def init_state(md: MagnitudeDirection, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The MD state of decoupled matrix ``p`` as the constructor creates it: direction Ŵ = W (a copy), radius = its
    sphere norm (float64 for a float64 W, else float32; whole for a DTensor W), gains θ with φ(θ) = 1 on W's device.
    On the meta device: the same shapes and dtypes, nothing read."""
    gdtype = torch.float64 if p.dtype == torch.float64 else torch.float32
    D = p.detach().clone()
    if on_meta(p):
        shape = sphere_norm(torch.empty(p.shape, device="meta"), md.sphere).shape
        radius = torch.empty(shape, dtype=gdtype, device="meta")
    else:
        radius = sphere_norm(D, md.sphere).to(gdtype)
        radius = radius.full_tensor() if is_dtensor(radius) else radius  # DTensor p: whole
    st = {"direction": D, "radius": radius}
    for key, shape in zip(GAIN_KEYS, GAIN_SHAPES[md.gains](*p.shape)):
        if shape is not None:
            st[key] = gain_init(shape, md.parameterization, dtype=gdtype, device=p.device)
    return st


def materialize(md: MagnitudeDirection) -> None:
    """Make the MD state of matrices built on the meta device from their values now (``init_state``), at the first
    step.

    Raises:
        ValueError: a parameter is still on the meta device (give it values first: ``model.to_empty(device=...)``
            with ``torch.__future__.set_swap_module_params_on_conversion(True)``, then initialise it), or has values
            the constructor would refuse (``validate_matrix``); naming it; nothing changed.
    """
    todo = [p for p in md._decoupled if on_meta(md.state[p]["direction"])]
    for p in todo:
        if on_meta(p):
            raise ValueError(f"MagnitudeDirection: parameter {md._name[p]!r} is still on the meta device; give the "
                             "model its values before the first step (model.to_empty(device=...) with "
                             "torch.__future__.set_swap_module_params_on_conversion(True), which keeps the parameter "
                             "objects the optimizer holds, then initialise it); step refused, nothing was changed")
        validate_matrix(p, md._name[p], md.sphere)
    for p in todo:
        st = md.state[p]
        for key, value in init_state(md, p).items():
            if key in GAIN_KEYS and key in st:
                md.state.pop(st[key], None)  # the meta θ's Adam state (none before a step)
            st[key] = value
        md._versions[p] = p._version
    for p in md._unit_rows:  # the constructor's projection, skipped on the meta device
        with torch.no_grad():
            normalize_rows_(p, md.embedding_radius)
    if on_meta(md._skipped):
        live = next((q for g in md.base_optimizer.param_groups for q in g["params"] if not on_meta(q)), None)
        md._skipped = torch.zeros((), dtype=torch.int64, device=live.device if live is not None else "cpu")
    md._deferred = False


def ascends(group: dict[str, Any]) -> bool:
    """Whether a base group maximizes (torch's ``maximize=True``): its matrices' gains then step on −∂L/∂θ."""
    return bool(group.get("maximize", False))


def step_base(base: torch.optim.Optimizer) -> Any:
    """``base.step()`` as MD's inner step: the base's own step hooks run, the global ones do not (they run around the
    MD step that calls this: once per step). A base whose class step is not torch's hooked wrapper is called as is."""
    fn = type(base).step
    raw = getattr(fn, "__wrapped__", None)
    if not getattr(fn, "hooked", False) or raw is None:
        return base.step()
    args: tuple[Any, ...] = (base,)
    kwargs: dict[str, Any] = {}
    for hook in list(base._optimizer_step_pre_hooks.values()):
        result = hook(base, args, kwargs)
        if result is not None:
            args, kwargs = result
    out = raw(*args, **kwargs)
    base._optimizer_step_code()
    for hook in list(base._optimizer_step_post_hooks.values()):
        hook(base, args, kwargs)
    if "step" in vars(base):  # an LR scheduler built on the base wraps its step to note the call: note it too
        base._opt_called = True
    return out


class MDState(defaultdict):
    """``MagnitudeDirection.state``: torch's ``defaultdict(dict)`` of per-tensor state, false in a boolean test until
    the wrapper has stepped or loaded a state dict (``live``), as a torch optimizer's state is empty until its first
    step. ``torch.distributed.checkpoint`` tests ``if optimizer.state`` to decide whether to create the state by one
    zero step (``dcp_init_step``); MD's own entries exist from construction."""

    def __init__(self, live: bool = False, items: Any = ()) -> None:
        super().__init__(dict, items)
        self.live = live

    def __bool__(self) -> bool:
        return self.live and len(self) > 0

    def __missing__(self, key: Any) -> dict:  # defaultdict's, in Python: torch.compile traces it
        value: dict = {}
        self[key] = value
        return value

    def __reduce__(self) -> tuple:  # pickle and deepcopy keep ``live``
        return (type(self), (self.live, list(self.items())))


def dcp_init_step(md: MagnitudeDirection) -> Callable[[], None] | None:
    """The undo of ``torch.distributed.checkpoint``'s state initialisation on ``md``, or None when this step is not
    one (``md.state`` not live, every lr — the gains' included — 0, every gradient zero: ``state_checks.is_zero_step``).

    Such a step still re-projects each direction and recomposes W (rounding), and a Muon base retracts; the decoupled
    matrices, the unit-row embeddings and MD's per-matrix tensors are copied first, and the returned function writes
    them back after the step, so only the base's and the gains' Adam state are created (and replaced by the load).
    """
    if torch.compiler.is_compiling() or md.state or not is_zero_step(md.param_groups):
        return None
    put_back = kept([*md._decoupled, *md._unit_rows,
                     *(t for p in md._decoupled for t in md.state[p].values() if torch.is_tensor(t))])

    def undo() -> None:
        put_back()
        for p in md._decoupled:
            md._versions[p] = p._version  # W equals γ_r Ŵ γ_c again

    return undo
