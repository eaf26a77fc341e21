"""The host-free step of ``MagnitudeDirection``: what ``torch.compile(md.step, fullgraph=True)`` traces (docs/md.md,
"On a GPU"; the manifold-Muon counterpart is ``manifold_host_free``).

The eager step (``MagnitudeDirection._update``) swaps each matrix's ``.data`` around the base step, reads
``p._version``, scans the gradients on the host, groups the gains by their step count (``int(step)``) and runs the C
passes of ``kernels/``. Here:

* decoupled matrices of the same shape, dtype, device and base group step as one **bucket**: parameters, gradients,
  directions, radii, gains and every state tensor are stacked (buckets keyed by the parameters themselves, their state
  read from ``md.state``/``base.state`` inside the step, so a trace serves exactly the parameters it was traced for),
  computed on as (B, m, n) batches and written back with one ``torch._foreach_copy_`` per state kind: the number of
  operations per bucket does not depend on its number of matrices;
* every host-side decision is a device tensor: the non-finite check (``on_nonfinite="skip"``: one 0-dim flag ``ok``
  masks every write through ``torch.where``, so a skipped step leaves every tensor bitwise unchanged), the
  re-derivation of Ŵ from a W changed outside the optimizer (a per-matrix mask: W ≠ γ_r Ŵ γ_c within
  ``RESYNC_ULPS``, instead of ``p._version``; a W that has no direction makes the whole step skip, or raise with
  ``on_nonfinite="raise"``), and the bias corrections (from the step counters as tensors, in float64);
* over ``torch.optim.Adam``/``AdamW`` (no amsgrad, maximize, differentiable) the base step is computed
  here — torch's single-tensor arithmetic on the stacked directions with the base's own ``exp_avg``/``exp_avg_sq``/
  ``step`` state and group hyperparameters, and plain Adam(W) for the base's other parameters — because torch's
  ``Optimizer.step`` breaks a graph; over any other base (Muon) the directions are written into the model's tensors
  (which the eager path also uses as scratch), ``.grad`` rebound to Ĝ and ``base.step()`` called once: a Muon with
  ``on_nonfinite="skip"`` masks its own step (a skipped MD step hands it NaN Ĝ), any other base makes a skipping
  step read ``ok`` on the host once (one graph break).

Equal to the eager step up to rounding: float32 sums of Ŵ⊙Ĝ instead of the C passes' float64 ones, γ from torch's
softplus instead of the C library's (≤ 1 ulp), batched reductions (tests/test_compiled_md.py: ≤ 1e-6 after 5 steps).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from weightgeom.optim import md_fused, md_torch
from weightgeom.optim.functional import NonFiniteGradientError, all_finite, first_nonfinite
from weightgeom.optim.md_checks import RESYNC_ULPS
from weightgeom.optim.md_functional import (
    _ZERO_NORM,
    compose,
    gain_chain,
    gain_chain_log,
    gain_grad_limit,
    gain_value,
    sphere_norm,
    sphere_norm_wide,
)
from weightgeom.optim.muon import Muon

if TYPE_CHECKING:  # pragma: no cover
    from weightgeom.optim.magnitude_direction import MagnitudeDirection

__all__ = ["step", "one_graph", "own_adam", "split", "adam_base", "adam_gains", "resync", "project"]

GAIN_KEYS = ("gain_row", "gain_col")
# group flags whose arithmetic ``adam_base`` lacks ("capturable" only moves the step counter to the device, as the
# host-free step does anyway; dynamo's view of a torch optimizer's groups shows it True inside a trace)
_ADAM_FLAGS = ("amsgrad", "maximize", "differentiable")


def _wide(device: torch.device) -> torch.dtype:
    """The dtype bias corrections are computed in: float64, float32 where the device has none (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def own_adam(base: torch.optim.Optimizer) -> bool:
    """Whether the host-free step computes the base step itself: torch's Adam/AdamW (exact types) with no group
    setting amsgrad, maximize or differentiable."""
    return md_fused.base_fusable(base) is None and not any(
        g.get(k) for g in base.param_groups for k in _ADAM_FLAGS)


def one_graph(md: MagnitudeDirection) -> bool:
    """Whether ``torch.compile(md.step)`` is one graph (no host read): ``on_nonfinite="skip"`` and a base whose step
    is masked on the device — torch's Adam/AdamW (``own_adam``) or a Muon with ``on_nonfinite="skip"``."""
    base = md.base_optimizer
    return md.on_nonfinite == "skip" and (own_adam(base) or (isinstance(base, Muon) and base.on_nonfinite == "skip"))


def _gain_shape(key: str, stacked: torch.Tensor) -> torch.Tensor:
    """Stacked θ (B, k) as γ's broadcast shape: rows (B, k, 1), columns (B, 1, k)."""
    return stacked.unsqueeze(-1) if key == "gain_row" else stacked.unsqueeze(-2)


def split(G: torch.Tensor, D: torch.Tensor, gr: torch.Tensor | None, gc: torch.Tensor | None, log: bool
          ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """``split_gradient_log`` (``log``) or ``split_gradient`` on a batch (B, m, n), gains (B, m, 1)/(B, 1, n) (a scalar
    gain (B, 1, 1)); the same operations in the same order. Returns (s_r (B, m) or (B, 1), s_c (B, n), Ĝ)."""
    if gr is None and gc is None:
        return None, None, G
    Gd = G * (gr if gr is not None else gc).to(G.dtype)
    if gr is not None and gc is not None:
        Gd = Gd * gc.to(G.dtype)
    big = torch.finfo(G.dtype).max
    Gd = Gd.clamp(-big, big)
    m, n = G.shape[-2:]
    scalar = gr is not None and gr.shape[-2] != m
    if not log:  # split_gradient: H = G ⊙ Ŵ, contracted with the other gain
        H = G * D
        H = H.float() if H.dtype in (torch.float16, torch.bfloat16) else H
        s_r = s_c = None
        if gr is not None:
            hr = (H @ gc.mT.to(H.dtype))[..., 0] if gc is not None else H.sum(dim=-1)
            s_r = hr.sum(dim=-1, keepdim=True) if scalar else hr
        if gc is not None:
            if gr is None:
                hc = H.sum(dim=-2)
            elif scalar:
                hc = H.sum(dim=-2) * gr[..., 0].to(H.dtype)
            else:
                hc = (gr.mT.to(H.dtype) @ H)[..., 0, :]
            s_c = hc
        return s_r, s_c, Gd
    P = D * Gd
    P = P.float() if P.dtype in (torch.float16, torch.bfloat16) else P
    e = math.ceil(math.log2(max(2, m * n if scalar else max(m, n))))  # split_gradient_log's overflow guard
    P = P * 2.0**-e
    s_r = None if gr is None else (P.sum(dim=(-2, -1))[..., None] if scalar else P.sum(dim=-1)) * 2.0**e
    s_c = None if gc is None else P.sum(dim=-2) * 2.0**e
    return s_r, s_c, Gd


def adam_base(X: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor,
              group: dict[str, Any], decoupled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's single-tensor Adam/AdamW step (``_single_tensor_adam``) on a batch, out of place: (X, m, v) new.

    ``step``: the counters after this step (B,) (float32, any device); the bias corrections are formed in float64
    from them as torch forms its Python ones. Low-precision X (bf16, fp16): every operation with a scalar runs in
    float32 and is rounded to X's dtype once, as torch's kernels apply a Python scalar — explicitly, because inside a
    trace the group's hyperparameters are 0-dim tensors (dynamo's ``specialize_float=False``), which a bf16 kernel
    would round to bf16 first.
    """
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group.get("weight_decay", 0.0)
    dt = X.dtype
    low = dt in (torch.float16, torch.bfloat16)
    op = torch.float32 if low else dt

    def f(t: torch.Tensor) -> torch.Tensor:  # to the kernels' opmath dtype
        return t.to(op)

    if wd != 0:
        if decoupled:
            X = (f(X) * (1 - lr * wd)).to(dt)
        else:
            grad = f(grad).add(f(X), alpha=wd).to(dt)
    m = f(m).lerp(f(grad), 1 - b1).to(dt)
    v = (f(v) * b2).to(dt)
    v = f(v).addcmul(f(grad), f(grad), value=1 - b2).to(dt)
    t = step.to(_wide(X.device)).reshape(-1, *([1] * (X.ndim - 1)))
    step_size = lr / (1 - torch.pow(b1, t))
    bc2_sqrt = (1 - torch.pow(b2, t)).sqrt()
    denom = (f(v.sqrt()) / bc2_sqrt.to(op)).to(dt)
    denom = (f(denom) + eps).to(dt)
    X = (f(X) + (f(m) / f(denom)) * (-step_size).to(op)).to(dt)
    return X, m, v


def adam_gains(theta: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor,
               group: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``adam_update_many_`` on a batch of θ (B, k) with per-row step counters (B,) (after this step), out of place:
    (θ, the gradient stepped with — NaN → 0, clamped —, m, v)."""
    (b1, b2), lr, eps = group["betas"], group["lr"], group["eps"]
    lim = gain_grad_limit(theta.dtype)
    g = grad.nan_to_num(nan=0.0).clamp(-lim, lim)
    m = m.lerp(g, 1 - b1)
    v = v.mul(b2).addcmul_(g, g, value=1 - b2)
    t = step.to(_wide(theta.device)).reshape(-1, 1)
    bc1, bc2 = 1 - torch.pow(b1, t), 1 - torch.pow(b2, t)
    denom = (v / bc2.to(v.dtype)).sqrt().add_(eps)
    return theta + m / denom * (-lr / bc1).to(theta.dtype), g, m, v


def resync(D: torch.Tensor, W: torch.Tensor, R: torch.Tensor, gr: torch.Tensor | None, gc: torch.Tensor | None,
           sphere: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``MagnitudeDirection._rederive`` on a batch, as masks: where W is no longer γ_r Ŵ γ_c (within
    ``RESYNC_ULPS``), Ŵ = W/γ_r/γ_c and its radius. Returns (Ŵ, radius, bad (B,): W changed and has no direction —
    NaN/Inf, W/γ overflowing, or a zero norm)."""
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
    return torch.where(keep, D, Dr), torch.where(keep, R, Rr), ~same & ~valid


def project(D: torch.Tensor, R: torch.Tensor, sphere: str) -> torch.Tensor:
    """``project_to_sphere_`` on a batch (B, m, n), radii (B, 1, 1)/(B, m, 1)/(B, 1, n), out of place."""
    norm = sphere_norm_wide(D, sphere)
    return D * (R.to(norm.dtype) / norm.clamp_min(_ZERO_NORM)).to(D.dtype)


def _masked(ok: torch.Tensor | None, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return new if ok is None else torch.where(ok, new, old)


def _write(ok: torch.Tensor | None, dst: list[torch.Tensor], new: torch.Tensor, old: torch.Tensor | None = None
           ) -> None:
    """One ``_foreach_copy_`` of a stacked result into its tensors (masked by ``ok``; ``old``: their stack)."""
    if ok is not None:
        new = torch.where(ok, new, torch.stack(dst) if old is None else old)
    torch._foreach_copy_(dst, list(new.unbind(0)))


def _count(ok: torch.Tensor | None, counters: list[torch.Tensor]) -> torch.Tensor:
    """Advance step counters (by 1, or by ``ok``) with one foreach op; returns their new values stacked."""
    if ok is None:
        torch._foreach_add_(counters, 1.0)
    else:  # a list of 0-dim tensors: the Tensor-scalar overload would read its scalar on the host
        torch._foreach_add_(counters, [ok.to(counters[0].dtype).to(counters[0].device)] * len(counters))
    return torch.stack(counters)


def _to_device(state: dict[str, Any], key: str, device: torch.device) -> torch.Tensor:
    """A step counter on its tensor's device (moved there once: a trace cannot read a CPU counter on a GPU)."""
    t = state[key]
    if t.device != device:
        t = state[key] = t.to(device)
    return t


class _Bucket:
    """Decoupled matrices of one shape, dtype, device and base group, stacked (what ``step`` computes on)."""

    def __init__(self, md: MagnitudeDirection, group: dict[str, Any], ps: list[torch.Tensor], scale: float | None):
        self.ps, self.group, self.scale = ps, group, scale
        self.states = [md.state[p] for p in ps]
        self.keys = [k for k in GAIN_KEYS if k in self.states[0]]
        self.thetas = {k: [st[k] for st in self.states] for k in self.keys}
        self.grads = [p.grad for p in ps]
        self.W = torch.stack([p.detach() for p in ps])
        self.G = torch.stack(self.grads)
        self.D0 = torch.stack([st["direction"] for st in self.states])
        self.R0 = torch.stack([st["radius"] for st in self.states])
        self.TH = {k: torch.stack(v) for k, v in self.thetas.items()}


def _gains(md: MagnitudeDirection, b: _Bucket, TH: dict[str, torch.Tensor]
           ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    out = {k: _gain_shape(k, gain_value(TH[k], md.parameterization)) for k in b.keys}
    return out.get("gain_row"), out.get("gain_col")


def _check(md: MagnitudeDirection) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """What the eager ``_plan`` refuses, without reading a tensor: the groups, each gradient's fit (metadata), sparse
    gradients; then the non-finite check — ``ok`` on the device (``"skip"``), or the eager scan and raise."""
    if not torch.compiler.is_compiling():  # a trace sees a scheduled lr as a symbol: compile_step checks before
        md.check_groups()
    base = md.base_optimizer
    params = [q for g in base.param_groups for q in g["params"] if q.grad is not None]
    md._check_metadata(params)
    if md.on_nonfinite == "skip":
        device = params[0].device if params else md._skipped.device
        if md._skipped.device != device:
            md._skipped = md._skipped.to(device)
        return params, all_finite([q.grad for q in params], device=device)
    bad = first_nonfinite([q.grad for q in params])
    if bad is not None:
        q = params[bad]
        raise NonFiniteGradientError.refused("MagnitudeDirection", md._param_label(q), tuple(q.shape))
    check_step = getattr(base, "check_step", None)
    if check_step is not None:
        check_step()
    return params, None


def step(md: MagnitudeDirection) -> None:
    """One MD step without host reads (module docstring); the same refusals as the eager step where they need no
    read, and ``on_nonfinite`` as ``MagnitudeDirection`` documents it."""
    base = md.base_optimizer
    params, ok = _check(md)
    group_of = {id(q): g for g in base.param_groups for q in g["params"]}
    decoupled = {id(p) for p in md._decoupled}
    adam = own_adam(base)
    buckets: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for p in md._decoupled:
        if p.grad is None:
            continue
        if id(p) not in group_of:
            raise ValueError(f"MagnitudeDirection: parameter {md._name[p]!r} is no longer in the base optimizer")
        group = group_of[id(p)]
        buckets.setdefault((tuple(p.shape), p.dtype, p.device, id(group)), []).append(p)
    gain_group = md._gain_groups[0]
    work: list[tuple[_Bucket, dict[str, Any]]] = []
    bad_any = None
    for ps in buckets.values():
        group = group_of[id(ps[0])]
        b = _Bucket(md, group, ps, md._scale_divisor(ps[0], group))
        for k in b.keys:  # the gains' Adam state (created as the eager path creates it)
            for theta in b.thetas[k]:
                gst = md_fused.gain_adam_state(md.state, theta)
                _to_device(gst, "step", theta.device)
        gr, gc = _gains(md, b, b.TH)
        D, R, bad = resync(b.D0, b.W, b.R0, gr, gc, md.sphere)
        bad_any = bad.any() if bad_any is None else bad_any | bad.any()
        b.D, b.R = D, R
        b.s_r, b.s_c, b.Gd = split(b.G, D, gr, gc, md.parameterization != "direct")
        work.append((b, {}))
    if bad_any is not None:
        if ok is not None:
            ok = ok & ~bad_any
        elif bool(bad_any):  # "raise" reads anyway: name the matrix and refuse as the eager step does
            for b, _ in work:
                for p in b.ps:
                    md._rederive(p)
    masks_base = one_graph(md)
    if ok is not None:
        md._skipped.add_(~ok)
        if not masks_base:  # this base cannot mask its own step: read the flag once (a graph break in a trace)
            if not bool(ok):
                return
            ok = None
    # the gains' gradients (θ.grad, as the eager step leaves them)
    for b, _ in work:
        b.gains_grad = {}
        for k in b.keys:
            s_ = b.s_r if k == "gain_row" else b.s_c
            theta = b.TH[k]
            chain = gain_chain if md.parameterization == "direct" else gain_chain_log
            g = chain(theta, s_.reshape(theta.shape).to(theta.dtype), md.parameterization)
            b.gains_grad[k] = g.neg() if md_torch.ascends(b.group) else g  # maximize: the gains ascend too
        target, Gd = b.D, b.Gd
        if b.scale is not None:  # norm-fixing manifold: the base steps Q = Ŵ/s with ∂L/∂Q = s·Ĝ
            sv = (b.R.reshape(-1, 1, 1) / b.scale)
            target = b.D / sv.to(b.D.dtype)
            Gd = Gd * sv.to(Gd.dtype)
            b.sv = sv
        b.target, b.Gd = target, Gd
    if adam:
        _adam_step(md, work, params, decoupled, group_of, ok)
    else:
        _base_step(md, work, ok)
    for b, _ in work:
        _finish(md, b, gain_group, ok)
    for p in md._unit_rows:
        norm = torch.linalg.vector_norm(p, dim=-1, keepdim=True)
        new = p * (md.embedding_radius / norm.clamp_min(_ZERO_NORM))
        p.copy_(_masked(ok, new, p))


def _adam_step(md: MagnitudeDirection, work: list, params: list[torch.Tensor], decoupled: set[int],
               group_of: dict[int, dict[str, Any]], ok: torch.Tensor | None) -> None:
    """The base Adam(W) step, computed here: each bucket's directions, then the base's other parameters (bucketed by
    shape, dtype, device and group), each from ``base.state`` and written back into it."""
    base = md.base_optimizer
    dec = isinstance(base, torch.optim.AdamW)
    for b, _ in work:
        sts = [md_fused.adam_state(base, b.group, p) for p in b.ps]
        for st, p in zip(sts, b.ps):
            _to_device(st, "step", p.device)
        steps = _count(ok, [st["step"] for st in sts])
        ms, vs = [st["exp_avg"] for st in sts], [st["exp_avg_sq"] for st in sts]
        M0, V0 = torch.stack(ms), torch.stack(vs)
        b.new, M, V = adam_base(b.target, b.Gd, M0, V0, steps, b.group,
                                dec or bool(b.group.get("decoupled_weight_decay")))
        _write(ok, ms, M, M0)
        _write(ok, vs, V, V0)
        md._path.update(dict.fromkeys(b.ps, "host-free"))
    others: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for q in params:
        if id(q) not in decoupled:
            g = group_of[id(q)]
            others.setdefault((tuple(q.shape), q.dtype, q.device, id(g)), []).append(q)
    for qs in others.values():
        group = group_of[id(qs[0])]
        sts = [md_fused.adam_state(base, group, q) for q in qs]
        for st, q in zip(sts, qs):
            _to_device(st, "step", q.device)
        steps = _count(ok, [st["step"] for st in sts])
        ms, vs = [st["exp_avg"] for st in sts], [st["exp_avg_sq"] for st in sts]
        X0, M0, V0 = torch.stack([q.detach() for q in qs]), torch.stack(ms), torch.stack(vs)
        X, M, V = adam_base(X0, torch.stack([q.grad for q in qs]), M0, V0, steps, group,
                            dec or bool(group.get("decoupled_weight_decay")))
        _write(ok, ms, M, M0)
        _write(ok, vs, V, V0)
        _write(ok, qs, X, X0)


def _base_step(md: MagnitudeDirection, work: list, ok: torch.Tensor | None) -> None:
    """Any other base: the directions written into the model's tensors, ``.grad`` rebound to Ĝ (NaN where the step is
    skipped, so that a Muon with ``on_nonfinite="skip"`` skips too), one ``base.step()``, the stepped directions read
    back and ``.grad`` restored."""
    for b, _ in work:
        torch._foreach_copy_(b.ps, list(b.target.to(b.W.dtype).unbind(0)))
        Gd = b.Gd if ok is None else torch.where(ok, b.Gd, float("nan"))
        for p, g in zip(b.ps, Gd.unbind(0)):
            p.grad = g
    try:
        md_torch.step_base(md.base_optimizer)  # the global step hooks fire around MD's step only
    finally:
        for b, _ in work:
            for p, g in zip(b.ps, b.grads):
                p.grad = g
    for b, _ in work:
        b.new = torch.stack([p.detach() for p in b.ps])
        md._path.update(dict.fromkeys(b.ps, "host-free"))


def _finish(md: MagnitudeDirection, b: _Bucket, gain_group: dict[str, Any], ok: torch.Tensor | None) -> None:
    """The gains' Adam step, Ŵ back on its sphere, W = γ_r Ŵ γ_c; every write masked by ``ok``."""
    TH = dict(b.TH)
    for k in b.keys:
        gsts = [md.state[t] for t in b.thetas[k]]
        steps = _count(ok, [g["step"] for g in gsts])
        ms, vs = [g["exp_avg"] for g in gsts], [g["exp_avg_sq"] for g in gsts]
        M0, V0 = torch.stack(ms), torch.stack(vs)
        th, grad, M, V = adam_gains(b.TH[k], b.gains_grad[k], M0, V0, steps, gain_group)
        _write(ok, ms, M, M0)
        _write(ok, vs, V, V0)
        _write(ok, b.thetas[k], th, b.TH[k])
        TH[k] = _masked(ok, th, b.TH[k])
        for theta, g in zip(b.thetas[k], grad.unbind(0)):
            theta.grad = g
    new = b.new
    if b.scale is not None:
        new = new * b.sv.to(new.dtype)
    D = project(new.to(b.D.dtype), b.R, md.sphere)
    gr, gc = _gains(md, b, TH)
    W = compose(D, gr, gc)
    _write(ok, [st["direction"] for st in b.states], D, b.D0)
    _write(ok, [st["radius"] for st in b.states], b.R, b.R0)
    _write(ok, b.ps, W, b.W)
