"""Activation-aware low-rank fits: every mode minimises the error of the layer's outputs on calibration data.

A layer y = W x (W m×n, PyTorch's (out, in) layout) sees calibration inputs whose mean Gram is G = (1/T) Σ_t x_t x_tᵀ
(n×n, float64, :mod:`weightgeom.analysis.calibration`). The mean squared output error of a replacement Ŵ is

    E(Ŵ) = (1/T) Σ_t ‖(W − Ŵ) x_t‖² = tr((W − Ŵ) G (W − Ŵ)ᵀ) = ‖(W − Ŵ) S‖_F²,   G = S Sᵀ (Cholesky, S lower).

G is damped by ``damping`` × mean(diag G) on its diagonal before the factorisation (a Gram of fewer tokens than n is
singular). The fits (all in float64, returned float32):

* **per layer** (SVD-LLM, Wang et al. arXiv:2403.07378): the best rank-r Ŵ is [W S]_r S⁻¹ (Eckart–Young on W S):
  W S = U Σ Vᵀ, Ŵ = (U_r Σ_r)(S⁻ᵀ V_r)ᵀ, stored as coefficients C = U_r Σ_r (m×r) and basis B = S⁻ᵀ V_r (n×r),
  Ŵ = C Bᵀ. E equals the sum of the squared singular values of W S beyond r: the exact optimum.
* **shared output space** (one left basis U, m×r orthonormal, for the group's layers; C_l = Uᵀ W_l): for a fixed U
  the coefficients minimising E_l are C_l = Uᵀ W_l (the normal equations Uᵀ(W_l − U C_l) G_l = 0), and then
  Σ_l E_l = Σ_l tr(W_l G_l W_lᵀ) − tr(Uᵀ (Σ_l W_l G_l W_lᵀ) U), minimised by the top-r eigenvectors of the summed
  output covariance Σ_l W_l G_l W_lᵀ: the exact joint optimum.
* **shared input space** (one right basis B, n×r, for the group; Ŵ_l = C_l Bᵀ), Basis-Sharing-style (Wang et al.
  arXiv:2410.03765): B = S⁻ᵀ V_r from the top-r right singular vectors V_r of the whitened stacked rows
  [W_1 S; …; W_k S], with S the Cholesky factor of the group's pooled Gram (1/k) Σ_l G_l (exact when the layers see
  the same inputs); then each layer's coefficients are refitted by least squares with its own Gram,
  C_l = W_l G_l B (Bᵀ G_l B)⁻¹, the minimiser of E_l for that B.

Every fit returns the layer-output errors E_l and energies tr(W_l G_l W_lᵀ), so a group's relative calibration loss
is Σ_l E_l / Σ_l tr(W_l G_l W_lᵀ).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["CALIBRATION_HOLDOUT", "CALIBRATION_TOKENS", "DAMPING", "Fit", "whitening", "output_error",
           "output_energy", "fit_per_layer", "fit_shared_input", "fit_shared_output", "refit_input_coefficients",
           "fit_group"]

DAMPING = 1e-6
"""Diagonal damping of a Gram before its Cholesky factorisation, as a fraction of its mean diagonal."""
CALIBRATION_TOKENS = 4096
"""Default calibration budget in tokens (:mod:`weightgeom.analysis.calibration`)."""
CALIBRATION_HOLDOUT = 0.25
"""Default fraction of the calibration tokens (the last ones) that ``auto`` scores its choice on, each space fitted on
the rest (:mod:`weightgeom.analysis.compress_choice`)."""


@dataclass
class Fit:
    """A group's fit in the stored format of :mod:`weightgeom.analysis.compress`.

    Attributes:
        basis: the shared basis (n×r input space, m×r output space) or, per layer, a list of n×r bases.
        coefs: per layer, m×r (input space, per layer) or r×n (output space) coefficients.
        errors: per layer, the mean squared output error E_l = tr((W_l − Ŵ_l) G_l (W_l − Ŵ_l)ᵀ).
        energies: per layer, tr(W_l G_l W_lᵀ) (the mean squared output norm).
    """

    basis: torch.Tensor | list[torch.Tensor]
    coefs: list[torch.Tensor]
    errors: list[float]
    energies: list[float]

    @property
    def loss(self) -> float:
        """Relative calibration loss Σ E_l / Σ tr(W_l G_l W_lᵀ) (0 for an all-zero group)."""
        tot = sum(self.energies)
        return sum(self.errors) / tot if tot > 0 else 0.0


def _damped(G: torch.Tensor, damping: float) -> torch.Tensor:
    G = G.double()
    G = 0.5 * (G + G.mT)
    scale = float(G.diagonal().mean()) if G.numel() else 0.0
    return G + (damping * scale if scale > 0 else damping) * torch.eye(G.shape[0], dtype=G.dtype)


def whitening(G: torch.Tensor, damping: float = DAMPING) -> torch.Tensor:
    """Lower Cholesky factor S of the damped Gram (G + damping·mean(diag G)·I = S Sᵀ), float64; the damping is raised
    tenfold until the factorisation succeeds (a Gram with round-off negative eigenvalues)."""
    d = damping
    for _ in range(12):
        S, info = torch.linalg.cholesky_ex(_damped(G, d))
        if int(info) == 0:
            return S
        d = max(d * 10, 1e-12)
    raise ValueError("calibration Gram is not positive definite even after damping (non-finite activations?)")


def output_error(W: torch.Tensor, What: torch.Tensor, G: torch.Tensor) -> float:
    """tr((W − Ŵ) G (W − Ŵ)ᵀ): the mean squared layer-output error on the calibration inputs (float64)."""
    D = W.double() - What.double()
    return float(((D @ G.double()) * D).sum())


def output_energy(W: torch.Tensor, G: torch.Tensor) -> float:
    """tr(W G Wᵀ): the mean squared layer-output norm on the calibration inputs (float64)."""
    W = W.double()
    return float(((W @ G.double()) * W).sum())


def _unwhiten(V: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """S⁻ᵀ V (n×r) by a triangular solve."""
    return torch.linalg.solve_triangular(S.mT, V, upper=True)


def fit_per_layer(W: torch.Tensor, G: torch.Tensor, r: int, damping: float = DAMPING) -> Fit:
    """Whitened truncated SVD (SVD-LLM) of one layer: Ŵ = C Bᵀ = [W S]_r S⁻¹, the rank-r minimiser of
    tr((W − Ŵ) G (W − Ŵ)ᵀ) (G damped)."""
    W64 = W.double()
    S = whitening(G, damping)
    U, s, Vh = torch.linalg.svd(W64 @ S, full_matrices=False)
    C = U[:, :r] * s[:r]
    B = _unwhiten(Vh[:r].mT, S)
    What = C @ B.mT
    return Fit([B.float()], [C.float()], [output_error(W64, What, G)], [output_energy(W64, G)])


def refit_input_coefficients(W: torch.Tensor, B: torch.Tensor, G: torch.Tensor, damping: float = DAMPING
                             ) -> torch.Tensor:
    """Least-squares coefficients of W on a fixed right basis B under the Gram G: C = W G B (Bᵀ G B)⁻¹ (m×r, float64),
    the minimiser of tr((W − C Bᵀ) G (W − C Bᵀ)ᵀ) (G damped)."""
    Gd = _damped(G, damping)
    B = B.double()
    GB = Gd @ B
    A = B.mT @ GB  # r×r, symmetric positive definite
    L, info = torch.linalg.cholesky_ex(0.5 * (A + A.mT))
    rhs = (W.double() @ GB).mT  # r×m
    if int(info) == 0:
        return torch.cholesky_solve(rhs, L).mT
    return torch.linalg.lstsq(A, rhs).solution.mT


def fit_shared_input(Ws: Sequence[torch.Tensor], Gs: Sequence[torch.Tensor], r: int, damping: float = DAMPING,
                     basis: torch.Tensor | None = None) -> Fit:
    """Shared right basis for a group (Basis-Sharing-style): B = S⁻ᵀ V_r from the whitened stacked rows, S the
    Cholesky factor of the pooled Gram (1/k)Σ G_l; per-layer coefficients refitted by least squares with G_l.

    Args:
        basis: a given n×r basis (e.g. a random one) instead of the whitened SVD one; the coefficients are refitted.
    """
    if basis is None:
        Gp = sum(G.double() for G in Gs) / len(Gs)
        S = whitening(Gp, damping)
        M = torch.zeros_like(S)
        for W in Ws:
            WS = W.double() @ S
            M += WS.mT @ WS
        _, vecs = torch.linalg.eigh(0.5 * (M + M.mT))
        B = _unwhiten(vecs[:, -r:].flip(-1), S)
    else:
        B = basis.double()
    coefs, errs, ens = [], [], []
    for W, G in zip(Ws, Gs):
        C = refit_input_coefficients(W, B, G, damping)
        coefs.append(C.float())
        errs.append(output_error(W, C @ B.mT, G))
        ens.append(output_energy(W, G))
    return Fit(B.float(), coefs, errs, ens)


def fit_shared_output(Ws: Sequence[torch.Tensor], Gs: Sequence[torch.Tensor], r: int,
                      basis: torch.Tensor | None = None) -> Fit:
    """Shared left basis for a group: U = the top-r eigenvectors of Σ_l W_l G_l W_lᵀ, C_l = Uᵀ W_l (the exact joint
    minimiser of Σ_l tr((W_l − U C_l) G_l (W_l − U C_l)ᵀ) over orthonormal U and any C_l).

    Args:
        basis: a given orthonormal m×r basis instead of the eigenvectors (C_l = Uᵀ W_l is still optimal for it).
    """
    if basis is None:
        m = Ws[0].shape[0]
        M = torch.zeros(m, m, dtype=torch.float64)
        for W, G in zip(Ws, Gs):
            W64 = W.double()
            M += W64 @ G.double() @ W64.mT
        _, vecs = torch.linalg.eigh(0.5 * (M + M.mT))
        U = vecs[:, -r:].flip(-1).contiguous()
    else:
        U = basis.double()
    coefs, errs, ens = [], [], []
    for W, G in zip(Ws, Gs):
        C = U.mT @ W.double()
        coefs.append(C.float())
        errs.append(output_error(W, U @ C, G))
        ens.append(output_energy(W, G))
    return Fit(U.float(), coefs, errs, ens)


def fit_group(space: str, Ws: Sequence[torch.Tensor], Gs: Sequence[torch.Tensor], r: int,
              basis: torch.Tensor | None = None, damping: float = DAMPING) -> Fit:
    """The activation-aware fit of one group in ``space`` (``input``, ``output`` or ``none`` = per layer).

    Args:
        basis: for a shared space, a given basis (the ``random`` baseline) whose coefficients are refitted.
    """
    if space == "none":
        fits = [fit_per_layer(W, G, r, damping) for W, G in zip(Ws, Gs)]
        return Fit([f.basis[0] for f in fits], [f.coefs[0] for f in fits], [f.errors[0] for f in fits],
                   [f.energies[0] for f in fits])
    if space == "input":
        return fit_shared_input(Ws, Gs, r, damping, basis)
    if space == "output":
        return fit_shared_output(Ws, Gs, r, basis)
    raise ValueError(f"unknown space {space!r}; choose from input, output, none")
