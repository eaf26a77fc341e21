"""Magnitude–direction decoupling: the pure maths, used by ``MagnitudeDirection``.

The MD paper: A. Hägele, A. Hernández-Cano, A. Kosson, M. Jaggi, arXiv:2606.25971 (2026); derivations in docs/md.md.

Gains γ = φ(θ) and their chain rule, the split of ∂L/∂W into gain gradients and the direction gradient Ĝ (plain and
log-gain forms), sphere norms and projections, the recomposition W = γ_r Ŵ γ_c, and the gains' Adam step. Stateless:
tensors in, tensors out (the ``_``-suffixed ones work in place). Design notes: ``docs/md.md``.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.nn.functional as F

from weightgeom.linalg.norms import column_norms

GAINS = ("row+col", "row", "col", "scalar", "none")
PARAMETERIZATIONS = ("softplus", "exp", "direct")
SPHERES = ("frobenius", "row", "col")
EMBEDDINGS = ("exclude", "unit_rows", "decouple")

# Norms below this (absolute, in the weight's units) count as zero when a radius is measured or a sphere projection
# divides: a zero-norm weight has no direction. Far below any trained weight's norm (≥ 1e-3 in practice).
_ZERO_NORM = 1e-30

# Effective gains are clamped to [GAIN_MIN, GAIN_MAX] (in magnitude; ``direct`` gains keep their sign), so W = γ_r Ŵ γ_c
# is always finite and Ŵ = W / γ_r / γ_c can always be re-derived from a changed W (``MagnitudeDirection._resync``).
# Why these values: a gain of 1e-6 already silences its row/column (with both gains at the floor, W is 1e-12 of its
# direction's scale, below float32's relative precision of 6e-8 next to any unsilenced entry), so no useful model
# needs less; and dividing by the floor multiplies W by at most 1e12, so ‖Ŵ‖² stays finite in float32 for any
# ‖W‖_F < 1e7. The ceiling mirrors the floor: γ_r γ_c ≤ 1e12 keeps W finite in float32/bfloat16 for any sphere
# radius < 1e26 (and exp(θ) cannot overflow to inf). Reaching the floor takes ~14 units of θ (softplus/exp) from its
# start, i.e. thousands of consistent Adam steps at gain_lr = 1e-3. The gradient passes straight through the clamp
# (∂L/∂θ = ∂L/∂log γ · dlog φ/dθ, unclamped φ), so a gain at the floor or ceiling can come back.
GAIN_MIN = 1e-6
GAIN_MAX = 1e6


def gain_grad_limit(dtype: torch.dtype) -> float:
    """Largest |gradient| the gains' Adam takes (``adam_update_``; the C kernels use the same value): half the square
    root of the dtype's largest number (float32 and bf16 9.2e18, float64 6.7e153, float16 128), so that g² and Adam's
    second moment stay finite."""
    return 0.5 * math.sqrt(torch.finfo(dtype).max)

_EMBED_RE = re.compile(
    r"(^|[._])(wte|wpe|tok_emb\w*|pos_emb\w*|embed\w*|embedding\w*|word_embeddings|position_embeddings)([._]|$)"
)


def is_embedding_name(name: str) -> bool:
    """Whether a name looks like an embedding table (``transformer.wte.weight``, ``model.embed_tokens.weight``)."""
    return bool(_EMBED_RE.search(name))


# ---------------------------------------------------------------------------------------------------------------------
# Pure functions: the maths of MD, one operation each.
# ---------------------------------------------------------------------------------------------------------------------
def gain_init(shape: tuple[int, ...], parameterization: str = "softplus", dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> torch.Tensor:
    """Raw gain parameters θ with φ(θ) = 1 exactly, so the forward pass is unchanged at initialisation.

    Args:
        shape: shape of the gain vector (e.g. (rows,), (cols,) or (1,) for a scalar gain).
        parameterization: ``"softplus"`` (θ₀ = log(e − 1) ≈ 0.5413), ``"exp"`` (θ₀ = 0) or ``"direct"`` (θ₀ = 1).
        dtype: dtype of θ.
        device: device of θ.

    Returns:
        Tensor θ of the given shape (dimensionless).
    """
    _check_choice("parameterization", parameterization, PARAMETERIZATIONS)
    value = {"softplus": math.log(math.expm1(1.0)), "exp": 0.0, "direct": 1.0}[parameterization]
    return torch.full(shape, value, dtype=dtype, device=device)


def gain_value(theta: torch.Tensor, parameterization: str = "softplus") -> torch.Tensor:
    """The effective gain γ = φ(θ) clamped to [``GAIN_MIN``, ``GAIN_MAX``] in magnitude.

    φ is softplus(θ), exp(θ) or θ itself (``"direct"``: may change sign, |γ| is clamped and the sign kept, θ = 0
    giving +``GAIN_MIN``). The clamp keeps W = γ_r Ŵ γ_c finite and Ŵ = W/γ_r/γ_c recoverable; see ``GAIN_MIN``.
    """
    if parameterization == "softplus":
        return F.softplus(theta).clamp(GAIN_MIN, GAIN_MAX)
    if parameterization == "exp":
        return torch.exp(theta).clamp(GAIN_MIN, GAIN_MAX)
    _check_choice("parameterization", parameterization, PARAMETERIZATIONS)  # "direct" from here
    magnitude = theta.abs().clamp(GAIN_MIN, GAIN_MAX)
    return torch.where(theta < 0, -magnitude, magnitude)


def gain_chain(theta: torch.Tensor, grad_gamma: torch.Tensor, parameterization: str = "softplus") -> torch.Tensor:
    """∂L/∂θ = ∂L/∂γ · φ'(θ): φ' = sigmoid(θ) for softplus, exp(θ) for exp, 1 for direct."""
    if parameterization == "softplus":
        return grad_gamma * torch.sigmoid(theta)
    if parameterization == "exp":
        return grad_gamma * torch.exp(theta)
    _check_choice("parameterization", parameterization, PARAMETERIZATIONS)  # "direct" from here
    return grad_gamma.clone()


def split(G: torch.Tensor, D: torch.Tensor, gr: torch.Tensor | None, gc: torch.Tensor | None, log: bool,
          out: torch.Tensor | None = None, scratch: torch.Tensor | None = None
          ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """The split of ∂L/∂W on a batch (B, m, n), gains (B, m, 1)/(B, 1, n) (a scalar gain (B, 1, 1)): the one
    definition (``split_gradient``/``split_gradient_log`` are its one-matrix forms; the C kernels follow its order).

    Ĝ = γ_r ⊙ G ⊙ γ_c, saturating at ±the dtype's largest number (a finite G times gains above 1 would be ±inf,
    which the base step turns into NaN). Plain form (``log`` False): ∂L/∂γ_r = Σ_j (Ŵ⊙G)_ij γ_c,j and ∂L/∂γ_c =
    Σ_i γ_r,i (Ŵ⊙G)_ij. Log-gain form: with P = Ŵ ⊙ Ĝ, s_r = Σ_j P_ij = γ_r ⊙ ∂L/∂γ_r and s_c = Σ_i P_ij =
    γ_c ⊙ ∂L/∂γ_c (the gradients w.r.t. log γ), turned into ∂L/∂θ by ``gain_chain_log`` without dividing by γ, so
    exact for softplus and exp even where γ underflows. Sums of low-precision products accumulate in float32.

    ``out`` (for Ĝ) and ``scratch`` (for the products Ŵ ⊙ Ĝ or G ⊙ Ŵ, overwritten): contiguous tensors shaped like G,
    aliasing neither G nor Ŵ, written in place instead of allocating (on a CPU each fresh MB-sized result is one more
    pass of memory traffic). The same operations: bitwise the same values when G and Ŵ are contiguous too.

    Returns:
        (s_r (B, m) or (B, 1), s_c (B, n), Ĝ); Ĝ is G itself without gains (``out`` then unused).
    """
    if gr is None and gc is None:
        return None, None, G
    first = (gr if gr is not None else gc).to(G.dtype)
    Gd = G * first if out is None else torch.mul(G, first, out=out)
    if gr is not None and gc is not None:
        Gd = Gd * gc.to(G.dtype) if out is None else Gd.mul_(gc.to(G.dtype))
    big = torch.finfo(G.dtype).max
    Gd = Gd.clamp(-big, big) if out is None else Gd.clamp_(-big, big)
    m, n = G.shape[-2:]
    scalar = gr is not None and gr.shape[-2] != m
    if not log:  # H = G ⊙ Ŵ, contracted with the other gain
        H = G * D if scratch is None else torch.mul(G, D, out=scratch)
        H = H.float() if H.dtype in (torch.float16, torch.bfloat16) else H
        s_r = s_c = None
        if gr is not None:
            hr = (H @ gc.mT.to(H.dtype))[..., 0] if gc is not None else H.sum(dim=-1)
            s_r = hr.sum(dim=-1, keepdim=True) if scalar else hr
        if gc is not None:
            if gr is None:
                s_c = H.sum(dim=-2)
            elif scalar:
                s_c = H.sum(dim=-2) * gr[..., 0].to(H.dtype)
            else:
                s_c = (gr.mT.to(H.dtype) @ H)[..., 0, :]
        return s_r, s_c, Gd
    P = D * Gd if scratch is None else torch.mul(D, Gd, out=scratch)
    P = P.float() if P.dtype in (torch.float16, torch.bfloat16) else P
    # no partial sum of finite products may overflow (huge products of both signs would give inf − inf = NaN): they
    # are summed scaled by 2^-e, 2^e ≥ the longest sum's length, and the sums scaled back (an overflow there is a clean
    # ±inf, which the gains' Adam clamps to gain_grad_limit). Powers of two commute with rounding: bitwise the plain
    # sums for any gradient whose products stay above ~1e-34. Products themselves past the range (|Ŵ| > 1 times a
    # saturated Ĝ) can still make a NaN sum, which the gains' update counts as 0, as the C kernels do
    e = math.ceil(math.log2(max(2, m * n if scalar else max(m, n))))
    P = P * 2.0**-e if scratch is None else P.mul_(2.0**-e)  # in place: scratch, or its float32 copy
    s_r = None if gr is None else (P.sum(dim=(-2, -1))[..., None] if scalar else P.sum(dim=-1)) * 2.0**e
    s_c = None if gc is None else P.sum(dim=-2) * 2.0**e
    return s_r, s_c, Gd


def _split_one(G: torch.Tensor, D: torch.Tensor, gamma_row: torch.Tensor | None, gamma_col: torch.Tensor | None,
               out: torch.Tensor | None, log: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    gr = None if gamma_row is None else gamma_row.reshape(1, -1, 1)
    gc = None if gamma_col is None else gamma_col.reshape(1, 1, -1)
    s_r, s_c, Gd = split(G[None], D[None], gr, gc, log)
    Gd = Gd[0] if out is None else out.copy_(Gd[0])
    return (None if s_r is None else s_r.reshape(gamma_row.shape),
            None if s_c is None else s_c.reshape(gamma_col.shape), Gd.clone() if Gd is G else Gd)


def split_gradient(G: torch.Tensor, D: torch.Tensor, gamma_row: torch.Tensor | None, gamma_col: torch.Tensor | None,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Chain rule through W = γ_r ⊙ D ⊙ γ_c (broadcast) for one matrix: ``split``'s plain form.

    Args:
        G: ∂L/∂W, shape (m, n). D: the direction Ŵ, shape (m, n).
        gamma_row: γ_r as (m, 1), a scalar gain as (1, 1), or None (no row gain). gamma_col: γ_c as (1, n) or None.
        out: optional (m, n) buffer for Ĝ (must not alias G or D).

    Returns:
        (∂L/∂γ_r shaped like gamma_row or None, ∂L/∂γ_c shaped like gamma_col or None, Ĝ = γ_r ⊙ G ⊙ γ_c, saturating).
    """
    return _split_one(G, D, gamma_row, gamma_col, out, log=False)


def split_gradient_log(G: torch.Tensor, D: torch.Tensor, gamma_row: torch.Tensor | None,
                       gamma_col: torch.Tensor | None, out: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """``split_gradient`` in log-gain form (``split``'s): (s_r shaped like gamma_row or None, s_c shaped like
    gamma_col or None, Ĝ), s = γ·∂L/∂γ, float32 at least."""
    return _split_one(G, D, gamma_row, gamma_col, out, log=True)


def gain_chain_log(theta: torch.Tensor, s: torch.Tensor, parameterization: str = "softplus") -> torch.Tensor:
    """∂L/∂θ from the log-gain gradient s = γ·∂L/∂γ: s for exp; s·sigmoid(θ)/softplus(θ) for softplus (→ s where
    softplus underflows to 0, its limit); s/θ for direct (undefined at θ = 0: use ``split_gradient`` there)."""
    if parameterization == "exp":
        return s.clone()
    if parameterization == "softplus":
        sp = F.softplus(theta)
        ratio = torch.where(sp > 0, torch.sigmoid(theta) / sp.clamp_min(torch.finfo(sp.dtype).tiny),
                            torch.ones_like(sp))
        return s * ratio
    _check_choice("parameterization", parameterization, PARAMETERIZATIONS)  # "direct" from here
    return s / theta


def sphere_norm(D: torch.Tensor, sphere: str = "frobenius") -> torch.Tensor:
    """Norm(s) that define the sphere: ‖D‖_F (shape (1, 1)), row norms (m, 1) or column norms (1, n); in D's dtype.

    The squares are summed in float64 (``sphere_norm_wide``), so neither a large entry (a float32 1e30 squares past
    float32's range) nor a long float32 accumulation (torch's float32 ``vector_norm`` of a 768×3072 Gaussian on the
    CPU is 4.0e-5 low) changes the sphere; a norm beyond D's dtype's range comes back as inf here, but
    ``project_to_sphere_`` divides in float64.
    """
    return sphere_norm_wide(D, sphere).to(D.dtype)


def sphere_norm_wide(D: torch.Tensor, sphere: str = "frobenius") -> torch.Tensor:
    """``sphere_norm`` in float64 (float32 on a device without float64, MPS): the squares summed in that dtype, as
    the C kernels sum them. Measured on the CPU (3072×768 float32): Frobenius 1.2 ms (0.5 for a float32 summed
    square), rows 0.9 (0.2), columns 1.8 (0.7) — the price of a sphere that an overflowing square cannot empty
    (before: a float32 gradient of 1e30 made every norm inf and set Ŵ, so W, to zero on the torch path). Limits: float64
    entries beyond ~1e154 still overflow the float64 sum (on the C passes too); a float16 parameter keeps its radius in
    float16, so a matrix whose norm exceeds 65504 cannot be put on its sphere."""
    wide = D.dtype if D.dtype == torch.float64 or D.device.type == "mps" else torch.float64
    if sphere == "frobenius":
        return torch.linalg.vector_norm(D, dim=(-2, -1), keepdim=True, dtype=wide)
    if sphere == "row":
        return torch.linalg.vector_norm(D, dim=-1, keepdim=True, dtype=wide)
    if sphere == "col":
        return column_norms(D.to(wide), keepdim=True)
    raise ValueError(f"MagnitudeDirection: unknown sphere {sphere!r}; choose from {SPHERES}")


def project_to_sphere_(D: torch.Tensor, radius: torch.Tensor, sphere: str = "frobenius") -> torch.Tensor:
    """In place: D ← radius · D / ‖D‖ on the chosen sphere (Frobenius, each row, or each column).

    Args:
        D: (m, n) direction, modified in place.
        radius: radius broadcastable to ``sphere_norm(D, sphere)`` (same units as D).
        sphere: ``"frobenius"``, ``"row"`` or ``"col"``.

    Returns:
        D. A zero-norm slice stays zero (the divisor is clamped at 1e-30, never NaN). The factor radius/‖D‖ is formed
        in float64 (``sphere_norm_wide``), so a finite D of any scale lands on the sphere.
    """
    norm = sphere_norm_wide(D, sphere)
    return D.mul_((radius.to(norm.dtype) / norm.clamp_min(_ZERO_NORM)).to(D.dtype))


def normalize_rows_(E: torch.Tensor, radius: float = 1.0) -> torch.Tensor:
    """In place: every row of E gets L2 norm ``radius`` (unit-norm embeddings). Zero rows stay zero."""
    norm = torch.linalg.vector_norm(E, dim=-1, keepdim=True)
    return E.mul_(radius / norm.clamp_min(_ZERO_NORM))


def compose(D: torch.Tensor, gamma_row: torch.Tensor | None, gamma_col: torch.Tensor | None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """W = γ_r ⊙ D ⊙ γ_c (gains as in ``split_gradient``), written into ``out`` when given (may be the model's W)."""
    if gamma_row is None and gamma_col is None:
        return D.clone() if out is None else out.copy_(D)
    first = gamma_row if gamma_row is not None else gamma_col
    W = torch.mul(D, first.to(D.dtype), out=out) if out is not None else D * first.to(D.dtype)
    if gamma_row is not None and gamma_col is not None:
        W.mul_(gamma_col.to(D.dtype))
    return W


def adam_update_(
    theta: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    grad_limit: float | None = None,
) -> torch.Tensor:
    """One bias-corrected Adam step on θ, in place (no weight decay). ``step`` counts from 1.

    m ← β₁m + (1−β₁)g; v ← β₂v + (1−β₂)g²; θ ← θ − lr · (m/(1−β₁ᵗ)) / (sqrt(v/(1−β₂ᵗ)) + eps), with g clamped to
    ±``grad_limit`` (default ``gain_grad_limit(θ.dtype)``; ``grad`` itself is not modified), so that g² and v stay
    finite: a finite but huge gradient (a float32 1e38 makes the log-gain sum overflow to inf) would otherwise give
    m/sqrt(v) = inf/inf = NaN gains — and NaN W even at lr 0 — or leave v at inf, freezing the gains for good. NaN
    passes through.
    """
    b1, b2 = betas
    lim = gain_grad_limit(theta.dtype) if grad_limit is None else grad_limit
    grad = grad.clamp(-lim, lim)
    exp_avg.lerp_(grad, 1 - b1)
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    bc1 = 1 - b1**step
    bc2 = 1 - b2**step
    denom = (exp_avg_sq / bc2).sqrt_().add_(eps)
    return theta.addcdiv_(exp_avg, denom, value=-lr / bc1)


def adam_update_many_(
    thetas: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    grad_limit: float | None = None,
) -> None:
    """``adam_update_`` on several θ of one device and dtype at the same ``step``, with each ``grad`` first made the
    gradient the gains step with, in place: a NaN counts as 0, then clamped to ±``grad_limit``. The same arithmetic
    as ``adam_update_`` per θ (bitwise): ``adam_gains`` on the concatenated vectors.
    """
    if not thetas:
        return
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    kinds = {(t.device, t.dtype) for t in [*thetas, *grads, *exp_avgs, *exp_avg_sqs]}
    if len(kinds) != 1 or any(len(v) != len(thetas) for v in lists.values()) or int(step) < 1:
        raise ValueError(f"adam_update_many_: needs {len(thetas)} θ, grads, exp_avgs and exp_avg_sqs of one device and "
                         f"dtype and step ≥ 1; got lengths {[len(v) for v in lists.values()]}, (device, dtype) "
                         f"{sorted(map(str, kinds))}, step={step!r}")
    flat = [torch.cat([t.reshape(-1) for t in ts])[None] for ts in (thetas, grads, exp_avgs, exp_avg_sqs)]
    t = torch.full((1,), float(step), dtype=torch.float32, device=thetas[0].device)
    new = adam_gains(*flat, t, {"betas": betas, "lr": lr, "eps": eps}, grad_limit)
    sizes = [x.numel() for x in thetas]
    for dst, src in zip((thetas, grads, exp_avgs, exp_avg_sqs), new):
        torch._foreach_copy_(dst, [piece.view_as(d) for piece, d in zip(src[0].split(sizes), dst)])


def _wide(device: torch.device) -> torch.dtype:
    """The dtype bias corrections are computed in: float64, float32 where the device has none (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def adam_gains(theta: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor,
               group: dict[str, Any], grad_limit: float | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``adam_update_many_`` on a batch of θ (B, k) with per-row step counters (B,) (after this step), out of place,
    in its order of operations (θ + (−lr/bc₁·m)/denom, as ``addcdiv`` forms it): (θ, the gradient stepped with —
    NaN → 0, clamped to ±``grad_limit`` (default ``gain_grad_limit``) —, m, v)."""
    (b1, b2), lr, eps = group["betas"], group["lr"], group["eps"]
    lim = gain_grad_limit(theta.dtype) if grad_limit is None else grad_limit
    g = grad.nan_to_num(nan=0.0).clamp(-lim, lim)
    m = m.lerp(g, 1 - b1)
    v = v.mul(b2).addcmul_(g, g, value=1 - b2)
    t = step.to(_wide(theta.device)).reshape(-1, 1)
    bc1, bc2 = 1 - torch.pow(b1, t), 1 - torch.pow(b2, t)
    denom = (v / bc2.to(v.dtype)).sqrt().add(eps)
    return theta + (-lr / bc1).to(theta.dtype) * m / denom, g, m, v


def project(D: torch.Tensor, R: torch.Tensor, sphere: str) -> torch.Tensor:
    """``project_to_sphere_`` on a batch (B, m, n), radii (B, 1, 1)/(B, m, 1)/(B, 1, n), out of place."""
    norm = sphere_norm_wide(D, sphere)
    return D * (R.to(norm.dtype) / norm.clamp_min(_ZERO_NORM)).to(D.dtype)


def _check_choice(what: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"MagnitudeDirection: unknown {what} {value!r}; choose from {list(choices)}")
