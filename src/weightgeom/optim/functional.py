"""Pure update stages of the Muon family (docs/muon.md §1): momentum → direction → shape scale → decay → lr.

Every stage is a small function of tensors and floats, so the optimizer class (``muon.py``) is one loop that calls
them in order, and tests can check each stage alone. Derivations are in ``docs/muon.md``.

Conventions: matrices in PyTorch (out, in) layout; "rows" and "cols" are ``W.shape[-2]`` and ``W.shape[-1]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "MOMENTUM_FORMS",
    "ADJUST_LR_FNS",
    "NonFiniteGradientError",
    "first_nonfinite",
    "all_finite",
    "momentum_step",
    "momentum_direction",
    "shape_scale",
    "newton_schulz",
    "decoupled_step",
    "apply_update",
    "adamw_update",
]

MOMENTUM_FORMS = ("ema", "sum")
ADJUST_LR_FNS = ("original", "match_rms_adamw", "none")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class NonFiniteGradientError(ValueError):
    """A gradient holds NaN or Inf, so the optimizer refused the whole step before changing anything.

    Raised by ``Muon.step`` and ``MagnitudeDirection.step``: every gradient of every group is checked first, so on
    this error no parameter, momentum buffer, step counter or other optimizer state has changed.

    Attributes:
        param_name: the offending parameter's name (group ``"names"``, torch's ``"param_names"``, the model's name, or
            ``group{i}.param{j}`` where none is known).
        shape: its shape.
    """

    def __init__(self, message: str, param_name: str | None = None, shape: tuple[int, ...] | None = None) -> None:
        super().__init__(message)
        self.param_name = param_name
        self.shape = shape

    @classmethod
    def refused(cls, optimizer: str, param_name: str, shape: tuple[int, ...]) -> NonFiniteGradientError:
        """The standard one-line message: who refused, which parameter, and that nothing changed."""
        return cls(f"{optimizer}: gradient of parameter {param_name!r} (shape {shape}) contains NaN/Inf; step "
                   f"refused, no parameter or optimizer state was changed", param_name, shape)

    def __reduce__(self):  # picklable with its attributes (it may cross a process boundary, e.g. a sweep worker)
        return (type(self), (str(self), self.param_name, self.shape))


def _finite_flags(tensors: Sequence[torch.Tensor]) -> dict[torch.device, torch.Tensor]:
    """{device: 0-dim bool tensor, True iff the norms of all of its tensors are finite} (``all_finite``'s reduction,
    no host sync). Empty tensors are left out."""
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            buckets.setdefault((t.device, t.dtype), []).append(t)
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for (device, dtype), group in buckets.items():
        norms = torch._foreach_norm(group, 2, dtype=torch.float32 if dtype in _LOW_PRECISION else None)
        flags.setdefault(device, []).append(torch.isfinite(torch.stack(norms)).all())
    return {d: f[0] if len(f) == 1 else torch.stack(f).all() for d, f in flags.items()}


def all_finite(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """A 0-dim bool tensor, True iff every tensor holds only finite values — computed on the device, never read back.

    Cost: one fused norm reduction per (device, dtype) bucket (``torch._foreach_norm``) and no host sync, so a step
    can be made conditional on it (``torch.where``) without waiting for the GPU. Sparse tensors are checked through
    their stored values; float16/bfloat16 norms are accumulated in float32. A finite tensor whose 2-norm overflows
    (float32: entries ≳ 1e19) counts as non-finite — a gradient that large is itself a divergence.

    Args:
        tensors: any floating dtype, any devices.
        device: where the flag lives (default: the first tensor's device; CPU for an empty list). Flags of other
            devices are copied there (a device-to-host copy, hence a sync, only when mixing a GPU with the CPU).

    Returns:
        0-dim bool tensor on ``device``.
    """
    dense = [t._values() if t.is_sparse else t for t in tensors]
    if device is None:
        device = dense[0].device if dense else torch.device("cpu")
    flag = torch.ones((), dtype=torch.bool, device=device)
    for d, f in _finite_flags(dense).items():
        flag = flag & (f if d == device else f.to(device, non_blocking=True))
    return flag


def first_nonfinite(tensors: Sequence[torch.Tensor],
                    cpu_scan: Callable[[torch.Tensor], bool] | None = None) -> int | None:
    """Index of a tensor holding a NaN or Inf — the first one, except that a tensor ``cpu_scan`` finds bad is returned
    at once, before earlier unscanned ones are looked at — or None when all are finite.

    The common case (all finite) costs ``all_finite``'s reduction (one ``torch._foreach_norm`` call over all tensors
    when they share device and dtype; sparse tensors through their stored values, float16/bfloat16 norms in float32)
    and one host sync per device. Only when a norm is not finite are the tensors scanned one by one to find the
    culprit (a huge but finite tensor can overflow its norm; the scan then finds nothing and None is returned).

    Args:
        tensors: gradients (any floating dtype, any devices).
        cpu_scan: optional exact test "holds a NaN/Inf" for contiguous CPU float32/float64 tensors, used for those
            instead of the norm (``MagnitudeDirection`` passes the C kernel's ``kernels.any_nonfinite``, 2.5× faster
            than a torch norm on CPU).

    Returns:
        The index into ``tensors`` of the first non-finite one, or None.
    """
    dense = [t._values() if t.is_sparse else t for t in tensors]
    rest = []
    for i, t in enumerate(dense):
        if not t.numel():
            continue
        if cpu_scan is not None and t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) \
                and t.is_contiguous() and type(t) is torch.Tensor:
            if cpu_scan(t):
                return i
            continue
        rest.append(t)
    if all(bool(f) for f in _finite_flags(rest).values()):  # one host sync per device
        return None
    for i, t in enumerate(dense):  # slow path, only on failure: locate the offending tensor
        if t.numel() and not bool(torch.isfinite(t).all()):
            return i
    return None


def momentum_step(M: torch.Tensor, G: torch.Tensor, beta: float, nesterov: bool = True, form: str = "ema"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The momentum stage out of place: (new buffer M', the vector U to orthogonalise); any leading dims (a stack of
    matrices steps at once).

    Forms (β = ``beta``):
        - ``"ema"`` (torch.optim.Muon): M' = βM + (1−β)G (``lerp``); Nesterov U = (1−β)G + βM', else U = M'.
        - ``"sum"`` (SGD form, the manifold-assignment paper's published code): M' = βM + G; Nesterov U = G + βM',
          else U = M'.
    Started from M = 0 the two buffers differ by the constant factor (1−β), so after a scale-invariant msign the
    directions are identical; the forms differ only in what the buffer stores (and hence in checkpoints).

    Returns:
        (M', U): new tensors (U is M' itself without Nesterov); M and G are not modified.
    """
    if form not in MOMENTUM_FORMS:
        raise ValueError(f"momentum_form: unknown value {form!r}; choose one of {MOMENTUM_FORMS}")
    if form == "ema":
        new = M.lerp(G, 1.0 - beta)
        return new, (G.lerp(new, beta) if nesterov else new)
    new = M.mul(beta).add_(G)
    return new, (G.add(new, alpha=beta) if nesterov else new)


def momentum_direction(
    buf: torch.Tensor, grad: torch.Tensor, beta: float, nesterov: bool = True, form: str = "ema",
    ok: torch.Tensor | None = None,
) -> torch.Tensor:
    """``momentum_step`` with the buffer updated in place: returns the vector U to orthogonalise.

    Args:
        buf: momentum buffer M, modified in place.
        grad: gradient G (same shape as ``buf``).
        beta: momentum coefficient in [0, 1).
        nesterov: use the Nesterov look-ahead.
        form: ``"ema"`` or ``"sum"`` (``momentum_step``).
        ok: optional 0-dim bool tensor (``all_finite``): the new M is written only where it is True
            (``torch.where``, so a NaN in G never reaches M when it is False); M's values are bitwise those of the
            unconditional update when True. The returned U is then always a new tensor (NaN when G is).

    Returns:
        U (a new tensor, or ``buf`` itself when not Nesterov and ``ok`` is None — do not modify it).
    """
    new, U = momentum_step(buf, grad, beta, nesterov, form)
    if ok is None:
        buf.copy_(new)
        return U if nesterov else buf
    buf.copy_(torch.where(ok, new, buf))
    return U


def shape_scale(shape: tuple[int, ...] | torch.Size, adjust_lr_fn: str | None = "original") -> float:
    """Multiplier s of the orthogonalised update so its size is consistent across shapes.

    Args:
        shape: parameter shape (..., rows, cols).
        adjust_lr_fn: ``"original"`` (Keller Jordan): s = sqrt(max(1, rows/cols)); ``"match_rms_adamw"``
            (Moonshot): s = 0.2·sqrt(max(rows, cols)), giving the update the RMS of a typical AdamW step;
            ``"none"``: s = 1 (the step has spectral norm exactly lr). ``None`` means ``"original"``.

    Returns:
        s (dimensionless).
    """
    rows, cols = int(shape[-2]), int(shape[-1])
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn == "none":
        return 1.0
    raise ValueError(f"adjust_lr_fn: unknown value {adjust_lr_fn!r}; choose one of {ADJUST_LR_FNS}")


def newton_schulz(G: torch.Tensor, coefficients: Sequence[float], steps: int, eps: float,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation: ``steps`` quintic steps X ← aX + (bS + cS²)X, S = XXᵀ, with one fixed
    (a, b, c), in torch's arithmetic and evaluation order — cast to ``dtype`` first (bf16 in torch), turned wide,
    divided by max(‖X‖_F, eps) computed in ``dtype``, each step two fused matrix multiply-adds, turned back. Batched
    over leading dims (one bmm per product; a 2-D input takes torch's own ``mm`` path, so it equals torch's
    ``_zeropower_via_newtonschulz`` bit for bit).

    Args:
        G: (..., m, n) input, m, n ≥ 1.
        coefficients: (a, b, c) (torch's default: Keller Jordan's (3.4445, -4.775, 2.0315); singular values end in
            roughly [0.7, 1.2], not at 1).
        steps: number of steps (≥ 1).
        eps: lower bound of the Frobenius norm divided by (a zero matrix stays zero).
        dtype: compute dtype.

    Returns:
        The result in G's dtype (the values of a ``dtype`` tensor).
    """
    a, b, c = (float(x) for x in coefficients)
    X = G.to(dtype)
    flat = X.reshape(-1, *X.shape[-2:]) if X.ndim > 3 else X
    tall = G.shape[-2] > G.shape[-1]
    if tall:
        flat = flat.mT
    norm = flat.norm(dim=(-2, -1), keepdim=True) if flat.ndim == 3 else flat.norm()
    flat = flat / norm.clamp(min=eps)
    addmm = torch.addmm if flat.ndim == 2 else torch.baddbmm
    for _ in range(int(steps)):
        gram = flat @ flat.mT
        update = addmm(gram, gram, gram, beta=b, alpha=c)
        flat = addmm(flat, update, flat, beta=a)
    if tall:
        flat = flat.mT
    return flat.reshape(G.shape).to(G.dtype)


def _times(x: torch.Tensor, c: float) -> torch.Tensor:
    """x·c rounded to x's dtype as the eager kernel rounds it (the product in float32 for bf16/fp16, then x's dtype).

    Inside ``torch.compile`` a scheduled c is a symbol that the trace may hold as a 0-dim float32 tensor, which a bf16
    kernel would round to bf16 first: low precision is therefore multiplied in float32 explicitly."""
    if not torch.compiler.is_compiling():
        return x.mul(c)
    return (x.float() * c).to(x.dtype) if x.dtype in _LOW_PRECISION else x * c


def _plus_times(x: torch.Tensor, y: torch.Tensor, c: float) -> torch.Tensor:
    """x + c·y (y in x's dtype) rounded as the eager ``x.add(y, alpha=c)`` rounds it on x's device: one fused
    multiply-add in float32 (x's dtype when wider), then x's dtype; for bf16/fp16 on the CPU with c itself rounded to
    x's dtype first, as torch's CPU kernel takes ``alpha`` (measured: 0 of 10⁶ bf16 sums differ from that model, 36 %
    from an unrounded c); on CUDA torch's kernel keeps c in float32 (``AddFunctor<opmath_t>``, from its source).

    Inside ``torch.compile`` ``alpha=`` would make Dynamo specialise c (a Scalar argument), so every new learning rate
    from a scheduler would compile the step again; the trace instead forms c·y + x in float64 — the product of two
    float32 values is exact there (24 + 24 bits), and the sum is exact unless x and c·y lie more than 5 binary orders
    apart — and rounds it to float32: the fused multiply-add's result except where rounding the float64 sum to float32
    meets a tie (measured: the compiled Muon steps equal the eager ones bit for bit, ``tests/test_compiled_step.py``).
    Devices without float64 (MPS) use float32 (a product, then a sum: ≤ 1 ulp of float32 apart)."""
    y = y.to(x.dtype)
    if not torch.compiler.is_compiling():
        return x.add(y, alpha=c)
    if x.dtype == torch.float64:
        return x + y * c
    if x.device.type == "mps":
        return (x.float() + y.float() * c).to(x.dtype)
    alpha = x.dtype if x.dtype in _LOW_PRECISION and x.device.type == "cpu" else torch.float32
    c_t = (torch.ones((), dtype=torch.float64, device=x.device) * c).to(alpha).double()  # a graph input, not a guard
    return (x.double() + y.double() * c_t).float().to(x.dtype)


def decoupled_step(param: torch.Tensor, direction: torch.Tensor, lr: float, scale: float,
                   weight_decay: float) -> torch.Tensor:
    """W·(1 − lr·wd) − lr·s·O out of place, rounded as the eager in-place ``mul_``/``add_(alpha=)`` round it (O is
    cast to W's dtype first). Inside ``torch.compile`` written so that a scheduled lr is a graph input rather than
    a constant (``_times``, ``_plus_times``): two graphs for any number of lr values, not one per value."""
    new = _times(param, 1.0 - lr * weight_decay) if weight_decay != 0.0 else param
    return _plus_times(new, direction, -lr * scale)


def apply_update(param: torch.Tensor, direction: torch.Tensor, lr: float, scale: float, weight_decay: float,
                 ok: torch.Tensor | None = None) -> None:
    """W ← W·(1 − lr·wd) − lr·s·O, in place (decoupled weight decay, then the step).

    Args:
        param: W, modified in place.
        direction: O (unit spectral norm for Muon), same shape as W; cast to W's dtype.
        lr: learning rate (spectral-norm units per step for Muon).
        scale: shape scale s from ``shape_scale``.
        weight_decay: decoupled decay coefficient (multiplied by lr).
        ok: optional 0-dim bool tensor: W is written only where it is True (``torch.where``: W stays bitwise
            unchanged when False, whatever O holds; bitwise the unconditional result when True).
    """
    if ok is None and not torch.compiler.is_compiling():
        if weight_decay != 0.0:
            param.mul_(1.0 - lr * weight_decay)
        param.add_(direction.to(param.dtype), alpha=-lr * scale)
        return
    new = decoupled_step(param, direction, lr, scale, weight_decay)
    param.copy_(new if ok is None else torch.where(ok, new, param))


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int | torch.Tensor,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    ok: torch.Tensor | None = None,
) -> None:
    """One AdamW step in place (Loshchilov & Hutter; same arithmetic as torch.optim.AdamW, bias-corrected).

    Args:
        param: parameter, modified in place.
        grad: its gradient.
        exp_avg, exp_avg_sq: first and second moment buffers, modified in place.
        step: 1-based step count after this update (for bias correction): a Python int, or a 0-dim tensor (as
            ``Muon`` keeps it, on the parameter's device), whose bias corrections are then computed on the device
            in float64 (float32 where the device has no float64) — never read back to the host.
        lr: learning rate (parameter units per step, as in AdamW).
        betas: (β1, β2).
        eps: added to sqrt(v̂).
        weight_decay: decoupled decay coefficient (multiplied by lr).
        ok: optional 0-dim bool tensor: parameter and moments are written only where it is True (``torch.where``:
            bitwise unchanged when False, whatever ``grad`` holds). The caller advances ``step`` by ``ok``.
    """
    beta1, beta2 = betas
    if torch.is_tensor(step):
        t = step.to(torch.float32 if step.device.type == "mps" else torch.float64)
        bc1 = 1.0 - torch.pow(beta1, t)
        neg_step_size = (-lr / bc1).to(param.dtype)
        inv_bc2_sqrt = (1.0 - torch.pow(beta2, t)).rsqrt().to(param.dtype)
    else:
        bc1 = 1.0 - beta1**step
        bc2 = 1.0 - beta2**step
    keep = 1.0 - lr * weight_decay
    if ok is None:
        if weight_decay != 0.0 and torch.compiler.is_compiling():
            param.copy_(_times(param, keep))
        elif weight_decay != 0.0:
            param.mul_(keep)
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        m, v, p = exp_avg, exp_avg_sq, param
    else:
        m = exp_avg.lerp(grad, 1.0 - beta1)
        v = exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        p = _times(param, keep) if weight_decay != 0.0 else param.clone()
    if torch.is_tensor(step):
        denom = (v.sqrt() * inv_bc2_sqrt).add_(eps)
        p.add_(m / denom * neg_step_size)
    else:
        denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bc1)
    if ok is not None:
        exp_avg.copy_(torch.where(ok, m, exp_avg))
        exp_avg_sq.copy_(torch.where(ok, v, exp_avg_sq))
        param.copy_(torch.where(ok, p, param))
