"""State-dict compatibility of ``Muon``: torch.optim.Muon's defaults and state dicts, and older Muon checkpoints.

- ``TORCH_MUON``: torch.optim.Muon's defaults as Muon keywords (``Muon.torch_defaults`` builds a Muon with them,
  which steps as torch.optim.Muon does, to rounding: ``functional.newton_schulz`` is torch's arithmetic).
- Loading (``Muon.load_state_dict`` calls ``loadable_group`` per saved group): a torch.optim.Muon state dict loads into
  plain or manifold Muon groups with the EMA momentum form — its momentum buffers carried over, its hyperparameters
  (lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn) taken as torch takes a loaded
  group's. A Muon checkpoint from before ``adamw_eps`` (its groups carry ``eps`` as the AdamW ε and no
  ``adamw_eps``) loads with its ``eps`` as ``adamw_eps`` and one ``DeprecationWarning``.
- A run's own checkpoint whose groups moved between manifolds while it trained (``adopt_manifolds``, undone by
  ``restore_manifolds``; ``Muon.adopt_manifolds`` calls them).
- ``torch.distributed.checkpoint``'s state initialisation step leaves manifold groups bitwise as they were
  (``dcp_init_step``), so that training continues bit-identically after ``set_optimizer_state_dict``.
- Saving for torch (``to_torch_muon``): a Muon state dict of plain EMA groups in the form torch.optim.Muon loads.
  A Muon group that sets ``ns_coefficients`` saves in that form already (``state_dict()`` loads into torch as it is).

How ``eps`` is told apart (the key means torch's Newton–Schulz ε; the AdamW ε is ``adamw_eps``): a saved group that
has ``algorithm`` (a Muon checkpoint) but no ``adamw_eps`` is from before the split, so its ``eps`` is the AdamW ε; a
saved group without ``algorithm`` is torch's, whose ``eps`` is the Newton–Schulz ε; a param group given to ``Muon`` with
``algorithm="adamw"`` and ``eps`` but no ``adamw_eps`` is the old spelling (an AdamW group has no Newton–Schulz).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from weightgeom.optim.checks import (
    check_saved_state,
    check_torch_layout,
    describe_state_dict,
    is_bookkeeping_key,
    param_label,
)
from weightgeom.optim.muon_checks import MUON_DEFAULTS, validate_values
from weightgeom.optim.muon_layout import DUAL_STATE, STRUCTURAL_KEYS, dual_dtype, param_name, state_shapes, structural
from weightgeom.optim.state_checks import is_zero_step, kept

__all__ = ["TORCH_MUON", "ADAMW_EPS", "is_torch_muon_group", "rename_old_adamw_eps",
           "loadable_group", "check_state_dict", "restore_dual_dtype", "adopt_manifolds", "restore_manifolds",
           "to_torch_muon", "dcp_init_step"]

TORCH_MUON: dict[str, Any] = {
    "lr": 1e-3,
    "weight_decay": 0.1,
    "momentum": 0.95,
    "nesterov": True,
    "ns_coefficients": (3.4445, -4.775, 2.0315),
    "eps": 1e-7,
    "ns_steps": 5,
    "adjust_lr_fn": "original",
}
"""torch.optim.Muon's defaults (torch 2.9+; ``adjust_lr_fn=None`` there means ``"original"``) as Muon keywords; its
keys are the hyperparameter keys of a torch.optim.Muon param group."""
ADAMW_EPS = MUON_DEFAULTS["adamw_eps"]
"""Muon's default AdamW-group ε (``adamw_eps``; torch.optim.AdamW's)."""
_OLD_EPS = ("Muon: the param group key 'eps' of an algorithm='adamw' group is the old spelling of 'adamw_eps' (the "
            "AdamW ε; 'eps' now means torch.optim.Muon's Newton–Schulz ε): taken as adamw_eps={value!r}; write "
            "'adamw_eps'")
_OLD_CHECKPOINT = ("Muon.load_state_dict: a checkpoint from before 'adamw_eps': its groups' 'eps' (the AdamW ε then) "
                   "is loaded as 'adamw_eps' and the Newton–Schulz 'eps' kept from this optimizer; save it again to "
                   "update it")
_AMBIGUOUS_KEYWORD = ("Muon(eps={eps!r}) is torch.optim.Muon's Newton–Schulz ε; this AdamW group takes its ε from "
                      "adamw_eps ({adamw_eps!r}): pass adamw_eps= for it")


def is_torch_muon_group(saved: Mapping[str, Any]) -> bool:
    """Whether a saved param group is torch.optim.Muon's (its keys, no ``algorithm``)."""
    return "algorithm" not in saved and "ns_coefficients" in saved


def rename_old_adamw_eps(group: dict[str, Any], algorithm: str, defaults: Mapping[str, Any]) -> None:
    """A param group given to Muon in the old spelling — ``algorithm="adamw"`` with ``eps`` and no ``adamw_eps`` —
    gets its ``eps`` as ``adamw_eps``, with one DeprecationWarning. An AdamW group that sets neither, in a Muon built
    with a non-default ``eps`` keyword but the default ``adamw_eps`` (old code that meant the AdamW ε), warns that
    ``eps`` is the Newton–Schulz ε now. In place."""
    if algorithm != "adamw":
        return
    if "eps" in group and "adamw_eps" not in group:
        group["adamw_eps"] = group.pop("eps")
        warnings.warn(_OLD_EPS.format(value=group["adamw_eps"]), DeprecationWarning, stacklevel=4)
    elif "adamw_eps" not in group and defaults.get("eps", TORCH_MUON["eps"]) != TORCH_MUON["eps"] and defaults.get(
            "adamw_eps", ADAMW_EPS) == ADAMW_EPS:
        warnings.warn(_AMBIGUOUS_KEYWORD.format(eps=defaults["eps"], adamw_eps=ADAMW_EPS), DeprecationWarning,
                      stacklevel=4)


def loadable_group(saved: Mapping[str, Any], ours: Mapping[str, Any], gi: int) -> dict[str, Any]:
    """A saved param group as Muon loads it over its own group ``ours``: torch.optim.Muon's group (checked to fit: a
    Muon group with EMA momentum) or an old Muon group (``eps`` → ``adamw_eps``, warned) converted; any other
    returned as it is. Keys the saved group lacks are not filled here (``Muon._loaded_group`` takes them from
    ``ours``).

    Raises:
        ValueError: a torch.optim.Muon group loaded into an AdamW group or one with the sum momentum form, naming
            the group; nothing loaded.
    """
    out = dict(saved)
    if is_torch_muon_group(saved):
        if ours.get("algorithm") != "muon" or ours.get("momentum_form") != "ema":
            raise ValueError(f"Muon.load_state_dict: group {gi} of the state dict is torch.optim.Muon's, whose "
                             f"momentum buffer is an EMA of gradients, but this optimizer's group {gi} has "
                             f"algorithm={ours.get('algorithm')!r}, momentum_form={ours.get('momentum_form')!r}; build "
                             "it with algorithm='muon', momentum_form='ema'; nothing was loaded")
        if ours.get("manifold") is not None:  # a manifold group keeps its own (converging) msign
            out.pop("ns_coefficients", None)
            out.pop("ns_steps", None)
        if out.get("adjust_lr_fn") is None:
            out["adjust_lr_fn"] = "original"  # torch's None
        if out.get("ns_coefficients") is not None:
            out["ns_coefficients"] = tuple(out["ns_coefficients"])
        return out
    if "algorithm" in saved and "adamw_eps" not in saved and "eps" in saved:
        out["adamw_eps"] = out.pop("eps")
        warnings.warn(_OLD_CHECKPOINT, DeprecationWarning, stacklevel=4)
    return out


def check_state_dict(param_groups: Sequence[dict[str, Any]], defaults: Mapping[str, Any], state_dict: Any
                     ) -> list[dict[str, Any]]:
    """Validate a state dict for a Muon with these ``param_groups`` and ``defaults`` without loading anything.

    Checked: torch's layout with as many groups and parameters per group (``checks.check_torch_layout``; another
    optimizer's or MD's state dict is named as such); each group's keys and values as the constructor checks them
    (keys it lacks are taken from this optimizer's group; torch.optim.Muon's and older Muon groups converted by
    ``loadable_group``); the ``STRUCTURAL_KEYS`` (algorithm, manifold, layout, split, momentum_form, dual_normalize)
    equal to this optimizer's; each parameter's state only the entries this optimizer creates for it, with their
    shapes; every state tensor finite (``state_checks.check_state_finite``: one fused reduction, one host read).

    Returns:
        The param groups to load: each saved group over this optimizer's (its ``names`` kept).

    Raises:
        ValueError: one line naming the group, key or parameter that does not fit, and what to do; nothing loaded.
    """
    what = describe_state_dict(state_dict)
    if what not in ("a Muon state dict", "a torch.optim.Muon state dict"):
        raise ValueError(f"Muon.load_state_dict: expected a Muon (or torch.optim.Muon) state dict, got {what}; "
                         "nothing was loaded")
    ids = check_torch_layout("Muon", param_groups, state_dict, what)
    groups = [_loaded_group(defaults, gi, saved, group)
              for gi, (saved, group) in enumerate(zip(state_dict["param_groups"], param_groups))]
    check_saved_state("Muon", param_groups, state_dict, ids, lambda gi, i, p: (
        param_label(param_name(groups[gi], i, gi), gi, i, p), state_shapes(groups[gi], p)))
    return groups


def _loaded_group(defaults: Mapping[str, Any], gi: int, saved: dict[str, Any], group: dict[str, Any]
                  ) -> dict[str, Any]:
    """The group ``load_state_dict`` would install for ``saved`` over this optimizer's ``group``, validated."""
    where = "Muon.load_state_dict"
    saved = loadable_group(saved, group, gi)  # torch.optim.Muon's group, an older Muon's
    unknown = sorted(str(k) for k in set(saved) - set(defaults) if not is_bookkeeping_key(k))
    if unknown:
        raise ValueError(f"{where}: group {gi} has unknown key(s) {unknown[:6]} (valid keys: the keyword "
                         "arguments of Muon()); nothing was loaded")
    merged = {**{k: v for k, v in group.items() if k != "params"}, **saved}
    for key in ("names", "param_names"):
        if key in group:
            merged[key] = group[key]
        elif key in saved and not (isinstance(saved[key], (list, tuple)) and len(saved[key]) == len(group["params"])):
            raise ValueError(f"{where}: group {gi}'s {key!r} does not list one name per parameter; nothing was loaded")
    try:
        validate_values(merged, where=f"{where}: group {gi}")
    except ValueError as e:
        raise ValueError(f"{e}; nothing was loaded") from None
    for key in STRUCTURAL_KEYS:
        theirs, ours = structural(merged[key]), structural(group[key])
        if theirs != ours:
            raise ValueError(f"{where}: group {gi} has {key}={theirs!r} in the state dict but {key}={ours!r} in "
                             f"this optimizer, so its per-parameter state means something else here; build the "
                             f"optimizer with {key}={theirs!r} to resume it, or start it fresh; nothing was loaded")
    return merged


def restore_dual_dtype(state: Mapping[torch.Tensor, dict[str, Any]], param_groups: Sequence[dict[str, Any]],
                       state_dict: Mapping[str, Any]) -> None:
    """Put loaded dual multipliers back in the dtype the step keeps them in (``muon_layout.dual_dtype``): torch's
    ``load_state_dict`` casts all floating state to its parameter's dtype, which rounds a float16/bfloat16
    parameter's float32 multipliers (a resumed run then drifted from an uninterrupted one). In place on ``state``."""
    saved = state_dict["state"]
    for sg, group in zip(state_dict["param_groups"], param_groups):
        if group["algorithm"] != "muon" or group["manifold"] is None:
            continue
        for k, p in zip(sg["params"], group["params"]):
            for key in DUAL_STATE:
                t = saved.get(k, {}).get(key)
                if torch.is_tensor(t):
                    state[p][key] = t.to(device=p.device, dtype=dual_dtype(p))


def adopt_manifolds(param_groups: Sequence[dict[str, Any]], state_dict: Any,
                    resolve: Callable[[dict[str, Any]], None]) -> dict[int, Any]:
    """``Muon.adopt_manifolds``: put each of ``param_groups`` that is on a manifold onto the manifold its saved group
    in ``state_dict`` names, where that is another one, then ``resolve`` each changed group (``Muon``'s manifold and
    numerics resolution); a ValueError there undoes every change.

    Returns:
        group index → the manifold it had, for each group changed (empty when ``state_dict`` is not a Muon state dict
        over as many groups, or a manifold did not resolve).
    """
    if describe_state_dict(state_dict) != "a Muon state dict":
        return {}
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(param_groups):
        return {}
    before: dict[int, Any] = {}
    for gi, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        theirs = saved.get("manifold") if isinstance(saved, dict) else None
        ours = group.get("manifold")
        if (isinstance(theirs, str) and ours is not None and group.get("algorithm") == "muon"
                and theirs != structural(ours)):
            before[gi] = ours
            group["manifold"] = theirs
    try:
        for gi in before:
            resolve(param_groups[gi])
    except ValueError:
        restore_manifolds(param_groups, before)
        return {}
    return before


def restore_manifolds(param_groups: Sequence[dict[str, Any]], before: Mapping[int, Any]) -> None:
    """Undo ``adopt_manifolds`` (its return value ``before``) on ``param_groups``."""
    for gi, manifold in before.items():
        param_groups[gi]["manifold"] = manifold


def to_torch_muon(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A Muon ``state_dict()`` in the form torch.optim.Muon loads: per group torch's keys only, per parameter its
    momentum buffer. torch.optim.Muon runs only a fixed (a, b, c) quintic, so a group that runs a preset msign (Polar
    Express) continues under torch's default ``ns_coefficients`` and ``ns_steps``; its lr, weight decay, momentum
    and Nesterov setting carry over.

    Raises:
        ValueError: a group torch.optim.Muon cannot hold (an AdamW or manifold group, the sum momentum form), naming
            it.
    """
    groups = []
    for gi, g in enumerate(state_dict["param_groups"]):
        if g.get("algorithm", "muon") != "muon" or g.get("manifold") is not None or g.get("momentum_form",
                                                                                           "ema") != "ema":
            raise ValueError(f"to_torch_muon: group {gi} has algorithm={g.get('algorithm')!r}, manifold="
                             f"{g.get('manifold')!r}, momentum_form={g.get('momentum_form')!r}; torch.optim.Muon "
                             "holds only plain Muon groups with EMA momentum (save those in an optimizer of their "
                             "own)")
        out = {k: g.get(k, default) for k, default in TORCH_MUON.items()}
        if out["ns_coefficients"] is None:
            out["ns_coefficients"], out["ns_steps"] = TORCH_MUON["ns_coefficients"], TORCH_MUON["ns_steps"]
        out["ns_steps"] = out["ns_steps"] or TORCH_MUON["ns_steps"]
        if out["adjust_lr_fn"] == "none":
            raise ValueError(f"to_torch_muon: group {gi} has adjust_lr_fn='none', which torch.optim.Muon does not "
                             "offer (it has 'original' and 'match_rms_adamw')")
        out["params"] = list(g["params"])
        if "param_names" in g:
            out["param_names"] = g["param_names"]
        groups.append(out)
    state = {k: {"momentum_buffer": st["momentum_buffer"]} for k, st in state_dict["state"].items()
             if "momentum_buffer" in st}
    return {"state": state, "param_groups": groups}


def dcp_init_step(param_groups: Sequence[dict[str, Any]], state: Mapping[Any, Any]) -> Callable[[], None] | None:
    """The undo of ``torch.distributed.checkpoint``'s state initialisation, or None when this step is not one.

    ``set_optimizer_state_dict`` / ``get_optimizer_state_dict`` create the state of an optimizer that has none by one
    ``step()`` with every gradient zero and every group's lr 0 (``state_checks.is_zero_step``); the state is then
    replaced by the loaded one. torch's optimizers leave parameters untouched then; a manifold group would still
    retract its matrices, moving them by rounding, so the resumed run would not continue bit for bit. On such a step
    (no state yet, a manifold group present) the manifold groups' parameters are copied first and the returned
    function writes them back after the step.

    Args:
        param_groups: the optimizer's groups (a group with ``manifold`` set is a manifold group).
        state: the optimizer's state (empty before its first step).
    """
    if state or not any(g.get("manifold") for g in param_groups) or not is_zero_step(param_groups):
        return None
    return kept(p for g in param_groups if g.get("manifold") for p in g["params"])
