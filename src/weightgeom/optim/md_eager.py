"""The eager step of ``MagnitudeDirection`` on plain tensors (the module docstring of ``magnitude_direction``, steps
1–6): split each gradient into the gains' gradients and Ĝ, the base's step of the directions (swapped in around it),
the gains' Adam, the directions back on their spheres and W = γ_r Ŵ γ_c written into the model's tensors. Matrices on
the fused path (``md_fused``) take their whole step in C; the others run their passes in C where the kernels load
(``kernels.md_split``/``md_finish``: "eager-C") or in torch ("eager").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from weightgeom import kernels
from weightgeom.optim import md_fused, md_torch
from weightgeom.optim.md_functional import (
    adam_update_many_,
    compose,
    gain_chain,
    gain_chain_log,
    project_to_sphere_,
    split_gradient,
    split_gradient_log,
)

if TYPE_CHECKING:  # pragma: no cover
    from weightgeom.optim.magnitude_direction import MagnitudeDirection

__all__ = ["vector", "elementwise_many", "prepare", "kernel_passes", "pend_gain_grads", "base_step", "update_gains",
           "finish"]


def vector(gain: torch.Tensor | None, k: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A gain of ``gain_values`` as a contiguous vector of k entries in ``dtype`` (a scalar gain repeated)."""
    if gain is None:
        return None
    g = gain.to(dtype).reshape(-1)
    return (g.expand(k) if g.numel() == 1 else g).contiguous()


_BATCH_ON_CPU = False  # tests set it to run the batched (GPU) path of elementwise_many on the CPU


def elementwise_many(fn: Callable[..., torch.Tensor], firsts: list[torch.Tensor],
                      seconds: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """``[fn(a) for a in firsts]`` (or ``fn(a, b)`` pairwise) for an elementwise ``fn``; off the CPU, tensors of one
    device and dtype go through ``fn`` as one concatenated vector (a few kernels instead of a few per tensor: the
    gains' maps are launch-bound on a GPU, two small vectors per matrix). The CPU keeps one call per tensor (its
    vectorised kernels may round a vector's tail differently from its body, and launches cost little there)."""
    out: list[torch.Tensor | None] = [None] * len(firsts)
    groups: dict[tuple, list[int]] = {}
    for i, a in enumerate(firsts):
        groups.setdefault((a.device, a.dtype), []).append(i)
    for (dev, _dtype), idx in groups.items():
        if (dev.type == "cpu" and not _BATCH_ON_CPU) or len(idx) == 1:
            for i in idx:
                out[i] = fn(firsts[i]) if seconds is None else fn(firsts[i], seconds[i])
            continue
        flat_a = torch.cat([firsts[i].reshape(-1) for i in idx])
        res = fn(flat_a) if seconds is None else fn(flat_a, torch.cat([seconds[i].reshape(-1) for i in idx]))
        for i, piece in zip(idx, res.split([firsts[i].numel() for i in idx])):
            out[i] = piece.view(firsts[i].shape)
    return out  # type: ignore[return-value]


def prepare(md: MagnitudeDirection, plan: list[tuple], work: list[list]) -> None:
    """Steps 1–2: adopt re-derived directions, split G into gain gradients (on θ.grad) and Ĝ; fill ``work``.

    Matrices on the fused path (``md_fused``) also take their base Adam step here, in the same pass.
    """
    md._stepped = set()  # gains already stepped on the fused path
    for p, _G, _group, _why, resync in plan:
        md._adopt(p, resync)
    gains = md._gain_values_many([p for p, _G, _group, why, _r in plan if why is not None])
    pending: list[tuple] = []  # (θ, ∂L/∂γ or the log-gain sum, chain): θ.grad set together after the loop
    for p, G, group, why, _resync in plan:
        st = md.state[p]
        D = st["direction"]
        s = md._scale_for(p, group)
        # p, W, G, Ŵ, what the base steps, its gradient, True once stepped on the fused path (else None),
        # whether the eager passes run in C (``_kernel_passes``)
        item = [p, p.data, G, D, None, None, None, False]
        work.append(item)
        if why is None:
            md_fused.step(md.base_optimizer, group, p, G, st, md.state, md._gain_groups[0],
                          md.parameterization, md.sphere)
            item[6] = True
            md._path[p] = "fused"
            for key in ("gain_row", "gain_col"):
                if key in st:
                    md._stepped.add(st[key])
            continue
        ckernel = md.fused is None and s is None and kernel_passes(md, p, G, D, st)
        item[7] = ckernel
        md._path[p] = f"{'eager-C' if ckernel else 'eager'} ({why})"
        gr, gc = gains[id(p)]
        up = md_torch.ascends(group)  # a maximize group: the gains ascend with its direction
        if gr is None and gc is None:
            Gd = G  # W = Ŵ: the base sees the model's gradient itself
        else:
            buf = md._buffers.get(p)
            if buf is None:
                # row-major whatever G's layout: a later step's G may differ, and the C pass needs a plain buffer
                buf = md._buffers[p] = torch.empty_like(G, memory_format=torch.contiguous_format)
            if ckernel:  # Ĝ and the log-gain sums in one C pass
                m, n = D.shape
                s_r, s_c = kernels.md_split(G, D, vector(gr, m, D.dtype), vector(gc, n, D.dtype), buf,
                                            gr is not None, gc is not None)
                if s_r is not None and gr.numel() == 1:  # one scalar row gain: the sum over every entry
                    s_r = s_r.sum().reshape(1)
                pend_gain_grads(pending, st, s_r, s_c, gain_chain_log, up)
                Gd = buf
            elif md.parameterization != "direct":  # W's storage is scratch until it is recomposed
                g_row, g_col, Gd = split_gradient_log(G, D, gr, gc, out=buf, scratch=item[1])
                pend_gain_grads(pending, st, g_row, g_col, gain_chain_log, up)
            else:
                g_row, g_col, Gd = split_gradient(G, D, gr, gc, out=buf)
                pend_gain_grads(pending, st, g_row, g_col, gain_chain, up)
        target = D
        if s is not None:  # norm-fixing manifold: the base steps Q = Ŵ/s with ∂L/∂Q = s·Ĝ
            target = D / s.to(D.dtype)
            Gd = Gd * s.to(Gd.dtype)
        item[4], item[5] = target, Gd
    for chain in dict.fromkeys(c for _t, _g, c in pending):  # one chain per parameterization, in order
        part = [(t, g) for t, g, c in pending if c is chain]
        grads = elementwise_many(lambda th, g, chain=chain: chain(th, g, md.parameterization),
                                  [t for t, _ in part], [g for _, g in part])
        for (theta, _), grad in zip(part, grads):
            theta.grad = grad
    md._fresh = {id(theta) for theta, _g, _c in pending}

def kernel_passes(md: MagnitudeDirection, p: torch.Tensor, G: torch.Tensor, D: torch.Tensor, st: dict) -> bool:
    """Whether this eager matrix's MD passes can run in C (``kernels.md_split``/``md_finish``): plain contiguous
    CPU float32/float64 tensors of one dtype (W, G, Ŵ, the radius, the Ĝ buffer), not empty, softplus/exp gains,
    and the kernel loads — checked before anything changes, so the kernels cannot refuse after the base step."""
    if md.parameterization not in ("softplus", "exp") or md_fused.kernel_missing() is not None:
        return False
    ts = (p.data, G, D, st["radius"], md._buffers.get(p, D))
    return all(type(t) is torch.Tensor and t.device.type == "cpu" and t.dtype == D.dtype and t.is_contiguous()
               for t in ts) and D.dtype in (torch.float32, torch.float64) and D.ndim == 2 and D.numel() > 0

def pend_gain_grads(pending: list[tuple], st: dict, g_row: torch.Tensor | None, g_col: torch.Tensor | None,
                     chain, ascend: bool) -> None:
    """Queue the gains' gradients (θ.grad is set from them after the loop); ``ascend`` (a maximize group):
    negated, so that the gains' Adam ascends (the chain rule is linear in them)."""
    for key, g in (("gain_row", g_row), ("gain_col", g_col)):
        if g is not None:
            theta = st[key]
            g = g.reshape(theta.shape).to(theta.dtype)
            pending.append((theta, g.neg() if ascend else g, chain))

def base_step(md: MagnitudeDirection, work: list[list]) -> None:
    """Step 3: the base optimizer steps Ŵ with Ĝ (``.data``/``.grad`` swapped around its step); matrices already
    stepped on the fused path have their ``.grad`` hidden from it."""
    try:
        for p, _W, _G, _D, target, Gd, fused, _c in work:
            if fused is None:
                p.data = target
            p.grad = Gd
        md_torch.step_base(md.base_optimizer)  # the global step hooks fire around MD's step only
    finally:
        for item in work:
            p, W, G = item[0], item[1], item[2]
            if item[6] is None:
                item[4] = p.data  # what the base left (it may have rebound .data instead of writing in place)
            p.data = W
            p.grad = G

def update_gains(md: MagnitudeDirection) -> None:
    """Step 5: Adam on every θ whose matrix gave it a gradient in this step, batched per (device, dtype, step
    count). A θ.grad left from an earlier step (its matrix has no gradient now, e.g. after ``model.zero_grad()``
    instead of this optimizer's) is not stepped: the gains would move while W is not recomposed."""
    group = md._gain_groups[0]
    batches: dict[tuple, list[torch.Tensor]] = {}
    for theta in group["params"]:
        if theta.grad is None or theta in md._stepped or id(theta) not in md._fresh:
            continue
        gst = md_fused.gain_adam_state(md.state, theta)
        gst["step"] += 1
        batches.setdefault((theta.device, theta.dtype, int(gst["step"])), []).append(theta)
    for (_dev, _dtype, step), thetas in batches.items():
        # the gradient the gains step with, as the C kernel writes it back (θ.grad too): clamped, and a NaN —
        # only products of both signs past the dtype's range make one (|Ŵ| > 1 times a saturated Ĝ; NaN
        # gradients were refused) — counts as 0, so that gain does not move
        states = [md.state[t] for t in thetas]
        adam_update_many_(thetas, [t.grad for t in thetas], [st["exp_avg"] for st in states],
                          [st["exp_avg_sq"] for st in states], step, group["lr"], group["betas"], group["eps"])

def finish(md: MagnitudeDirection, work: list[list]) -> None:
    """Steps 4 and 6: Ŵ back on its sphere; W = γ_r Ŵ γ_c written into the model's tensor."""
    group_of = {id(q): g for g in md.base_optimizer.param_groups for q in g["params"]}
    gains = md._gain_values_many([item[0] for item in work if item[6] is None])
    for p, _W, _G, D, new, _Gd, fused, ckernel in work:
        st = md.state[p]
        if fused is not None:  # already recomposed by the fused step
            md._versions[p] = p._version
            continue
        s = md._scale_for(p, group_of[id(p)])
        if s is not None:
            torch.mul(new, s.to(new.dtype), out=D)
        elif new.data_ptr() != D.data_ptr():
            D.copy_(new)
        if ckernel:  # sphere and recomposition in two C passes
            m, n = D.shape
            gr, gc = gains[id(p)]
            kernels.md_finish(D, p.detach(), md.sphere, st["radius"], vector(gr, m, D.dtype),
                              vector(gc, n, D.dtype))
            torch.autograd.graph.increment_version(p)  # written through a pointer: as an in-place op would
        else:
            project_to_sphere_(D, st["radius"], md.sphere)
            compose(D, *gains[id(p)], out=p)
        md._versions[p] = p._version
