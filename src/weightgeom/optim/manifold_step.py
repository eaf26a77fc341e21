"""A manifold-Muon parameter group's step, eager and host-free alike (docs/muon.md §6).

``group_step`` sorts a group's matrices into buckets (same stored shape, dtype, device and state keys: a bucket is
one stacked batch whose state is passed in and written back, so a trace serves exactly the parameters it was traced
for) and ``bucket_step`` steps each: momentum → tall working copy → the dual-ascent core
(``manifold_muon.dual_ascent``, one call per bucket) → update → retraction → write-back of parameters and dual state.

What only the eager step does wraps that sequence and does not fork its maths: a matrix's first retraction onto the
manifold one matrix at a time with the far-retraction warning (``first_retraction``), the dual ascent's loop ending
once every matrix has stopped, per-matrix stats as Python floats (one host read per bucket), in-place updates of a
parameter whose tall view is row-major (no working copy), the constraint products the device chose
(``Muon._products_for``). The host-free step (``host_free=True``: what ``torch.compile(opt.step)`` traces) reads
nothing on the host, takes a constant number of operations per bucket, masks every write with ``ok``
(``on_nonfinite="skip"``) and retracts by the manifold's ``retract_host_free``. The manifold's maths (retraction,
projection, P) are its own methods: nothing here asks which manifold it is.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from weightgeom.linalg import MSIGN_PRESETS, msign
from weightgeom.linalg import layout as linalg_layout
from weightgeom.manifolds import Manifold
from weightgeom.optim.functional import apply_update, shape_scale
from weightgeom.optim.manifold_muon import dual_ascent
from weightgeom.optim.muon_checks import FAR_RETRACTION, looks_fresh
from weightgeom.optim.muon_layout import (
    DUAL_STATE,
    dual_shape,
    from_tall,
    matrices,
    retract,
    retraction_distance,
    tall_batch,
)

__all__ = ["group_step", "bucket_step", "msign_fns", "first_retraction", "host_free_supported", "BATCH_DEVICES"]

# Device types on which an eager step batches a manifold group's same-shape matrices (``group_step``; the host-free
# step always does). Not the CPU: there the stacking copies and batched products made the step slower (4 GPT-2-small
# layers, 16 matrices, on the 2-core AMX Xeon: Stiefel 1.77 s batched vs 1.57 s one at a time, DGram 1.91 vs
# 1.64 s); on a GPU batching replaces per-matrix kernel launches and host reads by one per bucket.
BATCH_DEVICES = ("cuda",)

Entries = list[tuple[str, torch.Tensor]]


def host_free_supported(manifold: Manifold) -> bool:
    """Whether ``manifold``, as configured, has a host-free retraction (``Manifold.host_free_retraction``; else a
    compiled step runs its group eagerly).

    Raises:
        TypeError: the manifold's class does not implement ``retract_host_free`` at all (one line naming it).
    """
    if type(manifold).retract_host_free is Manifold.retract_host_free:
        raise TypeError(f"Muon: manifold {manifold.name!r} ({type(manifold).__name__}) does not implement "
                        "retract_host_free(X, far), which a compiled or host-free step needs: implement it, or step "
                        "this group eagerly (no compile_step, host_free=False)")
    return manifold.host_free_retraction()


def group_step(opt: Any, group: dict[str, Any], entries: Entries, ok: torch.Tensor | None = None,
               host_free: bool = False) -> None:
    """Step a manifold group's matrices ``entries`` ((name, parameter) with gradients) of the ``Muon`` ``opt``.

    Buckets: same stored shape, dtype and device, and the same state keys. Eagerly a matrix at its first step, or on
    a device outside ``BATCH_DEVICES``, is a bucket of its own. ``ok``: host-free only (0-dim bool tensor, every
    write masked by it)."""
    manifold = opt._manifold(group)
    buckets: dict[tuple[Any, ...], Entries] = {}
    for name, p in entries:
        st = opt.state[p]
        alone = not host_free and ("momentum_buffer" not in st or p.device.type not in BATCH_DEVICES)
        key = (name,) if alone else (tuple(p.shape), p.dtype, p.device,
                                     *(k in st for k in ("momentum_buffer", *DUAL_STATE)))
        buckets.setdefault(key, []).append((name, p))
    for bucket in buckets.values():
        bucket_step(opt, group, manifold, bucket, ok, host_free)


def msign_fns(opt: Any, group: dict[str, Any], X32: torch.Tensor) -> tuple[Any, Any, bool, torch.dtype]:
    """(inner msign, final msign or None, whether the final one continues the inner, compute dtype) of a manifold
    group: the per-device choice where the group leaves it (dual_project), float32/float64 otherwise."""
    steps, dtype = opt._msign_settings(group, X32)  # the per-device choice where the group leaves it
    if dtype is None or not group["dual_project"] and group["msign_dtype"] is None:
        dtype = torch.float64 if X32.dtype == torch.float64 else torch.float32
    ms = partial(msign, method=group["msign_method"], dtype=dtype)
    inner, final, continues = partial(ms, steps=steps), None, False
    if group["dual_ns_steps"] is not None:
        k = int(group["dual_ns_steps"])
        inner, final = partial(ms, steps=k), inner
        preset = MSIGN_PRESETS.get(group["msign_method"])
        n_final = steps if steps is not None else (preset.steps if preset else 0)
        if preset is not None and k < n_final:  # the accurate msign continues the inner one from step k
            final, continues = partial(ms, steps=n_final, start_step=k), True
    return inner, final, continues, dtype


def first_retraction(opt: Any, group: dict[str, Any], manifold: Manifold, name: str, X: torch.Tensor) -> None:
    """Eager: retract parameter ``name``'s tall matrix (or blocks) X onto the manifold at its first step, in place,
    and record a far retraction of a matrix that does not look freshly initialised (``init="retract"``: the
    optimizer warns once). ``Manifold.retract_far``: to rounding level from a far start."""
    R = manifold.retract_far(X)
    dist = retraction_distance(X, R)
    if dist > FAR_RETRACTION and group["init"] == "retract" and not looks_fresh(X):
        opt._far_retractions[name] = (dist, manifold.name)
    X.copy_(R)


def bucket_step(opt: Any, group: dict[str, Any], manifold: Manifold, entries: Entries,
                ok: torch.Tensor | None = None, host_free: bool = False) -> None:
    """One bucket of ``group_step``: its matrices stacked as tall (B·k, m, n), one ``dual_ascent`` call, the update
    and the retraction on the stack, parameters and dual state written back (one ``_foreach_copy_`` each when
    host-free: a constant number of operations whatever B)."""
    layout, split, retracts = group["layout"], group["split"], group["init"] in ("retract", "auto")
    ps = [p for _, p in entries]
    states = [opt.state[p] for p in ps]
    first = "momentum_buffer" not in states[0]  # host-side: no step counter is read (a bucket shares its state keys)
    if host_free:
        U = opt._stacked_momentum(group, ps, ok)
    else:
        Us = [opt._momentum(group, p) for p in ps]
        U = Us[0][None] if len(ps) == 1 else torch.stack(Us)
    P = torch.stack([p.detach() for p in ps]) if host_free or len(ps) > 1 else ps[0].detach()[None]
    V, flip = tall_batch(P, layout, split)  # (B, [k,] m, n) tall views
    m, n = V.shape[-2:]
    # The step runs on row-major tall matrices: eagerly the parameter itself when its tall view is one, else (a wide
    # or an in_out matrix; a batch; the host-free step) a row-major copy written back once at the end — on the CPU,
    # in-place updates and fused products into a transposed view cost 3–7× their row-major versions (a 768×3072
    # Stiefel step took 135 ms against 123 ms for 3072×768 on the AMX Xeon). Elementwise results are the same bits.
    # Eagerly one parameter keeps its own matrix shape, (m, n) or (k, m, n) (2-D products, not batched ones: the bits
    # of a step alone); else the batch is flat, (B·k, m, n).
    one = not host_free and len(ps) == 1
    shape = (*V.shape[1:-2], m, n) if one else (-1, m, n)
    own = one and V.is_contiguous()
    X = V.reshape(shape) if own else V.reshape(shape).clone(memory_format=torch.contiguous_format)
    if retracts and first:  # start on the manifold
        if host_free:
            X = manifold.retract_host_free(X, far=True)
        else:
            first_retraction(opt, group, manifold, entries[0][0], X)  # eagerly a first step is a bucket alone
    G = tall_batch(U, layout, split)[0].reshape(shape).contiguous()
    X32 = X.float() if X.dtype in (torch.float16, torch.bfloat16) else X
    inner, final, continues, dtype = msign_fns(opt, group, X32)
    warm = group["dual_warm_start"]

    def stacked(key: str) -> torch.Tensor | None:
        return torch.stack([st[key] for st in states]).reshape(*X.shape[:-2], n, n) if key in states[0] else None

    # the constraint products' kind (split-bf16 or through oneDNN where that is faster); the host-free step keeps IEEE
    # products: the split is a ctypes call and oneDNN is not taken inside a compile trace, and an eager host-free step
    # must give the compiled one's bits
    products = "ieee" if host_free else opt._products_for(X32)
    out = dual_ascent(
        X32, G.to(X32.dtype), manifold, stacked("dual_multiplier") if warm else None,
        stacked("dual_cold") if warm else None, steps=max(1, int(group["dual_steps"])), lr=group["dual_lr"],
        tol=group["dual_tol"], msign_fn=inner, schedule=group["dual_schedule"], normalize=group["dual_normalize"],
        project=group["dual_project"], final_msign_fn=final, final_continues=continues, keep=group["dual_keep"],
        feed_dtype=dtype if dtype.itemsize < X32.dtype.itemsize else None, eager=not host_free,
        products=products)
    scale = shape_scale(matrices(ps[0], layout, split).shape, group["adjust_lr_fn"] or "none")
    apply_update(X, out.direction, float(group["lr"]), scale, group["weight_decay"])
    R = X
    if retracts and host_free:
        R = manifold.retract_host_free(X)
    elif retracts:
        R = manifold.retract_(X, products=products) if X.dtype in (torch.float32, torch.float64) \
            else retract(manifold, X, products)
    if host_free:
        new = from_tall(R.reshape(V.shape), layout, split, flip)
        torch._foreach_copy_(ps, list((new if ok is None else torch.where(ok, new, P)).unbind(0)))
    elif not own or R is not X:  # blocked where one side is a transposed view (``linalg.layout.copy_``)
        for p, v in zip(ps, from_tall(R.reshape(V.shape), layout, split, flip).unbind(0)):
            linalg_layout.copy_(p.detach(), v)
    b = len(ps)
    for key, value in (("dual_multiplier", out.multiplier), ("dual_cold", out.cold)):
        value = value.reshape(b, *dual_shape(group, ps[0]))
        old = stacked(key)
        if ok is not None:  # a skipped first step leaves Λ = cold = 0: the next step starts cold, as eagerly
            value = torch.where(ok, value, 0.0 if old is None else old.reshape(value.shape))
        if old is None:
            for st, v in zip(states, value.unbind(0)):
                st[key] = v.clone()  # its own storage: state must not hold views of the batch
        else:
            torch._foreach_copy_([st[key] for st in states], list(value.unbind(0)))
    opt._count_steps(ps, ok)
    # per-matrix statistics (worst block of a split matrix); host-free: device tensors, read (a sync) only when needed
    worst: Any = [t.reshape(b, -1).amax(dim=1) for t in (out.residuals, out.iters, out.dual_residuals)]
    if not host_free:  # one host read for the bucket
        worst = torch.stack([w.to(torch.float64) for w in worst]).tolist()
        worst[1] = [int(i) for i in worst[1]]
    for j, (name, _) in enumerate(entries):
        opt.last_stats[name] = {"tangent_residual": worst[0][j], "dual_iters": worst[1][j],
                                "dual_residual": worst[2][j]}
