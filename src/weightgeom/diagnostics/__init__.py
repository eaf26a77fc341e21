"""Training-time geometry monitors (σ of constrained matrices, Gram off-diagonal, Q/K spectral product, attention
logit max / entropy / saturation, manifold-Muon residuals, gradient norms). See :mod:`weightgeom.diagnostics.monitors`.
"""

from weightgeom.diagnostics.monitors import (
    SATURATION_THRESHOLD,
    attention_modules,
    collect,
    grad_norms,
    logit_stats,
    matrix_stats,
    monitored_matrices,
    optimizer_stats,
    qk_sigma_prod,
)

__all__ = [
    "collect", "matrix_stats", "qk_sigma_prod", "logit_stats", "grad_norms", "optimizer_stats",
    "monitored_matrices", "attention_modules", "SATURATION_THRESHOLD",
]
