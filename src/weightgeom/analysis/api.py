"""``analyze(source)``: per-role continuity of adjacent layers as a DataFrame (one row per (role, layer pair)).

Streamed: a path is opened with :func:`~weightgeom.analysis.loaders.open_lazy` (headers only), and each role's
matrices are read one at a time in layer order, analysed against the previous layer and released; tensors no role uses
are never read. In-memory sources (modules, state dicts, :class:`Loaded`) go through the same per-matrix pass, so both
give the same numbers.

Weights, and when available gradients (an nn.Module with ``.grad`` set, or ``grads=``) and accumulated updates
ΔW = W − W_0 (``reference=`` a W_0 source), each get the metrics of :mod:`weightgeom.analysis.continuity` with their
random levels; ``dominance`` = ‖ΔW_l‖_F/‖W0_l‖_F for the first layer of the pair (per-layer values in ``layers``).

A matrix holding NaN or Inf (e.g. one layer of a diverged checkpoint) is skipped, not fatal: it gets a row in
``layers`` whose note says so, a note in ``meta["notes"]`` naming the tensor, an entry in ``meta["skipped"]``, and the
pairs it would form with its neighbours are left out (no pair spans it); the other matrices are analysed as usual. An
empty matrix (a 0×n or m×0 tensor) is skipped the same way (its reason starts with ``"empty"``), and so is an all-zero
one (``"all zero"``: its singular vectors are arbitrary). Only when every matrix
is skipped does the analysis refuse (``ValueError``). A non-finite gradient or reference matrix
drops the ``grad_*`` / ``delta_*`` metrics of its run, with a note.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from weightgeom._fmt import duration
from weightgeom.analysis.continuity import (
    SKETCH_TOL,
    SKETCH_TOL_SMALL,
    powerlaw_alpha,
    random_level_cos,
    sketch_layer,
    sketch_pair,
)
from weightgeom.analysis.loaders import Loaded, materialize, open_lazy
from weightgeom.analysis.metric_names import DEFAULT_METRICS, METRICS
from weightgeom.analysis.roles import RoleWeight, assign_roles
from weightgeom.linalg.precision import with_full_precision
from weightgeom.linalg.topsv import top_singular

__all__ = ["analyze", "analyze_full", "AnalysisResult", "METRICS", "DEFAULT_METRICS", "GRAM_MODES", "SKETCH_MIN_DIM"]

GRAM_MODES = ("auto", "exact", "sketch")
# gram="auto" sketches the Gram alignment of matrices whose smaller side is at least this long: there the exact form's
# k×k products (≈ 3·m·n·k multiply-adds, k = min(m, n)) cost ≥ 8× the sketch (≈ 750·m·n with the default rank 16
# and 32 probes), and the sketch's error (≤ SKETCH_TOL, measured) is far below the layer-to-layer spread.
SKETCH_MIN_DIM = 2048


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
    return source if isinstance(source, Loaded) else open_lazy(source)


_NATIVE_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def as_computable(t: torch.Tensor, name: str = "") -> torch.Tensor:
    """``t`` in a dtype torch computes with: float8 (e4m3fn, e5m2, their fnuz variants, e8m0fnu) and other
    storage-only floats become float32 (``isfinite``, ``any`` and matmuls are not implemented for them); other
    tensors are returned as they are.

    Raises:
        ValueError: a floating dtype torch cannot convert (the packed ``float4_e2m1fn_x2``), one line naming ``name``.
    """
    if not t.is_floating_point() or t.dtype in _NATIVE_FLOATS:
        return t
    try:
        return t.float()
    except (NotImplementedError, RuntimeError):
        dtype = str(t.dtype).removeprefix("torch.")
        raise ValueError(f"{name or 'a tensor'} is {dtype}, which torch cannot convert to float32 (a packed "
                         "format); unpack or dequantise it first") from None


def _nonfinite(t: torch.Tensor) -> str | None:
    """``"3 NaN, 1 Inf of 4096 entries"`` when ``t`` holds non-finite values, else None."""
    t = as_computable(t)
    if not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return None
    return f"{int(torch.isnan(t).sum())} NaN, {int(torch.isinf(t).sum())} Inf of {t.numel()} entries"


def _empty(t: torch.Tensor) -> str | None:
    """``"empty: 0×8, no entries"`` when ``t`` has no entries (no singular vector to compare), else None."""
    if t.numel():
        return None
    return f"empty: {'×'.join(str(d) for d in t.shape)}, no entries"


def _zero(t: torch.Tensor) -> str | None:
    """``"all zero: no singular direction"`` for an all-zero matrix (its singular vectors are arbitrary, so any
    alignment with it would be meaningless; e.g. a pruned or never-trained layer), else None."""
    if t.is_floating_point() and not bool(as_computable(t).any()):
        return "all zero: no singular direction"
    return None


def skip_kind(reason: str) -> str:
    """The kind of a skipped matrix from its reason: ``"empty"``, ``"all-zero"`` or ``"non-finite"`` (NaN/Inf)."""
    if reason.startswith("empty"):
        return "empty"
    return "all-zero" if reason.startswith("all zero") else "non-finite"


def _run_key(role: str, run: list[RoleWeight], runs: list[list[RoleWeight]]) -> str:
    """Name of a run's heatmap: the role, with the shape (and layer range) when the role has several runs."""
    if len(runs) == 1:
        return role
    m, n = run[0].weight.shape
    same_shape = sum(1 for r in runs if r[0].weight.shape == run[0].weight.shape)
    return f"{role}[{m}x{n}]" if same_shape == 1 else f"{role}[{m}x{n}, layers {run[0].layer}-{run[-1].layer}]"


def _roles_or_none(tensors: Mapping[str, torch.Tensor] | None, roles) -> dict[str, list[RoleWeight]] | None:
    if tensors is None:
        return None
    try:
        return assign_roles(tensors, roles)
    except ValueError:
        return None


class _PairStream:
    """Adjacent-pair metrics of same-shape matrices fed one at a time (the streamed form of
    :func:`~weightgeom.analysis.continuity.stack_continuity`: the same columns, computed holding only the previous
    matrix and its Gram).

    Exact Gram alignment (``gram="exact"``): only the Gram of the smaller side is formed (k×k, k = min(m, n)); in the
    other space the alignment's numerator is the squared Frobenius norm of the k×k cross product (e.g. ‖W_aᵀW_b‖_F²
    for tall W), never a max(m, n)² matrix. Sketched (``gram="sketch"``, or ``"auto"`` for min(m, n) ≥
    :data:`SKETCH_MIN_DIM`): no k×k product at all (:func:`~weightgeom.analysis.continuity.sketch_layer`), the top
    vectors come from the same randomised top-r subspace.
    """

    def __init__(self, metrics: Sequence[str], method: str, idx_k: int | None, prefix: str = "",
                 want_top: bool = False, gram: str = "auto"):
        self.metrics, self.method, self.idx_k, self.p, self.gram = metrics, method, idx_k, prefix, gram
        self.want_top = want_top or "cv" in metrics or "cu" in metrics
        self.prev: dict | None = None
        self.sketched = False  # True once a matrix of this stream had its Gram alignment sketched

    def uses_sketch(self, m: int, n: int) -> bool:
        """Whether an (m, n) matrix gets the sketched Gram alignment (and Gram-free top vectors)."""
        return self.gram == "sketch" or (self.gram == "auto" and min(m, n) >= SKETCH_MIN_DIM)

    def reset(self) -> None:
        """Start a new run (the next matrix has no predecessor)."""
        self.prev = None

    def push(self, W: torch.Tensor) -> tuple[dict, dict]:
        """Add the next matrix (m, n).

        Returns:
            (vectors, columns): ``v1`` (n,), ``u1`` (m,), ``sigma1`` (0-d) of W when computed; the pair (previous,
            W) metric columns with their random levels (empty for the first matrix of a run).
        """
        W = W.to(torch.float64 if W.dtype == torch.float64 else torch.float32)
        m, n = W.shape
        tall = n <= m
        cur: dict = {"W": W}
        sketch = self.uses_sketch(m, n)
        vecs: dict = {}
        if sketch:
            self.sketched = True
            if "gram" in self.metrics:
                before = self.prev.get("sk") if self.prev is not None else None
                sk = cur["sk"] = sketch_layer(W, method=self.method, prev=before)
                vecs = {"v1": sk.v[:, 0], "u1": sk.u[:, 0], "sigma1": sk.s[0]}
            elif self.want_top:
                u, s, v = top_singular(W, 1, method=self.method)
                vecs = {"v1": v[:, 0], "u1": u[:, 0], "sigma1": s[0]}
        elif "gram" in self.metrics or self.method != "svd":
            G = W.mT @ W if tall else W @ W.mT
            cur.update(G=G, sq=(G * G).sum(), tr=torch.diagonal(G).sum())
        if self.want_top and not vecs:
            g = cur["G"][None] if "G" in cur else None
            u, s, v = top_singular(W[None], 1, method=self.method, gram=g)
            vecs = {"v1": v[0, :, 0], "u1": u[0, :, 0], "sigma1": s[0, 0]}
        if "idx" in self.metrics:
            uu, ss, vh = torch.linalg.svd(W, full_matrices=False)
            cur.update(U=uu, S=ss, V=vh.mT)
        cur.update(vecs)
        prev, p, cols = self.prev, self.p, {}
        if prev is not None:
            if "cv" in self.metrics:
                cols[p + "cv"] = float((prev["v1"] * vecs["v1"]).sum().abs())
                cols[p + "cv_rand"] = random_level_cos(n)
            if "cu" in self.metrics:
                cols[p + "cu"] = float((prev["u1"] * vecs["u1"]).sum().abs())
                cols[p + "cu_rand"] = random_level_cos(m)
            if "gram" in self.metrics and sketch:
                for space, (val, rnd) in sketch_pair(prev["sk"], cur["sk"]).items():
                    tag = "in" if space == "input" else "out"
                    cols[f"{p}gram_{tag}"] = val
                    cols[f"{p}gram_{tag}_rand"] = rnd
            elif "gram" in self.metrics:
                den = torch.sqrt(prev["sq"] * cur["sq"])
                for space, tag, d in (("input", "in", n), ("output", "out", m)):
                    if den <= 0:
                        val, rnd = 0.0, 0.0
                    else:
                        if (space == "input") == tall:
                            inner = (prev["G"] * cur["G"]).sum()
                        else:
                            X = prev["W"].mT @ W if tall else prev["W"] @ W.mT
                            inner = (X * X).sum()
                        val, rnd = float(inner / den), float(prev["tr"] * cur["tr"] / (d * den))
                    cols[f"{p}gram_{tag}"] = val
                    cols[f"{p}gram_{tag}_rand"] = rnd
            if "idx" in self.metrics:
                cols[p + "idx_in"] = _idx_pair(prev["V"], prev["S"], cur["V"], cur["S"], self.idx_k)
                cols[p + "idx_in_rand"] = random_level_cos(n)
                cols[p + "idx_out"] = _idx_pair(prev["U"], prev["S"], cur["U"], cur["S"], self.idx_k)
                cols[p + "idx_out_rand"] = random_level_cos(m)
        if "gram" not in self.metrics:
            cur.pop("W")  # the cross product is the only use of the previous matrix itself
        self.prev = cur
        return vecs, cols


def _idx_pair(Ua: torch.Tensor, Sa: torch.Tensor, Ub: torch.Tensor, Sb: torch.Tensor, k: int | None) -> float:
    """Index-matched alignment Σ_i σ_iσ'_i |⟨x_i, x'_i⟩| / Σ_i σ_iσ'_i over the top ``k`` (None: all) pairs."""
    r = Sa.shape[-1] if k is None else min(k, Sa.shape[-1])
    w = Sa[:r] * Sb[:r]
    c = (Ua[:, :r] * Ub[:, :r]).sum(0).abs()
    return float((w * c).sum() / w.sum()) if w.sum() > 0 else 0.0


# The space in which a role's layers can share a basis (the continuity paper: Q, K, Gate, Up share input-space bases;
# O, Down output-space; V neither — its input space is used, and the suggestions say V is not advised).
SHARE_SPACE = {"Q": "input", "K": "input", "Gate": "input", "Up": "input", "MLP": "input", "V": "input",
               "O": "output", "Down": "output"}
SHARE_KS = (1, 8, 64)


class _RoleAnalysis:
    """One role's layers, fed one matrix at a time in layer order; runs of one shape become pair rows in ``ctx``.

    Holds the previous matrix (and its Gram) of the weights, of the gradients and of ΔW = W − W0 only; the rows and
    top vectors of the current run are kept until the run ends (a shape change, a skipped layer, the role's end).
    """

    def __init__(self, ctx: _RunContext, role: str):
        self.ctx, self.role = ctx, role
        self.runs: list[tuple[list[RoleWeight], torch.Tensor, torch.Tensor]] = []
        self.cur: dict | None = None
        self.main = _PairStream(ctx.metrics, ctx.method, ctx.idx_k, want_top=True, gram=ctx.gram)
        self.grad = (_PairStream(ctx.metrics, ctx.method, ctx.idx_k, "grad_", gram=ctx.gram) if ctx.has_grads
                     else None)
        self.delta = (_PairStream(ctx.metrics, ctx.method, ctx.idx_k, "delta_", gram=ctx.gram) if ctx.has_ref
                      else None)
        self.grad_by_layer = _by_layer(ctx.grad_roles, role)
        self.ref_by_layer = _by_layer(ctx.ref_roles, role)

    def _other(self, by_layer: dict | None, rw: RoleWeight, shape, what: str) -> tuple[torch.Tensor | None, str]:
        """The gradient / W0 matrix matching ``rw`` (read now), or (None, why) when missing, misshaped or non-finite."""
        ref = None if by_layer is None else by_layer.get(rw.layer)
        if ref is None or tuple(ref.shape) != tuple(shape):
            return None, "missing"
        t = as_computable(materialize(ref), f"{what} {getattr(ref, 'name', f'of {self.role} layer {rw.layer}')}")
        why = _nonfinite(t)
        return (None, f"{self.role} layer {rw.layer} is non-finite ({why})") if why else (t, "")

    def add(self, rw: RoleWeight, W: torch.Tensor) -> None:
        """Analyse the next finite, non-empty matrix of the role (float32 or float64, (m, n))."""
        ctx, cur = self.ctx, self.cur
        m, n = W.shape
        if cur is not None and cur["shape"] != (m, n):
            self.end_run()
            cur = None
        if cur is None:
            cur = self.cur = {"shape": (m, n), "items": [], "lay": [], "pairs": [], "v1": [], "u1": [],
                              "grad_fail": None, "ref_fail": None, "svd_prev": None}
            for st in (self.main, self.grad, self.delta):
                if st is not None:
                    st.reset()
        lay = {"role": self.role, "layer": rw.layer, "tensor": rw.name, "out_dim": m, "in_dim": n, "note": rw.note,
               "fro": float(torch.linalg.matrix_norm(W))}
        tf = time.perf_counter()
        vecs, cols = self.main.push(W)
        ctx.timing["fast"] += time.perf_counter() - tf
        s1 = float(vecs["sigma1"])
        lay["sigma1"] = s1
        lay["stable_rank"] = lay["fro"] ** 2 / s1**2 if s1 > 0 else float("nan")
        cur["v1"].append(vecs["v1"])
        cur["u1"].append(vecs["u1"])
        if ctx.spectra:
            ts = time.perf_counter()
            G = self.main.prev.get("G") if self.main.prev else None
            if G is None:
                G = W.mT @ W if n <= m else W @ W.mT
            lay.update(powerlaw_alpha(torch.linalg.eigvalsh(G).cpu().numpy()))
            ctx.timing["spectra"] = ctx.timing.get("spectra", 0.0) + time.perf_counter() - ts
        if ctx.suggest:
            self._share(W, cur, cols)
        if ctx.check_svd:
            ts = time.perf_counter()
            us, ss, vs = top_singular(W[None], 1, method="svd")
            ctx.timing["svd_check"] += time.perf_counter() - ts
            vs, us = vs[0, :, 0], us[0, :, 0]
            lay["v1_err"] = 1.0 - float((vs * vecs["v1"]).sum().abs())
            lay["u1_err"] = 1.0 - float((us * vecs["u1"]).sum().abs())
            lay["sigma1_svd"] = float(ss[0, 0])
            if cur["svd_prev"] is not None:
                pv, pu = cur["svd_prev"]
                cols["cv_svd"] = float((pv * vs).sum().abs())
                cols["cu_svd"] = float((pu * us).sum().abs())
            cur["svd_prev"] = (vs, us)
        if self.grad is not None and cur["grad_fail"] is None:
            g, why = self._other(self.grad_by_layer, rw, (m, n), "gradients")
            if g is None:
                cur["grad_fail"] = why
            else:
                cols.update(self.grad.push(g.float())[1])
            del g
        if self.delta is not None and cur["ref_fail"] is None:
            W0, why = self._other(self.ref_by_layer, rw, (m, n), "reference")
            if W0 is None:
                cur["ref_fail"] = why
            else:
                W0 = W0.to(W.dtype)
                D = W - W0
                lay["dominance"] = float(torch.linalg.matrix_norm(D.double())
                                         / torch.linalg.matrix_norm(W0.double()))
                del W0
                cols.update(self.delta.push(D)[1])
                del D
        if cur["items"]:
            row = {"role": self.role, "layer": cur["items"][-1].layer, "layer_next": rw.layer, "out_dim": m,
                   "in_dim": n}
            row.update(cols)
            cur["pairs"].append(row)
        cur["items"].append(rw)
        cur["lay"].append(lay)

    def _share(self, W: torch.Tensor, cur: dict, cols: dict) -> None:
        """``share_k{k}``: energy fraction of W captured by the previous layer's top-k basis in the role's space
        (:data:`SHARE_SPACE`), with the random level k/d; the top-64 basis of W is kept for the next layer."""
        m, n = W.shape
        space = SHARE_SPACE.get(self.role, "input")
        kmax = min(max(SHARE_KS), m, n)
        G = self.main.prev.get("G") if self.main.prev else None
        method = "svd" if self.ctx.method == "svd" else "randomized"
        u, _, v = top_singular(W, kmax, method=method, gram=G if method != "svd" else None)
        B = v if space == "input" else u
        prev = cur.get("share_prev")
        if prev is not None:
            tot = float((W.double() ** 2).sum())
            d = n if space == "input" else m
            for k in SHARE_KS:
                kk = min(k, prev.shape[1])
                P = W @ prev[:, :kk] if space == "input" else prev[:, :kk].mT @ W
                cols[f"share_k{k}"] = float((P.double() ** 2).sum()) / tot if tot > 0 else 0.0
                cols[f"share_k{k}_rand"] = kk / d
        cur["share_prev"] = B

    def end_run(self) -> None:
        """Close the current run: notes for missing gradients / W0, dominance columns, rows into ``ctx``."""
        cur, ctx = self.cur, self.ctx
        if cur is None:
            return
        self.cur = None
        items, lay, pairs = cur["items"], cur["lay"], cur["pairs"]
        L, first, last = len(items), items[0].layer, items[-1].layer
        if self.grad is not None and cur["grad_fail"] is not None and L >= 2:
            why = cur["grad_fail"]
            ctx.notes.append(f"gradients: no complete set for role {self.role} (same names and shapes needed)"
                             if why == "missing" else
                             f"gradients: {why}; gradients metrics left out for {self.role} layers {first}-{last}")
            for row in pairs:
                for k in [k for k in row if k.startswith("grad_")]:
                    del row[k]
        if self.delta is not None:
            why = cur["ref_fail"]
            if why is not None:
                ctx.notes.append(f"reference: no matching W0 for role {self.role} (same names and shapes needed)"
                                 if why == "missing" else
                                 f"reference: {why}; reference metrics left out for {self.role} layers "
                                 f"{first}-{last}")
                for row in pairs:
                    for k in [k for k in row if k.startswith("delta_")]:
                        del row[k]
                for d in lay:
                    d.pop("dominance", None)
            elif L >= 2:
                for a, row in enumerate(pairs):
                    row["dominance"] = lay[a]["dominance"]
                    row["dominance_next"] = lay[a + 1]["dominance"]
        ctx.layer_rows.extend(lay)
        ctx.pair_rows.extend(pairs)
        self.runs.append((items, torch.stack(cur["v1"]), torch.stack(cur["u1"])))
        for st in (self.main, self.grad, self.delta):
            if st is not None:
                st.reset()

    def finish(self) -> None:
        """Close the last run and store each run's all-pairs |cos| matrices of the top vectors."""
        self.end_run()
        if "gram" in self.ctx.metrics and any(st is not None and st.sketched for st in (self.main, self.grad,
                                                                                          self.delta)):
            self.ctx.sketched_roles.append(self.role)
        runs = [r[0] for r in self.runs]
        for items, v1, u1 in self.runs:
            key = _run_key(self.role, items, runs)
            self.ctx.v1_cos[key] = (v1 @ v1.mT).abs().cpu().numpy()
            self.ctx.u1_cos[key] = (u1 @ u1.mT).abs().cpu().numpy()


def _by_layer(roles: dict[str, list[RoleWeight]] | None, role: str) -> dict | None:
    """layer → matrix (tensor or reference) of ``role`` in a role-assigned gradient / W0 source (None: no source)."""
    return None if roles is None else {rw.layer: rw.weight for rw in roles.get(role, [])}


def _result(ctx: _RunContext, src: Loaded, by_role: dict[str, list[RoleWeight]], done: list[str], method: str,
            metrics: Sequence[str], t_start: float, skipped: list[dict]) -> AnalysisResult:
    """The :class:`AnalysisResult` of the roles in ``done`` (all of them, or those finished before an interrupt)."""
    order = {r: i for i, r in enumerate(by_role)}
    layer_rows = sorted(ctx.layer_rows, key=lambda d: (order[d["role"]], d["layer"]))  # skipped layers in place
    meta = {"format": src.format, "notes": list(src.notes), "method": method, "metrics": list(metrics),
            "time_total_s": time.perf_counter() - t_start, "time_metrics_s": ctx.timing["fast"],
            "time_svd_check_s": ctx.timing["svd_check"], "skipped": list(skipped),
            **({"time_spectra_s": ctx.timing["spectra"]} if "spectra" in ctx.timing else {}),
            "source_meta": {k: v for k, v in src.meta.items() if k != "config"},
            "gram": ctx.gram, "gram_sketched_roles": list(ctx.sketched_roles), "suggest": ctx.suggest}
    meta["notes"] += sorted({rw.note for r in done for rw in by_role[r] if rw.note}) + ctx.notes
    if ctx.sketched_roles:
        meta["notes"].append(f"Gram alignment sketched for {', '.join(ctx.sketched_roles)} (within {SKETCH_TOL:g} "
                             f"of the exact value for spaces of ≥ 1024 dimensions, {SKETCH_TOL_SMALL:g} for a few "
                             "hundred" + (f"; min(m, n) ≥ {SKETCH_MIN_DIM}; gram='exact' computes it exactly)"
                                          if ctx.gram == "auto" else ")"))
    missing = [r for r in by_role if r not in done]
    meta["roles_done"] = list(done)
    if missing:
        meta["roles_missing"] = missing
        meta["incomplete"] = True
    return AnalysisResult(pd.DataFrame(list(ctx.pair_rows)), pd.DataFrame(layer_rows), dict(ctx.v1_cos),
                          dict(ctx.u1_cos), meta)


@with_full_precision  # its float32 Grams and products at IEEE precision whatever the process's matmul mode
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
    on_role_done: Callable[[AnalysisResult], None] | None = None,
    spectra: bool = False,
    suggest: bool = False,
    gram: str = "auto",
) -> AnalysisResult:
    """Continuity analysis with per-layer details and the all-pairs top-vector cosine matrices.

    A path is streamed (:func:`~weightgeom.analysis.loaders.open_lazy`): each matrix a role uses is read when the
    analysis gets to it (one role at a time, in layer order), analysed against its predecessor and released; tensors
    no role uses (embeddings, LM head, norms) are never read. Peak memory is a few float32 copies of the largest matrix
    (plus its smaller-side Gram), independent of the number of layers.

    Args:
        source: nn.Module, state dict, path (HF dir, .safetensors, torch checkpoint, .gguf) or a :class:`Loaded`.
        roles: user role map ``{role: "name.{i}.pattern"}`` (or JSON text); default: built-in naming rules.
        reference: W_0 source (same kinds as ``source``) for accumulated-update continuity and dominance.
        grads: name → gradient mapping (default: the module's ``.grad`` when ``source`` is an nn.Module).
        metrics: subset of ``cv``, ``cu``, ``gram``, ``idx`` (index-matched, needs a full SVD per matrix).
        method: top-singular-vector method (``randomized`` | ``power`` | ``svd``).
        check_svd: also compute v1/u1 by full SVD: columns ``cv_svd``/``cu_svd`` and per-layer ``v1_err``.
        idx_k: top-k truncation of the index-matched sum.
        progress: print one line per matrix (stderr) with the elapsed time and an ETA (by matrix size), and one per
            finished role.
        on_role_done: called after each role with the result so far (``meta["roles_missing"]`` lists the roles
            still to come); the CLI writes its CSV/JSON files from it, so an interrupt keeps the finished roles.
        spectra: per-layer heavy-tail metrics in ``layers``: ``alpha`` (power-law exponent of the eigenvalue density
            of WᵀW, see :func:`~weightgeom.analysis.continuity.powerlaw_alpha`), ``alpha_xmin``, ``alpha_ks``,
            ``alpha_tail``; from the eigenvalues of the smaller-side Gram the pass already forms (one ``eigvalsh`` of
            a k×k matrix, k = min(m, n), per matrix). ``sigma1`` (σ_max) and ``stable_rank`` are always there.
        suggest: pair columns ``share_k1``, ``share_k8``, ``share_k64`` (with ``*_rand`` = k/d): the fraction
            ‖P_l W_{l+1}‖_F²/‖W_{l+1}‖_F² of layer l+1's energy that layer l's top-k singular basis captures in the
            role's space (input for Q, K, Gate, Up and V, output for O and Down; V is not advised for sharing). See
            :func:`~weightgeom.analysis.report.shared_basis_runs`.
        gram: how ``gram_in`` / ``gram_out`` are computed: ``"exact"`` (the smaller-side Gram and the cross product
            with the previous layer, ≈ 3·m·n·min(m, n) multiply-adds per matrix), ``"sketch"``
            (:func:`~weightgeom.analysis.continuity.gram_alignment_sketch`: exact on both layers' top-16 singular
            subspace plus a 32-probe estimate of the rest, ≈ 750·m·n, within
            :data:`~weightgeom.analysis.continuity.SKETCH_TOL` of exact; the top vectors then come from the same
            randomised subspace, so no k×k Gram is formed unless ``spectra``) or ``"auto"`` (sketch for matrices with
            min(m, n) ≥ :data:`SKETCH_MIN_DIM`, e.g. the 4096-wide projections of an 8B model; exact below).
            ``meta["gram_sketched_roles"]`` and a note name the roles that were sketched.

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
    if gram not in GRAM_MODES:
        raise ValueError(f"unknown gram mode {gram!r}; choose from {', '.join(GRAM_MODES)}")
    t_start = time.perf_counter()
    src = _as_loaded(source)
    grads = grads if grads is not None else (src.grads or None)
    ref = _as_loaded(reference).tensors if reference is not None else None
    by_role = assign_roles(src.tensors, roles)
    ctx = _RunContext(metrics, method, idx_k, check_svd, _roles_or_none(grads, roles), _roles_or_none(ref, roles),
                      grads is not None, ref is not None, spectra, suggest, gram=gram)
    skipped: list[dict] = []
    total = sum(len(items) for items in by_role.values())
    units = sum(rw.weight.numel() for items in by_role.values() for rw in items) or 1
    done_units, k, done = 0, 0, []
    for role, items in by_role.items():
        t0 = time.perf_counter()
        ra = _RoleAnalysis(ctx, role)
        for rw in items:
            W = as_computable(materialize(rw.weight), rw.name)
            why = _empty(W) or _nonfinite(W) or _zero(W)
            if why is not None:
                kind = why if skip_kind(why) != "non-finite" else f"non-finite ({why})"
                skipped.append({"role": role, "layer": rw.layer, "tensor": rw.name, "reason": why})
                m, n = W.shape
                ctx.layer_rows.append({"role": role, "layer": rw.layer, "tensor": rw.name, "out_dim": m, "in_dim": n,
                                       "note": f"skipped: {kind}"})
                ctx.notes.append(f"skipped {role} layer {rw.layer} ({rw.name}): {kind}; its pairs with the "
                                 "neighbouring layers are left out")
                ra.end_run()
            else:
                try:
                    ra.add(rw, W.float() if W.dtype != torch.float64 else W)
                except torch.linalg.LinAlgError as e:
                    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    start = ra.cur["items"][0] if ra.cur and ra.cur["items"] else rw
                    raise ValueError(f"cannot analyse role {role}, layers {start.layer}-{rw.layer} "
                                     f"({start.name} ...): {first}") from None
            del W
            k += 1
            done_units += rw.weight.numel()
            if progress:
                el = time.perf_counter() - t_start
                eta = el / done_units * (units - done_units) if done_units else 0.0
                shape = "×".join(str(d) for d in rw.weight.shape)
                print(f"  [{k:{len(str(total))}d}/{total}] {role:5s} layer {rw.layer:3d} {shape:>11s}  "
                      f"{duration(el)} elapsed, ETA {duration(eta)}", file=sys.stderr, flush=True)
        ra.finish()
        done.append(role)
        if progress:
            print(f"  {role:5s} {len(items):3d} layers  {time.perf_counter() - t0:6.2f} s", file=sys.stderr)
        if on_role_done is not None and len(done) < len(by_role):
            on_role_done(_result(ctx, src, by_role, done, method, metrics, t_start, skipped))
    if skipped and len(skipped) == total:
        names = ", ".join(dict.fromkeys(d["tensor"] for d in skipped[:3]))
        if all(skip_kind(d["reason"]) == "non-finite" for d in skipped):
            raise ValueError(f"every matrix holds NaN or Inf ({total} matrices, e.g. {names}): nothing to analyse "
                             "(a diverged checkpoint?)")
        kinds = sorted({skip_kind(d["reason"]).replace("non-finite", "NaN/Inf") for d in skipped})
        raise ValueError(f"no matrix can be analysed: every one is {' or '.join(kinds)} ({total} matrices, "
                         f"e.g. {names})")
    res = _result(ctx, src, by_role, done, method, metrics, t_start, skipped)
    if on_role_done is not None:
        on_role_done(res)
    return res


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
    spectra: bool = False
    suggest: bool = False
    gram: str = "auto"
    sketched_roles: list[str] = field(default_factory=list)
    pair_rows: list[dict] = field(default_factory=list)
    layer_rows: list[dict] = field(default_factory=list)
    v1_cos: dict[str, np.ndarray] = field(default_factory=dict)
    u1_cos: dict[str, np.ndarray] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timing: dict[str, float] = field(default_factory=lambda: {"fast": 0.0, "svd_check": 0.0})


def analyze(source, roles: Mapping[str, str] | str | None = None, **kwargs) -> pd.DataFrame:
    """Per-role adjacent-layer continuity table (see :func:`analyze_full` for the arguments).

    Returns:
        DataFrame with one row per (role, layer pair): ``role, layer, layer_next, out_dim, in_dim`` and the metric
        columns ``cv, cu, gram_in, gram_out`` (+ ``idx_in, idx_out``), each with its ``*_rand`` random level;
        ``grad_*`` / ``delta_*`` / ``dominance`` when gradients / a reference were given.
    """
    return analyze_full(source, roles, **kwargs).pairs
