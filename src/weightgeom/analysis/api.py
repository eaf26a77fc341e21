"""``analyze(source)``: per-role continuity of adjacent layers as a DataFrame (one row per (role, layer pair)).

Weights, and when available gradients (an nn.Module with ``.grad`` set, or ``grads=``) and accumulated updates
ΔW = W − W_0 (``reference=`` a W_0 source), each get the metrics of :mod:`weightgeom.analysis.continuity` with their
random levels; ``dominance`` = ‖ΔW_l‖_F/‖W0_l‖_F for the first layer of the pair (per-layer values in ``layers``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from weightgeom.analysis.continuity import stack_continuity
from weightgeom.analysis.loaders import Loaded, load
from weightgeom.analysis.roles import RoleWeight, assign_roles
from weightgeom.linalg.topsv import top_singular

__all__ = ["analyze", "analyze_full", "AnalysisResult", "METRICS", "DEFAULT_METRICS"]

METRICS = ("cv", "cu", "gram", "idx")
DEFAULT_METRICS = ("cv", "cu", "gram")


@dataclass
class AnalysisResult:
    """Everything one analysis produces.

    Attributes:
        pairs: one row per (role, layer pair): metric columns and their ``*_rand`` random levels.
        layers: one row per (role, layer): shape, σ1, ‖W‖_F, stable rank ‖W‖_F²/σ1², dominance, SVD check.
        v1_cos / u1_cos: role → (L, L) array of |cos| between the top singular vectors of all layer pairs.
        meta: source format, notes (unpermuted, dequantised, transposed), timings in seconds, method.
    """

    pairs: pd.DataFrame
    layers: pd.DataFrame
    v1_cos: dict[str, np.ndarray] = field(default_factory=dict)
    u1_cos: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


def _as_loaded(source) -> Loaded:
    return source if isinstance(source, Loaded) else load(source)


def _groups(items: list[RoleWeight]) -> list[list[RoleWeight]]:
    """Split a role's layers into runs of one shape (continuity needs equal shapes)."""
    runs: list[list[RoleWeight]] = []
    for rw in items:
        if runs and runs[-1][-1].weight.shape == rw.weight.shape:
            runs[-1].append(rw)
        else:
            runs.append([rw])
    return runs


def _roles_or_none(tensors: Mapping[str, torch.Tensor] | None, roles) -> dict[str, list[RoleWeight]] | None:
    if tensors is None:
        return None
    try:
        return assign_roles(tensors, roles)
    except ValueError:
        return None


def _match(other: dict[str, list[RoleWeight]] | None, role: str, items: list[RoleWeight]) -> list[torch.Tensor] | None:
    """The matrices of ``other`` (grads or reference, role-assigned) matching ``items`` by (role, layer, shape)."""
    if other is None:
        return None
    by_layer = {rw.layer: rw.weight for rw in other.get(role, [])}
    out = []
    for rw in items:
        t = by_layer.get(rw.layer)
        if t is None or t.shape != rw.weight.shape:
            return None
        out.append(t)
    return out


def analyze_full(
    source,
    roles: Mapping[str, str] | str | None = None,
    *,
    reference=None,
    grads: Mapping[str, torch.Tensor] | None = None,
    metrics: Sequence[str] = DEFAULT_METRICS,
    method: str = "randomized",
    check_svd: bool = False,
    idx_k: int | None = None,
    progress: bool = False,
) -> AnalysisResult:
    """Continuity analysis with per-layer details and the all-pairs top-vector cosine matrices.

    Args:
        source: nn.Module, state dict, path (HF dir, .safetensors, torch checkpoint, .gguf) or a :class:`Loaded`.
        roles: user role map ``{role: "name.{i}.pattern"}`` (or JSON text); default: built-in naming rules.
        reference: W_0 source (same kinds as ``source``) for accumulated-update continuity and dominance.
        grads: name → gradient mapping (default: the module's ``.grad`` when ``source`` is an nn.Module).
        metrics: subset of ``cv``, ``cu``, ``gram``, ``idx`` (index-matched, needs a full SVD per matrix).
        method: top-singular-vector method (``randomized`` | ``power`` | ``svd``).
        check_svd: also compute v1/u1 by full SVD: columns ``cv_svd``/``cu_svd`` and per-layer ``v1_err``.
        idx_k: top-k truncation of the index-matched sum.
        progress: print one line per role (stderr) with its time.

    Returns:
        :class:`AnalysisResult`.
    """
    import sys

    bad = set(metrics) - set(METRICS)
    if bad:
        raise ValueError(f"unknown metrics {sorted(bad)}; choose from {', '.join(METRICS)}")
    t_start = time.perf_counter()
    src = _as_loaded(source)
    grads = grads if grads is not None else (src.grads or None)
    ref = _as_loaded(reference).tensors if reference is not None else None
    by_role = assign_roles(src.tensors, roles)
    grad_roles = _roles_or_none(grads, roles)
    ref_roles = _roles_or_none(ref, roles)
    notes: list[str] = []
    pair_rows, layer_rows = [], []
    v1_cos, u1_cos = {}, {}
    timing = {"fast": 0.0, "svd_check": 0.0}
    for role, items in by_role.items():
        t0 = time.perf_counter()
        for run in _groups(items):
            W = torch.stack([rw.weight.float() if rw.weight.dtype != torch.float64 else rw.weight for rw in run])
            L, m, n = W.shape
            base = {"role": role}
            lay = [dict(base, layer=rw.layer, tensor=rw.name, out_dim=m, in_dim=n, note=rw.note) for rw in run]
            fro = torch.linalg.matrix_norm(W)
            for d, f in zip(lay, fro.tolist()):
                d["fro"] = f
            if L >= 2:
                tf = time.perf_counter()
                cols, vecs = stack_continuity(W, metrics, method=method, idx_k=idx_k)
                timing["fast"] += time.perf_counter() - tf
            else:
                cols, vecs = {}, {}
            if "v1" not in vecs:
                u, s, v = top_singular(W, 1, method=method)
                vecs = {"v1": v[..., 0], "u1": u[..., 0], "sigma1": s[..., 0]}
            for d, s1 in zip(lay, vecs["sigma1"].tolist()):
                d["sigma1"] = s1
                d["stable_rank"] = d["fro"] ** 2 / s1**2 if s1 > 0 else float("nan")
            key = role if len(_groups(items)) == 1 else f"{role}[{m}x{n}]"
            v1_cos[key] = (vecs["v1"] @ vecs["v1"].mT).abs().cpu().numpy()
            u1_cos[key] = (vecs["u1"] @ vecs["u1"].mT).abs().cpu().numpy()
            if check_svd:
                ts = time.perf_counter()
                us, ss, vs = top_singular(W, 1, method="svd")
                timing["svd_check"] += time.perf_counter() - ts
                vs, us = vs[..., 0], us[..., 0]
                for i, d in enumerate(lay):
                    d["v1_err"] = 1.0 - float((vs[i] * vecs["v1"][i]).sum().abs())
                    d["u1_err"] = 1.0 - float((us[i] * vecs["u1"][i]).sum().abs())
                    d["sigma1_svd"] = float(ss[i, 0])
                if L >= 2:
                    cols["cv_svd"] = [float((vs[a] * vs[a + 1]).sum().abs()) for a in range(L - 1)]
                    cols["cu_svd"] = [float((us[a] * us[a + 1]).sum().abs()) for a in range(L - 1)]
            g = _match(grad_roles, role, run) if L >= 2 else None
            if grads is not None and g is None and L >= 2:
                notes.append(f"gradients: no complete set for role {role} (same names and shapes needed)")
            if g is not None:
                gc, _ = stack_continuity(torch.stack(g).float(), metrics, method=method, idx_k=idx_k, prefix="grad_")
                cols.update(gc)
            r0 = _match(ref_roles, role, run)
            if ref is not None and r0 is None:
                notes.append(f"reference: no matching W0 for role {role} (same names and shapes needed)")
            if r0 is not None:
                W0 = torch.stack(r0).to(W.dtype)
                dom = (torch.linalg.matrix_norm((W - W0).double()) / torch.linalg.matrix_norm(W0.double())).tolist()
                for d, x in zip(lay, dom):
                    d["dominance"] = x
                if L >= 2:
                    dc, _ = stack_continuity(W - W0, metrics, method=method, idx_k=idx_k, prefix="delta_")
                    cols.update(dc)
                    cols["dominance"] = dom[:-1]
                    cols["dominance_next"] = dom[1:]
            layer_rows.extend(lay)
            for a in range(L - 1):
                row = dict(base, layer=run[a].layer, layer_next=run[a + 1].layer, out_dim=m, in_dim=n)
                row.update({k: v[a] for k, v in cols.items()})
                pair_rows.append(row)
        if progress:
            print(f"  {role:5s} {len(items):3d} layers  {time.perf_counter() - t0:6.2f} s", file=sys.stderr)
    meta = {"format": src.format, "notes": list(src.notes), "method": method, "metrics": list(metrics),
            "time_total_s": time.perf_counter() - t_start, "time_metrics_s": timing["fast"],
            "time_svd_check_s": timing["svd_check"], "source_meta": {k: v for k, v in src.meta.items()
                                                                   if k != "config"}}
    meta["notes"] += sorted({rw.note for items in by_role.values() for rw in items if rw.note}) + notes
    return AnalysisResult(pd.DataFrame(pair_rows), pd.DataFrame(layer_rows), v1_cos, u1_cos, meta)


def analyze(source, roles: Mapping[str, str] | str | None = None, **kwargs) -> pd.DataFrame:
    """Per-role adjacent-layer continuity table (see :func:`analyze_full` for the arguments).

    Returns:
        DataFrame with one row per (role, layer pair): ``role, layer, layer_next, out_dim, in_dim`` and the metric
        columns ``cv, cu, gram_in, gram_out`` (+ ``idx_in, idx_out``), each with its ``*_rand`` random level;
        ``grad_*`` / ``delta_*`` / ``dominance`` when gradients / a reference were given.
    """
    return analyze_full(source, roles, **kwargs).pairs
