"""Training-time geometry monitors (SPEC §C mechanism): small pure functions plus :func:`collect`.

Metric names (flat, one float each; ``collect`` returns them for the trainer's ``diag`` lines):

* ``mat.<param>.sigma_max`` / ``.sigma_min`` — extreme singular values of each hidden matrix;
  ``.gram_offdiag`` = ‖Off(WᵀW)‖_F/‖WᵀW‖_F (0 on DGram/Stiefel); ``.colnorm_spread`` = (max − min)/mean of the
  column norms (0 on Oblique/Stiefel); ``.colnorm_mean``. W is taken tall (wide matrices transposed), as the manifold
  optimizers do, so "columns" are those of the tall orientation.
* ``muon.<param>.tangent_residual`` / ``.dual_iters`` from ``optimizer.last_stats`` (manifold Muon), plus
  ``muon.tangent_residual_max`` and ``muon.dual_iters_mean``.
* ``attn.<i>.qk_sigma_prod`` = σ_max(W_Q)·σ_max(W_K) (whole matrices; |Z_ij| ≤ ‖x_i‖‖x_j‖·this/√d for every head),
  ``attn.<i>.qk_sigma_prod_head_max`` (max over heads of σ_max(W_Q^h)σ_max(W_K^h), the per-head bound);
  with a batch: ``attn.<i>.logit_max`` (max |pre-softmax logit|), ``attn.<i>.entropy`` (mean softmax entropy, nats),
  ``attn.<i>.saturation`` (fraction of rows whose max probability > 0.99). Rows with fewer than two visible keys
  (the first causal position) are always "saturated" and are left out of entropy and saturation.
* ``grad_norm.<module>`` — L2 norm of the gradients of each module's own parameters, and ``grad_norm.total``.
  Uses ``.grad`` when set; otherwise (the trainer calls ``collect`` after ``zero_grad``) one extra backward on the
  diagnostic batch computes them with ``torch.autograd.grad`` (no ``.grad`` is written).
* ``diag.time_ms`` — wall time of the collection.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import torch
from torch import nn

__all__ = [
    "matrix_stats",
    "qk_sigma_prod",
    "logit_stats",
    "grad_norms",
    "optimizer_stats",
    "monitored_matrices",
    "attention_modules",
    "collect",
    "SATURATION_THRESHOLD",
]

SATURATION_THRESHOLD = 0.99  # a softmax row counts as saturated when its max probability exceeds this


def matrix_stats(W: torch.Tensor) -> dict[str, float]:
    """σ_max, σ_min, Gram off-diagonal ratio and column-norm spread of one matrix (tall orientation).

    Computed from the Gram G = AᵀA of the tall orientation A (k×k, k = min(m, n)), formed in float32 (float64 for
    float64 weights) and diagonalised in float64 with ``eigvalsh``: σ_i = sqrt(λ_i(G)). Absolute error of σ_min is
    ≲ 3e-4·σ_max for float32 weights (1e-7 relative error of G, square-rooted), ≲ 1e-8·σ_max for float64.

    Args:
        W: (m, n) matrix.

    Returns:
        {"sigma_max", "sigma_min", "gram_offdiag", "colnorm_spread", "colnorm_mean"} (dimensionless except
        σ and column norms, which are in the weight's units).
    """
    A = W.detach()
    if A.shape[0] < A.shape[1]:
        A = A.mT
    A = A.double() if A.dtype == torch.float64 else A.float()
    G = (A.mT @ A).double()  # Gram in the weight's precision (fp32 for fp32/bf16), spectrum in float64
    ev = torch.linalg.eigvalsh(G)
    d = torch.diagonal(G)
    gn = torch.linalg.matrix_norm(G)
    off = torch.sqrt(torch.clamp(gn**2 - (d * d).sum(), min=0.0))
    cn = torch.sqrt(torch.clamp(d, min=0.0))
    mean = cn.mean()
    return {
        "sigma_max": float(torch.sqrt(ev[-1].clamp_min(0))),
        "sigma_min": float(torch.sqrt(ev[0].clamp_min(0))),
        "gram_offdiag": float(off / gn) if gn > 0 else 0.0,
        "colnorm_spread": float((cn.max() - cn.min()) / mean) if mean > 0 else 0.0,
        "colnorm_mean": float(mean),
    }


def _sigma_max(W: torch.Tensor) -> torch.Tensor:
    """Spectral norm of (..., m, n), batched: float64 ``eigvalsh`` of the small (fp32) Gram when min(m, n) ≤ 1024
    (~3× cheaper than ``svdvals`` at 768×768), else block power iteration on it (Ritz values converged to 1e-7)."""
    A = W.detach().float()
    m, n = A.shape[-2], A.shape[-1]
    G = A.mT @ A if n <= m else A @ A.mT
    if min(m, n) <= 1024:
        return torch.sqrt(torch.linalg.eigvalsh(G.double())[..., -1].clamp_min(0))
    from weightgeom.linalg.topsv import top_singular

    return top_singular(A, 1, method="power", gram=G, oversample=8)[1][..., 0]


def qk_sigma_prod(W_Q: torch.Tensor, W_K: torch.Tensor, n_head: int | None = None,
                  n_kv_head: int | None = None) -> dict[str, float]:
    """σ_max(W_Q)·σ_max(W_K), and the max over heads of the per-head product (GQA: head h uses KV head h // (H/H_kv)).

    Args:
        W_Q: (H·d_h, d_model), W_K: (H_kv·d_h, d_model), (out, in) layout.
        n_head, n_kv_head: head counts (per-head value omitted when n_head is None).
    """
    out = {"qk_sigma_prod": float(_sigma_max(W_Q) * _sigma_max(W_K))}
    if n_head:
        n_kv = n_kv_head or n_head
        hd = W_Q.shape[0] // n_head
        sq = _sigma_max(W_Q.reshape(n_head, hd, -1))
        sk = _sigma_max(W_K.reshape(n_kv, W_K.shape[0] // n_kv, -1))
        group = n_head // n_kv
        prod = sq * sk.repeat_interleave(group)
        out["qk_sigma_prod_head_max"] = float(prod.max())
    return out


def logit_stats(logits: torch.Tensor, threshold: float = SATURATION_THRESHOLD) -> dict[str, float]:
    """Statistics of pre-softmax attention logits (B, H, T, S) with masked entries at -inf.

    Returns:
        {"logit_max": max |finite logit|, "entropy": mean softmax entropy (nats) over rows with ≥ 2 visible keys,
        "saturation": fraction of those rows whose max probability > ``threshold``}.
    """
    z = logits.detach().float()
    finite = torch.isfinite(z)
    lmax = float(z.abs().where(finite, torch.zeros_like(z)).amax()) if finite.any() else float("nan")
    valid = finite.sum(-1) >= 2
    p = torch.softmax(z, dim=-1)
    ent = -torch.special.xlogy(p, p).sum(-1)
    sat = p.amax(-1) > threshold
    nv = int(valid.sum())
    if nv == 0:
        return {"logit_max": lmax, "entropy": float("nan"), "saturation": float("nan")}
    return {"logit_max": lmax, "entropy": float(ent[valid].mean()), "saturation": float(sat[valid].float().mean())}


def grad_norms(named_grads: Iterable[tuple[str, torch.Tensor | None]]) -> dict[str, float]:
    """Per-module gradient L2 norms from (parameter name, grad) pairs: module = name without the last component.

    Returns:
        {"grad_norm.<module>": ‖g‖₂, ..., "grad_norm.total": ‖all grads‖₂}.
    """
    sq: dict[str, float] = {}
    for name, g in named_grads:
        if g is None:
            continue
        mod = name.rsplit(".", 1)[0] if "." in name else name
        sq[mod] = sq.get(mod, 0.0) + float(g.detach().double().pow(2).sum())
    out = {f"grad_norm.{k}": math.sqrt(v) for k, v in sq.items()}
    if sq:
        out["grad_norm.total"] = math.sqrt(sum(sq.values()))
    return out


def _inner_optimizers(optimizer) -> list:
    out, seen = [], set()
    stack = [optimizer]
    while stack:
        o = stack.pop()
        if o is None or id(o) in seen:
            continue
        seen.add(id(o))
        out.append(o)
        for attr in ("base_optimizer", "base", "optimizer", "inner"):
            stack.append(getattr(o, attr, None))
    return out


def _clean(name: str) -> str:
    """Drop torch.compile / DDP wrapper prefixes so metric names match the bare model's parameter names."""
    name = name.replace("_orig_mod.", "")
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _param_names(model: nn.Module | None, optimizer) -> dict[int, str]:
    """id(param) → name: from the model, else from the groups' "names"."""
    names: dict[int, str] = {}
    for o in _inner_optimizers(optimizer):
        for g in getattr(o, "param_groups", []):
            for p, n in zip(g.get("params", []), g.get("names", []) or []):
                names.setdefault(id(p), _clean(n))
    if model is not None:
        for n, p in model.named_parameters():
            names[id(p)] = _clean(n)
    return names


def optimizer_stats(optimizer, model: nn.Module | None = None) -> dict[str, float]:
    """Manifold-Muon per-parameter stats from ``optimizer.last_stats`` (tangent residual, dual iterations).

    Keys of ``last_stats`` may be parameter names or flat indices (over the groups' params in order).
    """
    out: dict[str, float] = {}
    seen: set[int] = set()
    for o in _inner_optimizers(optimizer):
        stats = getattr(o, "last_stats", None)
        if not stats or id(stats) in seen:
            continue
        seen.add(id(stats))
        flat = [p for g in getattr(o, "param_groups", []) for p in g.get("params", [])]
        names = _param_names(model, o)
        res, its = [], []
        for key, st in stats.items():
            if isinstance(key, int):
                name = names.get(id(flat[key]), f"p{key}") if 0 <= key < len(flat) else f"p{key}"
            elif isinstance(key, torch.Tensor):
                name = names.get(id(key), "param")
            else:
                name = str(key)
            if not isinstance(st, dict):
                continue
            for k in ("tangent_residual", "dual_iters"):
                if st.get(k) is not None:
                    v = float(st[k])
                    out[f"muon.{name}.{k}"] = v
                    (res if k == "tangent_residual" else its).append(v)
        if res:
            out["muon.tangent_residual_max"] = max(res)
        if its:
            out["muon.dual_iters_mean"] = sum(its) / len(its)
    return out


def monitored_matrices(model: nn.Module, optimizer=None) -> list[tuple[str, torch.Tensor]]:
    """The matrices ``collect`` reports on: parameters of the optimizer's Muon / manifold groups when there are any
    (a group with ``split=k`` contributes its k blocks, named ``<param>.q/.k/.v`` for k = 3, since each block carries
    its own constraint), else every 2-D parameter except embeddings and ``lm_head``."""
    names = _param_names(model, None)
    chosen: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for o in _inner_optimizers(optimizer):
        for g in getattr(o, "param_groups", []):
            if g.get("algorithm", "muon") == "adamw" or ("algorithm" not in g and "manifold" not in g):
                continue
            k = int(g.get("split") or 1)
            dim = 1 if g.get("layout") == "in_out" else 0
            for p in g.get("params", []):
                if p.ndim == 2 and id(p) not in seen:
                    seen.add(id(p))
                    name = names.get(id(p), f"p{len(chosen)}")
                    if k > 1 and p.shape[dim] % k == 0:  # fused QKV split into k constrained blocks
                        tags = "qkv" if k == 3 else [str(b) for b in range(k)]
                        chosen += [(f"{name}.{t}", blk) for t, blk in zip(tags, p.chunk(k, dim=dim))]
                    else:
                        chosen.append((name, p))
    if chosen:
        return chosen
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [(_clean(n), p) for n, p in model.named_parameters()
            if p.ndim == 2 and id(p) not in emb and not n.split(".")[-2:-1] == ["lm_head"]]


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that follow the attention diagnostics contract (``qk_weights()`` and ``record_logits``)."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "qk_weights") and hasattr(m, "record_logits")]


def _split_batch(batch, max_seqs: int):
    x = y = None
    if isinstance(batch, torch.Tensor):
        x = batch
    elif isinstance(batch, (tuple, list)) and batch:
        x = batch[0]
        y = batch[1] if len(batch) > 1 else None
    elif isinstance(batch, dict):
        x = batch.get("input_ids", batch.get("x", batch.get("idx")))
        y = batch.get("labels", batch.get("targets", batch.get("y")))
    if x is None:
        raise ValueError(f"diagnostics.collect: cannot read inputs from a batch of type {type(batch).__name__}; "
                         "pass a tensor, (x, y) or a dict with input_ids/x")
    if max_seqs and x.shape[0] > max_seqs:
        x = x[:max_seqs]
        y = y[:max_seqs] if isinstance(y, torch.Tensor) else y
    return x, y


def collect(model: nn.Module, optimizer=None, batch=None, *, max_seqs: int = 8, grads: bool = True,
            threshold: float = SATURATION_THRESHOLD) -> dict[str, float]:
    """All monitors at once, as flat ``{name: float}`` (see the module docstring for the names).

    Args:
        model: the model (any nn.Module; attention monitors need the attention contract of ARCHITECTURE.md).
        optimizer: optional; selects the monitored matrices and provides ``last_stats``.
        batch: optional input batch (tensor, (x, y) or dict); enables the logit statistics and, when it has targets
            and no ``.grad`` is set, the extra backward for the gradient norms. At most ``max_seqs`` sequences used.
        max_seqs: cap on the sequences of the diagnostic forward (memory: one (B, H, T, T) layer at a time).
        grads: compute the gradient norms.
        threshold: saturation threshold on the max softmax probability.

    The model's training mode and ``record_logits`` flags are restored; the global RNG is not consumed.
    """
    t0 = time.perf_counter()
    out: dict[str, float] = {}
    for name, W in monitored_matrices(model, optimizer):
        for k, v in matrix_stats(W).items():
            out[f"mat.{name}.{k}"] = v
    if optimizer is not None:
        out.update(optimizer_stats(optimizer, model))
    attn = attention_modules(model)
    for i, (_, m) in enumerate(attn):
        W_Q, W_K = m.qk_weights()
        for k, v in qk_sigma_prod(W_Q, W_K, getattr(m, "n_head", None), getattr(m, "n_kv_head", None)).items():
            out[f"attn.{i}.{k}"] = v
    have_grads = any(p.grad is not None for p in model.parameters())
    if grads and have_grads:
        out.update(grad_norms((_clean(n), p.grad) for n, p in model.named_parameters()))
    if batch is not None:
        x, y = _split_batch(batch, max_seqs)
        need_grad = grads and not have_grads and y is not None
        out.update(_forward_stats(model, attn, x, y, need_grad, threshold))
    out["diag.time_ms"] = (time.perf_counter() - t0) * 1e3
    return out


def _forward_stats(model, attn, x, y, need_grad: bool, threshold: float) -> dict[str, float]:
    out: dict[str, float] = {}
    index = {id(m): i for i, (_, m) in enumerate(attn)}
    flags = [(m, m.record_logits) for _, m in attn]
    was_training = model.training
    hooks = []

    def hook(mod, _inp, _out):
        z = getattr(mod, "last_logits", None)
        if z is not None:
            for k, v in logit_stats(z, threshold).items():
                out[f"attn.{index[id(mod)]}.{k}"] = v
            mod.last_logits = None  # free (B, H, T, T) before the next layer

    devices = []
    if x.device.type == "cuda":  # fork_rng wants CUDA device indices
        devices = [x.device.index if x.device.index is not None else torch.cuda.current_device()]
    try:
        for _, m in attn:
            m.record_logits = True
            hooks.append(m.register_forward_hook(hook))
        model.eval()
        with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(need_grad):
            res = model(x, y) if need_grad else model(x)
            if need_grad:
                loss = res[1] if isinstance(res, (tuple, list)) else getattr(res, "loss", None)
                if loss is not None:
                    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
                    gs = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
                    out.update(grad_norms((_clean(n), g) for (n, _), g in zip(named, gs)))
    finally:
        for h in hooks:
            h.remove()
        for m, f in flags:
            m.record_logits = f
            m.last_logits = None
        model.train(was_training)
    return out
