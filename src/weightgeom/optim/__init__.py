"""weightgeom.optim: Muon / manifold Muon / AdamW in one optimizer, and parameter-group strategies.

See docs/ARCHITECTURE.md (optim) and docs/muon.md (derivations).
"""

from weightgeom.optim.functional import adamw_update, apply_update, momentum_direction, shape_scale
from weightgeom.optim.manifold_muon import manifold_direction, manifold_direction_reference
from weightgeom.optim.muon import Muon

__all__ = [
    "Muon",
    "manifold_direction",
    "manifold_direction_reference",
    "momentum_direction",
    "shape_scale",
    "apply_update",
    "adamw_update",
]
