"""weightgeom: geometry-aware training of neural networks.

Top-level names:
    msign: matrix sign / polar factor U Vᵀ by Newton–Schulz presets (``weightgeom.linalg``).
    manifolds, optim, models, data, diagnostics, analysis, train, experiments: subpackages.
"""

from weightgeom._lazy import lazy_exports

__version__ = "0.1.0"
__all__ = ["msign", "__version__"]

lazy_exports(__name__, {"msign": "weightgeom.linalg"})  # imported on first use: `weightgeom --help` needs no torch
