"""What ``MagnitudeDirection.step`` refuses before anything changes: group values set since construction, gradients
(dtype, fit, sparse, NaN/Inf), and a weight changed outside the optimizer that has no direction — each refusal one
line naming the parameter (docs/md.md, "Bad input").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from weightgeom import kernels
from weightgeom.optim.checks import (
    PARAM_SHAPED_STATE,
    check_fits_param,
    check_group_kinds,
    dtype_supported,
    is_torch_optimizer,
    torch_state_shapes,
    unsupported_dtype,
)
from weightgeom.optim.functional import NonFiniteGradientError, first_nonfinite
from weightgeom.optim.md_functional import _ZERO_NORM, compose, sphere_norm
from weightgeom.optim.md_state import invalid_gain_key

if TYPE_CHECKING:  # pragma: no cover
    from weightgeom.optim.magnitude_direction import MagnitudeDirection

__all__ = ["RESYNC_ULPS", "SPARSE_BASES", "resync", "check_groups", "check_gradients", "check_metadata",
           "check_fits", "refuse_nonfinite", "with_gradients", "cpu_scan", "param_label", "rederive"]


# W counts as still γ_r Ŵ γ_c (no re-derivation of Ŵ) when every entry agrees to this many units in the last place:
# the fused kernel computes γ = softplus(θ) with the C library's log1p/exp, torch with its own; they differ by ≤ 1 ulp,
# so γ_r Ŵ γ_c recomputed in torch differs from the kernel's W by a few ulp (measured ≤ 3.3·eps·|W| over 30 fused
# steps of 10 matrices, softplus and exp). Any real change to W (a different checkpoint, an edit) is far larger.
RESYNC_ULPS = 16


# torch optimizers whose step takes sparse gradients; any other base (Adam, AdamW, Muon, ...) would refuse one inside
# its step, after MD had stepped the decoupled matrices, so MD refuses it before anything changes.
SPARSE_BASES = (torch.optim.SGD, torch.optim.SparseAdam, torch.optim.Adagrad)


def check_groups(md: MagnitudeDirection) -> None:
    """Refuse the step for a value set in a group since it was added on which a later part of the step would
    raise: the gains group's (``md_state.invalid_gain_key``, stepped after the base) and, for one of torch's optimizers,
    a base group's numeric hyperparameter of another kind than its default (``checks.check_group_kinds``; MD's
    passes run before the base step). A Muon base checks its own groups (``Muon.check_step``). Every eager step
    runs it first; ``compile_step`` runs it before each compiled step, whose trace sees a scheduled lr as a
    symbol it cannot test.

    Raises:
        ValueError: one line naming the group and key; nothing was changed.
    """
    gains = md._gain_groups[0]
    bad = invalid_gain_key(gains)
    if bad is not None:
        raise ValueError(f"MagnitudeDirection: the gains group has {bad}={gains[bad]!r}, which the constructor "
                         "refuses (gain_lr ≥ 0, gain_betas in [0, 1), gain_eps > 0, weight_decay 0); step refused, "
                         "nothing was changed")
    base = md.base_optimizer
    if is_torch_optimizer(base):
        for gi, group in enumerate(base.param_groups):
            check_group_kinds("MagnitudeDirection", base, gi, group, "it was set since the group was added; step "
                              "refused, nothing was changed")


def check_gradients(md: MagnitudeDirection) -> None:
    """Refuse the step, naming the parameter, if a base param's dtype is unsupported, its gradient, direction or
    base state no longer fits it (``check_fits``), a decoupled matrix has a sparse gradient (or any param does,
    where the base cannot step one: ``SPARSE_BASES``) or any gradient of the base optimizer's params holds
    NaN/Inf (one read of every gradient: the C scan, else one fused torch norm and one host sync,
    ``first_nonfinite``)."""
    params = [q for g in md.base_optimizer.param_groups for q in g["params"] if q.grad is not None]
    check_metadata(md, params)
    refuse_nonfinite(md, params, cpu_scan(md))


def refuse_nonfinite(md: MagnitudeDirection, params: list[torch.Tensor],
                     scan: Callable[[torch.Tensor], bool] | None = None) -> None:
    """Raise ``NonFiniteGradientError`` naming the first of ``params`` whose gradient holds NaN/Inf
    (``first_nonfinite``, with the C ``scan`` where given; one host sync)."""
    bad = first_nonfinite([q.grad for q in params], cpu_scan=scan)
    if bad is not None:
        q = params[bad]
        raise NonFiniteGradientError.refused("MagnitudeDirection", param_label(md, q), tuple(q.shape))


def check_metadata(md: MagnitudeDirection, params: list[torch.Tensor]) -> None:
    """``check_gradients`` without the finiteness scan (no tensor is read): dtypes, fits, sparse gradients."""
    decoupled = {id(p) for p in md._decoupled}
    sparse_ok = isinstance(md.base_optimizer, SPARSE_BASES)
    for q in params:
        if not dtype_supported(q):  # its dtype was changed after construction (``q.data = ...``)
            raise ValueError(f"{unsupported_dtype('MagnitudeDirection', f'parameter {param_label(md, q)!r}', q)}"
                             "; step refused, nothing was changed")
        check_fits(md, q, id(q) in decoupled)
        if q.grad.is_sparse and id(q) in decoupled:
            raise ValueError(f"MagnitudeDirection: parameter {md._name[q]!r} has a sparse gradient; "
                             "decoupled matrices need dense gradients; step refused, nothing was changed")
        if q.grad.is_sparse and not sparse_ok:  # the base would raise in its step, after MD's passes ran
            raise ValueError(f"MagnitudeDirection: parameter {param_label(md, q)!r} has a sparse gradient, "
                             f"which the base optimizer ({type(md.base_optimizer).__name__}) cannot step; step "
                             "refused, nothing was changed")


def check_fits(md: MagnitudeDirection, q: torch.Tensor, decoupled: bool) -> None:
    """Refuse the step if q's gradient, its direction Ŵ (a decoupled matrix) or, for one of torch's optimizers,
    the base's state no longer fits q — q was changed after they were made (``q.data = ...``, ``model.half()``),
    and the base would raise on it after MD's passes ran (``checks.check_fits_param``). A Muon base checks its
    own state (``Muon.check_step``)."""
    who, label = "MagnitudeDirection", f"parameter {param_label(md, q)!r}"
    if decoupled:
        check_fits_param(who, label, q, md.state[q], {"direction": tuple(q.shape)}, ("direction",),
                         remedy="build MagnitudeDirection again (it keeps W's direction in W's shape, dtype and "
                                "device)")
    base = md.base_optimizer
    torch_base = is_torch_optimizer(base)
    check_fits_param(who, label, q, base.state.get(q, {}) if torch_base else {},
                     torch_state_shapes(q) if torch_base else {}, PARAM_SHAPED_STATE)


def with_gradients(md: MagnitudeDirection) -> list[tuple[torch.Tensor, dict]]:
    """(p, its base group) for each decoupled matrix with a gradient, in order.

    Raises:
        ValueError: a decoupled matrix is no longer in the base optimizer (naming it); nothing was changed.
    """
    group_of = {id(q): g for g in md.base_optimizer.param_groups for q in g["params"]}
    out = []
    for p in md._decoupled:
        if p.grad is not None:
            if id(p) not in group_of:
                raise ValueError(f"MagnitudeDirection: parameter {md._name[p]!r} is no longer in the base optimizer")
            out.append((p, group_of[id(p)]))
    return out


def cpu_scan(md: MagnitudeDirection):
    """The C finiteness scan where this optimizer uses its kernels anyway (``fused`` not False: the fused Adam
    step or the C passes around any other base) and they load; None otherwise (a torch norm is used)."""
    return kernels.any_nonfinite if md.kernels else None


def param_label(md: MagnitudeDirection, q: torch.Tensor) -> str:
    """q's name; for a param added to the base after construction, its position in the base's groups."""
    if q in md._name:
        return md._name[q]
    for gi, group in enumerate(md.base_optimizer.param_groups):
        for pi, r in enumerate(group["params"]):
            if r is q:
                return f"param_groups[{gi}].params[{pi}]"
    return f"a parameter of shape {tuple(q.shape)}"


def resync(D: torch.Tensor, W: torch.Tensor, R: torch.Tensor, gr: torch.Tensor | None, gc: torch.Tensor | None,
           sphere: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The direction W implies, on a batch (B, m, n) with gains (B, m, 1)/(B, 1, n), as masks: where W is no longer
    γ_r Ŵ γ_c (within ``RESYNC_ULPS``), Ŵ = W/γ_r/γ_c and its radius. Returns (Ŵ, radius, same (B,): W still equals
    γ_r Ŵ γ_c, valid (B,): the re-derived direction exists — W finite, W/γ not overflowing, no zero norm)."""
    C = compose(D, gr, gc)
    tol = RESYNC_ULPS * torch.finfo(W.dtype).eps
    same = ((C == W) | ((C - W).abs() <= tol * W.abs())).flatten(1).all(dim=1)
    Dr = W
    for g in (gr, gc):
        if g is not None:
            Dr = Dr / g.to(W.dtype)
    Rr = sphere_norm(Dr, sphere).to(R.dtype)
    valid = (torch.isfinite(W).flatten(1).all(dim=1) & torch.isfinite(Dr).flatten(1).all(dim=1)
             & (torch.isfinite(Rr) & (Rr > _ZERO_NORM)).flatten(1).all(dim=1))
    keep = same.reshape(-1, 1, 1)
    return torch.where(keep, D, Dr), torch.where(keep, R, Rr), same, valid


def rederive(md: MagnitudeDirection, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The direction and radius W implies with the current gains (``resync`` on one matrix), or None if W still equals
    γ_r Ŵ γ_c (e.g. the same checkpoint loaded into the model: the stored Ŵ is then kept bit for bit). Changes
    nothing. Gains are at least ``GAIN_MIN`` in magnitude, so the division is always defined.

    Raises:
        ValueError: naming p, where W holds NaN/Inf, W/γ overflows the dtype, or the norm is zero.
    """
    st = md.state[p]
    gains = md.gain_values(p)
    W = p.detach()
    D, radius, same, valid = resync(st["direction"][None], W[None], st["radius"][None],
                                    *(None if g is None else g[None] for g in gains), md.sphere)
    if bool(same[0]):
        return None
    name = md._name[p]
    if not bool(valid[0]):
        if not bool(torch.isfinite(W).all()):
            raise ValueError(f"MagnitudeDirection: parameter {name!r} was changed outside the optimizer and now holds "
                             "NaN/Inf entries; it has no direction; step refused, nothing was changed")
        if not (bool(torch.isfinite(D).all()) and bool(torch.isfinite(radius).all())):
            low = [float(g.abs().min()) for g in gains if g is not None]
            smallest = f" (smallest gain {min(low):.3g})" if low else ""
            raise ValueError(f"MagnitudeDirection: cannot re-derive the direction of {name!r} from its changed "
                             f"weight: W / gains overflows {D.dtype}{smallest}; step refused, nothing was changed")
        what = {"frobenius": "zero norm", "row": "a zero row", "col": "a zero column"}[md.sphere]
        raise ValueError(f"MagnitudeDirection: parameter {name!r} was changed outside the optimizer and now has "
                         f"{what}; its direction is undefined; step refused, nothing was changed")
    return D[0], radius[0]
