"""Validation of optimizer state as it is loaded (``load_state_dict``) and of parameters as a step finds them.

- ``check_state_finite``: a state dict whose floating state tensors (Muon momentum buffers, manifold dual
  multipliers, AdamW moments, MD gains and their moments) hold NaN/Inf is refused when it is loaded, naming the
  parameter and the tensor — loaded, such a state never recovers (a NaN momentum buffer keeps every later direction
  NaN, and a ``"skip"`` optimizer then skips every step without a word). Every resume path goes through
  ``load_state_dict``: ``weightgeom train --resume``, HF Trainer's ``resume_from_checkpoint``, Lightning's
  ``ckpt_path``, ``torch.distributed.checkpoint``'s ``set_optimizer_state_dict``.

- ``is_zero_step``: whether a step is ``torch.distributed.checkpoint``'s state initialisation (every lr 0, every
  gradient zero), which Muon and MagnitudeDirection keep from changing any parameter.

The check is one fused reduction per device and dtype over every tensor (``functional.first_nonfinite``) and one host
read; only when it fails are the tensors scanned one by one to name the first bad one. A DTensor entry is checked
through its local shard (each rank checks what it holds; every rank loads the same dict); meta tensors hold no
values and are skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from weightgeom.optim.functional import first_nonfinite
from weightgeom.optim.sharded import is_dtensor, local

__all__ = ["StateEntry", "state_entries", "check_state_finite", "is_zero_step", "kept"]

StateEntry = tuple[str, str, torch.Tensor]
"""(parameter label, state key, tensor): one floating state tensor to check, labelled for the refusal."""


def state_entries(label: str, state: Any, prefix: str = "") -> list[StateEntry]:
    """The floating tensors of one parameter's saved state (nested dicts, e.g. MD's per-gain Adam moments, are
    walked with their keys joined by ``/``), as ``check_state_finite`` takes them; the rest (step counts as numbers,
    strings) is left out.

    Args:
        label: the parameter, for messages (``checks.param_label``).
        state: its saved state (a dict; anything else gives no entries).
        prefix: key prefix of a nested dict.
    """
    out: list[StateEntry] = []
    if not isinstance(state, dict):
        return out
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += state_entries(label, value, f"{name}/")
        elif torch.is_tensor(value) and (value.is_floating_point() or value.is_complex()):
            out.append((label, name, value))
    return out


def check_state_finite(who: str, entries: Sequence[StateEntry]) -> None:
    """Refuse a state dict one of whose floating state tensors holds NaN or Inf, naming the first such tensor.

    Args:
        who: the optimizer's name (``"Muon"``), for messages.
        entries: (parameter label, state key, tensor) per tensor (``state_entries``).

    Raises:
        ValueError: one line naming the parameter, the state key and how many entries are NaN/Inf; nothing loaded.
    """
    live = [(label, key, local(t)) for label, key, t in entries if t.device.type != "meta"]
    bad = first_nonfinite([t for *_, t in live])
    if bad is None:
        return
    label, key, t = live[bad]
    count = int((~torch.isfinite(t)).sum())
    raise ValueError(f"{who}.load_state_dict: {label}: state {key!r} holds {count} NaN/Inf value(s) of {t.numel()}; "
                     "loaded, the parameter would never move again: resume from an earlier checkpoint, or start the "
                     "optimizer fresh (build it again, without load_state_dict); nothing was loaded")


def is_zero_step(param_groups: Sequence[dict[str, Any]]) -> bool:
    """Whether a step over ``param_groups`` cannot move anything: every group's lr is 0 and every gradient is zero or
    absent — ``torch.distributed.checkpoint``'s state initialisation (``_init_optim_state``: one ``step()`` on an
    optimizer without state, gradients zeroed, lrs set to 0). Eager only; the lrs are read first, so a step with a
    non-zero lr reads nothing more; the gradients cost one host read each, with DTensor gradients (FSDP2) judged
    through their local shards and agreed over the ranks (one ``all_reduce``), so every rank decides alike.
    """
    if torch.compiler.is_compiling() or any(float(g["lr"]) != 0.0 for g in param_groups if "lr" in g):
        return False
    grads = [p.grad for g in param_groups for p in g["params"] if p.grad is not None]
    zero = torch.tensor(float(all(not bool(local(t).any()) for t in grads)))
    if any(is_dtensor(t) for t in grads) and torch.distributed.is_initialized():
        torch.distributed.all_reduce(zero, op=torch.distributed.ReduceOp.MIN)
    return bool(zero)


def kept(tensors: Iterable[torch.Tensor]) -> Callable[[], None]:
    """Copies of ``tensors`` taken now, and the function that writes them back in place (no autograd): how Muon and
    MagnitudeDirection undo what ``is_zero_step``'s step changed of their parameters and tensors."""
    saved = [(t, t.detach().clone()) for t in tensors]

    def put_back() -> None:
        with torch.no_grad():
            for t, v in saved:
                t.copy_(v)

    return put_back
