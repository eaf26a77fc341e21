"""Causal self-attention shared by the GPT and Llama models.

Both attention modules expose the diagnostics contract of docs/ARCHITECTURE.md:

- ``n_head``, ``head_dim`` (ints); Llama's also ``n_kv_head``;
- ``qk_weights() -> (W_Q, W_K)``, the query and key weights in PyTorch (out, in) layout, i.e. W_Q is
  (n_head·head_dim, n_embd) and q = x W_Qᵀ. For GPT's fused ``c_attn`` these are row-slices (views) of the fused weight;
- ``record_logits: bool``. False (default): ``F.scaled_dot_product_attention(..., is_causal=True)``. True: the
  attention is computed explicitly and ``last_logits`` holds the pre-softmax logits Z = q kᵀ/√head_dim, shape
  (B, H, T, T), causal-masked with -inf, detached (after RoPE for Llama). Both paths agree to float rounding.

``iter_attention(model)`` yields ``(name, module)`` for every attention module of a model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    dropout_p: float = 0.0,
    explicit: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal scaled-dot-product attention.

    Args:
        q, k, v: (B, H, T, head_dim); k and v must already be expanded to H heads.
        dropout_p: attention dropout probability (pass 0.0 in eval mode).
        explicit: compute softmax(q kᵀ/√d + causal mask) v by hand and also return the logits.

    Returns:
        (y, logits): y is (B, H, T, head_dim); logits is the (B, H, T, T) pre-softmax, scaled, -inf-masked
        tensor (detached) when ``explicit`` else None.
    """
    if not explicit:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True), None
    T, S = q.size(-2), k.size(-2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
    att = att.masked_fill(~mask, float("-inf"))
    logits = att.detach()
    p = F.softmax(att.float(), dim=-1).to(q.dtype)
    if dropout_p > 0.0:
        p = F.dropout(p, p=dropout_p)
    return p @ v, logits


class CausalSelfAttention(nn.Module):
    """GPT-2 multi-head causal self-attention (nanoGPT layout).

    Fused (default): ``c_attn`` Linear(n_embd, 3·n_embd) whose output rows are [Q; K; V], then ``c_proj``.
    ``separate_qkv=True``: ``q_proj``, ``k_proj``, ``v_proj`` each Linear(n_embd, n_embd) — same parameter count,
    but each projection is its own matrix (own manifold constraint / own Gram) for the optimizer.

    Args:
        n_embd: model width (channels).
        n_head: number of heads; must divide n_embd.
        bias: include biases in the linear layers.
        dropout: attention and residual dropout probability.
        separate_qkv: three projections instead of the fused ``c_attn``.
    """

    def __init__(
        self, n_embd: int, n_head: int, bias: bool = False, dropout: float = 0.0, separate_qkv: bool = False
    ) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.n_embd = n_embd
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.separate_qkv = separate_qkv
        self.dropout = dropout
        if separate_qkv:
            self.q_proj = nn.Linear(n_embd, n_embd, bias=bias)
            self.k_proj = nn.Linear(n_embd, n_embd, bias=bias)
            self.v_proj = nn.Linear(n_embd, n_embd, bias=bias)
        else:
            self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        self.record_logits = False
        self.last_logits: torch.Tensor | None = None

    def qk_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_Q, W_K), each (n_embd, n_embd) in (out, in) layout; views of ``c_attn.weight`` when fused."""
        if self.separate_qkv:
            return self.q_proj.weight, self.k_proj.weight
        C = self.n_embd
        w = self.c_attn.weight
        return w[:C], w[C : 2 * C]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, n_embd) → (B, T, n_embd)."""
        B, T, C = x.shape
        if self.separate_qkv:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y, logits = causal_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, explicit=self.record_logits
        )
        if logits is not None:
            self.last_logits = logits
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), HF-Llama "rotate_half" convention (non-interleaved halves).

    Args:
        head_dim: per-head dimension (even).
        max_seq_len: longest sequence (tokens) for which cos/sin are precomputed.
        theta: RoPE base (10000 for Llama-2, 500000 for Llama-3).
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_seq_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    @staticmethod
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        """[x1, x2] → [-x2, x1] on the last dimension."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (B, H, T, d) and k (B, H_kv, T, d) by their positions 0..T-1."""
        T = q.size(-2)
        if T > self.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.max_seq_len}")
        cos = self.cos[:T].to(q.dtype)
        sin = self.sin[:T].to(q.dtype)
        return q * cos + self.rotate_half(q) * sin, k * cos + self.rotate_half(k) * sin


class LlamaAttention(nn.Module):
    """Llama causal self-attention: separate q/k/v/o projections (no bias), RoPE, grouped-query attention.

    Args:
        dim: model width.
        n_heads: query heads; must divide dim.
        n_kv_heads: key/value heads (None → n_heads); must divide n_heads.
        max_seq_len: longest sequence for RoPE.
        rope_theta: RoPE base.
        dropout: attention dropout probability.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        max_seq_len: int = 1024,
        rope_theta: float = 10000.0,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if dim % n_heads != 0:
            raise ValueError(f"dim={dim} is not divisible by n_heads={n_heads}")
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}")
        self.n_head = n_heads
        self.n_kv_head = n_kv_heads
        self.head_dim = dim // n_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.rotary = RotaryEmbedding(self.head_dim, max_seq_len, rope_theta)
        self.record_logits = False
        self.last_logits: torch.Tensor | None = None

    def qk_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_Q, W_K) in (out, in) layout: (n_heads·head_dim, dim) and (n_kv_heads·head_dim, dim)."""
        return self.q_proj.weight, self.k_proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, dim) → (B, T, dim)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q, k)
        if self.n_kv_head != self.n_head:
            rep = self.n_head // self.n_kv_head
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y, logits = causal_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, explicit=self.record_logits
        )
        if logits is not None:
            self.last_logits = logits
        return self.o_proj(y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim))


ATTENTION_TYPES = (CausalSelfAttention, LlamaAttention)
"""This package's attention module classes (what :func:`iter_attention` finds in a model)."""


def iter_attention(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(qualified_name, module)`` for every attention module (GPT or Llama) in ``model``."""
    for name, m in model.named_modules():
        if isinstance(m, ATTENTION_TYPES):
            yield name, m


def set_record_logits(model: nn.Module, on: bool = True) -> int:
    """Turn ``record_logits`` on/off in every attention module; clears ``last_logits`` when off.

    Returns:
        The number of attention modules changed.
    """
    n = 0
    for _, m in iter_attention(model):
        m.record_logits = on
        if not on:
            m.last_logits = None
        n += 1
    return n
