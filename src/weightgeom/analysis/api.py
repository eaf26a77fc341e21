"""``analyze(source)``: per-role continuity of adjacent layers as a DataFrame (one row per (role, layer pair)).

Weights, and when available gradients (an nn.Module with ``.grad`` set, or ``grads=``) and accumulated updates
ΔW = W − W_0 (``reference=`` a W_0 source), each get the metrics of :mod:`weightgeom.analysis.continuity` with their
random levels; ``dominance`` = ‖ΔW_l‖_F/‖W0_l‖_F for the first layer of the pair (per-layer values in ``layers``).

A matrix holding NaN or Inf (e.g. one layer of a diverged checkpoint) is skipped, not fatal: it gets a row in
``layers`` whose note says so, a note in ``meta["notes"]`` naming the tensor, an entry in ``meta["skipped"]``, and the
pairs it would form with its neighbours are left out (no pair spans it); the other matrices are analysed as usual. An
empty matrix (a 0×n or m×0 tensor) is skipped the same way (its reason starts with ``"empty"``). Only when every matrix
is skipped does the analysis refuse (``ValueError``). A non-finite gradient or reference matrix
drops the ``grad_*`` / ``delta_*`` metrics of its run, with a note.
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
from weightgeom.analysis.metric_names import DEFAULT_METRICS, METRICS
from weightgeom.analysis.roles import RoleWeight, assign_roles
from weightgeom.linalg.topsv import top_singular

__all__ = ["analyze", "analyze_full", "AnalysisResult", "METRICS", "DEFAULT_METRICS"]


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


def _nonfinite(t: torch.Tensor) -> str | None:
    """``"3 NaN, 1 Inf of 4096 entries"`` when ``t`` holds non-finite values, else None."""
    if not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return None
    return f"{int(torch.isnan(t).sum())} NaN, {int(torch.isinf(t).sum())} Inf of {t.numel()} entries"


def _empty(t: torch.Tensor) -> str | None:
    """``"empty: 0×8, no entries"`` when ``t`` has no entries (no singular vector to compare), else None."""
    if t.numel():
        return None
    return f"empty: {'×'.join(str(d) for d in t.shape)}, no entries"


def _groups(items: list[RoleWeight], skip: set[int] | None = None) -> list[list[RoleWeight]]:
    """Split a role's layers into runs of one shape (continuity needs equal shapes); the layers in ``skip`` (indices
    into ``items``, e.g. non-finite matrices) are left out and end a run, so no pair spans a skipped layer."""
    runs: list[list[RoleWeight]] = []
    broken = True
    for i, rw in enumerate(items):
        if skip and i in skip:
            broken = True
            continue
        if runs and not broken and runs[-1][-1].weight.shape == rw.weight.shape:
            runs[-1].append(rw)
        else:
            runs.append([rw])
        broken = False
    return runs


def _run_key(role: str, run: list[RoleWeight], runs: list[list[RoleWeight]]) -> str:
    """Name of a run's heatmap: the role, with the shape (and layer range) when the role has several runs."""
    if len(runs) == 1:
        return role
    m, n = run[0].weight.shape
    same_shape = sum(1 for r in runs if r[0].weight.shape == run[0].weight.shape)
    return f"{role}[{m}x{n}]" if same_shape == 1 else f"{role}[{m}x{n}, layers {run[0].layer}-{run[-1].layer}]"


def _skip_nonfinite(by_role: dict[str, list[RoleWeight]], lay_rows: list[dict], notes: list[str],
                    skipped: list[dict]) -> dict[str, set[int]]:
    """Find the matrices that cannot be analysed (empty, or holding NaN/Inf); record them in ``lay_rows``, ``notes``
    and ``skipped`` (whose ``reason`` starts with ``"empty"`` for an empty matrix).

    Returns:
        role → indices of its skipped layers.

    Raises:
        ValueError: every matrix is skipped (nothing left to analyse); names the first tensors.
    """
    skip: dict[str, set[int]] = {}
    total = 0
    for role, items in by_role.items():
        for i, rw in enumerate(items):
            total += 1
            empty = _empty(rw.weight)
            why = empty or _nonfinite(rw.weight)
            if why is None:
                continue
            kind = why if empty else f"non-finite ({why})"
            skip.setdefault(role, set()).add(i)
            skipped.append({"role": role, "layer": rw.layer, "tensor": rw.name, "reason": why})
            m, n = rw.weight.shape
            lay_rows.append({"role": role, "layer": rw.layer, "tensor": rw.name, "out_dim": m, "in_dim": n,
                             "note": f"skipped: {kind}"})
            notes.append(f"skipped {role} layer {rw.layer} ({rw.name}): {kind}; its pairs with the neighbouring "
                         "layers are left out")
    if skipped and len(skipped) == total:
        names = ", ".join(dict.fromkeys(d["tensor"] for d in skipped[:3]))
        if any(d["reason"].startswith("empty") for d in skipped):
            raise ValueError(f"no matrix can be analysed: every one is empty or holds NaN/Inf ({total} matrices, "
                             f"e.g. {names})")
        raise ValueError(f"every matrix holds NaN or Inf ({total} matrices, e.g. {names}): nothing to analyse "
                         "(a diverged checkpoint?)")
    return skip


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

    Raises:
        ValueError: unknown metric, no recognised roles, every matrix non-finite, or a linear-algebra failure (names
            the role and tensors).
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
    ctx = _RunContext(metrics, method, idx_k, check_svd, _roles_or_none(grads, roles), _roles_or_none(ref, roles),
                      grads is not None, ref is not None)
    skipped: list[dict] = []
    skip = _skip_nonfinite(by_role, ctx.layer_rows, ctx.notes, skipped)
    for role, items in by_role.items():
        t0 = time.perf_counter()
        runs = _groups(items, skip.get(role))
        for run in runs:
            try:
                _analyse_run(ctx, role, run, _run_key(role, run, runs))
            except torch.linalg.LinAlgError as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ValueError(f"cannot analyse role {role}, layers {run[0].layer}-{run[-1].layer} "
                                 f"({run[0].name} ...): {first}") from None
        if progress:
            print(f"  {role:5s} {len(items):3d} layers  {time.perf_counter() - t0:6.2f} s", file=sys.stderr)
    order = {r: i for i, r in enumerate(by_role)}
    ctx.layer_rows.sort(key=lambda d: (order[d["role"]], d["layer"]))  # skipped layers in their place
    meta = {"format": src.format, "notes": list(src.notes), "method": method, "metrics": list(metrics),
            "time_total_s": time.perf_counter() - t_start, "time_metrics_s": ctx.timing["fast"],
            "time_svd_check_s": ctx.timing["svd_check"], "skipped": skipped,
            "source_meta": {k: v for k, v in src.meta.items() if k != "config"}}
    meta["notes"] += sorted({rw.note for items in by_role.values() for rw in items if rw.note}) + ctx.notes
    return AnalysisResult(pd.DataFrame(ctx.pair_rows), pd.DataFrame(ctx.layer_rows), ctx.v1_cos, ctx.u1_cos, meta)


@dataclass
class _RunContext:
    """Settings of one :func:`analyze_full` call and the rows / notes its runs add."""

    metrics: Sequence[str]
    method: str
    idx_k: int | None
    check_svd: bool
    grad_roles: dict[str, list[RoleWeight]] | None
    ref_roles: dict[str, list[RoleWeight]] | None
    has_grads: bool
    has_ref: bool
    pair_rows: list[dict] = field(default_factory=list)
    layer_rows: list[dict] = field(default_factory=list)
    v1_cos: dict[str, np.ndarray] = field(default_factory=dict)
    u1_cos: dict[str, np.ndarray] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timing: dict[str, float] = field(default_factory=lambda: {"fast": 0.0, "svd_check": 0.0})


def _finite_match(ctx: _RunContext, other, role: str, run: list[RoleWeight], what: str) -> list[torch.Tensor] | None:
    """The matrices of ``other`` matching ``run`` (see :func:`_match`), or None with a note in ``ctx`` when there is
    no complete match or a matched matrix holds NaN/Inf (``what``: ``"gradients"`` or ``"reference"``)."""
    got = _match(other, role, run)
    if got is None:
        ctx.notes.append(f"{what}: no complete set for role {role} (same names and shapes needed)"
                         if what == "gradients" else
                         f"{what}: no matching W0 for role {role} (same names and shapes needed)")
        return None
    for rw, t in zip(run, got):
        why = _nonfinite(t)
        if why is not None:
            ctx.notes.append(f"{what}: {role} layer {rw.layer} is non-finite ({why}); {what} metrics left out for "
                             f"{role} layers {run[0].layer}-{run[-1].layer}")
            return None
    return got


def _check_svd(ctx: _RunContext, W: torch.Tensor, vecs: dict, lay: list[dict], cols: dict) -> None:
    """Full-SVD check of the top vectors: per-layer ``v1_err``/``u1_err``/``sigma1_svd``, pair ``cv_svd``/``cu_svd``."""
    ts = time.perf_counter()
    us, ss, vs = top_singular(W, 1, method="svd")
    ctx.timing["svd_check"] += time.perf_counter() - ts
    vs, us = vs[..., 0], us[..., 0]
    for i, d in enumerate(lay):
        d["v1_err"] = 1.0 - float((vs[i] * vecs["v1"][i]).sum().abs())
        d["u1_err"] = 1.0 - float((us[i] * vecs["u1"][i]).sum().abs())
        d["sigma1_svd"] = float(ss[i, 0])
    L = W.shape[0]
    if L >= 2:
        cols["cv_svd"] = [float((vs[a] * vs[a + 1]).sum().abs()) for a in range(L - 1)]
        cols["cu_svd"] = [float((us[a] * us[a + 1]).sum().abs()) for a in range(L - 1)]


def _reference_metrics(ctx: _RunContext, role: str, run: list[RoleWeight], W: torch.Tensor, lay: list[dict],
                       cols: dict) -> None:
    """Dominance ‖W − W0‖/‖W0‖ per layer and the ``delta_*`` continuity of ΔW = W − W0 (when a W0 matches)."""
    if not ctx.has_ref:
        return
    r0 = _finite_match(ctx, ctx.ref_roles, role, run, "reference")
    if r0 is None:
        return
    W0 = torch.stack(r0).to(W.dtype)
    dom = (torch.linalg.matrix_norm((W - W0).double()) / torch.linalg.matrix_norm(W0.double())).tolist()
    for d, x in zip(lay, dom):
        d["dominance"] = x
    if W.shape[0] >= 2:
        dc, _ = stack_continuity(W - W0, ctx.metrics, method=ctx.method, idx_k=ctx.idx_k, prefix="delta_")
        cols.update(dc)
        cols["dominance"] = dom[:-1]
        cols["dominance_next"] = dom[1:]


def _analyse_run(ctx: _RunContext, role: str, run: list[RoleWeight], key: str) -> None:
    """All metrics of one run (same-shape, finite, consecutive layers of a role); rows go into ``ctx``."""
    W = torch.stack([rw.weight.float() if rw.weight.dtype != torch.float64 else rw.weight for rw in run])
    L, m, n = W.shape
    base = {"role": role}
    lay = [dict(base, layer=rw.layer, tensor=rw.name, out_dim=m, in_dim=n, note=rw.note) for rw in run]
    fro = torch.linalg.matrix_norm(W)
    for d, f in zip(lay, fro.tolist()):
        d["fro"] = f
    if L >= 2:
        tf = time.perf_counter()
        cols, vecs = stack_continuity(W, ctx.metrics, method=ctx.method, idx_k=ctx.idx_k)
        ctx.timing["fast"] += time.perf_counter() - tf
    else:
        cols, vecs = {}, {}
    if "v1" not in vecs:
        u, s, v = top_singular(W, 1, method=ctx.method)
        vecs = {"v1": v[..., 0], "u1": u[..., 0], "sigma1": s[..., 0]}
    for d, s1 in zip(lay, vecs["sigma1"].tolist()):
        d["sigma1"] = s1
        d["stable_rank"] = d["fro"] ** 2 / s1**2 if s1 > 0 else float("nan")
    ctx.v1_cos[key] = (vecs["v1"] @ vecs["v1"].mT).abs().cpu().numpy()
    ctx.u1_cos[key] = (vecs["u1"] @ vecs["u1"].mT).abs().cpu().numpy()
    if ctx.check_svd:
        _check_svd(ctx, W, vecs, lay, cols)
    g = _finite_match(ctx, ctx.grad_roles, role, run, "gradients") if ctx.has_grads and L >= 2 else None
    if g is not None:
        gc, _ = stack_continuity(torch.stack(g).float(), ctx.metrics, method=ctx.method, idx_k=ctx.idx_k,
                                 prefix="grad_")
        cols.update(gc)
    _reference_metrics(ctx, role, run, W, lay, cols)
    ctx.layer_rows.extend(lay)
    for a in range(L - 1):
        row = dict(base, layer=run[a].layer, layer_next=run[a + 1].layer, out_dim=m, in_dim=n)
        row.update({k: v[a] for k, v in cols.items()})
        ctx.pair_rows.append(row)


def analyze(source, roles: Mapping[str, str] | str | None = None, **kwargs) -> pd.DataFrame:
    """Per-role adjacent-layer continuity table (see :func:`analyze_full` for the arguments).

    Returns:
        DataFrame with one row per (role, layer pair): ``role, layer, layer_next, out_dim, in_dim`` and the metric
        columns ``cv, cu, gram_in, gram_out`` (+ ``idx_in, idx_out``), each with its ``*_rand`` random level;
        ``grad_*`` / ``delta_*`` / ``dominance`` when gradients / a reference were given.
    """
    return analyze_full(source, roles, **kwargs).pairs
