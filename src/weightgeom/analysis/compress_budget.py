"""A whole-model savings budget (``compress --savings F --budget model``): F of all the compressed roles' parameters
saved together, each role's share allotted by its measured calibration loss.

Per role, the loss curve of per-layer whitened SVD (SVD-LLM, :func:`~weightgeom.analysis.compress_fit.fit_per_layer`)
is known at every rank from one SVD per matrix: with G = S Sᵀ the fit Gram (Cholesky), W S = U Σ Vᵀ and the rank-r
fit
Ŵ_r = [W S]_r S⁻¹, the error on a Gram H (the held-out part's when the calibration holds one apart, else G) is

    tr((W − Ŵ_r) H (W − Ŵ_r)ᵀ) = Σ_{i>r} σ_i² · v_iᵀ S⁻¹ H S⁻ᵀ v_i

(the u_i are orthonormal), so every level of savings costs one SVD in all. A role's cost at a savings level s is the
sum over its matrices of the relative layer-output error E_l(r_l(s)) / tr(W_l H W_lᵀ) (each matrix counts once;
r_l(s) the largest per-layer rank that saves s of the matrix). Starting from nothing saved, the allocator repeatedly
moves the role whose next level (steps of :data:`STEP`) adds the least cost per parameter saved, until F of the
roles' parameters are saved: the roles that lose least give most, and a role may stay whole. The per-layer curve
stands for every space (the shared spaces' fits are not closed-form across ranks); the space of each role is then
chosen at its allotted savings as usual (``--share``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping

import torch

from weightgeom.analysis.api import as_computable
from weightgeom.analysis.compress import BUDGETS, rank_for_savings
from weightgeom.analysis.compress_fit import output_energy, whitening
from weightgeom.analysis.loaders import materialize
from weightgeom.analysis.roles import RoleWeight

__all__ = ["BUDGETS", "STEP", "MAX_SAVINGS", "layer_loss_curve", "role_curves", "allocate"]

STEP = 0.025
"""Granularity of the allotted savings (a fraction of a role's parameters)."""
MAX_SAVINGS = 0.9
"""The most any one role is allotted."""


def layer_loss_curve(W: torch.Tensor, G: torch.Tensor, H: torch.Tensor | None = None) -> torch.Tensor:
    """Relative layer-output error of the whitened rank-r fit on the Gram H (default G), for r = 0 … min(m, n):
    element r is Σ_{i>r} σ_i² h_i / tr(W H Wᵀ) (float64; 0 for an all-zero output)."""
    W64 = W.double()
    S = whitening(G)
    U, s, Vh = torch.linalg.svd(W64 @ S, full_matrices=False)
    if H is None:
        h = torch.ones_like(s)
        energy = output_energy(W64, G)
    else:
        Y = torch.linalg.solve_triangular(S.mT, Vh.mT, upper=True)  # columns y_i = S⁻ᵀ v_i
        h = ((H.double() @ Y) * Y).sum(0)  # y_iᵀ H y_i
        energy = output_energy(W64, H)
    tail = torch.flip(torch.cumsum(torch.flip(s ** 2 * h, (0,)), 0), (0,))  # tail[r] = Σ_{i≥r}
    curve = torch.cat([tail, torch.zeros(1, dtype=tail.dtype)])
    return curve / energy if energy > 0 else torch.zeros_like(curve)


def role_curves(by_role: Mapping[str, list[RoleWeight]], grams, *, progress: bool = False
                ) -> dict[str, list[tuple[float, int, float]]]:
    """Per role, ``(savings level, parameters saved, cost)`` at every level 0, :data:`STEP`, … up to
    :data:`MAX_SAVINGS` that some rank reaches. The parameters saved are nominal (level × the role's dense count:
    every space then saves at least that much); the cost is the sum of the matrices' relative output errors (see the
    module docstring), scored on the held-out Grams when ``grams`` holds a part apart, fitted on the rest."""
    held = grams.held if getattr(grams, "held", None) and grams.held_tokens > 0 else None
    fit = grams.fit_part() if held is not None else grams
    levels = [round(i * STEP, 6) for i in range(int(round(MAX_SAVINGS / STEP)) + 1)]
    out: dict[str, list[tuple[float, int, float]]] = {}
    t0 = time.perf_counter()
    for j, (role, items) in enumerate(by_role.items()):
        pts = {s: [0, 0.0] for s in levels}
        ok = set(levels)
        for rw in items:
            W = as_computable(materialize(rw.weight), rw.name).float()
            m, n = W.shape
            curve = layer_loss_curve(W, fit.get(role, rw.layer), None if held is None else held[(role, rw.layer)])
            for s in levels:
                r = min(m, n) if s == 0 else rank_for_savings("none", 1, m, n, s)
                if r < 1:
                    ok.discard(s)
                    continue
                pts[s][0] += int(round(s * m * n))  # nominal: every space then saves at least this much
                pts[s][1] += float(curve[r])
        out[role] = [(s, pts[s][0], pts[s][1]) for s in levels if s in ok]
        if progress:
            print(f"  [{j + 1}/{len(by_role)} roles] budget: {role} loss curve at {len(out[role])} savings levels  "
                  f"{time.perf_counter() - t0:.1f} s elapsed", file=sys.stderr, flush=True)
    return out


def allocate(curves: Mapping[str, list[tuple[float, int, float]]], dense: Mapping[str, int], savings: float
             ) -> dict[str, float]:
    """Greedy allotment: per role the savings level at which the roles together save at least ``savings`` of
    Σ ``dense`` (each step moves the role whose next level costs least per parameter saved).

    Args:
        curves: :func:`role_curves`.
        dense: role → its dense parameter count.
        savings: the whole-model fraction in (0, 1).

    Raises:
        ValueError: even every role at its largest level saves less than ``savings`` (one line).
    """
    need = savings * sum(dense.values())
    at = dict.fromkeys(curves, 0)
    saved = sum(curves[r][0][1] for r in curves)
    while saved < need:
        best, best_rate = None, math.inf
        for r, pts in curves.items():
            i = at[r]
            if i + 1 >= len(pts):
                continue
            gain = pts[i + 1][1] - pts[i][1]
            rate = (pts[i + 1][2] - pts[i][2]) / gain if gain > 0 else math.inf
            if rate < best_rate:
                best, best_rate = r, rate
        if best is None:
            most = max((sum(curves[r][-1][1] for r in curves) / max(sum(dense.values()), 1)), 0.0)
            raise ValueError(f"--savings {savings:g} --budget model: the compressed roles save at most {most:.0%} of "
                             f"their parameters together (each role at most {MAX_SAVINGS:.0%}); lower --savings")
        saved += curves[best][at[best] + 1][1] - curves[best][at[best]][1]
        at[best] += 1
    return {r: curves[r][at[r]][0] for r in curves}
