"""Distributed training: process-group setup from torchrun's environment, DDP / FSDP2 wrapping, and the trainer's
owner-rank optimizer step in which every parameter is updated by exactly one rank.

Launch: ``torchrun --nproc_per_node=N -m weightgeom train CONFIG``. Backend: ``nccl`` on CUDA, ``gloo`` on CPU.

One rank per matrix: :class:`ShardedStep` — the trainer's step (``weightgeom train`` under torchrun, DDP or FSDP2):
the optimizer is built on the unsharded model and its groups are filtered to the owned parameters once (ZeRO-1 style),
every parameter — AdamW's included — is stepped on its owner and broadcast. The owner-rank primitives
(``assign_owners``, ``broadcast_from_owners``, ``local_part``) live in :mod:`weightgeom.optim.sharded`, with
``step_on_owners``, the step Muon and MagnitudeDirection take themselves on DTensor parameters in a user's own loop.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from weightgeom.linalg.autotune import adopt_msign_choice, msign_choice
from weightgeom.optim.sharded import assign_owners, broadcast_from_owners, is_dtensor, local_part

__all__ = ["DistInfo", "init_distributed", "cleanup", "wrap_model", "ShardedStep", "all_reduce_mean", "barrier",
           "clip_grad_norm", "full_state_dict"]


@dataclass
class DistInfo:
    """Where this process stands.

    Attributes:
        rank: global rank (0 without torchrun).
        world_size: number of processes (1 without torchrun).
        local_rank: rank on this node (CUDA device index).
        device: the torch device this rank trains on.
        enabled: a process group is initialised (world_size > 1).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    enabled: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _pick_device(pref: str, local_rank: int) -> torch.device:
    if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("config key run.device='cuda': no CUDA device is available")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: str = "auto") -> DistInfo:
    """Initialise the process group from torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (no-op without them).

    Args:
        device: ``auto`` | ``cpu`` | ``cuda`` (``run.device``).

    Returns:
        The :class:`DistInfo` of this process.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _pick_device(device, local)
    if world <= 1:
        return DistInfo(device=dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    _agree_msign_choice(dev)
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local, device=dev,
                    enabled=True)


def _agree_msign_choice(device: torch.device) -> None:
    """Every rank adopts rank 0's per-device msign choice (dtype, Polar Express steps, constraint products), so which
    rank owns a matrix never changes how its direction is computed (each node would otherwise measure its own, and a
    close timing can pick bf16 on one and fp32 on another)."""
    mine = msign_choice(device) if dist.get_rank() == 0 else None
    box = [None if mine is None else (str(mine.dtype).replace("torch.", ""), mine.steps, mine.products)]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    dtype_name, steps, products = box[0]
    adopt_msign_choice(device, getattr(torch, dtype_name), steps, products)


def cleanup(info: DistInfo) -> None:
    """Destroy the process group if this module created one."""
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def all_reduce_mean(x: float | torch.Tensor, info: DistInfo) -> float:
    """Mean of a scalar over ranks (the value itself without a process group)."""
    if not info.enabled:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64, device=info.device if info.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.item() / info.world_size


def _block_lists(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard individually: the children of every ModuleList."""
    out = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            out.extend(m)
    return out


def wrap_model(model: nn.Module, info: DistInfo, parallel: str = "ddp") -> nn.Module:
    """The module to run forward/backward on.

    Args:
        model: the (unwrapped) model, already on ``info.device``.
        info: from :func:`init_distributed`.
        parallel: ``ddp`` (replicated weights, gradient all-reduce) or ``fsdp`` (FSDP2 ``fully_shard`` on every
            block of every ModuleList, then the root).

    Returns:
        ``model`` itself without a process group; a DDP wrapper; or ``model`` converted in place by ``fully_shard``.
    """
    if not info.enabled:
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [info.local_rank] if info.device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in _block_lists(model):
            fully_shard(block)
        fully_shard(model)
        return model
    raise ValueError(f"config key run.parallel={parallel!r}: must be ddp or fsdp")


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, info: DistInfo) -> torch.Tensor:
    """Clip the global gradient norm to ``max_norm`` (0 = only measure); returns the norm before clipping.

    Works for plain tensors (DDP gradients are already identical on every rank) and FSDP2 DTensor gradient shards
    (squared norms of the local shards are summed over ranks).

    Returns:
        The global norm as a 0-dim float32 tensor on the gradients' device (0 without gradients). On a GPU nothing
        here waits for the device: the float32 gradients' norms are one multi-tensor reduction, and the clip factor
        is applied on the device (``max_norm / (norm + 1e-6)``, formed in float64 as on the host, where norm >
        ``max_norm``, else 1), so read the norm with ``float()`` only when it is needed. On the CPU the gradients are
        scaled only when the norm exceeds ``max_norm`` (no extra pass; the same products either way).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=info.device)
    if any(is_dtensor(g) for g in grads):
        sq = torch.zeros((), dtype=torch.float32, device=info.device)
        for g in grads:
            loc = g.to_local() if is_dtensor(g) else g
            sq += loc.float().pow(2).sum().to(sq.device)
        if info.enabled:
            dist.all_reduce(sq)
        total = sq.sqrt()
        locals_ = [g.to_local() if is_dtensor(g) else g for g in grads]
    else:
        # float32 gradients: one multi-tensor norm (bitwise the per-tensor norms on the CPU); others upcast one by one;
        # stacked in the gradients' order, so the total sums them as before
        f32 = [i for i, g in enumerate(grads) if g.dtype == torch.float32]
        norms: list[torch.Tensor | None] = [None] * len(grads)
        for i, n in zip(f32, torch._foreach_norm([grads[i] for i in f32]) if f32 else []):
            norms[i] = n
        for i, g in enumerate(grads):
            if norms[i] is None:
                norms[i] = torch.linalg.vector_norm(g.float())
        total = torch.linalg.vector_norm(torch.stack(norms))
        locals_ = grads
    if max_norm > 0:
        if total.device.type == "cpu":  # reading the norm costs nothing here: scale only when clipping
            norm = float(total)
            if norm > max_norm:
                coef = max_norm / (norm + 1e-6)
                for g in locals_:
                    g.mul_(coef)
        else:
            t64 = total.double()
            coef = torch.where(t64 > max_norm, max_norm / (t64 + 1e-6), 1.0)
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for g in locals_:
                by_dtype.setdefault(g.dtype, []).append(g)
            for dtype, gs in by_dtype.items():  # a float32 factor for narrower dtypes, as the CPU's g.mul_(float)
                torch._foreach_mul_(gs, coef if dtype == torch.float64 else coef.float())
    return total


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A full (unsharded) CPU state dict; every rank must call it under FSDP2 (it all-gathers DTensors)."""
    out = {}
    for k, v in model.state_dict().items():
        if is_dtensor(v):
            v = v.full_tensor()
        out[k] = v.detach().cpu().clone()
    return out


class ShardedStep:
    """The trainer's step: runs an optimizer so that each parameter is updated on one rank only, then broadcasts the
    results (``assign_owners``, ``broadcast_from_owners`` of :mod:`weightgeom.optim.sharded`).

    The optimizer is the normal one (Muon, AdamW, any ``torch.optim.Optimizer``) built on the *unwrapped, unsharded*
    model; its param groups are filtered in place, once, to the parameters this rank owns, so each rank runs msign
    only for its own matrices and keeps optimizer state only for them (ZeRO-1 style) — every parameter, AdamW's
    included, is stepped on its owner. The result equals a 1-process run up to the floating-point order of the
    gradient all-reduce.

    Under FSDP2 the owner keeps a full-size copy of its parameters (the "shadow": the Parameter the optimizer was built
    on before sharding), receives the full gradient with ``DTensor.full_tensor()`` (every rank joins the all-gather),
    steps the shadow, broadcasts it, and every rank copies its own part into its shard. Memory: full copies of ≈ 1/N of
    the parameters plus one full gradient at a time. (In a user's own loop the optimizer is built on the DTensor
    parameters instead and steps them itself: ``weightgeom.optim.sharded.step_on_owners``.)

    Args:
        optimizer: built on the *unwrapped, unsharded* model's parameters (these become the shadows under FSDP2).
            Its param groups are filtered in place to the parameters this rank owns.
        named: (name, parameter) in the order of ``model.named_parameters()`` before wrapping.
        info: from :func:`init_distributed`.
        sharded_params: under FSDP2, name → the DTensor parameter that replaced it (None for DDP).

    Attributes:
        owner: name → owning rank.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.Tensor]], info: DistInfo,
                 sharded_params: dict[str, torch.Tensor] | None = None):
        self.optimizer = optimizer
        self.info = info
        self.sharded = sharded_params
        self.named = named
        self.owner = assign_owners([(n, p.numel()) for n, p in named], info.world_size)
        by_id = {id(p): n for n, p in named}
        for g in optimizer.param_groups:
            names = g.get("names")
            keep = [i for i, p in enumerate(g["params"]) if self.owner.get(by_id.get(id(p)), 0) == info.rank]
            g["params"] = [g["params"][i] for i in keep]
            if isinstance(names, list) and names:
                g["names"] = [names[i] for i in keep]
        self.mine = [(n, p) for n, p in named if self.owner[n] == info.rank]
        if self.sharded is not None:  # free the full copies this rank does not own
            for n, p in named:
                if self.owner[n] != info.rank:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    @torch.no_grad()
    def step(self) -> None:
        """Gradients → owners, optimizer step on owned parameters, updated values → everyone."""
        info = self.info
        if self.sharded is not None:
            for n, p in self.named:
                g = self.sharded[n].grad
                full = g.full_tensor() if g is not None else None
                if self.owner[n] == info.rank:
                    p.grad = full.to(p.dtype) if full is not None else None
        self.optimizer.step()
        items = [(self.owner[n], p, tuple(self.sharded[n].shape) if self.sharded is not None else tuple(p.shape),
                  p.dtype) for n, p in self.named]

        def sink(k: int, value: torch.Tensor) -> None:
            n, p = self.named[k]
            if self.sharded is not None:
                sp = self.sharded[n]
                sp.to_local().copy_(local_part(value, sp))
            elif self.owner[n] != info.rank:
                p.copy_(value)

        device = info.device if (self.sharded is not None or info.device.type == "cuda") else torch.device("cpu")
        broadcast_from_owners(items, device, sink)
        if self.sharded is not None:
            for _, p in self.mine:
                p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of *every* parameter (the optimizer only knows the owned ones)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for _, p in self.named:
            p.grad = None
        if self.sharded is not None:
            for sp in self.sharded.values():
                sp.grad = None

    def state_dict(self) -> dict:
        """This rank's optimizer state (its owned parameters only)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        """Restore this rank's ``state_dict()`` (same world size and owners)."""
        self.optimizer.load_state_dict(sd)
