"""Owner-rank optimizer steps over DTensor (FSDP2) parameters: every whole matrix is updated by exactly one rank.

Muon's msign and the manifold dual ascent need whole matrices, so every matrix gets an owner rank
(:func:`assign_owners`: greedy balancing by element count, deterministic on all ranks); the owner steps it with exactly
the code a single process runs, and the new values go back to every rank from the owners (:func:`broadcast_from_owners`,
one flat buffer per owner and dtype). Two users of these primitives:

* :func:`step_on_owners` — what ``weightgeom.optim.Muon.step`` and ``MagnitudeDirection.step`` do when their
  parameters are DTensors (FSDP2 ``fully_shard`` in the user's own loop): whole-matrix parameters are all-gathered to
  their owner for the step and scattered back; elementwise parameters (AdamW groups) stay sharded and are stepped on
  each rank's local shard.
* ``weightgeom.train.distributed.ShardedStep`` — the trainer's step under torchrun (DDP or FSDP2).

Every function here except :func:`is_dtensor`, :func:`holds_dtensors` and :func:`assign_owners` needs an initialised
default process group.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from weightgeom.optim.functional import NonFiniteGradientError, first_nonfinite

__all__ = ["is_dtensor", "holds_dtensors", "local", "assign_owners", "owned_here", "local_part",
           "broadcast_from_owners", "agreed_first_nonfinite", "step_on_owners"]


def is_dtensor(t: Any) -> bool:
    """True for a torch.distributed DTensor (FSDP2 parameters and gradients). Cheap: without
    ``torch.distributed.tensor`` imported no DTensor can exist, and nothing is imported here."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def assign_owners(sizes: Sequence[tuple[str, int]], world_size: int) -> dict[str, int]:
    """Owner rank of each item: largest first onto the least-loaded rank (ties → lowest rank).

    Deterministic: every rank computes the same answer from the same list, so no communication is needed.

    Args:
        sizes: (unique key, element count) per item.
        world_size: number of ranks.

    Returns:
        key → owning rank in ``[0, world_size)``.
    """
    load = [0] * world_size
    owner: dict[str, int] = {}
    for key, n in sorted(sizes, key=lambda kv: (-kv[1], kv[0])):
        r = min(range(world_size), key=lambda i: (load[i], i))
        owner[key] = r
        load[r] += int(n)
    return owner


def local_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of the whole tensor ``full`` that DTensor ``like`` holds on this rank (a view of ``full``).

    Works for any device mesh and Shard/Replicate placements (FSDP2's ``Shard(0)``, HSDP's 2-D mesh); uneven sizes
    follow ``torch.chunk``, as DTensor does.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, like.device_mesh, like.placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def broadcast_from_owners(items: Sequence[tuple[int, torch.Tensor | None, Sequence[int], torch.dtype]],
                          device: torch.device, sink: Callable[[int, torch.Tensor], None]) -> None:
    """Send each item's whole value from its owner to every rank, then hand it to ``sink`` on every rank.

    One flattened ``broadcast`` per (owner, dtype), owners in rank order; every rank of the default process group must
    call this with the same owners, shapes and dtypes (the values are read on the owners only).

    Args:
        items: (owner rank, the whole value on the owner — ignored elsewhere, may be None —, its shape, its dtype).
        device: where the flat buffers live (the CUDA device under NCCL; CPU under gloo).
        sink: called as ``sink(k, whole_k)`` for every item k on every rank (the owner included), with a view of the
            received buffer (valid during the call only).
    """
    rank = dist.get_rank()
    batches: dict[tuple[int, str], list[int]] = {}
    for k, (owner, _, _, dtype) in enumerate(items):
        batches.setdefault((owner, str(dtype)), []).append(k)
    for (owner, _), ks in sorted(batches.items()):
        dtype = items[ks[0]][3]
        sizes = [int(torch.Size(items[k][2]).numel()) for k in ks]
        if owner == rank:
            flat = torch.cat([items[k][1].detach().reshape(-1).to(device=device, dtype=dtype) for k in ks])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, src=owner)
        off = 0
        for k, n in zip(ks, sizes):
            sink(k, flat[off:off + n].view(tuple(items[k][2])))
            off += n


def agreed_first_nonfinite(tensors: Sequence[torch.Tensor], device: torch.device) -> int | None:
    """``first_nonfinite`` over this rank's tensors, agreed by all ranks: the smallest index any rank found (one
    ``all_reduce``). Every rank must pass the same number of tensors, in the same order (their local shards)."""
    bad = first_nonfinite(list(tensors))
    n = len(tensors)
    flag = torch.tensor([n if bad is None else bad], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    k = int(flag.item())
    return None if k >= n else k


def holds_dtensors(param_groups: Sequence[dict[str, Any]]) -> bool:
    """True when a parameter of these groups is a DTensor (FSDP2 ``fully_shard``, tensor parallel)."""
    return any(is_dtensor(p) for g in param_groups for p in g["params"])


def local(t: torch.Tensor) -> torch.Tensor:
    """The values this rank holds of ``t``: a DTensor's local shard (the same storage), else ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def _swap_params(groups: Sequence[dict[str, Any]], states: Sequence[dict], mapping: dict[int, torch.Tensor | None],
                 label: Callable[[int, dict, int], str]):
    """Replace parameters in ``groups`` by their stand-ins (``mapping``: id(param) → stand-in, None: left out of this
    step, with its ``names`` entry; a group without names gets ``label(group index, group, index)`` for the step) and
    move their entries in ``states`` to the stand-ins. Returns the undo function (stand-ins' state moves back to the
    parameters, so ``state_dict`` keeps its layout)."""
    saved = []
    moved: list[tuple[torch.Tensor, torch.Tensor]] = []
    for gi, g in enumerate(groups):
        params = g["params"]
        keys = [k for k in ("names", "param_names") if isinstance(g.get(k), list) and len(g[k]) == len(params)]
        saved.append((g, params, {k: g[k] for k in keys}, "names" not in g and "param_names" not in g))
        if saved[-1][3]:
            g["names"] = [label(gi, g, i) for i in range(len(params))]
            keys = ["names"]
        keep = [i for i, p in enumerate(params) if mapping.get(id(p), p) is not None]
        g["params"] = [mapping.get(id(params[i]), params[i]) for i in keep]
        for k in keys:
            g[k] = [g[k][i] for i in keep]
        moved += [(p, mapping[id(p)]) for p in params if mapping.get(id(p)) is not None]
    for st in states:
        for p, q in moved:
            if p in st:
                st[q] = st.pop(p)

    def undo() -> None:
        for g, params, names, added in saved:
            g["params"] = params
            g.update(names)
            if added:
                del g["names"]
        for st in states:
            for p, q in moved:
                if q in st:
                    st[p] = st.pop(q)

    return undo


def _shard_state(shards: Sequence[tuple[torch.Tensor, torch.Tensor]], states: Sequence[dict]) -> None:
    """Give the state of elementwise DTensor parameters (AdamW moments, stepped on the local shards) the parameter's
    sharding again: each entry shaped like the local shard becomes a DTensor over it (no copy, no communication), as
    torch's optimizers keep their state under FSDP2 — so a ``torch.distributed.checkpoint`` save writes each rank's
    shard rather than one rank's shard for all."""
    from torch.distributed.tensor import DTensor

    for p, loc in shards:
        for st in states:
            entry = st.get(p) if p in st else None
            for k, v in list((entry or {}).items()):
                if torch.is_tensor(v) and not is_dtensor(v) and v.dim() > 0 and v.shape == loc.shape:
                    entry[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                                  stride=p.stride())


def owned_here(groups: Sequence[dict[str, Any]], whole: Callable[[dict[str, Any], torch.Tensor], bool]
               ) -> set[int] | None:
    """The ids of the whole-matrix DTensor parameters this rank owns in ``step_on_owners`` (the same assignment), or
    None when ``groups`` hold no DTensor or no process group is initialised (a single process owns everything).
    State kept whole on the owner only (Muon's momentum, MD's gains) is saved by the owner alone, so that a
    ``torch.distributed.checkpoint`` save has one writer for it.

    Args:
        groups: the optimizer's param groups, as ``step_on_owners`` sees them.
        whole: (group, parameter) → does the parameter's update need the whole matrix (as given to
            ``step_on_owners``).
    """
    if not holds_dtensors(groups) or not dist.is_initialized():
        return None
    wholes, owner = _whole_owners(groups, whole, dist.get_world_size())
    rank = dist.get_rank()
    return {id(p) for k, p in wholes if owner[k] == rank}


def _whole_owners(groups: Sequence[dict[str, Any]], whole: Callable[[dict[str, Any], torch.Tensor], bool],
                  world: int) -> tuple[list[tuple[str, torch.Tensor]], dict[str, int]]:
    """The whole-matrix DTensor parameters of ``groups`` keyed ``"group.index"``, and each key's owner rank
    (``assign_owners``): the one assignment ``step_on_owners`` steps by and ``owned_here`` reports."""
    wholes = [(f"{gi}.{i}", p) for gi, g in enumerate(groups) for i, p in enumerate(g["params"])
              if is_dtensor(p) and whole(g, p)]
    return wholes, assign_owners([(k, p.numel()) for k, p in wholes], world)


def step_on_owners(optimizer: torch.optim.Optimizer, update: Callable[[], None], *,
                   whole: Callable[[dict[str, Any], torch.Tensor], bool], name: Callable[[int, dict, int], str],
                   who: str, states: Sequence[dict] = (), swap: Callable[[dict[int, Any]], Callable[[], None]] | None
                   = None, merge_stats: Sequence[Any] = ()) -> None:
    """One optimizer step over DTensor (FSDP2) parameters with the optimizer's own single-process code.

    Every rank of the default process group must call it (SPMD, as FSDP2 requires). In order:

    1. All or nothing: each rank scans its local gradient shards for NaN/Inf and the ranks agree on the first bad
       parameter (one ``all_reduce``); if there is one, every rank raises ``NonFiniteGradientError`` naming it before
       any parameter or state changes.
    2. Each whole-matrix parameter (``whole(group, p)``: Muon groups, magnitude–direction matrices) gets an owner rank
       (:func:`assign_owners` over all of them, so owners stay fixed from step to step); its gradient and value are
       all-gathered (``DTensor.full_tensor``) and kept by the owner only. Every other DTensor parameter is elementwise
       (AdamW groups) and is stepped on this rank's local shard, in place.
    3. The parameters in the optimizer's groups (and their entries in ``optimizer.state`` and ``states``) are replaced
       by these stand-ins — the owned whole matrices and the local shards; whole matrices owned elsewhere are left out —
       and ``update()`` runs: exactly the code a single process runs, on this rank's matrices only, so the owners work
       in parallel. Then the parameters are put back.
    4. If ``update`` raised on any rank, every rank raises (the model's whole matrices are then unchanged).
    5. Each owner's new values are broadcast (:func:`broadcast_from_owners`) and every rank copies its shard out.
       The ``last_stats`` dicts of ``merge_stats`` (Muon's per-matrix statistics) are merged over ranks.

    DTensor entries in a whole matrix's state (the magnitude–direction wrapper's direction and radius, made from the
    DTensor parameter at construction) are gathered to the owner with it and written back to their shards after.

    Memory per rank: the whole matrices it owns (≈ 1/N of them) with their gradients, plus one whole matrix at a time
    while gathering. Optimizer state of a whole matrix (Muon's momentum, the dual multiplier, MD's direction) lives on
    its owner only, full size; elementwise state (AdamW moments) is sharded like the parameter. ``state_dict()`` is
    therefore per rank: save one per rank, load each on the same rank with the same world size and sharding.

    Args:
        optimizer: the optimizer whose ``param_groups`` hold the DTensor parameters.
        update: the single-process step body (no closure; it must not call ``step_on_owners`` again).
        whole: (group, parameter) → does the parameter's update need the whole matrix.
        name: (group index, group, index in group) → the parameter's name for messages.
        who: the optimizer's name for messages.
        states: per-parameter state dicts to re-key besides ``optimizer.state``.
        swap: optional extra re-keying of the optimizer's own per-parameter containers; called with
            id(param) → (param, stand-in or None) and returns its undo function.
        merge_stats: the Muon optimizers (``optimizer`` itself, or a wrapper's base) whose ``last_stats`` — this
            rank's matrices after ``update`` — become the union over ranks.

    Raises:
        NonFiniteGradientError: a gradient shard on any rank holds NaN/Inf (raised on every rank, nothing changed).
        RuntimeError: ``update`` raised on another rank (its message is included).
    """
    from torch.distributed.tensor import Replicate  # importing torch.distributed.tensor is slow: only on DTensors

    rank, world = dist.get_rank(), dist.get_world_size()
    groups = optimizer.param_groups
    entries = [(gi, g, i, p) for gi, g in enumerate(groups) for i, p in enumerate(g["params"])]
    dtensors = [p for *_, p in entries if is_dtensor(p)]
    device = dtensors[0].to_local().device if dtensors else torch.device("cpu")

    graded = [(gi, g, i, p) for gi, g, i, p in entries if p.grad is not None]
    bad = agreed_first_nonfinite([local(p.grad) for *_, p in graded], device)
    if bad is not None:
        gi, g, i, p = graded[bad]
        raise NonFiniteGradientError.refused(who, name(gi, g, i), tuple(p.shape))

    wholes, owner = _whole_owners(groups, whole, world)
    mapping: dict[int, torch.Tensor | None] = {}
    back: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []  # (owner, parameter, stand-in on the owner)
    # DTensor entries of a whole matrix's state (made from the DTensor parameter at construction, e.g. MD's direction)
    # go the same way: (owner, the DTensor, its state dict and key; the whole value sits there on the owner)
    held: list[tuple[int, torch.Tensor, dict, str]] = []
    all_states = [optimizer.state, *states]
    with torch.no_grad():
        for key, p in wholes:
            if id(p) in mapping:
                continue
            mapping[id(p)] = None
            if p.grad is None:
                continue
            mine = owner[key] == rank
            G = p.grad.full_tensor()
            W = p.detach().full_tensor()
            q = None
            if mine:
                q = W
                q.grad = G.to(W.dtype)
                mapping[id(p)] = q
            back.append((owner[key], p, q))
            for st in all_states:
                entry = st.get(p) if p in st else None
                for k, v in list((entry or {}).items()):
                    if is_dtensor(v):
                        if any(pl.is_partial() for pl in v.placements):  # e.g. a norm: made whole on every rank
                            v = entry[k] = v.redistribute(v.device_mesh, [Replicate()] * v.device_mesh.ndim)
                        full = v.full_tensor()
                        held.append((owner[key], v, entry, k))
                        if mine:
                            entry[k] = full
            del G, W
        shards = []  # elementwise parameters, stepped on their local shards (their state too)
        for p in dtensors:
            if id(p) not in mapping:
                loc = p.to_local()
                q = loc.view_as(loc)  # writes go through to the shard
                q.grad = None if p.grad is None else p.grad.to_local()
                mapping[id(p)] = q
                shards.append((p, loc))
                for st in all_states:
                    for k, v in (st.get(p) or {}).items() if p in st else ():
                        if is_dtensor(v):
                            st[p][k] = v.to_local()  # the same storage: the step's in-place writes reach it

    err: BaseException | None = None
    undo = _swap_params(groups, [optimizer.state, *states], mapping, name)
    undo_extra = None
    try:
        if swap is not None:
            undo_extra = swap({id(p): (p, mapping[id(p)]) for p in dtensors})
        update()
    except Exception as e:  # reported to every rank below
        err = e
    finally:
        if undo_extra is not None:
            undo_extra()
        undo()
        _shard_state(shards, all_states)
    failed = torch.tensor([1 if err is not None else 0], dtype=torch.int64, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if int(failed.item()):
        for r, v, entry, k in held:
            if r == rank:
                entry[k] = v
        msgs: list[Any] = [None] * world
        dist.all_gather_object(msgs, None if err is None else f"{type(err).__name__}: {err}")
        if err is not None:
            raise err
        r = next(i for i, m in enumerate(msgs) if m is not None)
        raise RuntimeError(f"{who}: rank {r} refused the step ({msgs[r]}); the whole matrices were not changed")

    with torch.no_grad():
        targets = [p for _, p, _ in back] + [v for _, v, _, _ in held]
        items = [(r, q, tuple(p.shape), p.dtype) for r, p, q in back]
        items += [(r, entry[k] if r == rank else None, tuple(v.shape), v.dtype) for r, v, entry, k in held]

        def sink(k: int, value: torch.Tensor) -> None:
            t = targets[k]
            t.to_local().copy_(local_part(value, t))

        broadcast_from_owners(items, device, sink)
        for _, _p, q in back:
            if q is not None:
                q.grad = None
        for r, v, entry, k in held:
            if r == rank:
                entry[k] = v
    for opt in merge_stats:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, opt.last_stats)
        merged: dict = {}
        for d in gathered:
            merged.update(d)
        opt.last_stats = merged
