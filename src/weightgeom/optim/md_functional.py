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
    if parameterization == "direct":
        magnitude = theta.abs().clamp(GAIN_MIN, GAIN_MAX)
        return torch.where(theta < 0, -magnitude, magnitude)
    _check_choice("parameterization", parameterization, PARAMETERIZATIONS)
    raise AssertionError("unreachable")


def gain_chain(theta: torch.Tensor, grad_gamma: torch.Tensor, parameterization: str = "softplus") -> torch.Tensor:
    """∂L/∂θ = ∂L/∂γ · φ'(θ): φ' = sigmoid(θ) for softplus, exp(θ) for exp, 1 for direct."""
    if parameterization == "softplus":
        return grad_gamma * torch.sigmoid(theta)
    if parameterization == "exp":
        return grad_gamma * torch.exp(theta)
    if parameterization == "direct":
        return grad_gamma.clone()
    _check_choice("parameterization", parameterization, PARAMETERIZATIONS)
    raise AssertionError("unreachable")


def split_gradient(
    G: torch.Tensor,
    D: torch.Tensor,
    gamma_row: torch.Tensor | None,
    gamma_col: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Chain rule through W = γ_r ⊙ D ⊙ γ_c (broadcast): gradients of the gains and of the direction.

    Args:
        G: ∂L/∂W, shape (m, n).
        D: the direction Ŵ, shape (m, n).
        gamma_row: γ_r as (m, 1), a scalar gain as (1, 1), or None (no row gain).
        gamma_col: γ_c as (1, n) or None.
        out: optional (m, n) buffer for Ĝ (must not alias G or D).

    Returns:
        (∂L/∂γ_r shaped like gamma_row or None, ∂L/∂γ_c shaped like gamma_col or None, Ĝ = γ_r ⊙ G ⊙ γ_c,
        saturating at ±the dtype's largest number). Gain gradients are float32 at least (reductions of low-precision
        products are accumulated in float32); a sum of products past the range may be ±inf or NaN, which the gains'
        update clamps, or counts as 0.
    """
    need = gamma_row is not None or gamma_col is not None
    g_row = g_col = None
    if need:
        H = G * D
        if H.dtype in (torch.float16, torch.bfloat16):
            H = H.float()
        if gamma_row is not None:
            if gamma_col is not None:
                hr = H @ gamma_col.reshape(-1).to(H.dtype)
            else:
                hr = H.sum(dim=1)
            # a (1, 1) gain on an m > 1 matrix is the scalar gain: its gradient sums over rows too
            g_row = (hr if gamma_row.numel() == hr.numel() else hr.sum()).reshape(gamma_row.shape)
        if gamma_col is not None:
            if gamma_row is None:
                hc = H.sum(dim=0)
            elif gamma_row.numel() == 1:
                hc = H.sum(dim=0) * gamma_row.reshape(()).to(H.dtype)
            else:
                hc = gamma_row.reshape(-1).to(H.dtype) @ H
            g_col = hc.reshape(gamma_col.shape)
    return g_row, g_col, _scaled_gradient(G, gamma_row, gamma_col, out)


def _scaled_gradient(G: torch.Tensor, gamma_row: torch.Tensor | None, gamma_col: torch.Tensor | None,
                     out: torch.Tensor | None) -> torch.Tensor:
    """Ĝ = γ_r ⊙ G ⊙ γ_c (``compose``), saturating at ±the dtype's largest number where there are gains: a finite G
    times gains above 1 would otherwise be ±inf, which the base step turns into NaN."""
    Gd = compose(G, gamma_row, gamma_col, out=out)
    if gamma_row is not None or gamma_col is not None:
        big = torch.finfo(G.dtype).max
        Gd.clamp_(-big, big)
    return Gd


def split_gradient_log(
    G: torch.Tensor,
    D: torch.Tensor,
    gamma_row: torch.Tensor | None,
    gamma_col: torch.Tensor | None,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """``split_gradient`` in log-gain form, with fewer and contiguous passes over the (m, n) tensors.

    With Ĝ = γ_r ⊙ G ⊙ γ_c and P = Ŵ ⊙ Ĝ: s_r = Σ_j P_ij = γ_r ⊙ ∂L/∂γ_r and s_c = Σ_i P_ij = γ_c ⊙ ∂L/∂γ_c
    (the gradients w.r.t. log γ). Turned into ∂L/∂θ by ``gain_chain_log`` without dividing by γ, so it is exact for
    the positive parameterizations (softplus, exp) even where γ underflows.

    Args:
        G, D, gamma_row, gamma_col, out: as in ``split_gradient``.
        scratch: optional (m, n) buffer for P, overwritten (the wrapper passes the model's W, which it rewrites
            after the base step anyway; avoids allocating — on CPU a fresh large tensor costs a pass of page faults).

    Returns:
        (s_r shaped like gamma_row or None, s_c shaped like gamma_col or None, Ĝ). s is float32 at least (see the
        comment on overflow below); Ĝ saturates at ±the dtype's largest number (a finite G times gains above 1 would
        be ±inf).
    """
    if gamma_row is None and gamma_col is None:
        return None, None, (G.clone() if out is None else out.copy_(G))
    Gd = _scaled_gradient(G, gamma_row, gamma_col, out)
    P = torch.mul(D, Gd, out=scratch) if scratch is not None else D * Gd
    if P.dtype in (torch.float16, torch.bfloat16):
        P = P.float()
    # no partial sum of finite products may overflow (huge products of both signs would give inf − inf = NaN): they
    # are summed scaled by 2^-e, 2^e ≥ the longest sum's length, and the sums scaled back (an overflow there is a clean
    # ±inf, which the gains' Adam clamps to gain_grad_limit). Powers of two commute with rounding: bitwise the plain
    # sums for any gradient whose products stay above ~1e-34; one pass, where float64 sums cost 1.6 ms per 3072×768
    # matrix. Products themselves past the range (|Ŵ| > 1 times a saturated Ĝ) can still make a NaN sum, which the
    # gains' update counts as 0, as the C kernels do
    scalar = gamma_row is not None and gamma_row.numel() != P.shape[0]
    e = math.ceil(math.log2(max(2, P.numel() if scalar else max(P.shape))))
    P.mul_(2.0**-e)
    s_row = s_col = None
    if gamma_row is not None:
        s_row = (P.sum() if scalar else P.sum(dim=1)).mul_(2.0**e).reshape(gamma_row.shape)
    if gamma_col is not None:
        s_col = P.sum(dim=0).mul_(2.0**e).reshape(gamma_col.shape)
    return s_row, s_col, Gd


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
    if parameterization == "direct":
        return s / theta
    _check_choice("parameterization", parameterization, PARAMETERIZATIONS)
    raise AssertionError("unreachable")


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
    gradient the gains step with, in place: a NaN counts as 0, then clamped to ±``grad_limit``.

    The same arithmetic as ``adam_update_`` per θ (bitwise, on the CPU and on CUDA), in a handful of multi-tensor
    (``torch._foreach_*``) kernels instead of ~10 kernels per θ: on a GPU the gains' updates are launch-bound
    (a row and a column vector per matrix, 96 of them on GPT-2 small).
    """
    if not thetas:
        return
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    kinds = {(t.device, t.dtype) for t in [*thetas, *grads, *exp_avgs, *exp_avg_sqs]}
    if len(kinds) != 1 or any(len(v) != len(thetas) for v in lists.values()) or int(step) < 1:
        raise ValueError(f"adam_update_many_: needs {len(thetas)} θ, grads, exp_avgs and exp_avg_sqs of one device and "
                         f"dtype and step ≥ 1; got lengths {[len(v) for v in lists.values()]}, (device, dtype) "
                         f"{sorted(map(str, kinds))}, step={step!r}")
    b1, b2 = betas
    lim = gain_grad_limit(thetas[0].dtype) if grad_limit is None else grad_limit
    flat = torch.cat([g.reshape(-1) for g in grads])  # one pass for the NaN → 0 and the clamp (no foreach nan_to_num)
    flat.nan_to_num_(nan=0.0).clamp_(-lim, lim)
    clamped = [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in grads]), grads)]
    torch._foreach_copy_(grads, clamped)
    torch._foreach_lerp_(exp_avgs, clamped, 1 - b1)
    torch._foreach_mul_(exp_avg_sqs, b2)
    torch._foreach_addcmul_(exp_avg_sqs, clamped, clamped, value=1 - b2)
    bc1 = 1 - b1**step
    bc2 = 1 - b2**step
    denom = torch._foreach_div(exp_avg_sqs, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(thetas, exp_avgs, denom, value=-lr / bc1)


def fused_step_reference(
    G: torch.Tensor,
    D: torch.Tensor,
    W: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    beta1: float,
    beta2: float,
    step_size: float,
    bc2_sqrt: float,
    eps: float,
    decay: float = 1.0,
    l2: float = 0.0,
    gain_row: tuple | None = None,
    gain_col: tuple | None = None,
    parameterization: str = "softplus",
    gain_lr: float = 0.0,
    gain_betas: tuple[float, float] = (0.9, 0.95),
    gain_eps: float = 1e-8,
    sphere: str = "frobenius",
    radius: torch.Tensor | None = None,
) -> None:
    """Slow float64 reference of the fused MD step over Adam(W) (``weightgeom.kernels.md_adam_step``), built from the
    functions above; same arguments, same in-place updates (computed in float64, written back in each dtype).

    Order: log-gain split of G (old Ŵ and gains); torch's Adam(W) step of Ŵ with Ĝ (+ ``l2``·Ŵ, × ``decay``); each
    gain's Adam step at ``gain_lr`` (``gain_row``/``gain_col`` = (θ, exp_avg, exp_avg_sq, step t, grad out)); Ŵ on its
    sphere of ``radius``; W = γ_r Ŵ γ_c with the new gains.
    """
    d = D.double()
    thetas = [None if g is None else g[0].double() for g in (gain_row, gain_col)]
    gr = None if thetas[0] is None else gain_value(thetas[0], parameterization).reshape(-1, 1)
    gc = None if thetas[1] is None else gain_value(thetas[1], parameterization).reshape(1, -1)
    s_row, s_col, gh = split_gradient_log(G.double(), d, gr, gc)
    big = torch.finfo(G.dtype).max  # the kernel's Ĝ saturates in its own dtype
    gh = gh.clamp(-big, big)
    e = gh + l2 * d
    m = exp_avg.double().lerp(e, 1 - beta1)
    v = exp_avg_sq.double() * beta2 + (1 - beta2) * e * e
    x = d * decay - step_size * (m / (v.sqrt() / bc2_sqrt + eps))
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    for gain, theta, s in ((gain_row, thetas[0], s_row), (gain_col, thetas[1], s_col)):
        if gain is None:
            continue
        ga, gv = gain[1].double(), gain[2].double()
        lim = gain_grad_limit(gain[0].dtype)  # the kernel clamps at its own dtype's limit
        grad = gain_chain_log(theta, s.reshape(theta.shape), parameterization).clamp(-lim, lim)
        if len(gain) > 4 and gain[4] is not None:
            gain[4].copy_(grad)
        adam_update_(theta, grad, ga, gv, int(gain[3]), gain_lr, gain_betas, gain_eps, grad_limit=lim)
        for dst, src in zip(gain[:3], (theta, ga, gv)):
            dst.copy_(src)
    shape = {"frobenius": (1, 1), "row": (-1, 1), "col": (1, -1)}[sphere]
    project_to_sphere_(x, radius.double().reshape(shape), sphere)
    gr = None if thetas[0] is None else gain_value(thetas[0], parameterization).reshape(-1, 1)
    gc = None if thetas[1] is None else gain_value(thetas[1], parameterization).reshape(1, -1)
    W.copy_(compose(x, gr, gc))
    D.copy_(x)


def _check_choice(what: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"MagnitudeDirection: unknown {what} {value!r}; choose from {list(choices)}")
