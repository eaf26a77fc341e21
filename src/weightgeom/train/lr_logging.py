"""Every param group's learning rate under a readable name: what the HF Trainer and Lightning callbacks log.

A weightgeom optimizer has several groups with different learning rates (e.g. ``param_groups(model, "hetero")``:
AdamW groups at ``adamw_lr``, Stiefel and DGram groups at ``lr``), but a framework that logs one ``learning_rate``
shows only the first group's. :func:`group_lrs` gives them all, keyed ``<prefix><group name>``;
``weightgeom.train.hf_callbacks`` and ``weightgeom.train.lightning_callbacks`` log them. No framework is imported here.
"""

from __future__ import annotations

from collections import Counter

import torch

__all__ = ["group_lrs", "group_names"]


def group_names(optimizer: torch.optim.Optimizer) -> list[str]:
    """One name per param group, in group order.

    A group's own ``"name"`` if it has one; else its weightgeom algorithm and manifold (``"adamw"``,
    ``"muon-stiefel"``, ``"muon-dgram"``, ``"muon"`` for an unconstrained Muon group); else ``"group"`` (a plain
    torch optimizer). A name that occurs more than once gets ``-2``, ``-3``, … on its later groups, in group order
    (``param_groups(model, "hetero")`` gives ``adamw``, ``adamw-2`` (norms and biases, no decay), ``muon-stiefel``,
    ``muon-dgram``).
    """
    base = []
    for g in optimizer.param_groups:
        name = g.get("name")
        if not isinstance(name, str) or not name:
            algo = g.get("algorithm")
            manifold = g.get("manifold")
            name = "group" if algo is None else str(algo) if manifold in (None, "none") else f"{algo}-{manifold}"
        base.append(name)
    seen: Counter[str] = Counter()
    out = []
    for name in base:
        seen[name] += 1
        out.append(name if seen[name] == 1 else f"{name}-{seen[name]}")
    return out


def group_lrs(optimizer: torch.optim.Optimizer, prefix: str = "lr/") -> dict[str, float]:
    """``{prefix + group name: the group's current lr}`` for every param group (names: :func:`group_names`).

    The lr is read as it is now (after the scheduler's last step: the rate of the next step), as a Python float;
    a tensor lr is read from its device (one host read per group: call it when logging, not inside a step).
    """
    return {prefix + name: float(g["lr"]) for name, g in zip(group_names(optimizer), optimizer.param_groups)}
