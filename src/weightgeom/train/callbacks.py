"""Trainer callbacks: the one extension point of :func:`weightgeom.train.train`, and the built-in ones.

A callback is an object with any of the :class:`Callback` methods; :func:`~weightgeom.train.train` calls them, in
the order the callbacks were given, at fixed points of the loop, each with the same :class:`TrainContext` (updated in
place). Per session (one ``train()`` call that trains):

0. ``on_setup(ctx)`` — once, after the model and optimizer are built and a checkpoint (if resuming) is loaded, but
   before anything in the run directory is written or an earlier run moved aside: the place to refuse a setting
   that cannot work (raise ``ValueError``), so a refused run leaves the directory as it was. Callback state is not
   loaded yet; write no files here.
1. ``on_train_start(ctx)`` — once, after the model and optimizer are built and a checkpoint (if resuming) is loaded,
   callback state included (:meth:`Callback.load_state_dict` runs just before it), and after the run directory's
   files are written (a fresh start has moved an earlier run aside already). ``ctx.step`` is the start step.
2. ``on_eval(ctx, metrics)`` — after every evaluation, including the one at step 0 of a fresh run.
3. per optimizer step s = ctx.step + 1: ``on_before_step(ctx)`` after backward and gradient clipping, before the
   update (weights are those of step s − 1; ``ctx.step`` is still s − 1); then the update; then ``on_step_end(ctx)``
   with ``ctx.step = s`` and the updated weights, before diagnostics, logging, evaluation and the checkpoint of step
   s. In both, ``ctx.grads_available`` is True: every parameter's ``.grad`` holds this step's gradient (mean over
   micro-batches and ranks, after clipping: the one the optimizer uses; under FSDP this rank's shard) and
   ``ctx.loss`` is the step's mean train loss. The gradients are dropped right after ``on_step_end``
   (``grads_available`` is False in every other hook). A callback may change the weights in ``on_step_end``
   (e.g. :class:`SigmaCap`); diagnostics and checkpoints then see the changed weights. A step whose loss or gradient
   is non-finite ends the run as diverged before ``on_before_step``.
4. ``on_checkpoint(ctx, path)`` — after a checkpoint is written (``path``: rank 0's file).
5. ``on_train_end(ctx, result)`` — when the run ends as ``done`` or ``diverged`` (``result`` is what ``train()``
   returns). Not called when the run fails (an exception, Ctrl-C) nor for a run that is already finished (nothing is
   trained; no hook is called).

Every rank calls every hook (a callback that changes weights must do it on every rank to keep replicas equal); a
callback that writes files checks ``ctx.is_main``. An exception from a hook stops the run: it is re-raised as
:class:`CallbackError` naming the callback, the hook and the step, and ``status.json`` says ``failed`` with that line.

**State across a resume.** Each checkpoint stores ``{key: callback.state_dict()}`` for the callbacks whose state is
not empty (key: :attr:`Callback.state_key`, default the class name; ``#2``, ``#3`` … for repeats); it must be tensors
and plain values (checkpoints are loaded with ``weights_only=True``). Resuming calls ``load_state_dict(state)`` on the
callbacks whose key is in the checkpoint, before ``on_train_start``; a callback whose key is missing (a checkpoint
written without it) is told so by ``ctx.resumed`` being True with no state loaded (``ctx.loaded_state`` lists the keys
that were loaded).

**Names.** Declarative configs (the experiment recipes' ``controls``) name callbacks; the registry that turns
names into instances is :mod:`weightgeom.experiments.callbacks` (it also names callbacks of the analysis layer,
which sits above this one).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "Callback",
    "TrainContext",
    "CallbackError",
    "CallbackList",
    "SigmaCap",
]


@dataclass
class TrainContext:
    """What a callback sees of the run; one object per session, updated in place by the trainer.

    Attributes:
        model: the model (unwrapped: not the DDP / ``torch.compile`` wrapper), parameters on ``device``.
        optimizer: the optimizer built from the config (Muon, AdamW or the magnitude–direction wrapper).
        config: the resolved, validated config the trainer runs (read it, do not change it).
        run_dir: the run directory.
        step: optimizer updates done so far (0 before the first; s in ``on_step_end`` of step s).
        start_step: the step this session started from (0 for a fresh run, the checkpoint's step on resume).
        max_steps: ``train.max_steps``.
        resumed: this session continues from a checkpoint.
        loaded_state: keys of the callbacks whose state was restored from the checkpoint.
        loss: the mean train loss of the current step (None before the first step of the session).
        grads_available: ``.grad`` holds the current step's (clipped) gradient: True in ``on_before_step`` and
            ``on_step_end`` only.
        batch: the last micro-batch ``(x, y)`` of the current step (None before the first step).
        rank, world_size, is_main: the process's place under torchrun (0, 1, True without it).
        device: where the model lives.
        fsdp: the parameters are FSDP shards (``run.parallel = "fsdp"`` under torchrun).
    """

    model: nn.Module
    optimizer: Any
    config: Any
    run_dir: Path
    step: int = 0
    start_step: int = 0
    max_steps: int = 0
    resumed: bool = False
    loaded_state: list[str] = field(default_factory=list)
    loss: float | None = None
    grads_available: bool = False
    batch: tuple[torch.Tensor, torch.Tensor] | None = None
    rank: int = 0
    world_size: int = 1
    is_main: bool = True
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    fsdp: bool = False


class Callback:
    """Base class of trainer callbacks: every hook is a no-op; override the ones you need (see the module docstring
    for when each is called and what ``ctx`` holds).

    Attributes:
        state_key: the key of this callback's state in checkpoints (None: the class name).
    """

    state_key: str | None = None

    def on_setup(self, ctx: TrainContext) -> None:
        """Once per session, before the run directory is written: raise ``ValueError`` to refuse a setting."""

    def on_train_start(self, ctx: TrainContext) -> None:
        """Once per session, before the first step (``ctx.step`` = start step)."""

    def on_before_step(self, ctx: TrainContext) -> None:
        """After backward and clipping, before the optimizer update (gradients present, weights not yet updated)."""

    def on_step_end(self, ctx: TrainContext) -> None:
        """After the optimizer update of step ``ctx.step`` (gradients still present)."""

    def on_eval(self, ctx: TrainContext, metrics: dict[str, float]) -> None:
        """After an evaluation at step ``ctx.step``; ``metrics`` as logged (``loss``, ``acc`` for classifiers)."""

    def on_checkpoint(self, ctx: TrainContext, path: Path) -> None:
        """After the checkpoint of step ``ctx.step`` was written to ``path``."""

    def on_train_end(self, ctx: TrainContext, result: dict[str, Any]) -> None:
        """When the run ends ``done`` or ``diverged``; ``result`` is ``train()``'s return value."""

    def state_dict(self) -> dict[str, Any]:
        """State to keep in checkpoints (tensors and plain values); empty (the default) keeps nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, when resuming from a checkpoint that has it."""

    def summary(self) -> dict[str, Any]:
        """A flat JSON-able account of what the callback did (the experiment runner writes it to ``controls.json``)."""
        return {}

    def metrics(self) -> dict[str, float]:
        """Numbers the trainer adds to each train line of ``metrics.jsonl`` (e.g. QK-clip's rescale count); keep
        them cheap (no host sync beyond what the callback already did)."""
        return {}


class CallbackError(RuntimeError):
    """A callback's hook raised; the message names the callback, the hook and the step (the original is the cause)."""


HOOKS = ("on_setup", "on_train_start", "on_before_step", "on_step_end", "on_eval", "on_checkpoint", "on_train_end")


class CallbackList:
    """The trainer's view of its callbacks: calls a hook on each in order, wrapping failures in :class:`CallbackError`.

    Args:
        callbacks: callback objects (a :class:`Callback` subclass, or any object with some of its methods).

    Raises:
        TypeError: an entry has none of the hook methods.
    """

    def __init__(self, callbacks: Iterable[Any] | Any = ()) -> None:
        if callbacks is None:
            callbacks = ()
        elif isinstance(callbacks, Callback) or not isinstance(callbacks, Iterable):
            callbacks = (callbacks,)  # one callback given on its own
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if isinstance(cb, type):
                raise TypeError(f"callbacks: {cb.__name__} is a class; pass an instance, e.g. {cb.__name__}()")
            if not any(callable(getattr(cb, h, None)) for h in HOOKS):
                raise TypeError(f"callbacks: {cb!r} has none of the hook methods ({', '.join(HOOKS)})")
        self.keys = _unique_keys(self.callbacks)

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.callbacks)

    def call(self, hook: str, ctx: TrainContext, *args: Any) -> None:
        """``cb.<hook>(ctx, *args)`` for every callback that has the method.

        Raises:
            CallbackError: a hook raised an ``Exception`` (``KeyboardInterrupt`` and the like pass unchanged).
        """
        for key, cb in zip(self.keys, self.callbacks):
            fn = getattr(cb, hook, None)
            if fn is None:
                continue
            try:
                fn(ctx, *args)
            except Exception as e:
                raise CallbackError(f"callback {key}.{hook} failed at step {ctx.step}: {type(e).__name__}: "
                                    f"{e}".splitlines()[0]) from e

    def metrics(self) -> dict[str, float]:
        """The callbacks' :meth:`Callback.metrics`, merged in order (for the trainer's train lines)."""
        out: dict[str, float] = {}
        for cb in self.callbacks:
            fn = getattr(cb, "metrics", None)
            if callable(fn):
                out.update(fn())
        return out

    def state_dict(self) -> dict[str, Any]:
        """``{key: state}`` of the callbacks with a non-empty state (what a checkpoint stores)."""
        out = {}
        for key, cb in zip(self.keys, self.callbacks):
            fn = getattr(cb, "state_dict", None)
            st = fn() if fn is not None else None
            if st:
                out[key] = st
        return out

    def load_state_dict(self, states: Mapping[str, Any] | None) -> list[str]:
        """Give each callback its state from a checkpoint's ``{key: state}``; returns the keys that were loaded.

        Raises:
            CallbackError: a callback refused its state.
        """
        loaded = []
        for key, cb in zip(self.keys, self.callbacks):
            if not states or key not in states or not hasattr(cb, "load_state_dict"):
                continue
            try:
                cb.load_state_dict(states[key])
            except Exception as e:
                raise CallbackError(f"callback {key}.load_state_dict: {type(e).__name__}: {e}".splitlines()[0]) from e
            loaded.append(key)
        return loaded


def _unique_keys(callbacks: Sequence[Any]) -> list[str]:
    keys, seen = [], {}
    for cb in callbacks:
        base = getattr(cb, "state_key", None) or type(cb).__name__
        n = seen.get(base, 0) + 1
        seen[base] = n
        keys.append(base if n == 1 else f"{base}#{n}")
    return keys


# ------------------------------------------------------------------------------------------------------ σ cap
def _sigma_max(W: torch.Tensor) -> torch.Tensor:
    return torch.linalg.matrix_norm(W.detach().float(), ord=2)


class SigmaCap(Callback):
    """Cap σ_max(W_Q)·σ_max(W_K) per attention layer by scalar rescaling after the optimizer step.

    After every ``every``-th step, for each attention layer whose product exceeds ``cap``, the attention weight is
    multiplied by a scalar so that the product equals ``cap``. A scalar keeps every Gram-space constraint (DGram:
    orthogonal columns stay orthogonal) and bounds the attention logits: |Z_ij| ≤ ‖x_i‖‖x_j‖·cap/√d. A fused
    ``c_attn`` (Q, K, V stacked by rows, (3d, d)) is rescaled as a whole by √(cap/product) (Q, K and V share one
    constraint); separate ``q_proj``/``k_proj`` are each rescaled by √(cap/product). The models have no QK-norm
    option; this is the scale control the manifolds recipe uses for its ``all-dgram-capped`` arm.

    Layers are found by parameter name in ``ctx.model`` (``….c_attn.weight``, or ``….q_proj.weight`` with a
    matching ``….k_proj.weight``). Its counters (steps, rescales, largest product seen) are kept in checkpoints, so
    :meth:`summary` covers the whole run across resumes. The rescale acts on the model's weight tensor: under the
    magnitude–direction wrapper the next step recomposes that tensor from its direction and gains, so the cap has no
    lasting effect there; under FSDP the weights are shards and the cap refuses to run.

    Args:
        cap: the bound on the product (> 0; Stiefel attention has product ≤ 1 for a fused ``c_attn``).
        every: check every this many steps (1 = every step).

    Raises:
        ValueError: ``cap`` not > 0.
    """

    FUSED = re.compile(r"(.*)\.c_attn\.weight$")
    SEP_Q = re.compile(r"(.*)\.q_proj\.weight$")

    def __init__(self, cap: float, every: int = 1) -> None:
        cap = float(cap)
        if not cap > 0 or not math.isfinite(cap):
            raise ValueError(f"sigma_cap must be a finite number > 0, got {cap}")
        self.cap = cap
        self.every = max(1, int(every))
        self.steps = 0
        self.rescales = 0
        self.max_seen = 0.0
        self._targets: list[tuple[str, Callable[[], None]]] | None = None

    def on_setup(self, ctx: TrainContext) -> None:
        if ctx.fsdp:
            raise ValueError("sigma_cap needs whole attention weights; it does not work with run.parallel='fsdp'")
        self._targets = self._find(ctx.model)

    def on_train_start(self, ctx: TrainContext) -> None:
        if self._targets is None:  # a caller that skipped on_setup
            self.on_setup(ctx)

    def _find(self, model: nn.Module) -> list[tuple[str, Callable[[], None]]]:
        named = dict(model.named_parameters())
        targets = []
        for n, p in named.items():
            m = self.FUSED.match(n)
            if m:
                targets.append((m.group(1), self._fused_fn(p)))
                continue
            m = self.SEP_Q.match(n)
            if m and f"{m.group(1)}.k_proj.weight" in named:
                targets.append((m.group(1), self._sep_fn(p, named[f"{m.group(1)}.k_proj.weight"])))
        if not targets:
            raise ValueError("sigma_cap found no attention weights (….c_attn.weight or ….q_proj.weight with "
                             "….k_proj.weight) among the model's parameters")
        return targets

    def _apply(self, scale_fn: Callable[[float], None], prod: float) -> None:
        self.max_seen = max(self.max_seen, prod)
        if prod > self.cap:
            scale_fn(self.cap / prod)
            self.rescales += 1

    def _fused_fn(self, W: torch.Tensor) -> Callable[[], None]:
        def fn() -> None:
            d = W.shape[1]
            prod = float(_sigma_max(W[:d]) * _sigma_max(W[d:2 * d]))

            def scale(r: float) -> None:
                with torch.no_grad():
                    W.mul_(math.sqrt(r))  # Q and K each scale by √r → product by r

            self._apply(scale, prod)

        return fn

    def _sep_fn(self, Wq: torch.Tensor, Wk: torch.Tensor) -> Callable[[], None]:
        def fn() -> None:
            prod = float(_sigma_max(Wq) * _sigma_max(Wk))

            def scale(r: float) -> None:
                with torch.no_grad():
                    Wq.mul_(math.sqrt(r))
                    Wk.mul_(math.sqrt(r))

            self._apply(scale, prod)

        return fn

    def on_step_end(self, ctx: TrainContext) -> None:
        self.steps += 1
        if self.steps % self.every:
            return
        if self._targets is None:
            self._targets = self._find(ctx.model)
        for _, fn in self._targets:
            fn()

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "rescales": self.rescales, "max_product_seen": self.max_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.rescales = int(state["rescales"])
        self.max_seen = float(state["max_product_seen"])

    def summary(self) -> dict[str, Any]:
        """``sigma_cap``, ``steps`` (steps checked or skipped, whole run), ``rescales``, ``max_product_seen``,
        ``layers`` (attention layers capped)."""
        return {"sigma_cap": self.cap, "steps": self.steps, "rescales": self.rescales,
                "max_product_seen": self.max_seen, "layers": len(self._targets or [])}
