"""Activation functions selectable by name, including the rotation-equivariant radial activation of the continuity paper
(K. Jeong, W.-G. Paeng, H. Suh, arXiv:2605.04971).

``radial``: σ(x) = x · tanh(‖x‖), the norm taken over the last (feature) dimension, one norm per token / sample. It is
non-linear but commutes with every rotation R of the feature space (σ(Rx) = Rσ(x)), so it does not break the SO(d)
symmetry that element-wise activations (ReLU, GELU, SiLU) break.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS = ("relu", "gelu", "silu", "none", "radial")
"""Activation names :func:`get_activation` accepts (``radial``: :func:`radial`; ``none``: the identity)."""


def radial(x: torch.Tensor) -> torch.Tensor:
    """Radial activation σ(x) = x · tanh(‖x‖₂) with the norm over the last dimension.

    Args:
        x: tensor (..., d).

    Returns:
        Tensor of the same shape; each length-d vector keeps its direction, its norm r becomes r·tanh(r).
    """
    return x * torch.tanh(torch.linalg.vector_norm(x, dim=-1, keepdim=True))


def identity(x: torch.Tensor) -> torch.Tensor:
    """The identity (activation "none")."""
    return x


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return the activation function called ``name``.

    Args:
        name: one of ``relu``, ``gelu`` (exact erf form), ``silu``, ``none`` (identity), ``radial``.

    Raises:
        ValueError: for an unknown name (the message names it and lists the valid ones).
    """
    table: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "relu": F.relu,
        "gelu": F.gelu,
        "silu": F.silu,
        "none": identity,
        "radial": radial,
    }
    key = str(name).lower()
    if key not in table:
        raise ValueError(f"unknown activation {name!r}; choose one of {', '.join(ACTIVATIONS)}")
    return table[key]
