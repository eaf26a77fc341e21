"""Linear-algebra kernels: msign (polar factor) presets, its per-device dtype/step choice, the numerics per device as
one value, top singular vectors."""

from weightgeom.linalg.autotune import MsignChoice, msign_choice, orthogonality_error
from weightgeom.linalg.msign import MSIGN_PRESETS, NSPreset, default_dtype, msign, msign_reference
from weightgeom.linalg.norms import column_norms
from weightgeom.linalg.numerics import Numerics, resolve_numerics
from weightgeom.linalg.precision import full_precision, with_full_precision
from weightgeom.linalg.topsv import top_singular

__all__ = ["msign", "msign_reference", "MSIGN_PRESETS", "NSPreset", "default_dtype", "top_singular", "MsignChoice",
           "msign_choice", "orthogonality_error", "column_norms", "full_precision", "with_full_precision", "Numerics",
           "resolve_numerics"]
