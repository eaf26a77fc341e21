"""``MagnitudeDirection``'s construction: which base parameters it decouples and their names, the weight-decay edit
of the base's groups, and how a group's manifold meets MD's sphere (docs/md.md, "Manifold-Muon groups" and "All
options").
"""

from __future__ import annotations

import fnmatch
import math
from typing import TYPE_CHECKING, Any

import torch

from weightgeom import manifolds
from weightgeom.optim.md_functional import is_embedding_name

if TYPE_CHECKING:  # pragma: no cover
    from weightgeom.optim.magnitude_direction import MagnitudeDirection

__all__ = ["manifold_kind", "param_names", "select", "override_weight_decay", "scale_divisor"]


def manifold_kind(manifold: Any, k: int) -> str:
    """How a base group's manifold meets MD's sphere for a k-wide block: "free" (no manifold, or a constraint invariant
    under scaling, e.g. DGram: off-diagonal Gram = 0) → Ŵ is projected on the sphere directly; "fixed" (Stiefel,
    Oblique: the manifold fixes ‖Ŵ‖_F = sqrt(min(m, n))) → the base steps Q = Ŵ/s with s = radius/sqrt(min(m, n)).
    Decided from the manifold's target Gram P(I) (``_kind_uncached``), so a registered manifold needs no entry here;
    cached per (name, k) in a dict, which a trace reads (dynamo traces through ``functools.lru_cache``: P(I)'s host
    read would break a ``fullgraph`` trace)."""
    if not (manifold is None or isinstance(manifold, str)):
        return _kind_uncached(manifold, k)
    key = (manifold, k)
    kind = _KIND_CACHE.get(key)
    if kind is None:
        kind = _KIND_CACHE[key] = _kind_uncached(manifold, k)
    return kind


_KIND_CACHE: dict[tuple[Any, int], str] = {}


def _kind_uncached(manifold: Any, k: int) -> str:
    """``manifold_kind`` without the cache: from the manifold's target Gram P(I) of a k×k identity."""
    if manifold is None:
        return "free"
    try:
        obj = manifolds.get(manifold)
    except ValueError as e:
        raise ValueError(f"MagnitudeDirection: unknown manifold {manifold!r} in a base param group ({e})") from None
    target = obj.P(torch.eye(k, dtype=torch.float64))
    if bool(torch.all(target == 0)):
        return "free"
    if bool(torch.all(target.diagonal() == 1)):
        return "fixed"
    raise ValueError(f"MagnitudeDirection: manifold {obj.name!r} neither fixes ‖W‖_F nor is scale-invariant; "
                     "MD cannot combine its sphere with it")


def param_names(md: MagnitudeDirection, model: torch.nn.Module | None) -> dict[torch.Tensor, str]:
    """Each base parameter's name, for messages and selection: the group's ``names``/``param_names`` entry, else the
    model's name for it, else its position (``param_groups[g].params[i]``)."""
    model_names = {}
    if model is not None:
        for n, q in model.named_parameters():
            model_names.setdefault(q, n)
    names: dict[torch.Tensor, str] = {}
    for gi, group in enumerate(md.base_optimizer.param_groups):
        given = group.get("names", group.get("param_names"))
        for pi, q in enumerate(group["params"]):
            if given is not None and pi < len(given):
                names[q] = str(given[pi])
            elif q in model_names:
                names[q] = model_names[q]
            else:
                names[q] = f"param_groups[{gi}].params[{pi}]"
    return names


def select(md: MagnitudeDirection, names: dict[torch.Tensor, str], params: Any, exclude: Any, embeddings: str,
           model: torch.nn.Module | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the matrices to decouple, the embeddings to keep at unit row norm), in the base's order, as the
    constructor's ``params``/``exclude``/``embeddings`` options pick them.

    Raises:
        ValueError: an ``exclude`` pattern that matches nothing, a name or tensor that is not a base parameter.
        TypeError: a ``params`` entry that is neither a tensor nor a name.
    """
    base_params = list(names)
    embed_ids = set()
    if model is not None:
        for mod in model.modules():
            if isinstance(mod, torch.nn.Embedding):
                embed_ids.add(id(mod.weight))

    def is_embedding(q):
        return id(q) in embed_ids or is_embedding_name(names[q])

    def matches(name, patterns):
        return any(name == pat or fnmatch.fnmatchcase(name, pat) for pat in patterns)

    exclude = [exclude] if isinstance(exclude, str) else list(exclude)
    unused = [pat for pat in exclude if not any(matches(names[q], [pat]) for q in base_params)]
    if unused:  # a pattern that excludes nothing is a typo (or a regex where a glob is meant), never silent
        raise ValueError(f"MagnitudeDirection: exclude pattern {unused[0]!r} matches no parameter name (names or "
                         "fnmatch globs over the whole name, e.g. 'transformer.h.*.attn.*')")
    if params is None:
        chosen = [q for q in base_params if q.ndim == 2 and not matches(names[q], exclude)
                  and (embeddings == "decouple" or not is_embedding(q))]
    else:
        if isinstance(params, (str, torch.Tensor)):
            params = [params]
        chosen_set: dict[int, torch.Tensor] = {}
        for item in params:
            if isinstance(item, torch.Tensor):
                if item not in names:
                    raise ValueError(f"MagnitudeDirection: a tensor of shape {tuple(item.shape)} marked for "
                                     "decoupling is not a parameter of the base optimizer")
                chosen_set[id(item)] = item
            elif isinstance(item, str):
                hits = [q for q in base_params if matches(names[q], [item])]
                if not hits:
                    raise ValueError(f"MagnitudeDirection: no base-optimizer parameter is named {item!r} "
                                     f"(known: {sorted(names.values())[:8]}...)")
                for q in hits:
                    chosen_set[id(q)] = q
            else:
                raise TypeError(f"MagnitudeDirection: params entries must be tensors or names, got {type(item)}")
        chosen = [q for q in base_params if id(q) in chosen_set]  # base order
    chosen_ids = {id(q) for q in chosen}
    unit_rows = []
    if embeddings == "unit_rows":
        unit_rows = [q for q in base_params if is_embedding(q) and id(q) not in chosen_ids]
    return chosen, unit_rows


def override_weight_decay(md: MagnitudeDirection, handled: set, names: dict[torch.Tensor, str]) -> list[str]:
    """Set weight decay 0 for the ``handled`` parameters in the base's groups (a group wholly handled is edited, a
    mixed one split: the handled parameters move to a new group with the same hyperparameters); returns their
    names."""
    changed: list[str] = []
    base = md.base_optimizer
    for group in list(base.param_groups):
        if not group.get("weight_decay", 0):
            continue
        mine = [q for q in group["params"] if q in handled]
        if not mine:
            continue
        changed += [names[q] for q in mine]
        if len(mine) == len(group["params"]):
            group["weight_decay"] = 0.0
            continue
        name_key = "names" if "names" in group else ("param_names" if "param_names" in group else None)
        keep_idx = [i for i, q in enumerate(group["params"]) if q not in handled]
        move_idx = [i for i, q in enumerate(group["params"]) if q in handled]
        new = {k: v for k, v in group.items() if k not in ("params", "names", "param_names")}
        new["params"] = [group["params"][i] for i in move_idx]
        if name_key is not None:
            new[name_key] = [group[name_key][i] for i in move_idx]
            group[name_key] = [group[name_key][i] for i in keep_idx]
        group["params"] = [group["params"][i] for i in keep_idx]
        new["weight_decay"] = 0.0
        base.add_param_group(new)
    return changed


def scale_divisor(md: MagnitudeDirection, p: torch.Tensor, group: dict[str, Any]) -> float | None:
    """κ = the fixed ‖Q‖_F of p's group's norm-fixing manifold (``_scale_for``), or None for a free group."""
    manifold = group.get("manifold")
    if manifold is None:
        return None
    # Muon's group keys: layout "in_out" stores (in, out); split=k stacks k blocks along the output dim, each
    # its own manifold point, so κ² = Σ_blocks min(block rows, cols) = k·min(out/k, in).
    out_dim, in_dim = (p.shape[1], p.shape[0]) if group.get("layout") == "in_out" else tuple(p.shape)
    k = int(group.get("split") or 1)
    block = min(out_dim // k, in_dim)
    if manifold_kind(manifold, block) == "free":
        return None
    if md.sphere != "frobenius":
        raise ValueError(f"MagnitudeDirection: parameter {md._name[p]!r} is in a {manifold!r} manifold group, "
                         f"which fixes ‖W‖_F; only sphere='frobenius' is supported there (got {md.sphere!r})")
    return math.sqrt(k * block)
