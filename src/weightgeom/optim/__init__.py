"""weightgeom.optim: Muon / manifold Muon / AdamW in one optimizer, the magnitude–direction wrapper, parameter-group
strategies, typed optimizer configs and one-line builders.

See docs/ARCHITECTURE.md (optim) and docs/muon.md (derivations).
"""

from weightgeom.optim.build import build_optimizer
from weightgeom.optim.compiled import compile_step
from weightgeom.optim.config import AdamWConfig, MDConfig, MuonConfig, OptimConfig
from weightgeom.optim.dual import DUAL_PRESETS, DualAscent
from weightgeom.optim.functional import (
    NonFiniteGradientError,
    adamw_update,
    apply_update,
    momentum_direction,
    shape_scale,
)
from weightgeom.optim.magnitude_direction import MagnitudeDirection
from weightgeom.optim.manifold_muon import dual_ascent, manifold_direction, manifold_direction_reference
from weightgeom.optim.muon import FarRetractionWarning, Muon
from weightgeom.optim.param_groups import STRATEGIES, describe, param_groups

__all__ = [
    "Muon",
    "DualAscent",
    "DUAL_PRESETS",
    "MagnitudeDirection",
    "build_optimizer",
    "compile_step",
    "param_groups",
    "describe",
    "STRATEGIES",
    "MuonConfig",
    "AdamWConfig",
    "MDConfig",
    "OptimConfig",
    "FarRetractionWarning",
    "manifold_direction",
    "manifold_direction_reference",
    "dual_ascent",
    "momentum_direction",
    "shape_scale",
    "apply_update",
    "adamw_update",
    "NonFiniteGradientError",
]
