"""Llama-style decoder: RMSNorm, gated MLP (SwiGLU by default), RoPE, optional grouped-query attention, no biases.

Parameter names follow HF Llama: ``model.embed_tokens``, ``model.layers.{i}.input_layernorm``,
``.self_attn.{q,k,v,o}_proj``, ``.post_attention_layernorm``, ``.mlp.{gate,up,down}_proj``, ``model.norm``,
``lm_head``. RoPE uses HF's rotate-half convention, so HF Llama weights load by name.

MLP: down(act(gate(x)) ⊙ up(x)); ``activation`` selects act (silu = SwiGLU, gelu = GeGLU, relu = ReGLU, none =
bilinear, radial = x·tanh(‖x‖) over the hidden dimension). ``mlp_gated=False`` gives the plain down(act(up(x))) (no
``gate_proj``).

Initialisation: all Linear/Embedding weights ~ N(0, init_std²), the residual output projections ``o_proj`` and
``down_proj`` ~ N(0, (init_std/√(2·n_layers))²) (the GPT-2 rule), RMSNorm weights 1.
Weight tying (``tie_weights``): ``lm_head.weight`` is ``model.embed_tokens.weight``; it is yielded once, as
``model.embed_tokens.weight``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from .activations import get_activation
from .attention import LlamaAttention
from .base import ConfigBase, ModelBase, lm_loss


@dataclasses.dataclass
class LlamaConfig(ConfigBase):
    """Llama-style model hyper-parameters.

    Attributes:
        dim: model width.
        n_layers: decoder layers.
        n_heads: query heads.
        n_kv_heads: key/value heads (None = n_heads; fewer = grouped-query attention).
        ffn_hidden: MLP hidden width (None = Llama's rule: 8/3·dim rounded up to a multiple of ``multiple_of``).
        multiple_of: rounding for the default ffn_hidden.
        vocab_size: vocabulary size.
        max_seq_len: context length in tokens (RoPE table size).
        activation: MLP activation: silu | gelu | relu | none | radial.
        mlp_gated: gated MLP (gate_proj ⊙ up_proj) as in Llama; False → down(act(up(x))).
        rope_theta: RoPE base.
        norm_eps: RMSNorm ε.
        dropout: attention dropout probability.
        tie_weights: share embed_tokens and lm_head.
        init_std: std of the N(0, σ²) weight init.
    """

    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    multiple_of: int = 64
    vocab_size: int = 50304
    max_seq_len: int = 1024
    activation: str = "silu"
    mlp_gated: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    tie_weights: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len", "multiple_of"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"LlamaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"LlamaConfig: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        if kv <= 0 or self.n_heads % kv != 0:
            raise ValueError(f"LlamaConfig: n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2 != 0:
            raise ValueError(f"LlamaConfig: head_dim={self.dim // self.n_heads} must be even for RoPE")
        if self.ffn_hidden is not None and self.ffn_hidden <= 0:
            raise ValueError(f"LlamaConfig.ffn_hidden must be positive, got {self.ffn_hidden}")
        get_activation(self.activation)

    @property
    def hidden_dim(self) -> int:
        """The MLP hidden width actually used."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        h = int(8 * self.dim / 3)
        return self.multiple_of * math.ceil(h / self.multiple_of)


class RMSNorm(nn.Module):
    """RMSNorm: x / sqrt(mean(x²) + eps) · weight, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class LlamaMLP(nn.Module):
    """Gated MLP down(act(gate(x)) ⊙ up(x)) (or down(act(up(x))) when not gated)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h = config.hidden_dim
        self.gated = config.mlp_gated
        if self.gated:
            self.gate_proj = nn.Linear(config.dim, h, bias=False)
        self.up_proj = nn.Linear(config.dim, h, bias=False)
        self.down_proj = nn.Linear(h, config.dim, bias=False)
        self.act = get_activation(config.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act(self.up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = LlamaAttention(
            config.dim, config.n_heads, config.n_kv_heads, config.max_seq_len, config.rope_theta, config.dropout
        )
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """The ``model.`` prefix of HF Llama: embed_tokens, layers, norm."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.n_layers)])
        self.norm = RMSNorm(config.dim, config.norm_eps)


class Llama(ModelBase):
    """Llama-style causal language model.

    Args:
        config: a ``LlamaConfig`` (or a dict accepted by ``LlamaConfig.from_dict``).
    """

    def __init__(self, config: LlamaConfig | dict) -> None:
        super().__init__()
        if isinstance(config, dict):
            config = LlamaConfig.from_dict(config)
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.model.embed_tokens.weight
        std = config.init_std
        proj_std = std / math.sqrt(2 * config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=proj_std)
            elif p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=std)

    def embedding_parameters(self) -> list[nn.Parameter]:
        return [] if self.config.tie_weights else [self.model.embed_tokens.weight]

    def context_length(self) -> int:
        return self.config.max_seq_len

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits for every position.

        Args:
            idx: (B, T) int64 token ids, T ≤ max_seq_len.
            targets: optional (B, T) next-token ids (-1 = ignore).

        Returns:
            (logits (B, T, vocab_size), mean cross-entropy loss in nats or None).
        """
        if idx.size(1) > self.config.max_seq_len:
            raise ValueError(f"sequence length {idx.size(1)} exceeds max_seq_len={self.config.max_seq_len}")
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x)
        logits = self.lm_head(self.model.norm(x))
        return logits, lm_loss(logits, targets)


# name -> LlamaConfig overrides.
LLAMA_PRESETS: dict[str, dict] = {
    # The continuity paper's small model: 8 layers, ~34M parameters with the GPT-2 BPE vocabulary (50304) and tied
    # embeddings: 19.3M embedding + 8 × 1.77M layers = 33.5M.
    "llama-34m": dict(dim=384, n_layers=8, n_heads=6, ffn_hidden=1024, tie_weights=True, max_seq_len=1024),
    # CPU sizes.
    "llama-micro": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=344, max_seq_len=256),
    "llama-nano": dict(dim=64, n_layers=2, n_heads=4, ffn_hidden=172, max_seq_len=128),
}
