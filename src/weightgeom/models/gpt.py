"""GPT-2 family (nanoGPT-compatible layout, sizes and initialisation).

Parameter names follow nanoGPT / HF GPT-2: ``transformer.wte``, ``transformer.wpe``, ``transformer.h.{i}.ln_1``,
``.attn.c_attn`` (or ``.attn.q_proj/k_proj/v_proj`` with ``separate_qkv``), ``.attn.c_proj``, ``.ln_2``,
``.mlp.c_fc``, ``.mlp.c_proj``, ``transformer.ln_f``, ``lm_head``. Linear weights are (out, in) (nn.Linear), unlike
HF's Conv1D (in, out).

Initialisation (nanoGPT): every Linear and Embedding weight ~ N(0, 0.02²), biases 0, LayerNorm weight 1; the residual
output projections (``attn.c_proj``, ``mlp.c_proj``) ~ N(0, (0.02/√(2·n_layer))²).

Weight tying (``tie_weights=True``, default, as nanoGPT): ``lm_head.weight`` *is* ``transformer.wte.weight`` — one
Parameter. ``model.parameters()`` / ``named_parameters()`` yield it once, as ``transformer.wte.weight`` (so optimizer
param groups see it once, under that name, shape (vocab_size, n_embd)). ``state_dict()`` still lists both keys.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from .activations import get_activation
from .attention import CausalSelfAttention
from .base import ConfigBase, ModelBase, lm_loss


@dataclasses.dataclass
class GPTConfig(ConfigBase):
    """GPT-2 hyper-parameters (nanoGPT defaults = GPT-2 small with the vocabulary padded to 50304).

    Attributes:
        block_size: context length in tokens.
        vocab_size: vocabulary size (GPT-2 BPE has 50257; nanoGPT pads to 50304, a multiple of 64).
        n_layer: transformer blocks.
        n_head: attention heads per block.
        n_embd: width (channels).
        dropout: dropout probability (embeddings, attention, residual).
        bias: biases in Linear and LayerNorm layers (GPT-2 had them; nanoGPT and the manifold-assignment paper train
            without).
        separate_qkv: separate ``q_proj/k_proj/v_proj`` instead of the fused ``c_attn`` (same parameter count).
        tie_weights: share the token embedding with the LM head (one Parameter).
        activation: MLP activation (GPT-2: ``gelu``; also relu, silu, none, radial).
        init_std: std of the N(0, σ²) weight init (0.02).
    """

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False
    separate_qkv: bool = False
    tie_weights: bool = True
    activation: str = "gelu"
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        get_activation(self.activation)


class MLP(nn.Module):
    """GPT-2 MLP: c_fc (n_embd → 4·n_embd), activation, c_proj (4·n_embd → n_embd), dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.act = get_activation(config.activation)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(
            config.n_embd, config.n_head, bias=config.bias, dropout=config.dropout, separate_qkv=config.separate_qkv
        )
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(ModelBase):
    """GPT-2 language model.

    Args:
        config: a ``GPTConfig`` (or a dict accepted by ``GPTConfig.from_dict``).
    """

    def __init__(self, config: GPTConfig | dict) -> None:
        super().__init__()
        if isinstance(config, dict):
            config = GPTConfig.from_dict(config)
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        proj_std = config.init_std / math.sqrt(2 * config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=proj_std)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.init_std
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)

    def embedding_parameters(self) -> list[nn.Parameter]:
        out = [self.transformer.wpe.weight]
        if not self.config.tie_weights:
            out.append(self.transformer.wte.weight)
        return out

    def context_length(self) -> int:
        return self.config.block_size

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits for every position.

        Args:
            idx: (B, T) int64 token ids, T ≤ block_size.
            targets: optional (B, T) next-token ids (-1 = ignore).

        Returns:
            (logits (B, T, vocab_size), mean cross-entropy loss in nats or None).
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, lm_loss(logits, targets)


# name -> GPTConfig overrides. GPT-2 sizes as in nanoGPT's from_pretrained; the small ones are minGPT's.
GPT_PRESETS: dict[str, dict] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
    "gpt-mini": dict(n_layer=6, n_head=6, n_embd=192, block_size=256),  # CPU sizes (minGPT)
    "gpt-micro": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "gpt-nano": dict(n_layer=3, n_head=3, n_embd=48, block_size=64),
}
