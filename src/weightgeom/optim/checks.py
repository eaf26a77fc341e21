"""Checks shared by weightgeom's optimizers (``Muon``, ``MagnitudeDirection``): the parameters they accept and the state
dicts they load. Each refusal is one ValueError line naming the parameter, group or key, raised before anything
changes.

- Parameters (at construction and in ``add_param_group``; ``check_new_group``): a dtype the step handles
  (``SUPPORTED_DTYPES``) and each parameter listed once — torch only warns about a parameter listed twice in one
  group, and would then step it twice.
- Parameters changed under their state (before every step; ``check_fits_param``): a gradient and state tensors of
  the parameter's shape, dtype and device — ``p.data = ...`` or ``model.half()`` after a step leaves them behind.
- Groups of torch's optimizers (``MagnitudeDirection``'s base; before every step and at load;
  ``check_group_kinds``): numeric hyperparameters of their defaults' kinds — torch checks them only in its
  constructor.
- State dicts (``load_state_dict``): torch's layout (``check_torch_layout``: ``{"state", "param_groups"}``, as many
  groups and parameters per group as this optimizer, state only for listed parameters), and per-parameter state
  entries of the shape and kind this optimizer would create (``check_param_state``; over a whole dict with the
  finiteness check, ``check_saved_state``); ``describe_state_dict`` says what a refused dict looks like instead
  (another optimizer's, MD's).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from weightgeom.optim.sharded import is_dtensor, local
from weightgeom.optim.state_checks import check_state_finite, state_entries

__all__ = ["SUPPORTED_DTYPES", "PARAM_SHAPED_STATE", "is_bookkeeping_key", "held_shape", "dtype_supported",
           "param_label", "unsupported_dtype", "check_new_group", "check_fits_param", "is_torch_optimizer",
           "torch_state_shapes", "param_shape", "fits_shape", "check_group_kinds", "describe_state_dict",
           "check_torch_layout", "check_param_state", "check_saved_state", "check_torch_state", "as_number"]

# The parameter dtypes every step path handles (msign, the manifold step, AdamW, MD's passes). Not complex (msign,
# retractions and sphere norms are real), integer or bool (no gradients), nor float8 (no norm, isfinite or promotion).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Per-parameter state of torch's optimizers that has the parameter's shape (Adam/AdamW, SGD, RMSprop, Adadelta,
# Adagrad, Adamax, NAdam, RAdam, ASGD, Rprop): checked when MagnitudeDirection loads a torch base optimizer's state.
PARAM_SHAPED_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum",
                      "grad_avg", "exp_inf", "ax", "prev")
_NOTHING = "nothing was loaded"
# Group keys that are not hyperparameters: the params, their names (ours, torch's named-params key), and what LR
# schedulers record (torch's ``initial_lr``, weightgeom's ``initial_<key>`` per LR key, ``train.schedule``).
_BOOKKEEPING_KEYS = frozenset({"params", "names", "param_names", "name"})


def is_bookkeeping_key(key: Any) -> bool:
    """Whether a param-group key is bookkeeping (params, names, an LR scheduler's ``initial_*``), not a
    hyperparameter."""
    return key in _BOOKKEEPING_KEYS or (isinstance(key, str) and key.startswith("initial_"))


def as_number(value: Any, integer: bool = False) -> float | int | None:
    """``value`` as a float (with ``integer``, an int by ``operator.index``), or None for a bool, a string or anything
    that does not convert (a tensor of several entries): how group values and ``DualAscent`` fields are read."""
    if isinstance(value, (bool, str, bytes)):
        return None
    try:
        return operator.index(value) if integer else float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def dtype_supported(p: torch.Tensor) -> bool:
    """Whether a parameter's dtype is one of ``SUPPORTED_DTYPES``."""
    return p.dtype in SUPPORTED_DTYPES


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def param_label(name: str | None, gi: int, i: int, p: torch.Tensor) -> str:
    """``parameter 'fc.weight' (group 0, position 2, shape (16, 8))``, or ``parameter at group 0, position 2 (shape
    (16, 8))`` when its name is unknown."""
    if name is None:
        return f"parameter at group {gi}, position {i} (shape {tuple(p.shape)})"
    return f"parameter {name!r} (group {gi}, position {i}, shape {tuple(p.shape)})"


def unsupported_dtype(who: str, label: str, p: torch.Tensor) -> ValueError:
    """The one-line refusal of a parameter whose dtype is not in ``SUPPORTED_DTYPES``."""
    supported = ", ".join(_dtype_name(d) for d in SUPPORTED_DTYPES)
    return ValueError(f"{who}: {label} has dtype {_dtype_name(p.dtype)}, which {who} cannot step; supported dtypes: "
                      f"{supported} (convert it, or leave it out of the optimizer)")


def _group_entries(group: Mapping[str, Any]) -> list[tuple[str | None, torch.Tensor]]:
    """(name or None, tensor) per parameter of a group, given as torch accepts it (a tensor, tensors, or named pairs);
    ``group["params"]`` must be a list already (``check_new_group`` makes it one)."""
    params = group["params"]
    names = group.get("names", group.get("param_names"))
    out = []
    for i, item in enumerate(params):
        name, t = (item[0], item[1]) if isinstance(item, tuple) and len(item) == 2 else (None, item)
        if name is None and names is not None and i < len(names):
            name = names[i]
        out.append((None if name is None else str(name), t))
    return out


def check_new_group(who: str, groups: Sequence[Mapping[str, Any]], group: dict[str, Any]) -> None:
    """Refuse a param group about to join ``groups`` if one of its parameters has an unsupported dtype or is listed
    twice (in it, or already in ``groups``), naming it; turns ``group["params"]`` into a list as torch does (a set is
    left for torch to refuse).

    Raises:
        ValueError: one line naming the parameter (group index, position, shape, dtype) and what is supported.
    """
    params = group.get("params")
    if isinstance(params, torch.Tensor):
        group["params"] = [params]
    elif params is not None and not isinstance(params, (set, list)):
        group["params"] = list(params)
    if not isinstance(group.get("params"), list):
        return
    gi = len(groups)
    seen: dict[int, tuple[int, int]] = {}
    for gj, other in enumerate(groups):
        for j, (_, t) in enumerate(_group_entries(other)):
            seen.setdefault(id(t), (gj, j))
    for i, (name, t) in enumerate(_group_entries(group)):
        if not isinstance(t, torch.Tensor):
            continue  # torch refuses it
        label = param_label(name, gi, i, t)
        if not dtype_supported(t):
            raise unsupported_dtype(who, label, t)
        if id(t) in seen:
            gj, j = seen[id(t)]
            raise ValueError(f"{who}: {label} is listed twice (also group {gj}, position {j}); list each parameter "
                             "once (it would be stepped twice per step)")
        seen[id(t)] = (gi, i)


def _tensor_desc(t: torch.Tensor) -> str:
    """``float32 (16, 8) on cpu``."""
    return f"{_dtype_name(t.dtype)} {tuple(t.shape)} on {t.device}"


def _misfit(p: torch.Tensor, state: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...] | None],
            param_like: Collection[str]) -> tuple[str, torch.Tensor, bool] | None:
    """(what, tensor, whether only its dtype or device differs) for the first of p's gradient and state tensors that
    no longer fits p, or None. The gradient and the ``param_like`` entries must have p's shape, dtype and device;
    other tensor entries of ``shapes`` (None: a step count, not checked) their shape and p's device."""
    g = p.grad
    if g is not None and (g.shape != p.shape or g.dtype != p.dtype or g.device != p.device):
        return "gradient", g, g.shape == p.shape
    for key, shape in shapes.items():
        t = state.get(key)
        if shape is None or not torch.is_tensor(t):
            continue
        same_shape = fits_shape(t, shape)
        if not same_shape or t.device != p.device or (key in param_like and t.dtype != p.dtype):
            return f"optimizer state {key!r}", t, same_shape
    return None


def check_fits_param(who: str, label: str, p: torch.Tensor, state: Mapping[str, Any],
                     shapes: Mapping[str, tuple[int, ...] | None], param_like: Collection[str] = (),
                     remedy: str | None = None) -> None:
    """Refuse a step, before anything changes, when p's gradient or a tensor of its optimizer state no longer fits p:
    the parameter was changed after they were made (``p.data = ...``; ``model.half()``/``.to()`` after a step), and
    the step would raise on it after stepping the parameters before it. Metadata only: no host synchronisation.

    Args:
        who: the optimizer's name, for messages.
        label: the parameter (``param_label``).
        p: the parameter (a plain tensor: a DTensor's local shard or whole matrix as it is stepped).
        state: its optimizer state.
        shapes: state key → the shape the optimizer keeps there (None: a step count, not checked).
        param_like: the keys whose tensors also have p's dtype (momentum buffers, Adam moments).
        remedy: what to do when a state tensor does not fit (default: build the optimizer again, or, when only the
            dtype or device differs, load its ``state_dict()`` back: torch casts state to its parameter's).

    Raises:
        ValueError: one line naming the parameter, the gradient or state entry, both descriptions and what to do.
    """
    bad = _misfit(p, state, shapes, param_like)
    if bad is None:
        return
    what, t, castable = bad
    if what == "gradient":
        fix = "compute the gradient again"
    elif remedy is not None:
        fix = remedy
    elif castable:
        fix = ("build the optimizer again, or load its state_dict() back (torch casts it to the parameter's dtype "
               "and device)")
    else:
        fix = "build the optimizer again for the new shape"
    raise ValueError(f"{who}: {label} is {_tensor_desc(p)} but its {what} is {_tensor_desc(t)}: the parameter was "
                     f"changed since (p.data = ..., model.half() or .to()); {fix}; step refused, nothing was changed")


# ---------------------------------------------------------------------------------------------------------------------
# State dicts.
# ---------------------------------------------------------------------------------------------------------------------
def describe_state_dict(sd: Any) -> str:
    """What a state dict looks like, for a refusal: ``"a MagnitudeDirection state dict"``, ``"a Muon state dict"``,
    ``"a torch.optim.AdamW state dict"``, ..."""
    if not isinstance(sd, Mapping):
        return f"a {type(sd).__name__}, not a state dict"
    if "md" in sd and ("base" in sd or "state" in sd):  # MD's layout, or its older nested one
        return "a MagnitudeDirection state dict"
    groups = sd.get("param_groups")
    if "state" not in sd or not isinstance(groups, (list, tuple)):
        return f"a dict with keys {sorted(map(str, sd))[:6]}"
    if groups and isinstance(groups[-1], Mapping) and groups[-1].get("md_role") == "gains":
        return "a MagnitudeDirection state dict"
    keys: set[str] = set()
    for g in groups:
        if isinstance(g, Mapping):
            keys |= {str(k) for k in g}
    if "algorithm" in keys:
        return "a Muon state dict"
    if "ns_coefficients" in keys:
        return "a torch.optim.Muon state dict"
    if {"amsgrad", "betas"} <= keys:
        decoupled = any(isinstance(g, Mapping) and g.get("decoupled_weight_decay") for g in groups)
        return f"a torch.optim.{'AdamW' if decoupled else 'Adam'} state dict"
    if "dampening" in keys:
        return "a torch.optim.SGD state dict"
    return f"an optimizer state dict with group keys {sorted(keys - {'params'})[:8]}"


def check_torch_layout(who: str, groups: Sequence[Mapping[str, Any]], sd: Any, expected: str
                       ) -> dict[Any, tuple[int, int]]:
    """Refuse ``sd`` unless it has torch's optimizer layout for ``groups``: ``{"state", "param_groups"}``, as
    many groups, each listing as many parameter ids (or names, as ``torch.distributed.checkpoint`` writes them) as
    this optimizer's, ids unique, state only for listed ids, each a dict.

    Args:
        who: the optimizer's name (``"Muon"``) for messages.
        groups: this optimizer's param groups.
        sd: the state dict to load.
        expected: what ``sd`` should be, for messages (``"a Muon state dict"``).

    Returns:
        {saved parameter id: (group index, position)}.

    Raises:
        ValueError: one line naming what does not fit (and what ``sd`` looks like instead); nothing loaded.
    """
    where = f"{who}.load_state_dict"
    if not isinstance(sd, Mapping) or not {"state", "param_groups"} <= set(sd):
        raise ValueError(f"{where}: expected {expected} ({{'state': ..., 'param_groups': [...]}}), got "
                         f"{describe_state_dict(sd)}; {_NOTHING}")
    saved, state = sd["param_groups"], sd["state"]
    if not isinstance(saved, (list, tuple)) or not all(isinstance(g, Mapping) for g in saved):
        raise ValueError(f"{where}: 'param_groups' must be a list of dicts, got {type(saved).__name__}; {_NOTHING}")
    if len(saved) != len(groups):
        raise ValueError(f"{where}: the state dict ({describe_state_dict(sd)}) has {len(saved)} param groups, this "
                         f"optimizer has {len(groups)}; {_NOTHING}")
    ids: dict[Any, tuple[int, int]] = {}
    for gi, (s, g) in enumerate(zip(saved, groups)):
        pids = s.get("params")
        # ids as torch.optim saves them (ints), or parameter names as torch.distributed.checkpoint's
        # get_optimizer_state_dict writes them; either way matched by position, as torch's own loader does
        if not isinstance(pids, (list, tuple)) or not all(isinstance(k, (int, str)) and not isinstance(k, bool)
                                                          for k in pids):
            raise ValueError(f"{where}: group {gi}'s 'params' must be a list of parameter ids or names; {_NOTHING}")
        if len(pids) != len(g["params"]):
            raise ValueError(f"{where}: group {gi} of the state dict has {len(pids)} parameters, this optimizer's has "
                             f"{len(g['params'])}; {_NOTHING}")
        for i, k in enumerate(pids):
            if k in ids:
                raise ValueError(f"{where}: parameter id {k} is listed twice (group {ids[k][0]} and {gi}); {_NOTHING}")
            ids[k] = (gi, i)
    if not isinstance(state, Mapping):
        raise ValueError(f"{where}: 'state' must be a dict, got {type(state).__name__}; {_NOTHING}")
    for k, v in state.items():
        if k not in ids:
            raise ValueError(f"{where}: 'state' has an entry for parameter id {k!r}, which no group lists; {_NOTHING}")
        if not isinstance(v, Mapping):
            raise ValueError(f"{where}: the state of parameter id {k} must be a dict, got {type(v).__name__}; "
                             f"{_NOTHING}")
    return ids


def _is_count(value: Any) -> bool:
    """A step count: a real number ≥ 0, or a 0-dim real tensor (torch keeps ``step`` as one)."""
    if torch.is_tensor(value):
        return value.ndim == 0 and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def _shown(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a {_dtype_name(value.dtype)} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def check_param_state(who: str, label: str, state: Mapping[str, Any],
                      expected: Mapping[str, tuple[int, ...] | None], strict: bool = True) -> None:
    """Refuse one parameter's saved state unless every entry is what this optimizer would create for it.

    Args:
        who: the optimizer's name, for messages.
        label: the parameter (``param_label``).
        state: its saved state.
        expected: key → the shape of the floating tensor this optimizer keeps there, or None for a step count (a
            number ≥ 0 or a 0-dim real tensor).
        strict: refuse keys not in ``expected`` (False: leave them unchecked — another optimizer's own state).

    Raises:
        ValueError: one line naming the parameter, the key, what it holds and what was expected; nothing loaded.
    """
    where = f"{who}.load_state_dict"
    for key, value in state.items():
        if key not in expected:
            if strict:
                raise ValueError(f"{where}: {label}: state key {key!r} is not one this optimizer keeps "
                                 f"({sorted(expected)}); {_NOTHING}")
            continue
        shape = expected[key]
        if shape is None:
            if not _is_count(value):
                raise ValueError(f"{where}: {label}: state {key!r} is {_shown(value)}, expected a step count (a "
                                 f"number ≥ 0 or a 0-dim tensor); {_NOTHING}")
        elif not (torch.is_tensor(value) and value.is_floating_point() and fits_shape(value, shape)):
            shown = " or ".join(str(s) for s in sorted(shape)) if isinstance(shape, frozenset) else tuple(shape)
            raise ValueError(f"{where}: {label}: state {key!r} is {_shown(value)}, this optimizer keeps a floating "
                             f"tensor of shape {shown} there; {_NOTHING}")


def check_saved_state(who: str, groups: Sequence[Mapping[str, Any]], sd: Mapping[str, Any],
                      ids: Mapping[Any, tuple[int, int]],
                      expect: Callable[[int, int, torch.Tensor], tuple[str, Mapping[str, tuple[int, ...] | None]]],
                      strict: bool = True) -> None:
    """Refuse the per-parameter state of ``sd`` (its ids mapped to (group, position) by ``check_torch_layout``)
    unless each parameter's entries are what ``expect(gi, i, p)`` → (label, expected) says (``check_param_state``)
    and every floating state tensor is finite (``state_checks.check_state_finite``: one fused reduction, one host
    read): a NaN momentum, moment or dual state, loaded, would freeze its parameter silently.

    Raises:
        ValueError: one line naming the parameter and the state entry; nothing loaded.
    """
    entries = []
    for k, st in sd["state"].items():
        gi, i = ids[k]
        label, expected = expect(gi, i, groups[gi]["params"][i])
        check_param_state(who, label, st, expected, strict)
        entries += state_entries(label, st)
    check_state_finite(who, entries)


def held_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape a rank holds of a state tensor: a DTensor's local shard's (the state of an elementwise FSDP2
    parameter, sharded like it), else the tensor's."""
    return tuple(local(t).shape)


def is_torch_optimizer(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` is one of torch's own optimizers (``torch.optim.*``), whose per-parameter state
    ``PARAM_SHAPED_STATE`` describes."""
    return type(opt).__module__.startswith("torch.optim")


def param_shape(p: torch.Tensor) -> tuple[int, ...] | frozenset[tuple[int, ...]]:
    """The shape of p-shaped optimizer state: p's; for a DTensor p (FSDP2) either its local shard's (the state of an
    elementwise parameter, stepped on the shard: a DTensor sharded like p, or a plain shard in older per-rank
    checkpoints) or its whole shape (a matrix stepped whole on its owner rank, e.g. a magnitude–direction matrix)."""
    if is_dtensor(p):
        return frozenset({tuple(p.shape), held_shape(p)})
    return tuple(p.shape)


def fits_shape(t: torch.Tensor, shape: tuple[int, ...] | frozenset[tuple[int, ...]]) -> bool:
    """Whether state tensor ``t`` has ``shape`` (``param_shape``: one shape, or a set of them), judged by what a rank
    holds (``held_shape``) or by its whole shape."""
    allowed = shape if isinstance(shape, frozenset) else {tuple(shape)}
    return held_shape(t) in allowed or tuple(t.shape) in allowed


def torch_state_shapes(p: torch.Tensor) -> dict[str, Any]:
    """The state a torch optimizer keeps for ``p``, as ``check_param_state``/``check_fits_param`` take it: the
    ``PARAM_SHAPED_STATE`` keys (``param_shape``) and ``step`` (a count)."""
    shapes: dict[str, Any] = {key: param_shape(p) for key in PARAM_SHAPED_STATE}
    shapes["step"] = None
    return shapes


def _real(v: Any) -> bool:
    """A real number that is not NaN (not a bool; NumPy's count), or a one-element real tensor (torch takes a tensor
    ``lr``)."""
    if torch.is_tensor(v):
        return v.numel() == 1 and not v.is_complex() and v.dtype != torch.bool
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and not math.isnan(v)


def _numbers_in(default: Any) -> int | None:
    """How many numbers a hyperparameter whose default is ``default`` holds: 0 for a number, n for a tuple of n
    numbers, None for anything else (a bool, None, a string: not checked — torch's steps only read their truth)."""
    if isinstance(default, bool):
        return None
    if isinstance(default, numbers.Real):
        return 0
    if isinstance(default, tuple) and default and all(_real(d) for d in default):
        return len(default)
    return None


def check_group_kinds(who: str, opt: torch.optim.Optimizer, gi: int, group: Mapping[str, Any], when: str) -> None:
    """Refuse a param group of one of torch's optimizers whose numeric hyperparameter is not of its default's kind (a
    number that is not NaN, or a tuple of as many: ``lr="fast"``, ``betas=(0.9,)``, ``eps=None``) — torch checks
    values only in its constructor, and its step would raise on it after other parameters had stepped.

    Args:
        who: the caller, for messages (``"MagnitudeDirection"``).
        opt: the optimizer whose ``defaults`` say what each key is.
        gi: the group's index, for messages.
        group: the group (this optimizer's, or one about to be loaded).
        when: what is refused and how the value got there, for messages (``"step refused, ..."``).

    Raises:
        ValueError: one line naming the group, the key, its value and what it must be.
    """
    for key, value in group.items():
        if key not in opt.defaults or is_bookkeeping_key(key):
            continue
        default = opt.defaults[key]
        n = _numbers_in(default)
        if not (n is None or (_real(value) if n == 0 else isinstance(value, (tuple, list)) and len(value) == n
                              and all(_real(v) for v in value))):
            kind = "a number" if n == 0 else f"{n} numbers"
            raise ValueError(f"{who}: group {gi} of {type(opt).__name__} has {key}={value!r}, which must be {kind} "
                             f"(its default is {default!r}); {when}")


def check_torch_state(who: str, opt: torch.optim.Optimizer, sd: Any) -> None:
    """Validate a state dict for a plain torch optimizer (a base of ``MagnitudeDirection``) without loading it: torch's
    layout (``check_torch_layout``), group keys this optimizer's groups have (others name another optimizer's), for
    torch's own optimizers with values of their defaults' kinds (``check_group_kinds``), and parameter-shaped state
    (``PARAM_SHAPED_STATE``, ``step``) of its parameter's shape, every floating state tensor finite
    (``state_checks.check_state_finite``).

    Raises:
        ValueError: one line naming what does not fit; nothing loaded.
    """
    name = type(opt).__name__
    qualified = f"torch.optim.{name}" if is_torch_optimizer(opt) else name
    expected = f"a {qualified} state dict"
    ids = check_torch_layout(who, opt.param_groups, sd, expected)
    for gi, (saved, group) in enumerate(zip(sd["param_groups"], opt.param_groups)):
        unknown = sorted(str(k) for k in set(saved) - set(group) if not is_bookkeeping_key(k))
        if unknown:
            raise ValueError(f"{who}.load_state_dict: group {gi} has key(s) {unknown[:6]} that {name}'s groups do not "
                             f"have: this is {describe_state_dict(sd)}, not {expected}; {_NOTHING}")
        if is_torch_optimizer(opt):
            check_group_kinds(f"{who}.load_state_dict", opt, gi, saved,
                              f"the state dict's value is refused; {_NOTHING}")
    check_saved_state(who, opt.param_groups, sd, ids,
                      lambda gi, i, p: (param_label(None, gi, i, p), torch_state_shapes(p)), strict=False)
