"""Continuity of a model's layer stacks over training: :class:`ContinuityRecorder` (a trainer callback) and
:func:`continuity_rows` (the same rows for one state dict, e.g. a final checkpoint).

Layers are grouped by projection role with :func:`weightgeom.analysis.roles.assign_roles` (Q, K, V, O, Gate, Up,
Down, MLP — ResMLP's ``blocks.{i}.fc``; or a user role map) and every adjacent pair of a role's stack is measured with
:func:`weightgeom.analysis.continuity.stack_continuity` and :func:`~weightgeom.analysis.continuity.dominance_ratio`.

A row of ``continuity.jsonl`` (one JSON object per line) is one adjacent pair (``layer`` l, l + 1) of one role at one
step::

    {"step": s, "kind": "weight" | "grad" | "delta", "role": "mlp" | "q" | "k" | ... (lower case), "layer": l,
     "cv", "cu",                # |cos| of the top right (input) / left (output) singular vectors of W_l, W_l+1
     "align_in", "align_out",   # σ²-weighted Gram alignment in the input (S = WᵀW) / output (S = WWᵀ) space
     "cv_rand", "cu_rand", "align_in_rand", "align_out_rand",   # their random levels
     "dominance",               # delta rows only: ‖ΔW_l‖_F / ‖W_0,l‖_F of the pair's first layer
     "cv_dir1" … "cv_dirK", "v1_share", "cv_rest", "topk_overlap", "topk_overlap_rand"}   # weight rows, topk ≥ 2

The last group (weight rows of the first and the last recorded step only — it costs a top-K decomposition per
layer —, K = ``topk``, default :data:`TOPK`) says how continuity spreads over the top K
input-space singular directions (:func:`weightgeom.analysis.continuity.topk_spread`): C_v of each v_i
(index-matched), v1's share of Σ_i C_v(i)², the mean C_v of v2..vK, and the overlap of the two top-K subspaces
with its random level K/d.

``weight`` rows measure W_t, ``grad`` rows the gradient the optimizer used at step t (minibatch mean, after clipping;
step 0 = the first step's gradient, before any update), ``delta`` rows the accumulated update ΔW = W_t − W_0. All
numbers are dimensionless, in [0, 1] except ``dominance``. Metrics are computed in float64 from float32 copies; top
singular vectors by the randomized method with :data:`ITERS` power steps: C_v and C_u within 2e-5 of the values from
an exact SVD even for freshly initialised 256-wide layers, whose top singular values are nearly equal (σ1/σ2 ≈ 1.004),
and within 1e-6 once σ1/σ2 ≥ 1.04.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from weightgeom._files import open_append, write_atomic
from weightgeom.analysis.continuity import dominance_ratio, stack_continuity, topk_spread
from weightgeom.analysis.roles import assign_roles
from weightgeom.train.callbacks import Callback, TrainContext

__all__ = ["ContinuityRecorder", "continuity_rows", "role_stacks", "spread_columns", "CONTINUITY_FILE", "W0_FILE",
           "ROW_METRICS", "TOPK"]

CONTINUITY_FILE = "continuity.jsonl"
"""Rows of a continuity record, one JSON object per line (in the run directory)."""

W0_FILE = "continuity_w0.safetensors"
"""Where earlier versions kept a continuity run's initial block weights (key ``w0``); read only to resume such a run.
W_0 is now part of the recorder's state in every checkpoint."""

ROW_METRICS = ("cv", "cu", "align_in", "align_out")
"""The continuity numbers of a row (each with a ``*_rand`` random level)."""

_COLUMN = {"cv": "cv", "cu": "cu", "gram_in": "align_in", "gram_out": "align_out", "cv_rand": "cv_rand",
           "cu_rand": "cu_rand", "gram_in_rand": "align_in_rand", "gram_out_rand": "align_out_rand"}


def role_stacks(tensors: Mapping[str, torch.Tensor], roles: Mapping[str, str] | str | None = None,
                ) -> dict[str, list[torch.Tensor]]:
    """The (out, in) matrices of each role with at least two same-shape layers, in layer order (lower-case role).

    Args:
        tensors: name → tensor (a state dict, ``dict(model.named_parameters())`` or the matching gradients).
        roles: a user role map for :func:`~weightgeom.analysis.roles.assign_roles` (None: the built-in naming).

    Raises:
        ValueError: no role recognised (from ``assign_roles``; names the tensors seen and how to pass a role map).
    """
    out = {}
    for role, items in assign_roles(tensors, roles).items():
        mats = [rw.weight for rw in items]
        if len(mats) >= 2 and all(m.shape == mats[0].shape for m in mats):
            out[role.lower()] = mats
    return out


def _stack(mats: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([m.detach().float() for m in mats])


ITERS = 32
"""Power steps for the top singular vectors: at the near-equal top singular values of randomly initialised layers
(σ1/σ2 ≈ 1.004 for 256×256) they still reach the SVD's vector to 1 − |⟨v1, v1_svd⟩| ≈ 2e-8."""


TOPK = 8
"""Top singular directions whose continuity :func:`spread_columns` measures on weight rows (0 or 1: none)."""


def spread_columns(stack: torch.Tensor, topk: int = TOPK, method: str = "randomized",
                   iters: int | None = ITERS) -> dict[str, list[float]]:
    """The top-k spread columns of weight rows (module docstring) for a stack (L, m, n), one value per pair.

    Args:
        stack: L ≥ 2 same-shape matrices (out, in); computed in float64 for float64 input, else float32.
        topk: directions (≥ 2; clipped to min(m, n); below 2: no columns).
        method: top-singular-vector method of :func:`~weightgeom.analysis.continuity.topk_spread`.
        iters: its power steps.
    """
    if topk < 2:
        return {}
    sp = topk_spread(stack, k=topk, method=method, iters=iters)
    cols: dict[str, list[float]] = {f"cv_dir{i + 1}": [row[i] for row in sp["cv_dirs"]] for i in range(sp["k"][0])}
    cols.update({"v1_share": sp["v1_share"], "cv_rest": sp["cv_rest"], "topk_overlap": sp["overlap"],
                 "topk_overlap_rand": sp["overlap_rand"]})
    return cols


def _rows(stack: torch.Tensor, step: int, kind: str, role: str, method: str,
          extra: dict[str, list[float]] | None = None, iters: int | None = ITERS,
          topk: int = 0) -> list[dict[str, Any]]:
    cols, _ = stack_continuity(stack.double(), metrics=("cv", "cu", "gram"), method=method, iters=iters)
    if kind == "weight" and topk >= 2:
        extra = {**(extra or {}), **spread_columns(stack, topk, method, iters)}
    rows = []
    for layer in range(stack.shape[0] - 1):
        row: dict[str, Any] = {"step": int(step), "kind": kind, "role": role, "layer": layer}
        row.update({_COLUMN[k]: float(v[layer]) for k, v in cols.items()})
        if extra:
            row.update({k: float(v[layer]) for k, v in extra.items()})
        rows.append(row)
    return rows


def continuity_rows(tensors: Mapping[str, torch.Tensor], step: int = -1, kind: str = "weight",
                    roles: Mapping[str, str] | str | None = None, method: str = "randomized",
                    topk: int = TOPK) -> list[dict[str, Any]]:
    """Rows (module docstring) for every role stack of one set of tensors, e.g. a final checkpoint's weights.

    Args:
        tensors: name → tensor.
        step: the ``step`` field of the rows.
        kind: the ``kind`` field (``"weight"``, ``"grad"`` …).
        roles: user role map (None: built-in naming).
        method: top-singular-vector method of :func:`~weightgeom.analysis.continuity.stack_continuity`.
        topk: top-k spread columns on weight rows (:func:`spread_columns`; below 2: none).

    Raises:
        ValueError: no role recognised.
    """
    rows = []
    for role, mats in role_stacks(tensors, roles).items():
        rows += _rows(_stack(mats), step, kind, role, method, topk=topk)
    return rows


def _write_rows(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Replace ``path`` with ``rows`` (one JSON line each), atomically."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def _earlier_rows(path: Path, upto: int) -> list[dict[str, Any]]:
    """Rows of an existing record with ``step <= upto`` (later ones are recomputed after a resume)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a partial last line of a killed writer
        if isinstance(r, dict) and isinstance(r.get("step"), int) and r["step"] <= upto:
            out.append(r)
    return out


class ContinuityRecorder(Callback):
    """Record continuity of the model's layer stacks during training into ``run_dir/continuity.jsonl``.

    At the start of a fresh run it records the weights (step 0) and, at the first step before the update, that
    step's gradient (step 0); then after every ``every``-th optimizer step and the last one (``train.max_steps``) the
    weights, the step's gradient (if not all zero) and ΔW = W_t − W_0 with the dominance ratio (if ΔW ≠ 0). Rows are
    appended as they are computed (a killed run keeps them). W_0 is the recorder's checkpoint state, so a resumed
    run measures ΔW from the first session's W_0 and drops the rows after the checkpoint's step (steps it redoes).
    Only rank 0 records.

    Args:
        every: recording interval in optimizer steps (≥ 1).
        roles: a user role map (None: every role :func:`~weightgeom.analysis.roles.assign_roles` recognises among
            the model's parameters; for the residual MLP that is ``blocks.{i}.fc``, role ``mlp``).
        method: top-singular-vector method for ``cv``/``cu`` (``"randomized"`` | ``"power"`` | ``"svd"``).
        topk: top singular directions of the spread columns on the weight rows of step 0 and the last step
            (:func:`spread_columns`; 0 or 1: none).

    Raises:
        ValueError: ``every`` < 1 or ``topk`` < 0 (at construction); no role found in the model, or FSDP-sharded
            parameters (``on_setup``: before the run directory is written).
    """

    state_key = "continuity"

    def __init__(self, every: int, roles: Mapping[str, str] | str | None = None, method: str = "randomized",
                 topk: int = TOPK) -> None:
        if int(every) < 1:
            raise ValueError(f"continuity recording interval must be >= 1, got {every}")
        if int(topk) < 0:
            raise ValueError(f"continuity top-k spread: topk must be >= 0, got {topk}")
        self.every = int(every)
        self.topk = int(topk)
        self.roles = roles
        self.method = method
        self.rows: list[dict[str, Any]] = []  # this session's rows
        self.path: Path | None = None
        self.max_steps = 0
        self._params: dict[str, list[torch.Tensor]] = {}
        self._w0: dict[str, torch.Tensor] | None = None
        self._grad0_due = False
        self._flushed = 0

    # -- state ------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"w0": {k: v.clone() for k, v in self._w0.items()}} if self._w0 else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        w0 = state.get("w0")
        if not isinstance(w0, dict) or not all(isinstance(v, torch.Tensor) for v in w0.values()):
            raise ValueError("continuity recorder state: 'w0' must map role names to tensors")
        self._w0 = {str(k): v.float() for k, v in w0.items()}

    # -- hooks ------------------------------------------------------------------------------------------------------
    def on_setup(self, ctx: TrainContext) -> None:
        """Refuse, before the run directory is touched, a run the recorder cannot record: FSDP-sharded parameters,
        or a model with no role of two or more same-shape layers (``roles`` included)."""
        if ctx.fsdp:
            raise ValueError("the continuity recorder needs whole weight matrices; it does not work with "
                             "run.parallel='fsdp'")
        named = {n: p for n, p in ctx.model.named_parameters()}
        self._params = role_stacks(named, self.roles)
        if not self._params:
            raise ValueError("continuity recorder: no role has two or more same-shape layers to compare")

    def on_train_start(self, ctx: TrainContext) -> None:
        if not self._params:  # a caller that skipped on_setup
            self.on_setup(ctx)
        if not ctx.is_main:
            return
        self.max_steps = ctx.max_steps
        self.path = Path(ctx.run_dir) / CONTINUITY_FILE
        W = {role: _stack(mats) for role, mats in self._params.items()}
        if not ctx.resumed:
            self._w0 = {role: w.clone() for role, w in W.items()}
            for role, w in W.items():
                self.rows += _rows(w, ctx.step, "weight", role, self.method, topk=self.topk)
            self._grad0_due = True
            _write_rows(self.path, [])
        else:
            if self._w0 is None:
                self._w0 = self._legacy_w0(Path(ctx.run_dir), W)
            _write_rows(self.path, _earlier_rows(self.path, ctx.step))
        bad = [r for r in W if r not in self._w0 or self._w0[r].shape != W[r].shape]
        if bad:
            raise ValueError(f"continuity recorder: the saved W_0 does not fit role(s) {', '.join(bad)} of this model")
        self._flush()

    def _legacy_w0(self, run_dir: Path, W: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """W_0 of a run resumed from a checkpoint without recorder state: the older ``W0_FILE`` (one stack, key
        ``w0``) when it fits, else the weights at the resume point (ΔW then counts from there)."""
        if len(W) == 1 and (run_dir / W0_FILE).exists():
            from safetensors.torch import load_file

            try:
                w0 = load_file(str(run_dir / W0_FILE)).get("w0")
            except Exception:  # noqa: BLE001 - an unreadable file: W_0 is taken at the resume point
                w0 = None
            (role, w), = W.items()
            if w0 is not None and w0.shape == w.shape:
                return {role: w0.float()}
        return {role: w.clone() for role, w in W.items()}

    def _grad_stacks(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Gradient stacks of the recorded roles whose layers all have a gradient."""
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        try:
            gs = role_stacks(grads, self.roles) if grads else {}
        except ValueError:  # no recorded layer has a gradient
            return {}
        return {role: _stack(gs[role]) for role, mats in self._params.items()
                if role in gs and len(gs[role]) == len(mats)}

    def on_before_step(self, ctx: TrainContext) -> None:
        if not ctx.is_main or not self._grad0_due:
            return
        self._grad0_due = False
        grads = self._grad_stacks(ctx.model)
        for role, g in grads.items():
            self.rows += _rows(g, 0, "grad", role, self.method)
        self._flush()

    def on_step_end(self, ctx: TrainContext) -> None:
        if not ctx.is_main or (ctx.step % self.every and ctx.step != self.max_steps):
            return
        grads = self._grad_stacks(ctx.model)
        for role, mats in self._params.items():
            W = _stack(mats)
            last = ctx.step == self.max_steps
            self.rows += _rows(W, ctx.step, "weight", role, self.method, topk=self.topk if last else 0)
            g = grads.get(role)
            if g is not None and float(g.abs().sum()) > 0:
                self.rows += _rows(g, ctx.step, "grad", role, self.method)
            dW = W - self._w0[role]
            if float(dW.abs().sum()) > 0:
                dom = [dominance_ratio(W[i], self._w0[role][i]) for i in range(W.shape[0] - 1)]
                self.rows += _rows(dW, ctx.step, "delta", role, self.method, {"dominance": dom})
        self._flush()

    def on_train_end(self, ctx: TrainContext, result: dict[str, Any]) -> None:
        self._flush()

    def _flush(self) -> None:
        """Append the rows computed since the last flush to ``continuity.jsonl``."""
        if self.path is None or self._flushed == len(self.rows):
            return
        with open_append(self.path) as f:
            for r in self.rows[self._flushed:]:
                f.write(json.dumps(r) + "\n")
        self._flushed = len(self.rows)

    def summary(self) -> dict[str, Any]:
        """``continuity_rows``: rows this session recorded; ``continuity_roles``: the roles recorded."""
        return {"continuity_rows": len(self.rows), "continuity_roles": sorted(self._params)}
