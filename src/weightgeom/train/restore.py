"""Resuming from a checkpoint: what a checkpoint must satisfy before its state goes into a model and optimizer.

Every refusal is one :class:`~weightgeom.train.checkpoint.CheckpointError` line naming the checkpoint and the first
thing that does not fit — a changed config key (with the ways out: ``--fresh``, ``--out``), a missing, unexpected or
mis-shaped model tensor, optimizer state of the wrong shape — instead of torch's multi-line errors or a traceback at
the next step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from weightgeom.optim import MagnitudeDirection, Muon
from weightgeom.train.checkpoint import CheckpointError
from weightgeom.train.config import RESUMABLE_KEYS, Config, config_to_dict
from weightgeom.train.distributed import ShardedStep
from weightgeom.train.rundir import PREVIOUS_DIR

__all__ = ["config_difference", "check_config_hash", "load_model_state", "load_optimizer_state"]

_PARAM_SHAPED_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
"""Optimizer state entries that have their parameter's shape (torch's AdamW/SGD, Muon's momentum)."""


def config_difference(old: Any, new: Any, prefix: str = "") -> str | None:
    """The first ``section.key`` whose value differs between two resolved configs (``old``: the checkpoint's), as
    ``"key: OLD in the checkpoint, NEW now"``, or None.

    Keys that may change on resume (:data:`~weightgeom.train.config.RESUMABLE_KEYS`, which ``config_hash`` also
    ignores) are skipped.
    """
    if isinstance(old, dict) and isinstance(new, dict):
        for k in list(old) + [k for k in new if k not in old]:
            full = f"{prefix}.{k}" if prefix else str(k)
            if full in RESUMABLE_KEYS:
                continue
            d = config_difference(old.get(k, "<unset>"), new.get(k, "<unset>"), full)
            if d:
                return d
        return None
    return None if old == new else f"{prefix}: {old!r} in the checkpoint, {new!r} now"


def check_config_hash(payload: dict[str, Any], path: Path, expected: str, cfg: Config) -> None:
    """Refuse a checkpoint made with another config, naming the first differing key and the ways out.

    Raises:
        CheckpointError: one line naming the checkpoint, the difference, ``--fresh`` and ``--out``.
    """
    got = payload.get("config_hash")
    if got == expected:
        return
    old = payload.get("config")
    diff = config_difference(old, config_to_dict(cfg)) if isinstance(old, dict) else None
    what = diff or f"hash {got} != {expected}"
    raise CheckpointError(
        f"checkpoint {path}: made with a different config ({what}); use --fresh to start over (the old run is moved "
        f"to {PREVIOUS_DIR}/) or --out to choose another directory; to continue the old run, resume with its "
        "config.resolved.toml")


def load_model_state(model: nn.Module, sd: Any, path: Path) -> None:
    """``model.load_state_dict(sd)``, refusing with the first mismatching key instead of torch's multi-line error.

    Raises:
        CheckpointError: one line naming the checkpoint and the first missing, unexpected or mis-shaped tensor.
    """
    if not isinstance(sd, dict):
        raise CheckpointError(f"checkpoint {path}: 'model' is not a state dict ({type(sd).__name__})")
    own = model.state_dict()
    for k, v in own.items():
        if k not in sd:
            raise CheckpointError(f"checkpoint {path}: model tensor {k!r} is missing (this model has it, "
                                           f"shape {tuple(v.shape)})")
        w = sd[k]
        if not torch.is_tensor(w) or tuple(w.shape) != tuple(v.shape):
            shape = tuple(w.shape) if torch.is_tensor(w) else type(w).__name__
            raise CheckpointError(
                f"checkpoint {path}: model tensor {k!r} has shape {shape}, this model's is {tuple(v.shape)}; the "
                "checkpoint does not fit the config")
    extra = [k for k in sd if k not in own]
    if extra:
        raise CheckpointError(f"checkpoint {path}: model tensor {extra[0]!r} is not in this model "
                                       f"({len(extra)} unexpected)")
    try:
        model.load_state_dict(sd)
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path}: model state does not load: "
                                       f"{str(e).strip().splitlines()[0]}") from e


def _torch_optimizers(stepper: torch.optim.Optimizer | ShardedStep) -> list[torch.optim.Optimizer]:
    """The optimizers whose state ``stepper`` holds: the optimizer itself (``ShardedStep.optimizer`` for the sharded
    step) and, for a ``MagnitudeDirection``, its ``base_optimizer``."""
    opt = stepper.optimizer if isinstance(stepper, ShardedStep) else stepper
    return [opt, opt.base_optimizer] if isinstance(opt, MagnitudeDirection) else [opt]


def load_optimizer_state(stepper: torch.optim.Optimizer | ShardedStep, sd: Any, model: nn.Module,
                         path: Path) -> None:
    """``stepper.load_state_dict(sd)``, then check that parameter-shaped state has its parameter's shape.

    torch's ``Optimizer.load_state_dict`` checks group sizes but not the shapes of the state tensors; a mismatch would
    surface only at the next step, as a traceback. A Muon group that the run moved to another manifold
    (``AutoAssign``) is put back on the checkpoint's manifold first (``Muon.adopt_manifolds``; undone on refusal).

    Raises:
        CheckpointError: one line naming the checkpoint and the parameter (or torch's first line).
    """
    opt = stepper.optimizer if isinstance(stepper, ShardedStep) else stepper
    moved = opt.adopt_manifolds(sd) if isinstance(opt, Muon) else {}  # groups AutoAssign moved in an earlier session
    try:
        stepper.load_state_dict(sd)
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as e:
        if moved:
            opt.restore_manifolds(moved)
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path}: optimizer state does not fit this optimizer: {line}") \
            from e
    names = {id(p): n for n, p in model.named_parameters()}
    for opt in _torch_optimizers(stepper):
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state.get(p) or {}
                for key in _PARAM_SHAPED_STATE:
                    v = st.get(key)
                    if torch.is_tensor(v) and v.shape != p.shape:
                        raise CheckpointError(
                            f"checkpoint {path}: optimizer state {key!r} of parameter {names.get(id(p), '?')!r} has "
                            f"shape {tuple(v.shape)}, the parameter's is {tuple(p.shape)}")
