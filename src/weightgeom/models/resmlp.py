"""Deep residual MLP for the geometric-continuity experiments of the continuity paper (K. Jeong, W.-G. Paeng,
H. Suh, arXiv:2605.04971; MNIST, 16 layers × 256).

Structure (names ``inp``, ``blocks.{i}.fc``, ``head``)::

    h = inp(x)                                     # in_dim → width
    for i in range(depth):
        h = h + act(blocks[i].fc(n(h)))    (residual=True)
        h = act(blocks[i].fc(n(h)))        (residual=False, "NoRes")
    logits = head(h)                               # width → out_dim

``n`` is the identity (``norm="none"``, the default) or a per-block pre-norm ``blocks.{i}.norm`` (``norm="layernorm"``:
``nn.LayerNorm(width)`` with its learned per-coordinate gain and bias, ε = 1e-5). LayerNorm subtracts the mean over
the coordinates and scales each coordinate by its own gain, so it breaks the SO(width) symmetry of a linear residual
network differently from an element-wise activation; ``activation="none", norm="layernorm"`` is the continuity
paper's Res+LN arm and ``activation="relu", norm="layernorm"`` its Res+ReLU+LN arm.

Activations: relu (baseline), gelu, none (a linear residual network: "Res+None"), radial σ(x) = x·tanh(‖x‖) (norm over
the width; rotation-equivariant: "Res+Radial"). Biases are off by default: a bias breaks the SO(width) symmetry that
the none/radial ablations are meant to keep.

Initialisation: PyTorch's ``nn.Linear`` default (weights U(±1/√fan_in), std 1/√(3·fan_in)), every weight (and bias)
then multiplied by ``init_scale``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from .activations import get_activation
from .base import ConfigBase, ModelBase


@dataclasses.dataclass
class ResMLPConfig(ConfigBase):
    """Residual MLP hyper-parameters.

    Attributes:
        depth: number of hidden width×width blocks.
        width: hidden width.
        in_dim: input features (784 = 28×28 MNIST pixels).
        out_dim: classes.
        residual: add the skip connection h + act(fc(h)).
        activation: relu | gelu | silu | none | radial.
        init_scale: multiplier on the default nn.Linear initialisation.
        bias: biases in the Linear layers.
        norm: pre-norm of each block's input: none | layernorm (nn.LayerNorm(width), learned gain and bias, ε 1e-5).
    """

    NORMS: ClassVar[tuple[str, ...]] = ("none", "layernorm")

    depth: int = 16
    width: int = 256
    in_dim: int = 784
    out_dim: int = 10
    residual: bool = True
    activation: str = "relu"
    init_scale: float = 1.0
    bias: bool = False
    norm: Literal["none", "layernorm"] = "none"

    def __post_init__(self) -> None:
        for name in ("width", "in_dim", "out_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ResMLPConfig.{name} must be positive, got {getattr(self, name)}")
        if self.depth < 0:
            raise ValueError(f"ResMLPConfig.depth must be >= 0, got {self.depth}")
        if self.init_scale <= 0:
            raise ValueError(f"ResMLPConfig.init_scale must be > 0, got {self.init_scale}")
        get_activation(self.activation)
        if str(self.norm).lower() not in self.NORMS:
            raise ValueError(f"ResMLPConfig.norm must be one of {', '.join(self.NORMS)}, got {self.norm!r}")
        self.norm = str(self.norm).lower()


class ResBlock(nn.Module):
    """One block: optional pre-norm, ``fc`` (width × width) + activation, with or without the skip connection."""

    def __init__(self, width: int, residual: bool, activation: str, bias: bool, norm: str = "none") -> None:
        super().__init__()
        if norm == "layernorm":
            self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width, bias=bias)
        self.residual = residual
        self.act = get_activation(activation)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h) if hasattr(self, "norm") else h
        y = self.act(self.fc(x))
        return h + y if self.residual else y


class ResMLP(ModelBase):
    """Residual MLP classifier.

    Args:
        config: a ``ResMLPConfig`` (or a dict accepted by ``ResMLPConfig.from_dict``).
    """

    def __init__(self, config: ResMLPConfig | dict) -> None:
        super().__init__()
        if isinstance(config, dict):
            config = ResMLPConfig.from_dict(config)
        self.config = config
        c = config
        self.inp = nn.Linear(c.in_dim, c.width, bias=c.bias)
        self.blocks = nn.ModuleList([ResBlock(c.width, c.residual, c.activation, c.bias, c.norm)
                                     for _ in range(c.depth)])
        self.head = nn.Linear(c.width, c.out_dim, bias=c.bias)
        if c.init_scale != 1.0:
            with torch.no_grad():
                for p in self.parameters():
                    p.mul_(c.init_scale)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Class logits.

        Args:
            x: (B, in_dim) float features, or (B, ...) flattened to in_dim (e.g. (B, 1, 28, 28)).
            targets: optional (B,) int64 class labels.

        Returns:
            (logits (B, out_dim), mean cross-entropy loss in nats or None).
        """
        x = x.reshape(x.size(0), -1)
        if x.size(1) != self.config.in_dim:
            raise ValueError(f"input has {x.size(1)} features, expected in_dim={self.config.in_dim}")
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        loss = None if targets is None else F.cross_entropy(logits.float(), targets)
        return logits, loss


RESMLP_PRESETS: dict[str, dict] = {
    "resmlp-16x256": dict(depth=16, width=256),  # the continuity paper's toy MLP
    "resmlp-tiny": dict(depth=4, width=64),
}
