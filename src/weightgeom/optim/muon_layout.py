"""How ``Muon`` sees a parameter: its (out, in) view and blocks, tall working copies, the state it keeps for it.

Pure functions of shapes and tensors, shared by the step (``muon.py``) and the state-dict checks
(``state_compat.py``): a stored 2-D weight's (out, in) view (``layout``: ``"out_in"``, nn.Linear, or ``"in_out"``, HF
``Conv1D``) split into k blocks (``split``), its tall view (rows ≥ columns), the per-parameter state each kind of group
keeps (``state_shapes``) and the step counter.
"""

from __future__ import annotations

from typing import Any

import torch

from weightgeom import manifolds
from weightgeom.optim.checks import param_shape

__all__ = ["STRUCTURAL_KEYS", "PARAM_LIKE_STATE", "DUAL_STATE", "param_name", "blocks", "stored", "tall_batch",
           "from_tall", "dual_shape", "step_counter", "structural", "state_shapes", "foreign_key", "dual_dtype",
           "out_in", "matrices", "retraction_distance", "retract"]

# Group keys that decide what a parameter's optimizer state means (which buffers exist, their shape and units): a state
# dict is loaded only into groups with the same values (``Muon.check_state_dict``).
STRUCTURAL_KEYS = ("algorithm", "manifold", "layout", "split", "momentum_form", "dual_normalize")
# Per-parameter state of the parameter's shape and dtype (the rest: ``step``, and manifold groups' dual multipliers in
# the compute dtype, ``DUAL_STATE``).
PARAM_LIKE_STATE = ("momentum_buffer", "exp_avg", "exp_avg_sq")
# A manifold group's per-matrix dual state: n×n per block, in float32 (float64 for a float64 matrix: ``dual_dtype``).
DUAL_STATE = ("dual_multiplier", "dual_cold")


def param_name(group: dict[str, Any], i: int, gi: int) -> str:
    """The name of a group's i-th parameter (its ``names`` or torch's ``param_names``), else ``group{gi}.param{i}``."""
    names = group.get("names") or group.get("param_names")
    return names[i] if names is not None else f"group{gi}.param{i}"


def blocks(T: torch.Tensor, layout: str, split: int | None) -> torch.Tensor:
    """View of a stack (B, *stored) of weights as its (out, in) matrices (B, out, in), or (B, k, out/k, in) blocks."""
    X = T if layout == "out_in" else T.mT
    return X.unflatten(1, (int(split), -1)) if split else X


def stored(X: torch.Tensor, layout: str, split: int | None) -> torch.Tensor:
    """The inverse view of ``blocks``."""
    X = X.flatten(1, 2) if split else X
    return X if layout == "out_in" else X.mT


def tall_batch(T: torch.Tensor, layout: str, split: int | None) -> tuple[torch.Tensor, bool]:
    """(``blocks`` of a stack as tall (B, [k,] m, n) matrices, whether they were transposed to get there)."""
    X = blocks(T, layout, split)
    flip = X.shape[-2] < X.shape[-1]
    return (X.mT if flip else X), flip


def from_tall(X: torch.Tensor, layout: str, split: int | None, flip: bool) -> torch.Tensor:
    """The inverse view of ``tall_batch``: tall (B, [k,] m, n) matrices as the stored (B, *stored) weights."""
    return stored(X.mT if flip else X, layout, split)


def dual_shape(group: dict[str, Any], p: torch.Tensor) -> tuple[int, ...]:
    """The shape of a manifold matrix's dual state (``state_shapes``)."""
    return state_shapes(group, p)["dual_multiplier"]


def step_counter(state: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
    """p's step count: a 0-dim float32 tensor on p's device (as torch.optim keeps it for capturable steps), so a step
    neither reads it on the host nor makes torch.compile specialise on its value. Created at 0; a Python number (a
    checkpoint from an earlier version) or a tensor on another device (torch's ``load_state_dict`` leaves "step"
    where it was saved) is converted in place."""
    st = state.get("step", 0)
    if not torch.is_tensor(st):  # a fill on the device: no host-to-device copy
        st = state["step"] = torch.full((), float(st), dtype=torch.float32, device=p.device)
    elif st.device != p.device or st.dtype != torch.float32:
        st = state["step"] = st.to(device=p.device, dtype=torch.float32)
    return st


def structural(value: Any) -> Any:
    """A ``STRUCTURAL_KEYS`` value as compared between a state dict and a group: a Manifold object by its name."""
    return value.name if isinstance(value, manifolds.Manifold) else value


def state_shapes(group: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    """The state Muon keeps for parameter ``p`` of ``group``: key → the shape of its floating tensor, or None for the
    step count. AdamW: ``exp_avg``/``exp_avg_sq`` (``checks.param_shape``: p's; for a DTensor its local shard's or,
    stepped whole by a wrapper, its whole shape); Muon: ``momentum_buffer`` (p's shape) and, with a manifold,
    ``dual_multiplier``/``dual_cold`` (n×n per block, n the smaller side of each (out, in) block)."""
    if group["algorithm"] == "adamw":
        shape = param_shape(p)
        return {"step": None, "exp_avg": shape, "exp_avg_sq": shape}
    shapes: dict[str, Any] = {"step": None, "momentum_buffer": tuple(p.shape)}
    if group["manifold"] is not None:
        k, (rows, cols) = group["split"], out_in(p.shape, group["layout"])
        n = min(rows // int(k), cols) if k else min(rows, cols)
        dual = (int(k), n, n) if k else (n, n)
        shapes.update(dict.fromkeys(DUAL_STATE, dual))
    return shapes


def foreign_key(state: dict[str, Any], shapes: dict[str, tuple[int, ...] | None]) -> str | None:
    """The first key of a parameter's state that ``shapes`` (``state_shapes``: what its group keeps) lacks."""
    return next((key for key in state if key not in shapes), None)


def dual_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of a manifold matrix's dual state: that of its working copy in the step (float16/bfloat16 matrices
    are stepped in float32)."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def out_in(shape: torch.Size, layout: str) -> tuple[int, int]:
    """(out, in) of a stored 2-D weight's shape."""
    return (shape[0], shape[1]) if layout == "out_in" else (shape[1], shape[0])


def matrices(t: torch.Tensor, layout: str, split: int | None) -> torch.Tensor:
    """View of a stored 2-D weight as (out, in), or as (k, out/k, in) blocks when split = k (writes go through)."""
    return blocks(t[None], layout, split)[0]


def retraction_distance(V: torch.Tensor, R: torch.Tensor) -> float:
    """How far a retraction moved V to R, relative to V: ‖R − V‖_F / ‖V‖_F (one host read)."""
    return float(torch.linalg.vector_norm(R - V) / torch.linalg.vector_norm(V).clamp_min(1e-30))


def retract(manifold, W: torch.Tensor, products: str = "ieee") -> torch.Tensor:
    """Retraction computed in at least float32, returned in W's dtype; ``products``: its constraint products' kind."""
    X = W.float() if W.dtype in (torch.float16, torch.bfloat16) else W
    return manifold.retract(X, products=products).to(W.dtype)
