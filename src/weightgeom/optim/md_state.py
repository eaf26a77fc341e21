"""``MagnitudeDirection``'s checkpoints: the state dict's layout, the older layout it still loads, and every check a
state dict passes before anything is loaded (docs/md.md, "torch.optim citizenship").

Layout (torch's, so that whatever reads ``sd["state"]`` / ``sd["param_groups"]`` works on it)::

    {"state": {...}, "param_groups": [...],     # the base optimizer's state_dict(), as the base saves it
     "md": {"options": {...}, "names": [...], "unit_rows": [...],
            "state": {i: {"direction", "radius", "gain_row", "gain_col", "gain_row_adam", "gain_col_adam"}},
            "gain_group": {...}}}               # MD's own state: per decoupled matrix i (in order), the gains group

The gains group is not among ``param_groups`` (its θ are not model parameters, so ids there would name nothing a
consumer of a torch state dict could map). The older nested layout ``{"base": <base state_dict>, "md": {...}}`` loads
unchanged (``split``), silently: it holds the same information; the next ``state_dict()`` writes the current layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from weightgeom.optim.checks import check_param_state, check_torch_state, describe_state_dict, is_bookkeeping_key
from weightgeom.optim.md_functional import _ZERO_NORM
from weightgeom.optim.state_checks import check_state_finite, state_entries

if TYPE_CHECKING:  # pragma: no cover
    from weightgeom.optim.magnitude_direction import MagnitudeDirection

__all__ = ["MD_KEY", "GAIN_KEYS", "invalid_gain_key", "split", "state_dict", "check", "load"]

MD_KEY = "md"  # the key of MD's own part, beside torch's "state" and "param_groups"
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


def split(sd: Any) -> tuple[Any, Any]:
    """(the base optimizer's part, MD's part) of a MagnitudeDirection state dict in either layout (module docstring).

    Raises:
        ValueError: not a MagnitudeDirection state dict (e.g. the base's own, or another optimizer's), naming what it
            looks like; nothing loaded.
    """
    if isinstance(sd, Mapping) and set(sd) == {"base", MD_KEY}:  # the older nested layout
        return sd["base"], sd[MD_KEY]
    if isinstance(sd, Mapping) and MD_KEY in sd and {"state", "param_groups"} <= set(sd):
        return {k: v for k, v in sd.items() if k != MD_KEY}, sd[MD_KEY]
    raise ValueError(f"{_WHERE}: expected a MagnitudeDirection.state_dict() ({{'state': ..., 'param_groups': [...], "
                     f"'md': {{...}}}}), got {describe_state_dict(sd)} without MD's 'md' part; {_NOTHING}")


def state_dict(md: MagnitudeDirection) -> dict[str, Any]:
    """The state dict of ``md`` (module docstring); tensors are references, as in torch's ``state_dict``."""
    entries = {}
    for i, p in enumerate(md._decoupled):
        st = md.state[p]
        entry = {"direction": st["direction"], "radius": st["radius"]}
        for key in GAIN_KEYS:
            if key in st:
                entry[key] = st[key]
                if md.state.get(st[key]):
                    entry[key + "_adam"] = dict(md.state[st[key]])
        entries[i] = entry
    base = md.base_optimizer.state_dict()
    own = {
        "options": {"gains": md.gains, "parameterization": md.parameterization, "sphere": md.sphere,
                    "embeddings": md.embeddings, "embedding_radius": md.embedding_radius},
        "names": md.decoupled_names,
        "unit_rows": md.unit_row_names,
        "state": entries,
        "gain_group": {k: v for k, v in md._gain_groups[0].items() if k != "params"},
    }
    return {**base, MD_KEY: own}


def check(md: MagnitudeDirection, sd: Any) -> tuple[Any, Mapping[str, Any]]:
    """Validate a state dict for ``md`` without loading anything (``MagnitudeDirection.check_state_dict``).

    Returns:
        (the base optimizer's part, MD's part), as ``split`` gives them.

    Raises:
        ValueError: one line naming what does not fit; nothing loaded.
    """
    base_sd, own = split(sd)
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
    if len(own["state"]) != len(md._decoupled) or len(own["names"]) != len(own["state"]):
        raise ValueError(f"{_WHERE}: checkpoint decouples {len(own['state'])} matrices ({list(own['names'][:3])}...), "
                         f"this optimizer {len(md._decoupled)}; {_NOTHING}")
    finite = []
    for i, p in enumerate(md._decoupled):
        saved = own["state"].get(i)
        if not isinstance(saved, Mapping):
            raise ValueError(f"{_WHERE}: checkpoint has no entry {i} for {md._name[p]!r}; {_NOTHING}")
        name = str(own["names"][i])
        _check_shapes(md, p, name, saved)
        finite += state_entries(f"checkpoint entry {name!r}", dict(saved))
    # direction, radius, θ and the gains' Adam moments: a NaN there would make W (or the gains) NaN for good
    check_state_finite("MagnitudeDirection", finite)
    for i in range(len(md._decoupled)):
        if not bool((own["state"][i]["radius"] > _ZERO_NORM).all()):
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


def _restored(key: str, value: Any, theta: torch.Tensor) -> torch.Tensor:
    """A saved gain-Adam entry as MD keeps it: ``step`` a float32 CPU scalar tensor (a number in older checkpoints),
    the moments θ's dtype and device."""
    if key == "step":
        return torch.as_tensor(value, dtype=torch.float32).detach().clone().to("cpu")
    return value.detach().to(device=theta.device, dtype=theta.dtype).clone()


def load(md: MagnitudeDirection, base_sd: Any, own: Mapping[str, Any]) -> None:
    """Load what ``check`` accepted: the base's part into the base, MD's part into ``md.state`` and its gains group."""
    md.base_optimizer.load_state_dict(base_sd)
    for i, p in enumerate(md._decoupled):
        saved = own["state"][i]
        st = md.state[p]
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
        md._versions[p] = None  # check W against the restored state at the next step
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
                      {k: tuple(t.shape) for k, t in ours.items()}, strict=False)
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
