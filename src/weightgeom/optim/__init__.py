"""weightgeom.optim: Muon / manifold Muon / AdamW in one optimizer, and parameter-group strategies.

See docs/ARCHITECTURE.md (optim) and docs/muon.md (derivations).
"""

from weightgeom.optim.functional import (
    NonFiniteGradientError,
    adamw_update,
    apply_update,
    momentum_direction,
    shape_scale,
)
from weightgeom.optim.manifold_muon import manifold_direction, manifold_direction_reference
from weightgeom.optim.muon import Muon
from weightgeom.optim.param_groups import STRATEGIES, param_groups

__all__ = [
    "Muon",
    "param_groups",
    "STRATEGIES",
    "manifold_direction",
    "manifold_direction_reference",
    "momentum_direction",
    "shape_scale",
    "apply_update",
    "adamw_update",
    "NonFiniteGradientError",
]

# Magnitude–direction wrapper and one-line builders (optim/magnitude_direction.py, optim/build.py).
from weightgeom.optim.build import build_optimizer  # noqa: E402
from weightgeom.optim.magnitude_direction import MagnitudeDirection  # noqa: E402

__all__ += ["MagnitudeDirection", "build_optimizer"]
