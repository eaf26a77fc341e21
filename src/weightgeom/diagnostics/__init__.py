"""Training-time geometry monitors (σ of constrained matrices, Gram off-diagonal, Q/K spectral product, attention
logit max / entropy / saturation, manifold-Muon residuals, gradient norms) for this package's models and Hugging Face
GPT-2, Llama and BERT. See :mod:`weightgeom.diagnostics.monitors`.
"""

from weightgeom.diagnostics.monitors import (
    INPUT_NORMS,
    SATURATION_THRESHOLD,
    HFAttention,
    attention_modules,
    collect,
    grad_norms,
    logit_stats,
    matrix_stats,
    monitored_matrices,
    optimizer_stats,
    qk_scale,
    qk_sigma_prod,
)

__all__ = [
    "collect", "matrix_stats", "qk_sigma_prod", "qk_scale", "INPUT_NORMS", "logit_stats", "grad_norms",
    "optimizer_stats", "monitored_matrices", "attention_modules", "HFAttention", "SATURATION_THRESHOLD",
]
