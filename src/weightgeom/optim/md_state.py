"""``MagnitudeDirection``'s checkpoints: the state dict's layout, the older layouts it still loads, and every check a
state dict passes before anything is loaded (docs/md.md, "torch.optim citizenship").

Layout (torch's, so that whatever reads ``sd["state"]`` / ``sd["param_groups"]`` works on it — among them
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` / ``set_optimizer_state_dict``, which keep only
those two keys and re-key parameters by name)::

    {"state": {i: {<the base's state of parameter i>,
                   "md.direction", "md.radius", "md.gain_row", "md.gain_col",      # decoupled matrix i: MD's state
                   "md.gain_row.step", "md.gain_row.exp_avg", ...}},               # the gains' Adam state
     "param_groups": [<the base's groups>...,
                      {"params": [], "md_role": "gains", "lr", "betas", "eps", "weight_decay", "names": [],
                       "md_options": {"gains", "parameterization", "sphere", "embeddings", "embedding_radius"}}]}

The gains group is the last group and has no parameters (its θ are not model parameters: they live in the decoupled
matrices' entries), so a consumer that maps parameters by position or by name finds only the model's; its
hyperparameters (``lr`` = ``gain_lr``, scheduled like any group's) travel with it. Two older layouts load unchanged
(``split``), silently — they hold the same information; the next ``state_dict()`` writes the current one: the base's
state dict with MD's part beside it under ``"md"``, and the nested ``{"base": <base state_dict>, "md": {...}}``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from weightgeom.optim.checks import (
    check_param_state,
    check_torch_state,
    describe_state_dict,
    held_shape,
    is_bookkeeping_key,
)
from weightgeom.optim.md_functional import _ZERO_NORM
from weightgeom.optim.sharded import is_dtensor, owned_here
from weightgeom.optim.state_checks import check_state_finite, state_entries

if TYPE_CHECKING:  # pragma: no cover
    from weightgeom.optim.magnitude_direction import MagnitudeDirection

__all__ = ["MD_KEY", "GAIN_KEYS", "invalid_gain_key", "is_gains_group", "split", "state_dict", "check", "load"]

MD_KEY = "md"  # the key of MD's own part in the older layouts
_PREFIX = "md."  # MD's per-matrix keys in a decoupled matrix's state entry
GAIN_KEYS = ("gain_row", "gain_col")
_WHERE = "MagnitudeDirection.load_state_dict"
_NOTHING = "nothing was loaded"


def _number(v: Any) -> bool:
    """A real Python number (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# The gains group's hyperparameters and what each must be (as the constructor checks them).
_GAIN_GROUP_VALUES: dict[str, Callable[[Any], bool]] = {
    "lr": lambda v: _number(v) and v >= 0 and math.isfinite(v),
    "eps": lambda v: _number(v) and v > 0,
    "weight_decay": lambda v: _number(v) and v == 0,
    "betas": lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v),
}


def invalid_gain_key(group: Mapping[str, Any]) -> str | None:
    """The first hyperparameter of a gains group (``_GAIN_GROUP_VALUES``) whose value the constructor would refuse."""
    return next((key for key, ok in _GAIN_GROUP_VALUES.items() if key in group and not ok(group[key])), None)


def is_gains_group(group: Any) -> bool:
    """Whether a saved param group is MD's gains group (``md_role`` = ``"gains"``)."""
    return isinstance(group, Mapping) and group.get("md_role") == "gains"


def split(md: MagnitudeDirection, sd: Any) -> tuple[Any, Any]:
    """(the base optimizer's part, MD's part as the older layouts hold it) of a MagnitudeDirection state dict in any
    layout (module docstring). The current layout's per-matrix ``md.*`` entries are found by position: the base
    groups' saved parameter keys (ids, or names after ``torch.distributed.checkpoint``) pair with this optimizer's
    parameters in order.

    Raises:
        ValueError: not a MagnitudeDirection state dict (e.g. the base's own, or another optimizer's), naming what it
            looks like; nothing loaded.
    """
    if isinstance(sd, Mapping) and set(sd) == {"base", MD_KEY}:  # the older nested layout
        return sd["base"], sd[MD_KEY]
    if isinstance(sd, Mapping) and MD_KEY in sd and {"state", "param_groups"} <= set(sd):  # "md" beside torch's
        return {k: v for k, v in sd.items() if k != MD_KEY}, sd[MD_KEY]
    groups = sd.get("param_groups") if isinstance(sd, Mapping) else None
    if not (isinstance(groups, (list, tuple)) and groups and is_gains_group(groups[-1])
            and isinstance(sd.get("state"), Mapping)):
        raise ValueError(f"{_WHERE}: expected a MagnitudeDirection.state_dict() (torch's 'state' and "
                         f"'param_groups' with MD's gains group last), got {describe_state_dict(sd)}; {_NOTHING}")
    *base_groups, gains = groups
    saved_keys = [k for g in base_groups if isinstance(g, Mapping) for k in g.get("params", ())]
    live = [q for g in md.base_optimizer.param_groups for q in g["params"]]
    key_of = {id(q): k for q, k in zip(live, saved_keys)}
    base_state: dict[Any, Any] = {}
    for k, entry in sd["state"].items():
        rest = {n: v for n, v in entry.items() if not str(n).startswith(_PREFIX)} if isinstance(entry, Mapping) \
            else entry
        if rest or not isinstance(entry, Mapping):
            base_state[k] = rest
    entries: dict[int, dict[str, Any]] = {}
    for i, p in enumerate(md._decoupled):
        entry = sd["state"].get(key_of.get(id(p)), {})
        own_entry: dict[str, Any] = {}
        for n, v in (entry.items() if isinstance(entry, Mapping) else ()):
            name = str(n)
            if not name.startswith(_PREFIX):
                continue
            key, _, sub = name[len(_PREFIX):].partition(".")
            if sub and key in GAIN_KEYS:  # the gains' Adam state: "md.gain_row.exp_avg"
                own_entry.setdefault(f"{key}_adam", {})[sub] = v
            else:
                own_entry[name[len(_PREFIX):]] = v
        if own_entry:
            entries[i] = own_entry
    stray = sorted(str(k) for k, entry in sd["state"].items() if isinstance(entry, Mapping)
                   and k not in {key_of.get(id(p)) for p in md._decoupled}
                   and any(str(n).startswith(_PREFIX) for n in entry))
    if stray:
        raise ValueError(f"{_WHERE}: checkpoint entry {stray[0]!r} holds MD state ('md.*'), but this optimizer does "
                         f"not decouple that parameter; {_NOTHING}")
    own = {"options": gains.get("md_options"), "names": md.decoupled_names, "state": entries,
           "gain_group": {k: v for k, v in gains.items() if k not in ("params", "md_options")}}
    rest = {k: v for k, v in sd.items() if k not in ("state", "param_groups")}  # e.g. Muon's "numerics"
    return {**rest, "state": base_state, "param_groups": list(base_groups)}, own


def state_dict(md: MagnitudeDirection) -> dict[str, Any]:
    """The state dict of ``md`` (module docstring); tensors are references, as in torch's ``state_dict``."""
    base = md.base_optimizer.state_dict()
    pid = {id(q): i for i, q in enumerate(q for g in md.base_optimizer.param_groups for q in g["params"])}
    state = dict(base["state"])
    # FSDP2: a matrix's direction is sharded like it (a DTensor, saved by every rank); its radius, gains and their
    # Adam state are whole and current on its owner rank only, which alone saves them (one writer in a DCP save)
    mine = owned_here(md.param_groups, md.whole_matrix)
    for p in md._decoupled:
        st = md.state[p]
        if mine is not None and id(p) not in mine:
            if is_dtensor(st["direction"]):
                state[pid[id(p)]] = {**state.get(pid[id(p)], {}), _PREFIX + "direction": st["direction"]}
            continue
        entry = dict(state.get(pid[id(p)], {}))  # a copy: the base's entry is its live state
        entry[_PREFIX + "direction"] = st["direction"]
        entry[_PREFIX + "radius"] = st["radius"]
        for key in GAIN_KEYS:
            if key in st:
                entry[_PREFIX + key] = st[key]
                for sub, v in md.state.get(st[key], {}).items():
                    entry[f"{_PREFIX}{key}.{sub}"] = v
        state[pid[id(p)]] = entry
    gains = {k: v for k, v in md._gain_groups[0].items() if k != "params"}
    gains["md_options"] = {"gains": md.gains, "parameterization": md.parameterization, "sphere": md.sphere,
                           "embeddings": md.embeddings, "embedding_radius": md.embedding_radius}
    # in parameter order on every rank: DCP's full_state_dict gathers each DTensor entry by one collective, in the
    # dict's order, so the ranks must list them alike (a rank's own matrices first would pair different matrices)
    state = {k: state[k] for k in sorted(state, key=lambda k: (0, k, "") if isinstance(k, int) else (1, 0, str(k)))}
    # the base's other top-level keys (Muon's "numerics") as the base saved them
    return {**base, "state": state, "param_groups": [*base["param_groups"], {"params": [], **gains}]}


def check(md: MagnitudeDirection, sd: Any) -> tuple[Any, Mapping[str, Any]]:
    """Validate a state dict for ``md`` without loading anything (``MagnitudeDirection.check_state_dict``).

    Returns:
        (the base optimizer's part, MD's part), as ``split`` gives them.

    Raises:
        ValueError: one line naming what does not fit; nothing loaded.
    """
    base_sd, own = split(md, sd)
    parts = {"options": Mapping, "names": (list, tuple), "state": Mapping, "gain_group": Mapping}
    for key, kind in parts.items():
        if not isinstance(own, Mapping) or not isinstance(own.get(key), kind):
            raise ValueError(f"{_WHERE}: the 'md' part lacks a valid {key!r} (not a MagnitudeDirection.state_dict()); "
                             f"{_NOTHING}")
    for key in ("gains", "parameterization", "sphere", "embeddings"):
        saved = own["options"].get(key)
        if saved != getattr(md, key):
            raise ValueError(f"{_WHERE}: checkpoint has {key}={saved!r}, this optimizer has {getattr(md, key)!r}; "
                             f"build it with {key}={saved!r} to resume this checkpoint; {_NOTHING}")
    if len(own["state"]) > len(md._decoupled) or len(own["names"]) != len(md._decoupled):
        raise ValueError(f"{_WHERE}: checkpoint decouples {len(own['state'])} matrices ({list(own['names'][:3])}...), "
                         f"this optimizer {len(md._decoupled)}; {_NOTHING}")
    finite = []
    mine = owned_here(md.param_groups, md.whole_matrix)
    for i, p in enumerate(md._decoupled):
        saved = own["state"].get(i)
        if mine is not None and id(p) not in mine:
            continue  # FSDP2: another rank owns this matrix and saved its MD state (``load`` takes the direction)
        if not isinstance(saved, Mapping):
            raise ValueError(f"{_WHERE}: checkpoint has no MD state for {md._name[p]!r} (decoupled matrix {i}); "
                             f"{_NOTHING}")
        name = str(own["names"][i])
        _check_shapes(md, p, name, saved)
        finite += state_entries(f"checkpoint entry {name!r}", _flat(saved))
    # direction, radius, θ and the gains' Adam moments: a NaN there would make W (or the gains) NaN for good
    check_state_finite("MagnitudeDirection", finite)
    for i in range(len(md._decoupled)):
        radius = own["state"].get(i, {}).get("radius")
        if radius is not None and not bool((radius > _ZERO_NORM).all()):
            raise ValueError(f"{_WHERE}: checkpoint entry {str(own['names'][i])!r}: radius must be > 0; {_NOTHING}")
    _check_gain_group(md, own["gain_group"])
    base = md.base_optimizer
    try:
        if hasattr(base, "check_state_dict"):
            base.check_state_dict(base_sd)
        else:
            check_torch_state(type(base).__name__, base, base_sd)
    except ValueError as e:
        raise ValueError(f"{_WHERE}: the base optimizer's part does not fit: {e}") from None
    return base_sd, own


def _flat(saved: Mapping[str, Any]) -> dict[str, Any]:
    """An entry of MD's part under the names the current layout gives its tensors (``md.gain_row.exp_avg``), for
    messages."""
    out = {}
    for key, value in saved.items():
        if str(key).endswith("_adam") and isinstance(value, Mapping):
            out.update({f"{_PREFIX}{str(key)[:-5]}.{sub}": v for sub, v in value.items()})
        else:
            out[f"{_PREFIX}{key}"] = value
    return out


def _restored(key: str, value: Any, theta: torch.Tensor) -> torch.Tensor:
    """A saved gain-Adam entry as MD keeps it: ``step`` a float32 CPU scalar tensor (a number in older checkpoints),
    the moments θ's dtype and device."""
    if key == "step":
        return torch.as_tensor(value, dtype=torch.float32).detach().clone().to("cpu")
    return value.detach().to(device=theta.device, dtype=theta.dtype).clone()


def load(md: MagnitudeDirection, base_sd: Any, own: Mapping[str, Any]) -> None:
    """Load what ``check`` accepted: the base's part into the base, MD's part into ``md.state`` and its gains group."""
    md.base_optimizer.load_state_dict(base_sd)
    mine = owned_here(md.param_groups, md.whole_matrix)
    for i, p in enumerate(md._decoupled):
        saved = own["state"].get(i, {})
        st = md.state[p]
        md._versions[p] = None  # check W against the restored state at the next step
        if mine is not None and id(p) not in mine:  # FSDP2, owned elsewhere: this rank's shard of the direction
            if "direction" in saved:
                st["direction"].copy_(saved["direction"])
            continue
        st["direction"].copy_(saved["direction"])
        st["radius"].copy_(saved["radius"])
        for key in GAIN_KEYS:
            if key in st:
                theta = st[key]
                theta.copy_(saved[key])
                adam = saved.get(key + "_adam")
                md.state.pop(theta, None)
                if adam:
                    md.state[theta] = {k: _restored(k, v, theta) for k, v in adam.items()}
    group = md._gain_groups[0]
    for k, v in own["gain_group"].items():
        if k != "names":
            group[k] = v


def _check_shapes(md: MagnitudeDirection, p: torch.Tensor, name: str, saved: Mapping[str, Any]) -> None:
    """Refuse a checkpoint entry unless it holds exactly the tensors ``md`` keeps for ``p`` (direction, radius, the
    gains it has, optionally their Adam state), each floating and of the same shape."""
    where = f"{_WHERE}: checkpoint entry {name!r}"
    st = md.state[p]
    ours = {k: st[k] for k in ("direction", "radius", *GAIN_KEYS) if k in st}
    allowed = set(ours) | {f"{k}_adam" for k in GAIN_KEYS if k in st}
    extra = sorted(map(str, set(saved) - allowed))
    missing = sorted(set(ours) - set(saved))
    if extra or missing:
        what = f"has {extra[0]!r}, which" if extra else f"lacks {missing[0]!r}, which"
        raise ValueError(f"{where}: {what} this optimizer (gains={md.gains!r}) "
                         f"{'does not keep' if extra else 'keeps'}; {_NOTHING}")
    v = saved["direction"]
    if not (torch.is_tensor(v) and tuple(v.shape) == tuple(p.shape)):
        shape = tuple(v.shape) if torch.is_tensor(v) else type(v).__name__
        raise ValueError(f"{_WHERE}: {md._name[p]!r} has shape {tuple(p.shape)}, checkpoint entry {name!r} has "
                         f"{shape}; {_NOTHING}")
    check_param_state("MagnitudeDirection", f"checkpoint entry {name!r}", saved,
                      {k: held_shape(t) for k, t in ours.items()}, strict=False)
    for key in GAIN_KEYS:
        adam = saved.get(f"{key}_adam")
        if adam is None or key not in ours:
            continue
        if not isinstance(adam, Mapping):
            raise ValueError(f"{where}: {key}_adam must be a dict, got {type(adam).__name__}; {_NOTHING}")
        shape = tuple(ours[key].shape)
        check_param_state("MagnitudeDirection", f"checkpoint entry {name!r} {key}_adam", adam,
                          {"step": None, "exp_avg": shape, "exp_avg_sq": shape})


def _check_gain_group(md: MagnitudeDirection, saved: Mapping[str, Any]) -> None:
    """Refuse a saved gains group with keys ``md``'s lacks or values its constructor would refuse."""
    where = f"{_WHERE}: the gains group"
    ours = md._gain_groups[0]
    unknown = sorted(str(k) for k in set(saved) - set(ours) if not is_bookkeeping_key(k))
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {unknown}; {_NOTHING}")
    if saved.get("md_role", "gains") != "gains":
        raise ValueError(f"{where} has md_role={saved['md_role']!r}, expected 'gains'; {_NOTHING}")
    bad = invalid_gain_key(saved)
    if bad is not None:
        raise ValueError(f"{where}: {bad}={saved[bad]!r} is invalid; {_NOTHING}")
