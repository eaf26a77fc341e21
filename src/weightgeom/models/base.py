"""Shared pieces of the model configs and modules: strict ``from_dict``, ``num_params``, sampling."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

C = TypeVar("C", bound="ConfigBase")


@dataclasses.dataclass
class ConfigBase:
    """Dataclass mixin: ``from_dict`` rejects unknown keys (naming them), ``to_dict`` returns plain values."""

    @classmethod
    def field_names(cls) -> list[str]:
        """Names of the config fields, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls: type[C], d: dict[str, Any] | None = None, **overrides: Any) -> C:
        """Build a config from a mapping (plus keyword overrides).

        Raises:
            ValueError: naming the first unknown key and listing the valid ones.
        """
        merged = {**(d or {}), **overrides}
        valid = cls.field_names()
        for key in merged:
            if key not in valid:
                raise ValueError(f"unknown {cls.__name__} key {key!r}; valid keys: {', '.join(valid)}")
        return cls(**merged)

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict (JSON/TOML serialisable)."""
        return dataclasses.asdict(self)


class ModelBase(nn.Module):
    """Common methods: ``num_params`` and (for language models) ``generate``."""

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters, each shared (tied) tensor counted once.

        Args:
            non_embedding: subtract the input lookup tables (position embeddings, and the token embedding unless it is
                tied to the output head) — nanoGPT's convention, so GPT-2 small gives 123.6M (124.4M in total).
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= sum(p.numel() for p in self.embedding_parameters())
        return n

    def embedding_parameters(self) -> list[nn.Parameter]:
        """Input embedding tables (overridden by the language models)."""
        return []

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens autoregressively (language models only).

        Args:
            idx: (B, T) int64 prompt token ids.
            max_new_tokens: tokens to append.
            temperature: softmax temperature (> 0).
            top_k: keep only the k most likely tokens per step (None: all).
            generator: torch.Generator for reproducible sampling.

        Returns:
            (B, T + max_new_tokens) token ids.
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        ctx = self.context_length()
        for _ in range(max_new_tokens):
            cond = idx if idx.size(1) <= ctx else idx[:, -ctx:]
            logits, _ = self(cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
            probs = F.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx

    def context_length(self) -> int:
        """Longest input sequence in tokens (language models override)."""
        raise NotImplementedError(f"{type(self).__name__} is not a language model")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
    """Mean next-token cross-entropy (nats) over all positions; target -1 is ignored (nanoGPT)."""
    if targets is None:
        return None
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
