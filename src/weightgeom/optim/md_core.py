"""The one step of ``MagnitudeDirection``: a batched function from stacked same-shape matrices and their state to the
new matrices and state, with no host read and every per-matrix decision a device mask (steps 2–6 of the
``magnitude_direction`` module docstring; docs/md.md, "One core, two backends").

The eager step (``MagnitudeDirection._update``), the host-free step (``host_free``; what a ``torch.compile`` trace and
``compile_step`` run) and the FSDP2 owner-rank step all call ``run`` on **buckets**: decoupled matrices of the same
shape, dtype, device and base group (``Bucket``; keyed by the parameters themselves, their state read from
``md.state``/``base.state`` inside the step, so a trace serves exactly the parameters it was traced for). What only
the eager step does — name the bad parameter, re-derive Ŵ from a W changed outside the optimizer by its version
counter, record each matrix's path — wraps ``run``; it does not fork it.

Per bucket two explicit choices, made by the caller from values it resolved once:

* ``adam``: the base step of the directions is computed here (torch's Adam/AdamW arithmetic, ``adam_base``, with the
  base's own state and hyperparameters), or the base's ``step()`` is called on the directions swapped in;
* ``kernels``: the backend of the passes over each matrix — torch (stacked (B, m, n) tensors: a constant number of
  operations per bucket; the eager CPU step keeps one matrix per bucket, as views written in place), or the C
  kernels (``md_fused``: per matrix, CPU float32/float64, softplus/exp gains; over Adam the whole step in two C
  passes, else the split and the finish around the base step). One equivalence test holds the C backend to the torch
  backend (tests/test_md_fused.py).

``ok`` (a 0-dim bool or None) masks every write through ``torch.where``: a skipped step (``on_nonfinite="skip"``)
leaves every tensor bitwise unchanged; the C backend runs only with ``ok`` None (the eager step refuses on the host).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from weightgeom.optim import md_checks, md_fused, md_setup, md_torch
from weightgeom.optim.functional import all_finite
from weightgeom.optim.md_functional import (
    _ZERO_NORM,
    _wide,
    adam_gains,
    compose,
    gain_chain,
    gain_chain_log,
    gain_value,
    project,
    project_to_sphere_,
    split,
)
from weightgeom.optim.md_state import GAIN_KEYS
from weightgeom.optim.muon import Muon

if TYPE_CHECKING:  # pragma: no cover
    from weightgeom.optim.magnitude_direction import MagnitudeDirection

__all__ = ["Bucket", "buckets", "own_adam", "one_graph", "prepare", "run", "step_host_free", "gain_grads",
           "adam_base"]

# group flags whose arithmetic ``adam_base`` lacks ("capturable" only moves the step counter to the device, as this
# step does anyway; dynamo's view of a torch optimizer's groups shows it True inside a trace)
_ADAM_FLAGS = ("amsgrad", "maximize", "differentiable")


def own_adam(base: torch.optim.Optimizer) -> bool:
    """Whether the base step can be computed here (``adam_base``): torch's Adam/AdamW (exact types) with no group
    setting amsgrad, maximize or differentiable."""
    return md_fused.base_fusable(base) is None and not any(
        g.get(k) for g in base.param_groups for k in _ADAM_FLAGS)


def one_graph(md: MagnitudeDirection) -> bool:
    """Whether ``torch.compile(md.step)`` is one graph (no host read): ``on_nonfinite="skip"`` and a base whose step
    is masked on the device — torch's Adam/AdamW (``own_adam``) or a Muon whose step is one graph
    (``Muon.one_graph``)."""
    base = md.base_optimizer
    return md.on_nonfinite == "skip" and (own_adam(base) or (isinstance(base, Muon) and base.one_graph()))


# ---------------------------------------------------------------------------------------------------------------------
# The batched maths (torch backend): pure functions on (B, m, n) stacks.
# ---------------------------------------------------------------------------------------------------------------------
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
    op = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt

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


# ---------------------------------------------------------------------------------------------------------------------
# Buckets and masked writes.
# ---------------------------------------------------------------------------------------------------------------------
def _stack(ts: list[torch.Tensor], view: bool = False) -> torch.Tensor:
    """``torch.stack``; with ``view``, one tensor as a (1, ...) view of itself (written through: eager only)."""
    return ts[0].unsqueeze(0) if view and len(ts) == 1 else torch.stack(ts)


def _masked(ok: torch.Tensor | None, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return new if ok is None else torch.where(ok, new, old)


def _write(ok: torch.Tensor | None, dst: list[torch.Tensor], new: torch.Tensor, old: torch.Tensor | None) -> None:
    """One ``_foreach_copy_`` of a stacked result into its tensors, ``_masked`` by ``ok`` (``old``: their stack)."""
    torch._foreach_copy_(dst, list(_masked(ok, new, old).unbind(0)))


def _count(ok: torch.Tensor | None, counters: list[torch.Tensor], view: bool = False) -> torch.Tensor:
    """Advance step counters (by 1, or by ``ok``) with one foreach op; returns their new values stacked (``view``:
    one counter as a view of itself, as ``_stack``)."""
    if ok is None:
        torch._foreach_add_(counters, 1.0)
    else:  # a list of 0-dim tensors: the Tensor-scalar overload would read its scalar on the host
        torch._foreach_add_(counters, [ok.to(counters[0].dtype).to(counters[0].device)] * len(counters))
    return _stack(counters, view)


def _to_device(state: dict[str, Any], key: str, device: torch.device) -> torch.Tensor:
    """A step counter on its tensor's device (moved there once: a trace cannot read a CPU counter on a GPU)."""
    t = state[key]
    if t.device != device:
        t = state[key] = t.to(device)
    return t


def _per_tensor(b: Bucket) -> bool:
    """Whether the gains' elementwise maps (φ, the chain rule) run one call per θ: in the eager step on the CPU (its
    vectorised transcendental kernels may round a vector's tail differently from its body: per θ, the bits do not
    depend on the bucket); elsewhere one call on the stack (launch-bound vectors on a GPU; the host-free step, whose
    operations per bucket do not grow with its matrices)."""
    return b.eager and b.ps[0].device.type == "cpu"


def _each(b: Bucket, fn, ts: list[torch.Tensor], stacked: torch.Tensor | None = None) -> torch.Tensor:
    """An elementwise ``fn`` of stacked tensors: per tensor then stacked (one result as a view of itself), or on the
    stack (``_per_tensor``)."""
    if _per_tensor(b):
        return _stack([fn(t) for t in ts], True)
    return fn(_stack(ts) if stacked is None else stacked)


class Bucket:
    """Decoupled matrices of one shape, dtype, device, base group and route, as ``run`` computes on them.

    Attributes:
        ps, group, states, grads: the parameters, their base group, their MD state dicts and gradients.
        scale: κ of a norm-fixing manifold group (the base steps Q = Ŵ/s, s = radius/κ), or None.
        adam: the base step is computed here (``adam_base``, or the fused C pass); else ``base.step()`` runs it.
        kernels: the C backend (per matrix, nothing stacked but the gains); else the torch backend.
        eager: built by the eager step (``_per_tensor``).
        keys, thetas, TH: the gains kept (``md_state.GAIN_KEYS``), their θ per key, and θ stacked (B, k).
        W, G, D0, R0: the stacks of W, G, Ŵ and the radii (torch backend only).
    """

    def __init__(self, md: MagnitudeDirection, group: dict[str, Any], ps: list[torch.Tensor], scale: float | None,
                 adam: bool, kernels: bool, eager: bool):
        self.ps, self.group, self.scale, self.adam, self.kernels, self.eager = ps, group, scale, adam, kernels, eager
        self.states = [md.state[p] for p in ps]
        self.keys = [k for k in GAIN_KEYS if k in self.states[0]]
        self.thetas = {k: [st[k] for st in self.states] for k in self.keys}
        self.grads = [p.grad for p in ps]
        self.TH = {k: _stack(v) for k, v in self.thetas.items()}
        if not kernels:  # eagerly on the CPU one matrix per bucket: views, the passes write in place (``_finish``)
            self.W = _stack([p.detach() for p in ps], eager)
            self.G = _stack(self.grads, eager)
            self.D0 = _stack([st["direction"] for st in self.states], eager)
            self.R0 = _stack([st["radius"] for st in self.states], eager)
            self.D, self.R = self.D0, self.R0
        self.gains: tuple[torch.Tensor | None, torch.Tensor | None] | None = None  # γ of TH, once computed


def _alone(p: torch.Tensor, eager: bool) -> bool:
    """Whether p is a bucket of its own: in the eager step on the CPU (stacking would copy each matrix, where the
    eager passes write in place; launches cost little there)."""
    return eager and p.device.type == "cpu"


def buckets(md: MagnitudeDirection, entries: list[tuple[torch.Tensor, dict[str, Any], bool, bool]],
            eager: bool) -> list[Bucket]:
    """``Bucket``s of (p, its base group, adam, kernels) entries, in order of first appearance (``eager``: built by
    the eager step); the gains' Adam state created where missing (as every path creates it)."""
    keyed: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    route: dict[tuple[Any, ...], tuple[dict[str, Any], bool, bool]] = {}
    for p, group, adam, kernels in entries:
        key = (tuple(p.shape), p.dtype, p.device, id(group), adam, kernels)
        if _alone(p, eager):
            key += (id(p),)
        keyed.setdefault(key, []).append(p)
        route[key] = (group, adam, kernels)
    out = []
    for key, ps in keyed.items():
        group, adam, kernels = route[key]
        b = Bucket(md, group, ps, md_setup.scale_divisor(md, ps[0], group), adam, kernels, eager)
        for k in b.keys:
            for theta in b.thetas[k]:
                _to_device(md_fused.gain_adam_state(md.state, theta), "step", theta.device)
        out.append(b)
    return out


def _gains(md: MagnitudeDirection, b: Bucket, thetas: dict[str, list[torch.Tensor]], TH: dict[str, torch.Tensor]
           ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """γ_r (B, m, 1) or (B, 1, 1) and γ_c (B, 1, n) of a bucket; None where absent."""
    out = {}
    for k in b.keys:
        g = _each(b, lambda t: gain_value(t, md.parameterization), thetas[k], TH[k])
        out[k] = g.unsqueeze(-1) if k == "gain_row" else g.unsqueeze(-2)
    return out.get("gain_row"), out.get("gain_col")


def prepare(md: MagnitudeDirection, bs: list[Bucket]) -> torch.Tensor | None:
    """The host-free re-derivation of Ŵ where W changed outside the optimizer (``resync``; the eager step uses W's
    version counter instead): sets each torch-backend bucket's Ŵ and radii; returns whether any changed W has no
    direction (0-dim bool), or None without buckets."""
    bad_any = None
    for b in bs:
        b.gains = _gains(md, b, b.thetas, b.TH)
        b.D, b.R, same, valid = md_checks.resync(b.D0, b.W, b.R0, *b.gains, md.sphere)
        bad = ~same & ~valid
        bad_any = bad.any() if bad_any is None else bad_any | bad.any()
    return bad_any


# ---------------------------------------------------------------------------------------------------------------------
# The step.
# ---------------------------------------------------------------------------------------------------------------------
def run(md: MagnitudeDirection, bs: list[Bucket], ok: torch.Tensor | None,
        others: list[torch.Tensor] | None = None) -> None:
    """Steps 2–6 on every bucket, all writes masked by ``ok``.

    Args:
        md: the wrapper (its options, state and gains group).
        bs: the buckets (``buckets``); torch-backend ones after ``prepare`` or with Ŵ already in sync.
        ok: 0-dim bool (False: the step is skipped, nothing changes) or None.
        others: None: ``base.step()`` steps the base's other parameters and the buckets without ``adam`` (the
            ``adam`` ones' ``.grad`` hidden from it). A list: the base is torch's Adam/AdamW (``own_adam``) and these
            non-decoupled parameters (with gradients) are stepped here too — no ``base.step()``, no graph break.
    """
    assert ok is None or not any(b.kernels for b in bs), "the C backend runs unmasked (eager) only"
    gain_group = md._gain_groups[0]
    for b in bs:
        if b.kernels and b.adam:  # the whole step in two C passes per matrix (gains' Adam and finish included)
            md_fused.adam_pass(md, b)
        elif b.kernels:
            gain_grads(md, b, md_fused.split_pass(md, b))
        else:
            _split(md, b)
    if others is not None:
        _adam_others(md, bs, others, ok)
    if others is None or any(not b.adam for b in bs):
        _base_step(md, bs, ok)
    for b in bs:
        if b.kernels and b.adam:
            continue
        TH = _adam_gains(md, b, gain_group, ok)
        if b.kernels:
            md_fused.finish_pass(md, b)
        else:
            _finish(md, b, TH, ok)
    for p in md._unit_rows:
        norm = torch.linalg.vector_norm(p, dim=-1, keepdim=True)
        p.copy_(_masked(ok, p * (md.embedding_radius / norm.clamp_min(_ZERO_NORM)), p))


def gain_grads(md: MagnitudeDirection, b: Bucket, s: dict[str, Any]) -> None:
    """∂L/∂θ (stacked (B, k), in θ's dtype) from the split's sums (per key: stacked, or a list of one per matrix)
    into ``b.gains_grad``; negated for a maximize group (the gains ascend with its direction)."""
    chain = gain_chain if md.parameterization == "direct" else gain_chain_log
    up = md_torch.ascends(b.group)
    b.gains_grad = {}
    for k in b.keys:
        sk, TH = s[k], b.TH[k]
        if isinstance(sk, list) or _per_tensor(b):
            g = _stack([chain(t, x.reshape(t.shape).to(t.dtype), md.parameterization)
                        for t, x in zip(b.thetas[k], sk if isinstance(sk, list) else sk.unbind(0))], True)
        else:
            g = chain(TH, sk.reshape(TH.shape).to(TH.dtype), md.parameterization)
        b.gains_grad[k] = g.neg() if up else g


def _split(md: MagnitudeDirection, b: Bucket) -> None:
    """Torch backend of step 2: Ĝ and the gains' gradients of a bucket; the base's target Q and its gradient. The
    eager step's one-matrix bucket writes Ĝ into a kept buffer and the products into the model's W (scratch until
    ``_finish`` recomposes it), as the C backend does, where W, G and Ŵ are contiguous (the same bits)."""
    gr, gc = b.gains if b.gains is not None else _gains(md, b, b.thetas, b.TH)
    out = scratch = None
    if b.eager and len(b.ps) == 1 and (gr is not None or gc is not None) and all(
            t.is_contiguous() for t in (b.W, b.G, b.D)):
        out, scratch = md_fused.kept_buffer(md, b.ps[0], b.G[0]).unsqueeze(0), b.W
    s_r, s_c, Gd = split(b.G, b.D, gr, gc, md.parameterization != "direct", out=out, scratch=scratch)
    gain_grads(md, b, {"gain_row": s_r, "gain_col": s_c})
    target = b.D
    if b.scale is not None:  # norm-fixing manifold: the base steps Q = Ŵ/s with ∂L/∂Q = s·Ĝ
        b.sv = b.R.reshape(-1, 1, 1) / b.scale
        target = b.D / b.sv.to(b.D.dtype)
        Gd = Gd * b.sv.to(Gd.dtype)
    b.target, b.Gd = target, Gd


def _adam_others(md: MagnitudeDirection, bs: list[Bucket], others: list[torch.Tensor], ok: torch.Tensor | None
                 ) -> None:
    """The base Adam(W) step computed here: each torch-backend ``adam`` bucket's directions, then the base's other
    parameters (bucketed by shape, dtype, device and group), each from ``base.state`` and written back into it."""
    base = md.base_optimizer
    dec = isinstance(base, torch.optim.AdamW)
    for b in bs:
        if b.adam and not b.kernels:
            b.new = _adam_batch(base, b.group, b.ps, b.target, b.Gd, ok, dec)
    group_of = {id(q): g for g in base.param_groups for q in g["params"]}
    keyed: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for q in others:
        keyed.setdefault((tuple(q.shape), q.dtype, q.device, id(group_of[id(q)])), []).append(q)
    for qs in keyed.values():
        X0 = _stack([q.detach() for q in qs])
        X = _adam_batch(base, group_of[id(qs[0])], qs, X0, _stack([q.grad for q in qs]), ok, dec)
        _write(ok, qs, X, X0)


def _adam_batch(base: torch.optim.Optimizer, group: dict[str, Any], ps: list[torch.Tensor], X: torch.Tensor,
                grad: torch.Tensor, ok: torch.Tensor | None, dec: bool) -> torch.Tensor:
    """``adam_base`` on stacked X with the base's state of ``ps`` (created as torch creates it), written back."""
    sts = [md_fused.adam_state(base, group, p) for p in ps]
    for st, p in zip(sts, ps):
        _to_device(st, "step", p.device)
    steps = _count(ok, [st["step"] for st in sts])
    ms, vs = [st["exp_avg"] for st in sts], [st["exp_avg_sq"] for st in sts]
    M0, V0 = _stack(ms), _stack(vs)
    new, M, V = adam_base(X, grad, M0, V0, steps, group, dec or bool(group.get("decoupled_weight_decay")))
    _write(ok, ms, M, M0)
    _write(ok, vs, V, V0)
    return new


def _base_step(md: MagnitudeDirection, bs: list[Bucket], ok: torch.Tensor | None) -> None:
    """The base's ``step()`` on the directions: per bucket without ``adam``, the torch backend writes Q into the
    model's tensors (scratch until ``_finish``) and rebinds ``.grad`` to Ĝ (NaN where the step is skipped, so that a
    Muon with ``on_nonfinite="skip"`` skips too); the C backend swaps ``.data``/``.grad`` to Q/Ĝ (no copy). ``adam``
    buckets' ``.grad`` is hidden. Everything is restored after the base step, whatever it raised."""
    swapped: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
    try:
        for b in bs:
            for i, p in enumerate(b.ps):
                swapped.append((p, p.data if (b.kernels or b.eager) and not b.adam else None, b.grads[i]))
            if b.adam:
                for p in b.ps:
                    p.grad = None
            elif b.kernels or b.eager:  # swapped in: the base steps Q in place (no copy)
                for p, target, Gd in zip(b.ps, b.target, b.Gd):
                    p.data, p.grad = target, Gd
            else:
                torch._foreach_copy_(b.ps, list(b.target.to(b.W.dtype).unbind(0)))
                Gd = b.Gd if ok is None else torch.where(ok, b.Gd, float("nan"))
                for p, g in zip(b.ps, Gd.unbind(0)):
                    p.grad = g
        md_torch.step_base(md.base_optimizer)  # the global step hooks fire around MD's step only
    finally:
        for b in bs:
            if (b.kernels or b.eager) and not b.adam:  # what the base left (it may have rebound .data)
                b.target = [p.data for p in b.ps]
        for p, data, grad in swapped:
            if data is not None:
                p.data = data
            p.grad = grad
    for b in bs:
        if not b.adam and not b.kernels:
            b.new = _stack(b.target, True) if b.eager else _stack([p.detach() for p in b.ps])


def _adam_gains(md: MagnitudeDirection, b: Bucket, gain_group: dict[str, Any], ok: torch.Tensor | None
                ) -> dict[str, torch.Tensor]:
    """Step 5: the gains' Adam of a bucket (θ.grad left as the gradient stepped with); returns θ new, stacked. The
    eager step's one-matrix bucket reads its counter and moments through views (nothing is written before they are
    read: ``adam_gains`` is out of place)."""
    TH = dict(b.TH)
    for k in b.keys:
        gsts = [md.state[t] for t in b.thetas[k]]
        steps = _count(ok, [g["step"] for g in gsts], b.eager)
        ms, vs = [g["exp_avg"] for g in gsts], [g["exp_avg_sq"] for g in gsts]
        M0, V0 = _stack(ms, b.eager), _stack(vs, b.eager)
        th, grad, M, V = adam_gains(b.TH[k], b.gains_grad[k], M0, V0, steps, gain_group)
        _write(ok, ms, M, M0)
        _write(ok, vs, V, V0)
        _write(ok, b.thetas[k], th, b.TH[k])
        TH[k] = _masked(ok, th, b.TH[k])
        for theta, g in zip(b.thetas[k], grad.unbind(0)):
            theta.grad = g
    return TH


def _finish(md: MagnitudeDirection, b: Bucket, TH: dict[str, torch.Tensor], ok: torch.Tensor | None) -> None:
    """Torch backend of steps 4 and 6: Ŵ back on its sphere, W = γ_r Ŵ γ_c; every write masked by ``ok``."""
    gr, gc = _gains(md, b, {k: list(TH[k].unbind(0)) for k in b.keys} if _per_tensor(b) else b.thetas, TH)
    new = b.new
    if b.eager:  # ok is None: in place, into the directions and the model's tensors (views for one matrix)
        D = b.D0
        if b.scale is not None:
            torch.mul(new, b.sv.to(new.dtype), out=D)
        elif new.data_ptr() != D.data_ptr():
            D.copy_(new)
        project_to_sphere_(D, b.R, md.sphere)
        compose(D, gr, gc, out=b.W)
        if len(b.ps) > 1:
            _write(None, [st["direction"] for st in b.states], D, None)
            _write(None, b.ps, b.W, None)
        return
    if b.scale is not None:
        new = new * b.sv.to(new.dtype)
    D = project(new.to(b.D.dtype), b.R, md.sphere)
    W = compose(D, gr, gc)
    _write(ok, [st["direction"] for st in b.states], D, b.D0)
    _write(ok, [st["radius"] for st in b.states], b.R, b.R0)
    _write(ok, b.ps, W, b.W)


# ---------------------------------------------------------------------------------------------------------------------
# The host-free wrapper: what a trace runs (``host_free``), the eager step's refusals made without reading a tensor.
# ---------------------------------------------------------------------------------------------------------------------
def step_host_free(md: MagnitudeDirection) -> None:
    """One MD step without host reads: the refusals of the eager step that need no read (groups, each gradient's
    fit, sparse gradients), the non-finite check as ``ok`` on the device (``"skip"``; ``"raise"`` scans and raises as
    the eager step does), Ŵ re-derived by mask (``prepare``), then ``run`` on torch-backend buckets. Over torch's
    Adam/AdamW the base step is computed here; any other base is stepped once by its ``step()`` — a Muon with
    ``on_nonfinite="skip"`` masks its own step, any other base makes a skipping step read ``ok`` once (a graph
    break in a trace)."""
    if not torch.compiler.is_compiling():  # a trace sees a scheduled lr as a symbol: compile_step checks before
        md.check_groups()
    base = md.base_optimizer
    params = [q for g in base.param_groups for q in g["params"] if q.grad is not None]
    md_checks.check_metadata(md, params)
    ok = None
    if md.on_nonfinite == "skip":
        device = params[0].device if params else md._skipped.device
        if md._skipped.device != device:
            md._skipped = md._skipped.to(device)
        ok = all_finite([q.grad for q in params], device=device)
    else:
        md_checks.refuse_nonfinite(md, params)
        check_step = getattr(base, "check_step", None)
        if check_step is not None:
            check_step()
    adam = own_adam(base)
    bs = buckets(md, [(p, group, adam, False) for p, group in md_checks.with_gradients(md)], eager=False)
    bad_any = prepare(md, bs)
    if bad_any is not None:
        if ok is not None:
            ok = ok & ~bad_any
        elif bool(bad_any):  # "raise" reads anyway: name the matrix and refuse as the eager step does
            for b in bs:
                for p in b.ps:
                    md_checks.rederive(md, p)
    if ok is not None:
        md._skipped.add_(~ok)
        if not one_graph(md):  # this base cannot mask its own step: read the flag once (a graph break in a trace)
            if not bool(ok):
                return
            ok = None
    decoupled = {id(p) for p in md._decoupled}
    run(md, bs, ok, [q for q in params if id(q) not in decoupled] if adam else None)
    for b in bs:
        md._path.update(dict.fromkeys(b.ps, "host-free"))
