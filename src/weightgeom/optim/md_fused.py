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
"""

from __future__ import annotations

import torch

from weightgeom import kernels

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
            parameterization: str, scaled: bool) -> str | None:
    """None if this decoupled matrix can take the fused path this step; else the reason (one line).

    Args:
        base: the base optimizer; group: p's group in it; p: the model's W; G: its gradient.
        gains, parameterization: the wrapper's options.
        scaled: whether the group's manifold fixes ‖Ŵ‖ (the base then steps Ŵ/s — eager only).
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
    return kernel_missing()


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


def step(base: torch.optim.Optimizer, group: dict, p: torch.Tensor, G: torch.Tensor, md_state: dict,
         gain_state: dict, gain_group: dict, parameterization: str, sphere: str) -> None:
    """The whole MD step of one matrix on the fused path (module docstring): Ŵ, its base Adam state, the gains and
    their Adam state, and the model's W, all updated in place; both step counters advanced.

    Args:
        base, group: the base optimizer and p's group in it (its ``lr``, ``betas``, ``eps``, ``weight_decay``).
        p: the model's W; G: its gradient.
        md_state: the wrapper's ``state[p]`` (``direction``, ``radius``, ``gain_row``/``gain_col``).
        gain_state: the wrapper's ``state`` (per gain θ: its Adam moments); gain_group: the gains' param group.
        parameterization, sphere: the wrapper's options.
    """
    st = adam_state(base, group, p)
    st["step"] += 1
    t = _f(st["step"])
    lr, eps, wd = _f(group["lr"]), _f(group["eps"]), _f(group.get("weight_decay", 0.0))
    b1, b2 = (_f(b) for b in group["betas"])
    decoupled = isinstance(base, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))
    gains = []
    for key in ("gain_row", "gain_col"):
        theta = md_state.get(key)
        if theta is None:
            gains.append(None)
            continue
        gst = gain_adam_state(gain_state, theta)
        gst["step"] += 1
        if theta.grad is None or theta.grad.shape != theta.shape or not theta.grad.is_contiguous():
            theta.grad = torch.empty_like(theta)  # ∂L/∂θ, written by the kernel (as the eager path leaves it)
        gains.append((theta, gst["exp_avg"], gst["exp_avg_sq"], _f(gst["step"]), theta.grad))
    gb1, gb2 = (_f(b) for b in gain_group["betas"])
    kernels.md_adam_step(
        G, md_state["direction"], p.detach(), st["exp_avg"], st["exp_avg_sq"], beta1=b1, beta2=b2,
        step_size=lr / (1 - b1**t), bc2_sqrt=(1 - b2**t) ** 0.5, eps=eps,
        decay=1 - lr * wd if decoupled else 1.0, l2=0.0 if decoupled else wd,
        gain_row=gains[0], gain_col=gains[1], parameterization=parameterization, gain_lr=_f(gain_group["lr"]),
        gain_betas=(gb1, gb2), gain_eps=_f(gain_group["eps"]), sphere=sphere, radius=md_state["radius"])
    # the C code wrote W through its pointer: bump its version as an in-place torch op would, so that autograd still
    # refuses a backward through a graph that saved the old W
    torch.autograd.graph.increment_version(p)
