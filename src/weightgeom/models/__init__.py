"""weightgeom.models: GPT-2 family, Llama-style, residual MLP; shared attention (see docs/models.md).

``build_model(kind, preset=None, **cfg)`` builds any of them::

    build_model("gpt", n_layer=2, n_head=2, n_embd=64, vocab_size=65)
    build_model("gpt", preset="gpt2")          # or build_model("gpt2")
    build_model("llama-34m", vocab_size=50304)
    build_model("resmlp", activation="radial", residual=True)
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .activations import ACTIVATIONS, get_activation, radial
from .attention import (
    ATTENTION_TYPES,
    CausalSelfAttention,
    LlamaAttention,
    RotaryEmbedding,
    causal_attention,
    iter_attention,
    set_record_logits,
)
from .base import ConfigBase, ModelBase
from .gpt import GPT, GPT_PRESETS, GPTConfig
from .llama import LLAMA_PRESETS, Llama, LlamaConfig, RMSNorm
from .resmlp import RESMLP_PRESETS, ResMLP, ResMLPConfig

# kind -> (config class, model class)
MODEL_KINDS: dict[str, tuple[type[ConfigBase], type[ModelBase]]] = {
    "gpt": (GPTConfig, GPT),
    "llama": (LlamaConfig, Llama),
    "resmlp": (ResMLPConfig, ResMLP),
}
"""Model kind (``gpt``, ``llama``, ``resmlp``) -> (config class, model class)."""

# preset name -> (kind, config overrides)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    **{k: ("gpt", v) for k, v in GPT_PRESETS.items()},
    **{k: ("llama", v) for k, v in LLAMA_PRESETS.items()},
    **{k: ("resmlp", v) for k, v in RESMLP_PRESETS.items()},
}
"""Preset name (``gpt2``, ``llama-34m``, …) -> (model kind, config values it sets)."""


def available_presets(kind: str | None = None) -> list[str]:
    """Preset names (all, or those of one kind)."""
    return [name for name, (k, _) in PRESETS.items() if kind is None or k == kind]


def get_config(kind: str, preset: str | None = None, **cfg: Any) -> ConfigBase:
    """Resolve ``kind`` / ``preset`` / overrides into a config dataclass.

    Args:
        kind: ``gpt`` | ``llama`` | ``resmlp``, or a preset name (then ``preset`` must be None or the same).
        preset: a preset of that kind whose values ``cfg`` overrides.
        **cfg: config fields.

    Raises:
        ValueError: unknown kind, unknown preset, preset of another kind, or an unknown config key (named).
    """
    if kind in PRESETS and kind not in MODEL_KINDS:
        if preset not in (None, kind):
            raise ValueError(f"model kind {kind!r} is a preset; cannot also use preset={preset!r}")
        kind, preset = PRESETS[kind][0], kind
    if kind not in MODEL_KINDS:
        raise ValueError(
            f"unknown model kind {kind!r}; choose one of {', '.join(MODEL_KINDS)} or a preset: {', '.join(PRESETS)}"
        )
    base: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; available: {', '.join(PRESETS)}")
        pkind, base = PRESETS[preset]
        if pkind != kind:
            raise ValueError(f"preset {preset!r} is a {pkind!r} model, not {kind!r}")
    config_cls, _ = MODEL_KINDS[kind]
    return config_cls.from_dict({**base, **cfg})


def build_model(kind: str, preset: str | None = None, **cfg: Any) -> nn.Module:
    """Build a model: ``kind`` (gpt | llama | resmlp | a preset name), optional ``preset``, config overrides.

    All models implement ``forward(x, targets=None) -> (logits, loss)`` and ``num_params()``; ``model.config`` is
    the resolved config dataclass.
    """
    config = get_config(kind, preset, **cfg)
    model_cls = next(m for c, m in MODEL_KINDS.values() if type(config) is c)
    return model_cls(config)


__all__ = [
    "ACTIVATIONS",
    "ATTENTION_TYPES",
    "GPT",
    "GPTConfig",
    "CausalSelfAttention",
    "Llama",
    "LlamaAttention",
    "LlamaConfig",
    "MODEL_KINDS",
    "PRESETS",
    "RMSNorm",
    "ResMLP",
    "ResMLPConfig",
    "RotaryEmbedding",
    "available_presets",
    "build_model",
    "causal_attention",
    "get_activation",
    "get_config",
    "iter_attention",
    "radial",
    "set_record_logits",
]
