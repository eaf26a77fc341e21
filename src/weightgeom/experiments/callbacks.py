"""The callback registry: names the experiment recipes' ``controls`` use, turned into trainer callbacks.

:func:`build_callbacks` turns a declarative ``{name: value}`` mapping into instances through :data:`CALLBACKS`
(``value`` is the factory's one argument, or a table of keyword arguments); :func:`register_callback` adds names.
Factories are named ``"module:attribute"`` and imported when first built, so a sweep process that never builds one
never imports its module (the runner imports no analysis code). It lives in the experiments layer because it names
callbacks of the layers below it — the trainer's (:mod:`weightgeom.train.callbacks`) and the analysis layer's
(:mod:`weightgeom.analysis.recorder`) — so no lower layer refers to a higher one. Built in:

* ``sigma_cap`` → :class:`weightgeom.train.callbacks.SigmaCap` (``value`` = the cap): bound σ_max(W_Q)·σ_max(W_K) per
  attention layer.
* ``continuity_every`` → :class:`weightgeom.analysis.recorder.ContinuityRecorder` (``value`` = the interval in
  steps): continuity of the layer stacks over training, into ``continuity.jsonl``.
* ``auto_assign`` → :class:`weightgeom.train.auto_assign.AutoAssign` (``value`` = the logit-bound threshold, or a table
  ``{threshold, action, every}``): strategy ``auto``, an attention layer moves to Stiefel when its logit bound grows.
* ``head_stats_every`` → :class:`weightgeom.train.head_stats.HeadStats` (``value`` = the interval in steps): softmax
  entropy, saturation and logit max per attention head, into ``heads.jsonl``.
* ``qk_clip`` → :class:`weightgeom.train.qk_clip.QKClip` (``value`` = τ, or a table ``{tau, alpha, constrained}``):
  per-head attention-logit bound after each step (the same as the config key ``qk_clip.enabled``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["CALLBACKS", "register_callback", "available_callbacks", "build_callbacks"]

CALLBACKS: dict[str, Callable[..., Any] | str] = {
    "sigma_cap": "weightgeom.train.callbacks:SigmaCap",
    "continuity_every": "weightgeom.analysis.recorder:ContinuityRecorder",
    "auto_assign": "weightgeom.train.auto_assign:AutoAssign",
    "head_stats_every": "weightgeom.train.head_stats:HeadStats",
    "qk_clip": "weightgeom.train.qk_clip:QKClip",
}
"""Name → callback factory (a callable, or ``"module:attribute"`` imported when first built)."""


def register_callback(name: str, factory: Callable[..., Any] | str, replace: bool = False) -> None:
    """Add a name to :data:`CALLBACKS`.

    Sweeps with ``--jobs > 1`` build callbacks in fresh worker processes: register there too (in a module the worker
    imports, e.g. the one defining its train function), or register a ``"module:attribute"`` string.

    Args:
        name: the name configs use.
        factory: a callable returning a callback, or ``"module:attribute"`` naming one (imported on first use).
        replace: allow replacing an existing name.

    Raises:
        ValueError: ``name`` exists and ``replace`` is False.
    """
    if name in CALLBACKS and not replace:
        raise ValueError(f"callback {name!r} is registered already")
    CALLBACKS[name] = factory


def available_callbacks() -> list[str]:
    """Registered callback names, sorted."""
    return sorted(CALLBACKS)


def _factory(name: str) -> Callable[..., Any]:
    f = CALLBACKS[name]
    if isinstance(f, str):
        mod, _, attr = f.partition(":")
        f = getattr(importlib.import_module(mod), attr)
        CALLBACKS[name] = f
    return f


def build_callbacks(spec: Mapping[str, Any] | None) -> list[Any]:
    """Callbacks from a declarative ``{name: value}`` mapping, in its order.

    ``value`` is passed as the factory's one positional argument, or as keyword arguments when it is a mapping.

    Raises:
        ValueError: an unknown name (listing the known ones), or a value the callback refuses (naming the name).
    """
    out = []
    for name, value in (spec or {}).items():
        if name not in CALLBACKS:
            raise ValueError(f"unknown callback {name!r}; known: {', '.join(available_callbacks())}")
        f = _factory(name)
        try:
            out.append(f(**value) if isinstance(value, Mapping) else f(value))
        except (TypeError, ValueError) as e:
            raise ValueError(f"callback {name}={value!r}: {e}") from None
    return out
