"""Strategy ``auto``: the manifold assignment decided from measured geometry during training.

The manifold-assignment paper (K. Yoshihara, arXiv:2606.13276) names automatic assignment as its future work; this is
one rule for it. Training starts as ALL-DGRAM (``optim.strategy = "auto"``: every hidden matrix DGram, each
attention matrix in a parameter group of its own) and :class:`AutoAssign` watches, per attention layer, the bound on
its attention logits

    B = σ_max(W_Q)·σ_max(W_K)·max_t ‖x_t‖² / √d_head,

(|Z_ij| = |q_i·k_j|/√d_head ≤ B for every head and pair of positions; x is the layer's input, the max taken over
the tokens of the step's training batch). When B exceeds ``threshold`` the layer's query/key weights (the fused
``c_attn`` weight, which also holds V and shares one constraint; or ``q_proj`` and ``k_proj``) are handled by
``action``:

* ``"stiefel"`` (default): their optimizer group switches to the Stiefel manifold, the matrices are retracted onto
  it (polar factor: every singular value set to 1) and their dual multipliers are dropped (a DGram multiplier means
  nothing to the Stiefel dual problem; the momentum is kept). The move is permanent.
* ``"cap"``: the group stays DGram and from then on the weights are rescaled by a scalar after every step so that
  B ≤ threshold (a scalar keeps DGram's orthogonal columns orthogonal), like the σ cap of the ``sigma_cap`` control.

Each check is written to ``run_dir/auto_assign.jsonl`` (``metrics.jsonl``'s format: ``step``, ``split`` = ``"auto"``,
``attn.<i>.logit_bound``, ``attn.<i>.qk_sigma_prod``, ``attn.<i>.x_sq_max``, ``attn.<i>.moved`` 0/1) and every move
as a line with ``event`` = ``"move"``; :meth:`AutoAssign.summary` lists the moves (the sweep runner writes it to
``controls.json``). The callback's state (moves, caps) is kept in checkpoints; the optimizer's checkpoint carries
each group's manifold, so a resumed run continues with the modules already moved.

Declared in a recipe as the control ``auto_assign`` (``{"threshold": 10.0}``; a bare number is the threshold), or
passed to :func:`weightgeom.train.train` as ``callbacks=[AutoAssign(threshold=10.0)]`` with
``optim.strategy = "auto"``; a run with ``optim.strategy = "auto"`` and no ``AutoAssign`` among its callbacks gets one
with the default settings (so ``weightgeom train --set optim.strategy=auto`` runs the rule).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from weightgeom import manifolds
from weightgeom._files import open_append, write_atomic
from weightgeom.diagnostics.monitors import HFAttention, attention_modules, qk_sigma_prod
from weightgeom.schema import ConfigError, Section, from_dict, setting
from weightgeom.train.callbacks import Callback, TrainContext
from weightgeom.train.logging import truncate_jsonl

__all__ = ["AutoAssignConfig", "AutoAssign", "AUTO_FILE", "logit_bound"]

AUTO_FILE = "auto_assign.jsonl"
"""File of a run directory the callback writes its checks and moves to."""


@dataclass
class AutoAssignConfig(Section):
    """Settings of the ``auto`` assignment (the ``auto_assign`` control)."""

    _prefix: ClassVar[str] = "controls.auto_assign"

    threshold: float = setting(10.0, "move an attention layer once its logit bound σ_max(W_Q)·σ_max(W_K)·max‖x‖²/"
                                     "√d_head exceeds this (logit units: the pre-softmax attention score; a softmax "
                                     "over 64 keys is ~99% one-hot at a logit range of ~9)", gt=0)
    action: Literal["stiefel", "cap"] = setting("stiefel", "what a layer over the threshold gets: stiefel (its Q/K "
                                                           "weights move to the Stiefel manifold) | cap (scalar "
                                                           "rescaling keeps the bound at the threshold)")
    every: int = setting(1, "steps between checks (optimizer steps)", gt=0)


def logit_bound(sigma_prod: float, x_sq_max: float, head_dim: int) -> float:
    """σ_max(W_Q)·σ_max(W_K)·max‖x‖²/√d_head: the largest attention logit |q·k|/√d_head these weights allow.

    Args:
        sigma_prod: σ_max(W_Q)·σ_max(W_K) (weight units squared).
        x_sq_max: the largest squared norm of a token's input to the attention layer.
        head_dim: per-head dimension d_head (the logits are divided by √d_head).
    """
    return float(sigma_prod) * float(x_sq_max) / math.sqrt(head_dim)


@dataclass
class _Layer:
    """One watched attention layer: its name, query/key weights, the parameters holding them, their groups."""

    index: int
    name: str
    site: Any  # the attention module (or HFAttention wrapper) with qk_weights()
    head_dim: int
    params: list[tuple[str, nn.Parameter]]
    groups: list[dict[str, Any]]


def _storage_owner(view: torch.Tensor, named: list[tuple[str, nn.Parameter]]) -> tuple[str, nn.Parameter] | None:
    """The parameter whose storage ``view`` (a weight or a row slice of one) lives in."""
    ptr = view.untyped_storage().data_ptr()
    for n, p in named:
        if p.untyped_storage().data_ptr() == ptr:
            return n, p
    return None


def _group_of(optimizer: Any, p: torch.Tensor) -> dict[str, Any] | None:
    for g in getattr(optimizer, "param_groups", []):
        if any(q is p for q in g["params"]):
            return g
    return None


def _matrices(p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """The (out, in) view of a stored weight as Muon steps it (``layout``, ``split`` group keys)."""
    X = p if group.get("layout", "out_in") == "out_in" else p.mT
    k = group.get("split")
    return X if not k else X.unflatten(0, (int(k), -1))


class AutoAssign(Callback):
    """Move an attention layer to Stiefel (or cap it) when its logit bound crosses a threshold (module docstring).

    Args:
        threshold: the bound, in logit units, above which a layer moves (see :class:`AutoAssignConfig`).
        action: ``"stiefel"`` | ``"cap"``.
        every: steps between checks.

    Raises:
        ValueError: a setting out of range (one line naming ``controls.auto_assign.<key>`` and the value); at the
            start of training: FSDP shards, an optimizer that is not :class:`weightgeom.optim.Muon` (e.g. the
            magnitude–direction wrapper), no attention layer, or query/key weights that share a parameter group with
            other matrices (use ``optim.strategy = "auto"``).
    """

    state_key = "auto_assign"

    def __init__(self, threshold: float = 10.0, action: str = "stiefel", every: int = 1) -> None:
        try:
            self.cfg = from_dict(AutoAssignConfig, {"threshold": threshold, "action": action, "every": every})
        except ConfigError as e:
            raise ValueError(str(e)) from None
        self.moves: list[dict[str, Any]] = []
        self.caps: dict[str, bool] = {}
        self.max_bound: dict[str, float] = {}
        self.checks = 0
        self._layers: list[_Layer] = []
        self._setup_model: nn.Module | None = None
        self._x_sq: dict[int, float] = {}
        self._hooks: list[Any] = []
        self._path: Path | None = None
        self._log_every = 1

    # -- state -----------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"moves": [dict(m) for m in self.moves], "caps": sorted(self.caps), "checks": self.checks,
                "max_bound": dict(self.max_bound)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.moves = [dict(m) for m in state.get("moves", [])]
        self.caps = {str(n): True for n in state.get("caps", [])}
        self.checks = int(state.get("checks", 0))
        self.max_bound = {str(k): float(v) for k, v in (state.get("max_bound") or {}).items()}

    def summary(self) -> dict[str, Any]:
        """``auto_threshold``, ``auto_action``, ``auto_layers`` (watched), ``auto_checks``, ``auto_moves`` (list of
        {layer, step, bound, action}), ``auto_max_bound`` (largest bound seen per layer)."""
        return {"auto_threshold": self.cfg.threshold, "auto_action": self.cfg.action,
                "auto_layers": len(self._layers), "auto_checks": self.checks, "auto_moves": list(self.moves),
                "auto_max_bound": dict(self.max_bound)}

    # -- setup -----------------------------------------------------------------------------------------------------
    def on_setup(self, ctx: TrainContext) -> None:
        """Find the attention layers and their groups; refuse what cannot work (before the run directory is written).

        Raises:
            ValueError: FSDP, not a Muon optimizer, query/key weights outside the model or not alone in a Muon group,
                no attention layer.
        """
        if ctx.fsdp:
            raise ValueError("auto_assign needs whole attention weights; it does not work with run.parallel='fsdp'")
        opt = ctx.optimizer
        if not all("manifold" in g for g in getattr(opt, "param_groups", [{}])):
            raise ValueError(f"auto_assign needs the Muon optimizer (optim.name='muon', optim.strategy='auto'), got "
                             f"{type(opt).__name__}")
        named = list(ctx.model.named_parameters())
        self._layers = []
        for i, (name, site) in enumerate(attention_modules(ctx.model)):
            W_Q, W_K = site.qk_weights()
            owners = []
            for W in (W_Q, W_K):
                own = _storage_owner(W, named)
                if own is None:
                    raise ValueError(f"auto_assign: the query/key weights of attention layer {name!r} are not "
                                     "parameters of the model")
                if all(own[1] is not p for _, p in owners):
                    owners.append(own)
            groups = []
            for pname, p in owners:
                g = _group_of(opt, p)
                if g is None or g.get("algorithm") != "muon":
                    raise ValueError(f"auto_assign: {pname} is not in a Muon group of the optimizer")
                if any(q is not p for q in g["params"]):
                    raise ValueError(f"auto_assign: {pname} shares its optimizer group with other matrices, so it "
                                     "cannot move alone; use optim.strategy='auto' (each attention matrix in its own "
                                     "group)")
                groups.append(g)
            self._layers.append(_Layer(i, name, site, int(site.head_dim), owners, groups))
        if not self._layers:
            raise ValueError("auto_assign found no attention layer in the model")
        self._setup_model = ctx.model

    def on_train_start(self, ctx: TrainContext) -> None:
        if self._setup_model is not ctx.model:  # a caller that skipped on_setup
            self.on_setup(ctx)
        for layer in self._layers:
            module = layer.site.module if isinstance(layer.site, HFAttention) else layer.site
            self._hooks.append(module.register_forward_pre_hook(self._x_hook(layer.index), with_kwargs=True))
        self._log_every = max(1, int(getattr(getattr(ctx.config, "train", None), "log_every", 1) or 1))
        if ctx.is_main:
            self._path = Path(ctx.run_dir) / AUTO_FILE
            if ctx.resumed:  # the rows of steps this session redoes move to the .dropped file
                truncate_jsonl(self._path, ctx.step)
            else:
                write_atomic(self._path, "")

    def _x_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not module.training:
                return  # evaluation and diagnostics forwards do not count: the bound is that of the training batch
            x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor) and x.ndim >= 2:
                v = float(x.detach().float().pow(2).sum(-1).max())
                self._x_sq[index] = max(self._x_sq.get(index, 0.0), v)
        return hook

    def on_train_end(self, ctx: TrainContext, result: dict[str, Any]) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- the check -------------------------------------------------------------------------------------------------
    def on_step_end(self, ctx: TrainContext) -> None:
        x_sq, self._x_sq = self._x_sq, {}
        moved_names = {m["layer"] for m in self.moves}
        for layer in self._layers:
            if layer.name in self.caps:
                self._cap(layer, x_sq.get(layer.index))
        if ctx.step % self.cfg.every:
            return
        self.checks += 1
        row: dict[str, Any] = {"step": ctx.step, "split": "auto"}
        for layer in self._layers:
            W_Q, W_K = layer.site.qk_weights()
            prod = qk_sigma_prod(W_Q, W_K)["qk_sigma_prod"]
            xs = x_sq.get(layer.index)
            moved = layer.name in moved_names
            row[f"attn.{layer.index}.qk_sigma_prod"] = prod
            row[f"attn.{layer.index}.moved"] = int(moved)
            if xs is None:
                continue
            bound = logit_bound(prod, xs, layer.head_dim)
            row[f"attn.{layer.index}.x_sq_max"] = xs
            row[f"attn.{layer.index}.logit_bound"] = bound
            self.max_bound[layer.name] = max(self.max_bound.get(layer.name, 0.0), bound)
            if not moved and bound > self.cfg.threshold:
                self._move(ctx, layer, bound, prod, xs)
                row[f"attn.{layer.index}.moved"] = 1
        if ctx.step % self._log_every == 0 or ctx.step == ctx.max_steps or any(
                m["step"] == ctx.step for m in self.moves):
            self._write(row)

    def _move(self, ctx: TrainContext, layer: _Layer, bound: float, prod: float, x_sq: float) -> None:
        event = {"layer": layer.name, "index": layer.index, "step": ctx.step, "bound": bound,
                 "qk_sigma_prod": prod, "x_sq_max": x_sq, "action": self.cfg.action,
                 "params": [n for n, _ in layer.params]}
        if self.cfg.action == "stiefel":
            for (_, p), g in zip(layer.params, layer.groups):
                self._to_stiefel(ctx.optimizer, p, g)
            W_Q, W_K = layer.site.qk_weights()
            event["qk_sigma_prod_after"] = qk_sigma_prod(W_Q, W_K)["qk_sigma_prod"]
        else:
            self.caps[layer.name] = True
            self._cap(layer, x_sq)
        self.moves.append(event)
        self._write({"step": ctx.step, "split": "auto", "event": "move", **event})

    @staticmethod
    def _to_stiefel(optimizer: Any, p: nn.Parameter, group: dict[str, Any]) -> None:
        """Switch ``p``'s group to Stiefel, drop its dual multipliers and retract ``p`` onto the manifold."""
        retraction = group.get("retraction")
        try:
            man = manifolds.get("stiefel", **({"retraction": retraction} if retraction is not None else {}))
        except (TypeError, ValueError):  # a retraction variant Stiefel does not take: its default
            man = manifolds.get("stiefel")
        group["manifold"] = "stiefel"
        state = optimizer.state.get(p, {})
        for key in ("dual_multiplier", "dual_cold"):
            state.pop(key, None)
        with torch.no_grad():
            W = _matrices(p, group)
            X = W.float() if W.dtype in (torch.float16, torch.bfloat16) else W
            W.copy_(man.retract(X).to(W.dtype))

    def _cap(self, layer: _Layer, x_sq: float | None) -> None:
        """Rescale the layer's Q/K weights by a scalar so that its logit bound is at most the threshold."""
        if not x_sq:
            return
        W_Q, W_K = layer.site.qk_weights()
        prod = qk_sigma_prod(W_Q, W_K)["qk_sigma_prod"]
        bound = logit_bound(prod, x_sq, layer.head_dim)
        if bound <= self.cfg.threshold:
            return
        r = self.cfg.threshold / bound
        with torch.no_grad():
            for _, p in layer.params:  # fused c_attn: one parameter holds Q and K, scaled by √r → product by r
                p.mul_(math.sqrt(r))

    def _write(self, row: dict[str, Any]) -> None:
        if self._path is None:
            return
        with open_append(self._path) as f:
            f.write(json.dumps(row, default=str) + "\n")
