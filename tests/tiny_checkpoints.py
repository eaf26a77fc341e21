"""Tiny checkpoints the analysis and compression tests share."""

from __future__ import annotations

import torch


def llama_state_dict(L: int = 3, d: int = 16, kv: int = 8, ff: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama-layout state dict: L layers of width d (K/V width kv, MLP width ff), random weights."""
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(50, d, generator=g)}
    shapes = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
              "self_attn.o_proj": (d, d), "mlp.gate_proj": (ff, d), "mlp.up_proj": (ff, d), "mlp.down_proj": (d, ff)}
    for i in range(L):
        for k, s in shapes.items():
            sd[f"model.layers.{i}.{k}.weight"] = torch.randn(*s, generator=g)
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(d)
    return sd
