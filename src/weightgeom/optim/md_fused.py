"""The fused CPU path of ``MagnitudeDirection`` over ``torch.optim.Adam``/``AdamW``: two memory passes per matrix.

Eager MD over Adam costs the base step plus about nine passes over each matrix (Ĝ, Ŵ⊙Ĝ, two reductions, the sphere
norm and rescale, a two-factor recomposition). When the base is torch's Adam or AdamW, the wrapper can instead run
the *same maths* in one C call per matrix (``weightgeom.kernels.md_adam_step``), two passes over memory:

1. Ĝ = γ_r G γ_c, the gain-gradient sums of Ŵ⊙Ĝ, the Adam(W) step of Ŵ with Ĝ — reading the base optimizer's own
   ``exp_avg``/``exp_avg_sq``/``step`` state and its group's ``lr``, ``betas``, ``eps``, ``weight_decay`` — and the
   squared norms of the new Ŵ;
2. after the gains' Adam step (vectors only): Ŵ back on its sphere and W = γ_r Ŵ γ_c written into the model's tensor.

The base optimizer's state stays where it was (``base_optimizer.state[p]``, torch's keys and dtypes), so a checkpoint
moves freely between the fused and the eager path, and LR schedulers work unchanged. The parameter's ``.grad`` is
hidden from ``base.step()`` so that torch does not step it a second time. Anything the kernel does not cover (another
base optimizer, amsgrad, maximize, capturable, differentiable, CUDA, bfloat16, ``direct`` gains, a manifold group)
takes the eager path; ``fusable`` says why.

This module is the C backend of ``md_core``'s passes (``adam_pass``, ``split_pass``, ``finish_pass``); the torch
backend is ``md_core``'s batched functions, which the float64 reference and the equivalence test
(tests/test_md_fused.py) hold it to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from weightgeom import kernels
from weightgeom.optim.md_state import GAIN_KEYS

if TYPE_CHECKING:  # pragma: no cover
    from weightgeom.optim.magnitude_direction import MagnitudeDirection
    from weightgeom.optim.md_core import Bucket

try:  # the dtype torch's Adam gives state["step"] (private helper; float32 unless the default dtype is float64)
    from torch.optim.optimizer import _get_scalar_dtype
except ImportError:  # pragma: no cover - older/newer torch without the helper
    def _get_scalar_dtype(is_fused: bool | None = None) -> torch.dtype:
        return torch.float64 if torch.get_default_dtype() == torch.float64 and not is_fused else torch.float32

_BASES = (torch.optim.Adam, torch.optim.AdamW)  # exact types: a subclass may change the step


def base_fusable(base: torch.optim.Optimizer) -> str | None:
    """None if the base optimizer's step is one the fused kernel reproduces; else why not."""
    if type(base) not in _BASES:
        return f"the base optimizer is {type(base).__name__}, the fused path covers torch.optim.Adam and AdamW"
    return None


def fusable(base: torch.optim.Optimizer, group: dict, p: torch.Tensor, G: torch.Tensor, gains: str,
            parameterization: str, scaled: bool, kernels_on: bool | None = None) -> str | None:
    """None if this decoupled matrix can take the fused path this step; else the reason (one line).

    Args:
        base: the base optimizer; group: p's group in it; p: the model's W; G: its gradient.
        gains, parameterization: the wrapper's options.
        scaled: whether the group's manifold fixes ‖Ŵ‖ (the base then steps Ŵ/s — eager only).
        kernels_on: whether the C kernels are in use (resolved once, when the wrapper was built); None: whether they
            load now.
    """
    why = base_fusable(base)
    if why:
        return why
    for key in ("amsgrad", "maximize", "capturable", "differentiable"):
        if group.get(key):
            return f"the base group has {key}=True"
    if scaled:
        return "the base group has a norm-fixing manifold"
    if gains != "none" and parameterization not in ("softplus", "exp"):
        return f"parameterization {parameterization!r} (the kernel computes log-gain gradients)"
    if type(p.data) is not torch.Tensor or type(G) is not torch.Tensor:
        return f"the parameter or its gradient is a {type(p.data).__name__}/{type(G).__name__} (sharded or subclass)"
    if p.device.type != "cpu":
        return f"the parameter is on {p.device.type} (the kernel is CPU-only)"
    if p.dtype not in (torch.float32, torch.float64):
        return f"dtype {p.dtype} (the kernel covers float32 and float64)"
    if G.dtype != p.dtype or not G.is_contiguous() or not p.is_contiguous():
        return "the parameter or its gradient is not contiguous or differs in dtype"
    st = base.state.get(p)
    if st and ("max_exp_avg_sq" in st or any(
            st.get(k) is None or st[k].dtype != p.dtype or not st[k].is_contiguous()
            for k in ("exp_avg", "exp_avg_sq"))):
        return "the base optimizer's state for it is not plain contiguous Adam moments"
    return kernel_missing() if kernels_on is None or not kernels_on else None


def kernel_missing() -> str | None:
    """None if the C kernel is built and loaded; else why not (one line)."""
    if kernels.load_kernel("md_adam") is None:
        return f"the C kernel is unavailable: {kernels.unavailable_reason('md_adam')}"
    return None


def adam_state(base: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> dict:
    """``base.state[p]``, initialised exactly as torch's Adam does on its first step."""
    st = base.state[p]
    if len(st) == 0:
        fused = bool(group.get("fused"))
        st["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=True), device=p.device) if fused
                      else torch.tensor(0.0, dtype=_get_scalar_dtype()))
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st


def _f(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def gain_adam_state(state: dict, theta: torch.Tensor) -> dict:
    """The wrapper's Adam state of a gain θ (``state[θ]``), initialised on first use (both paths use this)."""
    gst = state[theta]
    if not gst:
        gst["step"] = torch.zeros((), dtype=torch.float32)
        gst["exp_avg"] = torch.zeros_like(theta)
        gst["exp_avg_sq"] = torch.zeros_like(theta)
    return gst


def vector(gain: torch.Tensor | None, k: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A gain γ as a contiguous vector of k entries in ``dtype`` (a scalar gain repeated), as the kernels take it."""
    if gain is None:
        return None
    g = gain.to(dtype).reshape(-1)
    return (g.expand(k) if g.numel() == 1 else g).contiguous()


def kernel_passes(md: MagnitudeDirection, p: torch.Tensor, G: torch.Tensor) -> bool:
    """Whether this matrix's passes around a base step can run in C (``split_pass``/``finish_pass``): plain
    contiguous CPU float32/float64 tensors of one dtype (W, G, Ŵ, the radius, the Ĝ buffer), not empty,
    softplus/exp gains — checked before anything changes, so the kernels cannot refuse after the base step. The
    caller checks that the kernels are in use."""
    st = md.state[p]
    D = st["direction"]
    if md.parameterization not in ("softplus", "exp"):
        return False
    ts = (p.data, G, D, st["radius"], md._buffers.get(p, D))
    return all(type(t) is torch.Tensor and t.device.type == "cpu" and t.dtype == D.dtype and t.is_contiguous()
               for t in ts) and D.dtype in (torch.float32, torch.float64) and D.ndim == 2 and D.numel() > 0


def adam_pass(md: MagnitudeDirection, b: Bucket) -> None:
    """C backend of the whole step over torch's Adam/AdamW (module docstring): per matrix two C passes
    (``md_adam_step``) update, in place, Ŵ and its base Adam state (``adam_state``; the group's ``lr``, ``betas``,
    ``eps``, ``weight_decay``), the gains θ and their Adam state (``gain_adam_state``; the gains group's
    hyperparameters; θ.grad left as ∂L/∂θ) and the model's W; both step counters advanced."""
    base, group, gain_group = md.base_optimizer, b.group, md._gain_groups[0]
    lr, eps, wd = _f(group["lr"]), _f(group["eps"]), _f(group.get("weight_decay", 0.0))
    b1, b2 = (_f(x) for x in group["betas"])
    gb1, gb2 = (_f(x) for x in gain_group["betas"])
    decoupled = isinstance(base, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))
    for p, G, md_state in zip(b.ps, b.grads, b.states):
        st = adam_state(base, group, p)
        st["step"] += 1
        t = _f(st["step"])
        gains = []
        for key in GAIN_KEYS:
            theta = md_state.get(key)
            if theta is None:
                gains.append(None)
                continue
            gst = gain_adam_state(md.state, theta)
            gst["step"] += 1
            if theta.grad is None or theta.grad.shape != theta.shape or not theta.grad.is_contiguous():
                theta.grad = torch.empty_like(theta)  # ∂L/∂θ, written by the kernel (as the eager path leaves it)
            gains.append((theta, gst["exp_avg"], gst["exp_avg_sq"], _f(gst["step"]), theta.grad))
        kernels.md_adam_step(
            G, md_state["direction"], p.detach(), st["exp_avg"], st["exp_avg_sq"], beta1=b1, beta2=b2,
            step_size=lr / (1 - b1**t), bc2_sqrt=(1 - b2**t) ** 0.5, eps=eps,
            decay=1 - lr * wd if decoupled else 1.0, l2=0.0 if decoupled else wd,
            gain_row=gains[0], gain_col=gains[1], parameterization=md.parameterization, gain_lr=_f(gain_group["lr"]),
            gain_betas=(gb1, gb2), gain_eps=_f(gain_group["eps"]), sphere=md.sphere, radius=md_state["radius"])
        # the C code wrote W through its pointer: bump its version as an in-place torch op would, so that autograd
        # still refuses a backward through a graph that saved the old W
        torch.autograd.graph.increment_version(p)


def kept_buffer(md: MagnitudeDirection, p: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """p's kept Ĝ buffer (``md._buffers``, shared by both backends): row-major whatever G's layout (a later step's G
    may differ), shaped like G, made at first use and again when G's shape, dtype or device changes."""
    buf = md._buffers.get(p)
    if buf is None or buf.shape != G.shape or buf.dtype != G.dtype or buf.device != G.device:
        buf = md._buffers[p] = torch.empty(G.shape, dtype=G.dtype, device=G.device)
    return buf


def split_pass(md: MagnitudeDirection, b: Bucket) -> dict[str, list[torch.Tensor]]:
    """C backend of step 2 (``md_split``, one pass per matrix): Ĝ into a kept buffer and the log-gain sums; sets
    ``b.target`` (Ŵ, stepped in place by the base) and ``b.Gd``; returns the sums per gain key, one per matrix (for
    ``md_core.gain_grads``)."""
    sums: dict[str, list[torch.Tensor]] = {k: [] for k in b.keys}
    b.target, b.Gd = [], []
    for p, G, st in zip(b.ps, b.grads, b.states):
        D = st["direction"]
        gr, gc = md.gain_values(p)
        Gd = G
        if gr is not None or gc is not None:
            buf = kept_buffer(md, p, G)
            m, n = D.shape
            s_r, s_c = kernels.md_split(G, D, vector(gr, m, D.dtype), vector(gc, n, D.dtype), buf,
                                        gr is not None, gc is not None)
            if s_r is not None and gr.numel() == 1:  # one scalar row gain: the sum over every entry
                s_r = s_r.sum().reshape(1)
            for k, s in (("gain_row", s_r), ("gain_col", s_c)):
                if s is not None:
                    sums[k].append(s)
            Gd = buf
        b.target.append(D)
        b.Gd.append(Gd)
    return sums


def finish_pass(md: MagnitudeDirection, b: Bucket) -> None:
    """C backend of steps 4 and 6 (``md_finish``, two passes per matrix): what the base left copied into Ŵ, Ŵ back
    on its sphere, W = γ_r Ŵ γ_c with the new gains."""
    for p, new, st in zip(b.ps, b.target, b.states):
        D = st["direction"]
        if new.data_ptr() != D.data_ptr():
            D.copy_(new)
        m, n = D.shape
        gr, gc = md.gain_values(p)
        kernels.md_finish(D, p.detach(), md.sphere, st["radius"], vector(gr, m, D.dtype), vector(gc, n, D.dtype))
        torch.autograd.graph.increment_version(p)  # written through a pointer: as an in-place op would
