"""Training-time geometry monitors: small pure functions plus :func:`collect`.

They follow the mechanism the manifold-Muon experiments test: a large σ_max(W_Q)·σ_max(W_K) allows large attention
logits, large logits give low-entropy, saturated softmax rows, and saturation precedes instability.

Metric names (flat, one float each; ``collect`` returns them for the trainer's ``diag`` lines):

* ``mat.<param>.sigma_max`` / ``.sigma_min`` — extreme singular values of each hidden matrix;
  ``.gram_offdiag`` = ‖Off(WᵀW)‖_F/‖WᵀW‖_F (0 on DGram/Stiefel); ``.colnorm_spread`` = (max − min)/mean of the
  column norms (0 on Oblique/Stiefel); ``.colnorm_mean``. W is taken tall (wide matrices transposed), as the manifold
  optimizers do, so "columns" are those of the tall orientation.
* ``muon.<param>.tangent_residual`` / ``.dual_iters`` from ``optimizer.last_stats`` (manifold Muon), plus
  ``muon.tangent_residual_max`` and ``muon.dual_iters_mean``.
* ``attn.<i>.*`` for the i-th attention layer of :func:`attention_modules` (this package's GPT/Llama attention, or
  Hugging Face GPT-2, Llama and BERT self-attention — same names and definitions for both):
  ``attn.<i>.qk_sigma_prod`` = σ_max(W_Q)·σ_max(W_K) (whole matrices, weights only; |Z_ij| ≤ ‖x_i‖‖x_j‖·this/√d
  for every head), ``attn.<i>.qk_sigma_prod_head_max`` (max over heads of σ_max(W_Q^h)σ_max(W_K^h), the per-head
  bound; GQA-aware); where the attention's input passes a norm with a gain g in its block (pre-norm: this package's
  GPT/Llama, Hugging Face GPT-2/Llama), ``attn.<i>.norm_gain_mean`` (mean |g|) and ``attn.<i>.qk_sigma_prod_gain`` =
  σ_max(W_Q·diag g)·σ_max(W_K·diag g), the same product with the gain folded into the weights (:func:`qk_scale`:
  a gain can hold the scale that σQ·σK alone does not show); with a batch, from the scaled pre-softmax logits
  Z = q kᵀ/√d (after RoPE for Llama) under the model's mask (causal for GPT/Llama, the padding ``attention_mask``
  for all): ``attn.<i>.logit_max`` (max |Z| over visible entries), ``attn.<i>.entropy`` (mean softmax entropy over
  heads and query positions, nats), ``attn.<i>.saturation`` (fraction of rows whose max probability >
  :data:`SATURATION_THRESHOLD` = 0.99). Rows with fewer than two visible keys (the first causal position) are always
  "saturated" and are left out of entropy and saturation, as are the rows of padding query positions.
* ``grad_norm.<module>`` — L2 norm of the gradients of each module's own parameters, and ``grad_norm.total``.
  Uses ``.grad`` when set; otherwise (the trainer calls ``collect`` after ``zero_grad``) one extra backward on the
  diagnostic batch computes them with ``torch.autograd.grad`` (no ``.grad`` is written).
* ``diag.time_ms`` — wall time of the collection.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Iterable

import torch
from torch import nn

from weightgeom.linalg.precision import with_full_precision
from weightgeom.linalg.topsv import top_singular
from weightgeom.optim.magnitude_direction import MagnitudeDirection

__all__ = [
    "matrix_stats",
    "bare_name",
    "qk_sigma_prod",
    "qk_scale",
    "INPUT_NORMS",
    "logit_stats",
    "grad_norms",
    "optimizer_stats",
    "monitored_matrices",
    "attention_modules",
    "HFAttention",
    "collect",
    "head_logit_maxima",
    "SATURATION_THRESHOLD",
    "MAX_SEQS",
]

SATURATION_THRESHOLD = 0.99  # a softmax row counts as saturated when its max probability exceeds this
"""A softmax row counts as saturated when its largest probability exceeds this."""
MAX_SEQS = 8  # sequences of a batch the diagnostic forward uses (memory: one (B, H, T, T) layer at a time)


@with_full_precision  # the stated error bounds assume IEEE float32 Grams (weightgeom.linalg.precision)
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


@with_full_precision  # the stated error bounds assume IEEE float32 Grams (weightgeom.linalg.precision)
def _sigma_max(W: torch.Tensor) -> torch.Tensor:
    """Spectral norm of (..., m, n), batched: float64 ``eigvalsh`` of the small (fp32) Gram when min(m, n) ≤ 1024
    (~3× cheaper than ``svdvals`` at 768×768), else block power iteration on it (Ritz values converged to 1e-7)."""
    A = W.detach().float()
    m, n = A.shape[-2], A.shape[-1]
    G = A.mT @ A if n <= m else A @ A.mT
    if min(m, n) <= 1024:
        return torch.sqrt(torch.linalg.eigvalsh(G.double())[..., -1].clamp_min(0))
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


INPUT_NORMS = {"attn": "ln_1", "self_attn": "input_layernorm", "attention": "attention_norm"}
"""The attention module's name in its block → the norm its input passes there (a sibling module): this package's GPT
and Hugging Face GPT-2 (``attn`` after ``ln_1``), this package's and Hugging Face Llama (``self_attn`` after
``input_layernorm``), Meta Llama (``attention`` after ``attention_norm``). Other attention modules have none here:
cross-attention (its keys come from elsewhere) and post-norm blocks such as BERT's."""


def _input_gain(model: nn.Module, name: str) -> torch.Tensor | None:
    """The gain vector of the norm :data:`INPUT_NORMS` names for the attention module ``name``; None without one."""
    parent_name, _, own = name.rpartition(".")
    norm = INPUT_NORMS.get(own)
    if norm is None:
        return None
    parent = model.get_submodule(parent_name) if parent_name else model
    w = getattr(getattr(parent, norm, None), "weight", None)
    return w if isinstance(w, torch.Tensor) and w.ndim == 1 else None


def _sigma_max_scaled(W: torch.Tensor, g: torch.Tensor) -> float:
    """σ_max(W·diag g), with g divided by max |g| first and the result multiplied back (no float32 overflow of the
    Gram for a large gain)."""
    top = float(g.abs().max()) if g.numel() else 0.0
    if top == 0.0:
        return 0.0
    return float(_sigma_max(W.detach().float() * (g / top))) * top


def qk_scale(model: nn.Module) -> dict[str, float]:
    """Where an attention layer's logit scale sits: in its W_Q, W_K or in the gain of the norm before it.

    For a pre-norm attention, x = g ⊙ x̂ (+ b) with x̂ normalised, so the logits are x̂ᵀ diag(g) W_Qᵀ W_K diag(g) x̂ /
    √d_h (bias aside): the weights alone bound them only together with g. A training that shrinks W_Q, W_K (QK-clip,
    a σ cap, a constraint) can see g grow instead, and the reverse.

    Args:
        model: any model; attention layers as :func:`attention_modules` finds them, ``attn.<i>`` its i-th.

    Returns:
        Per attention layer i that has a norm of :data:`INPUT_NORMS` before it, with a gain of the input's width on
        the weights' device: ``attn.<i>.norm_gain_mean`` (mean |g|, dimensionless) and ``attn.<i>.qk_sigma_prod_gain``
        = σ_max(W_Q·diag g)·σ_max(W_K·diag g); both NaN when g or W_Q, W_K are not finite. Layers without such a
        norm are left out.
    """
    out: dict[str, float] = {}
    for i, (name, m) in enumerate(attention_modules(model)):
        g = _input_gain(model, name)
        W_Q, W_K = m.qk_weights()
        if (g is None or g.numel() != W_Q.shape[-1] or g.numel() != W_K.shape[-1] or g.device != W_Q.device
                or g.device != W_K.device or g.is_meta):
            continue
        g = g.detach().float()
        finite = bool(torch.isfinite(g).all() and torch.isfinite(W_Q).all() and torch.isfinite(W_K).all())
        out[f"attn.{i}.norm_gain_mean"] = float(g.abs().mean()) if finite else math.nan
        out[f"attn.{i}.qk_sigma_prod_gain"] = (_sigma_max_scaled(W_Q, g) * _sigma_max_scaled(W_K, g) if finite
                                               else math.nan)
    return out


def logit_stats(logits: torch.Tensor, threshold: float = SATURATION_THRESHOLD,
                per_head: bool = False) -> dict[str, float]:
    """Statistics of pre-softmax attention logits (B, H, T, S) with masked entries at -inf.

    Returns:
        {"logit_max": max |finite logit|, "entropy": mean softmax entropy (nats) over rows with ≥ 2 visible keys,
        "saturation": fraction of those rows whose max probability > ``threshold``}; with ``per_head`` also
        ``logit_max_h<j>``, ``entropy_h<j>``, ``saturation_h<j>`` for each head j (the same over head j's rows).
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
    out = {"logit_max": lmax, "entropy": float(ent[valid].mean()), "saturation": float(sat[valid].float().mean())}
    if per_head and z.ndim == 4:
        absz = z.abs().where(finite, torch.zeros_like(z))
        for j in range(z.shape[1]):
            v = valid[:, j]
            out[f"logit_max_h{j}"] = float(absz[:, j].amax())
            out[f"entropy_h{j}"] = float(ent[:, j][v].mean()) if bool(v.any()) else float("nan")
            out[f"saturation_h{j}"] = float(sat[:, j][v].float().mean()) if bool(v.any()) else float("nan")
    return out


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
    """``optimizer`` and, for a ``MagnitudeDirection``, its base optimizer (which holds Muon's ``last_stats``);
    [] for None."""
    if optimizer is None:
        return []
    return [optimizer, optimizer.base_optimizer] if isinstance(optimizer, MagnitudeDirection) else [optimizer]


def bare_name(name: str) -> str:
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
                names.setdefault(id(p), bare_name(n))
    if model is not None:
        for n, p in model.named_parameters():
            names[id(p)] = bare_name(n)
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
    return [(bare_name(n), p) for n, p in model.named_parameters()
            if p.ndim == 2 and id(p) not in emb and not n.split(".")[-2:-1] == ["lm_head"]]


# Hugging Face self-attention classes the logit monitors understand, keyed by (module, qualname) of a class in the
# module's MRO (subclasses such as the SDPA/flash variants of older transformers releases match too). Matching by
# name means transformers is never imported here.
_HF_ATTENTION = {
    ("transformers.models.gpt2.modeling_gpt2", "GPT2Attention"): "gpt2",
    ("transformers.models.llama.modeling_llama", "LlamaAttention"): "llama",
    ("transformers.models.bert.modeling_bert", "BertSelfAttention"): "bert",
}


def _hf_family(m: nn.Module) -> str | None:
    for c in type(m).__mro__:
        fam = _HF_ATTENTION.get((c.__module__, c.__qualname__))
        if fam is not None:
            return fam
    return None


class HFAttention:
    """One Hugging Face GPT-2, Llama or BERT self-attention module seen through the attention diagnostics contract.

    ``qk_weights()`` returns (W_Q, W_K) in (out, in) layout: GPT-2's fused ``c_attn`` is a ``Conv1D`` with an
    (in, 3·C) weight, so W_Q, W_K are transposed column blocks of it; Llama's ``q_proj``/``k_proj`` and BERT's
    ``query``/``key`` weights as they are. Biases (GPT-2, BERT, Llama with ``attention_bias``) are not part of the
    σ product. ``logits(args, kwargs)`` recomputes the pre-softmax logits of one forward call from the module's own
    inputs (as a forward pre-hook sees them) with the module's own projections, in float32, scaled as the module
    scales them (GPT-2: ``scaling``, which includes the optional 1/(layer_idx + 1); Llama, BERT: 1/√head_dim).
    Llama's logits are taken **after RoPE**: q and k are rotated with the (cos, sin) position embeddings the decoder
    layer passes to the attention module (the "rotate_half" convention of Hugging Face Llama), then K/V heads are
    repeated for grouped-query attention (query head h uses KV head h // (H / H_kv)), so they are the logits the
    model's softmax sees, before its mask is added (up to rounding: float32 here, the model's dtype there). Masks are
    applied by the caller (:func:`collect`).

    Args:
        module: the attention module (``GPT2Attention``, ``LlamaAttention`` or ``BertSelfAttention``).
        family: ``"gpt2"``, ``"llama"`` or ``"bert"``.
    """

    def __init__(self, module: nn.Module, family: str) -> None:
        self.module = module
        self.family = family
        if family == "gpt2":
            self.n_head = int(module.num_heads)
            self.n_kv_head = self.n_head
            self.head_dim = int(module.head_dim)
            self.causal = not getattr(module, "is_cross_attention", False)
        elif family == "llama":
            cfg = module.config
            self.n_head = int(cfg.num_attention_heads)
            self.n_kv_head = int(getattr(cfg, "num_key_value_heads", None) or self.n_head)
            self.head_dim = int(module.head_dim)
            self.causal = True
        elif family == "bert":
            self.n_head = int(module.num_attention_heads)
            self.n_kv_head = self.n_head
            self.head_dim = int(module.attention_head_size)
            # transformers 5: is_causal (True in a decoder's self-attention); older releases: is_decoder
            self.causal = bool(getattr(module, "is_causal", getattr(module, "is_decoder", False)))
        else:
            raise ValueError(f"unknown Hugging Face attention family {family!r}")
        self._signature = inspect.signature(module.forward)
        self._var_kw = next((p.name for p in self._signature.parameters.values()
                             if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    def qk_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_Q, W_K) in (out, in) layout: (n_head·head_dim, d_model) and (n_kv_head·head_dim, d_model)."""
        m = self.module
        if self.family == "gpt2":
            if getattr(m, "is_cross_attention", False):
                C = m.q_attn.weight.shape[1]
                return m.q_attn.weight.mT, m.c_attn.weight[:, :C].mT
            C = m.split_size
            w = m.c_attn.weight  # Conv1D: (in, 3C), y = x W + b
            return w[:, :C].mT, w[:, C:2 * C].mT
        if self.family == "llama":
            return m.q_proj.weight, m.k_proj.weight
        return m.query.weight, m.key.weight

    def _scaling(self) -> float:
        m = self.module
        s = getattr(m, "scaling", None)
        if s is not None:
            return float(s)
        if self.family != "gpt2":
            return self.head_dim ** -0.5
        s = self.head_dim ** -0.5 if getattr(m, "scale_attn_weights", True) else 1.0
        if getattr(m, "scale_attn_by_inverse_layer_idx", False):
            s /= float(m.layer_idx + 1)
        return s

    def logits(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """Scaled pre-softmax logits (B, H, T, T), float32, unmasked, for one self-attention call.

        Args:
            args, kwargs: the call's arguments, as a ``register_forward_pre_hook(..., with_kwargs=True)`` hook gets
                them.

        Returns:
            The logits, or None for a cross-attention call (``encoder_hidden_states`` given), which is not monitored.

        Raises:
            ValueError: a Llama call without ``position_embeddings`` (transformers older than 4.45 computes RoPE
                inside the module), or a BERT module with relative position embeddings (older transformers).
        """
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        extra = bound.get(self._var_kw, {}) if self._var_kw else {}  # what the module's **kwargs collected
        if bound.get("encoder_hidden_states", extra.get("encoder_hidden_states")) is not None:
            return None
        h = bound.get("hidden_states", args[0] if args else None)
        if not isinstance(h, torch.Tensor):
            raise ValueError(f"diagnostics: no hidden_states tensor in the call of {type(self.module).__name__}")
        m = self.module
        B, T = h.shape[0], h.shape[1]
        H, Hkv, d = self.n_head, self.n_kv_head, self.head_dim
        if self.family == "gpt2":
            if getattr(m, "is_cross_attention", False):
                return None
            q, k, _ = m.c_attn(h).split(m.split_size, dim=2)
        elif self.family == "llama":
            pe = bound.get("position_embeddings", extra.get("position_embeddings"))
            if pe is None:
                raise ValueError("diagnostics: Hugging Face LlamaAttention was called without position_embeddings "
                                 "(transformers < 4.45); the logit monitors need the (cos, sin) the model passes")
            q, k = m.q_proj(h), m.k_proj(h)
        else:
            if getattr(m, "position_embedding_type", "absolute") != "absolute":
                raise ValueError("diagnostics: BERT attention with relative position embeddings "
                                 f"({m.position_embedding_type!r}) is not supported by the logit monitors")
            q, k = m.query(h), m.key(h)
        q = q.view(B, T, H, d).transpose(1, 2).float()
        k = k.view(B, T, Hkv, d).transpose(1, 2).float()
        if self.family == "llama":
            cos, sin = (t.float().unsqueeze(1) for t in pe)  # (B or 1, T, d) -> broadcast over heads
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if Hkv != H:
            k = k.repeat_interleave(H // Hkv, dim=1)
        return (q @ k.mT) * self._scaling()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] on the last dimension (Hugging Face Llama's RoPE convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module | HFAttention]]:
    """The attention layers the monitors report on, in ``named_modules`` order; ``attn.<i>`` is the i-th of them.

    A module that follows the attention diagnostics contract of ARCHITECTURE.md (``qk_weights()`` and
    ``record_logits``: this package's GPT and Llama attention) is returned as is; a Hugging Face ``GPT2Attention``,
    ``LlamaAttention`` or ``BertSelfAttention`` is returned wrapped in :class:`HFAttention`.
    """
    out: list[tuple[str, nn.Module | HFAttention]] = []
    for n, m in model.named_modules():
        if hasattr(m, "qk_weights") and hasattr(m, "record_logits"):
            out.append((n, m))
        else:
            fam = _hf_family(m)
            if fam is not None:
                out.append((n, HFAttention(m, fam)))
    return out


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP/FSDP (``.module``) and torch.compile (``._orig_mod``) wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "_orig_mod", None)
        if inner is None:
            inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module):
            model = inner
    return model


def _is_hf_model(model: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(_unwrap(model)).__mro__)


_TARGET_KEYS = ("labels", "targets", "y")
_BATCH_TYPES = (torch.Tensor, dict, tuple, list)


def _forward_inputs(model: nn.Module, batch, forward_kwargs: dict, max_seqs: int,
                    need_grad_if_targets: bool) -> tuple[tuple, dict, bool]:
    """(args, kwargs, has_targets) of the diagnostic forward; at most ``max_seqs`` sequences.

    Tensor ``x``: ``model(x)`` (a Hugging Face model: ``input_ids=x``). ``(x, y)``: ``model(x, y)`` when the gradient
    norms need the loss, else ``model(x)`` (a Hugging Face model: ``input_ids=x, labels=y``). A dict: passed as
    keyword arguments when ``model.forward`` accepts its keys, else read as ``x`` = input_ids/x/idx and
    ``y`` = labels/targets/y. ``forward_kwargs`` are added as keyword arguments.
    """
    hf = _is_hf_model(model)
    main = getattr(_unwrap(model), "main_input_name", "input_ids") if hf else "input_ids"
    args: tuple = ()
    kwargs: dict = {}
    has_targets = False
    if isinstance(batch, dict):
        try:
            inspect.signature(_unwrap(model).forward).bind(**batch, **forward_kwargs)
            fits = True
        except TypeError:
            fits = False
        if fits or hf:
            kwargs = dict(batch)
        else:
            x = batch.get("input_ids", batch.get("x", batch.get("idx")))
            y = batch.get("labels", batch.get("targets", batch.get("y")))
            if not isinstance(x, torch.Tensor):
                raise ValueError("diagnostics.collect: a dict batch needs a tensor under input_ids, x or idx")
            batch = (x, y)
    if isinstance(batch, torch.Tensor):
        args = (batch,)
    elif isinstance(batch, (tuple, list)):
        if not batch or not isinstance(batch[0], torch.Tensor):
            raise ValueError("diagnostics.collect: a tuple batch must start with the input tensor: (x, y) or (x,)")
        x, y = batch[0], (batch[1] if len(batch) > 1 else None)
        args = (x,)
        if y is not None and need_grad_if_targets:
            args = (x, y)
            has_targets = True
    elif not isinstance(batch, dict):
        raise ValueError(f"diagnostics.collect: cannot read inputs from a batch of type {type(batch).__name__}; "
                         "pass a tensor, (x, y) or a dict of keyword inputs")
    if hf and args:  # Hugging Face forwards take labels as a keyword (positionally it would be attention_mask)
        kwargs = {main: args[0]} | ({"labels": args[1]} if len(args) > 1 else {})
        args = ()
    for k, v in forward_kwargs.items():
        if k in kwargs:
            raise ValueError(f"diagnostics.collect: forward keyword {k!r} is given twice (in the batch and as a "
                             "keyword argument)")
        kwargs[k] = v
    for k in ("past_key_values", "cache"):
        if kwargs.get(k) is not None:
            raise ValueError(f"diagnostics.collect: {k} is not supported: the logit monitors need the whole "
                             "sequence in one forward")
    has_targets = has_targets or any(kwargs.get(k) is not None for k in _TARGET_KEYS)
    if hf and "use_cache" not in kwargs and "use_cache" in inspect.signature(_unwrap(model).forward).parameters:
        kwargs["use_cache"] = False  # no KV cache to build for a single diagnostic forward
    first = next((t for t in (*args, kwargs.get(main), *kwargs.values()) if isinstance(t, torch.Tensor)), None)
    if first is None:
        raise ValueError("diagnostics.collect: the batch holds no input tensor")
    B = first.shape[0] if first.ndim else 0
    if max_seqs and B > max_seqs:  # cut every batched tensor argument (first dimension = batch size)
        def cut(t):
            return t[:max_seqs] if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == B else t
        args = tuple(cut(t) for t in args)
        kwargs = {k: cut(v) for k, v in kwargs.items()}
    return args, kwargs, has_targets


def collect(model: nn.Module, optimizer=None, batch=None, *, max_seqs: int = MAX_SEQS, grads: bool = True,
            threshold: float = SATURATION_THRESHOLD, per_head: bool = False, **forward_kwargs) -> dict[str, float]:
    """All monitors at once, as flat ``{name: float}`` (see the module docstring for the names).

    Args:
        model: the model (any nn.Module). Attention monitors cover this package's GPT/Llama attention and Hugging
            Face GPT-2, Llama and BERT self-attention (see :func:`attention_modules`).
        optimizer: optional; selects the monitored matrices and provides ``last_stats``. A tensor, dict, tuple or
            list here is taken as the batch (``collect(model, batch)``).
        batch: optional input batch: a tensor of input ids, ``(x, y)``, or a dict of keyword inputs (Hugging Face
            style: ``input_ids``, ``attention_mask``, ``labels``, ...). Enables the logit statistics and, when it
            has targets (``y``, ``labels``/``targets``) and no ``.grad`` is set, the extra backward for the gradient
            norms. At most ``max_seqs`` sequences are used. For a Hugging Face model ``(x, y)`` means
            ``input_ids=x, labels=y`` (causal-LM labels are shifted inside the model: pass ``labels=input_ids``).
        max_seqs: cap on the sequences of the diagnostic forward (memory: one (B, H, T, T) layer at a time).
        grads: compute the gradient norms.
        threshold: saturation threshold on the max softmax probability.
        per_head: also report ``attn.<i>.{logit_max,entropy,saturation}_h<j>`` per head j (see :func:`logit_stats`).
        **forward_kwargs: extra keyword arguments for the model's forward (e.g. ``attention_mask``); batched
            tensors among them are cut to ``max_seqs`` sequences like the batch.

    Raises:
        ValueError: a batch that cannot be read, a keyword given twice, a KV cache among the inputs, an attention
            mask that is not (B, T), or an unsupported Hugging Face attention variant (see :class:`HFAttention`).

    The model's training mode and ``record_logits`` flags are restored and every hook is removed, also when the
    forward raises; the global RNG is not consumed.
    """
    if batch is None and isinstance(optimizer, _BATCH_TYPES):
        optimizer, batch = None, optimizer
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
    out.update(qk_scale(model))
    have_grads = any(p.grad is not None for p in model.parameters())
    if grads and have_grads:
        out.update(grad_norms((bare_name(n), p.grad) for n, p in model.named_parameters()))
    if batch is not None:
        want_grad = grads and not have_grads
        args, kwargs, has_targets = _forward_inputs(model, batch, forward_kwargs, max_seqs, want_grad)
        out.update(_forward_stats(model, attn, args, kwargs, want_grad and has_targets, threshold, per_head))
    out["diag.time_ms"] = (time.perf_counter() - t0) * 1e3
    return out


def _visible(mask: torch.Tensor | None, B: int, T: int, causal: bool, device) -> torch.Tensor:
    """(B, T, T) bool: query t may attend to key s (causal and key padding); padded query rows are all False."""
    vis = torch.ones(B, T, T, dtype=torch.bool, device=device)
    if causal:
        vis = vis.tril()
    if mask is not None:
        keep = mask.to(device) != 0
        vis = vis & keep[:, None, :] & keep[:, :, None]
    return vis


def _forward_stats(model, attn, args: tuple, kwargs: dict, need_grad: bool, threshold: float,
                   per_head: bool = False) -> dict[str, float]:
    out: dict[str, float] = {}
    own = [(i, m) for i, (_, m) in enumerate(attn) if not isinstance(m, HFAttention)]
    hf = [(i, m) for i, (_, m) in enumerate(attn) if isinstance(m, HFAttention)]
    index = {id(m): i for i, m in own}
    flags = [(m, m.record_logits) for _, m in own]
    pad = kwargs.get("attention_mask")
    if hf and pad is not None and (not isinstance(pad, torch.Tensor) or pad.ndim != 2):
        raise ValueError("diagnostics.collect: the attention monitors need a (batch, seq) padding attention_mask "
                         f"(1 = token, 0 = padding), got {getattr(pad, 'shape', type(pad).__name__)}")
    was_training = model.training
    hooks = []

    def own_hook(mod, _inp, _out):
        z = getattr(mod, "last_logits", None)
        if z is not None:
            for k, v in logit_stats(z, threshold, per_head).items():
                out[f"attn.{index[id(mod)]}.{k}"] = v
            mod.last_logits = None  # free (B, H, T, T) before the next layer

    def hf_hook(i: int, site: HFAttention):
        def pre_hook(_mod, a, kw):
            with torch.no_grad():
                z = site.logits(a, kw)
                if z is None:
                    return
                B, _, T, S = z.shape
                if pad is not None and tuple(pad.shape) != (B, S):
                    raise ValueError(f"diagnostics.collect: attention_mask has shape {tuple(pad.shape)}, the "
                                     f"attention layer sees (batch, seq) = ({B}, {S})")
                vis = _visible(pad, B, T, site.causal, z.device)
                for k, v in logit_stats(z.masked_fill(~vis[:, None], float("-inf")), threshold, per_head).items():
                    out[f"attn.{i}.{k}"] = v
        return pre_hook

    first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
    devices = []
    if first is not None and first.device.type == "cuda":  # fork_rng wants CUDA device indices
        devices = [first.device.index if first.device.index is not None else torch.cuda.current_device()]
    try:
        for _, m in own:
            m.record_logits = True
            hooks.append(m.register_forward_hook(own_hook))
        for i, site in hf:
            hooks.append(site.module.register_forward_pre_hook(hf_hook(i, site), with_kwargs=True))
        model.eval()
        with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(need_grad):
            res = model(*args, **kwargs)
            if need_grad:
                loss = getattr(res, "loss", None)
                if loss is None and isinstance(res, (tuple, list)) and res:
                    # this package's models return (logits, loss); Hugging Face tuples put the loss first
                    loss = res[0] if _is_hf_model(model) else (res[1] if len(res) > 1 else None)
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
                    gs = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
                    out.update(grad_norms((bare_name(n), g) for (n, _), g in zip(named, gs)))
    finally:
        for h in hooks:
            h.remove()
        for m, f in flags:
            m.record_logits = f
            m.last_logits = None
        model.train(was_training)
    return out


def head_logit_maxima(model: nn.Module, batch, *, max_seqs: int = MAX_SEQS, **forward_kwargs) -> list[list[float]]:
    """Per attention layer (the order of :func:`attention_modules`), the max |logit| of each query head: the
    ``attn.<i>.logit_max_h<j>`` of :func:`collect` with ``per_head=True``, from one no-grad forward of at most
    ``max_seqs`` sequences of ``batch`` under the model's mask, without the weight statistics or gradient norms.

    Args:
        model: the model (this package's GPT/Llama, Hugging Face GPT-2, Llama or BERT).
        batch: input ids, ``(x, y)`` or a dict of keyword inputs, as for :func:`collect`.
        max_seqs: cap on the sequences of the forward.
        **forward_kwargs: extra keyword arguments for the model's forward (e.g. ``attention_mask``).

    Returns:
        ``[[max |Z| of head 0, head 1, …] for each attention layer]`` (scaled pre-softmax logits, dimensionless;
        NaN for a head with no visible entry or a layer the forward did not reach).
    """
    attn = attention_modules(model)
    args, kwargs, _ = _forward_inputs(model, batch, forward_kwargs, max_seqs, False)
    stats = _forward_stats(model, attn, args, kwargs, False, SATURATION_THRESHOLD, per_head=True)
    return [[stats.get(f"attn.{i}.logit_max_h{j}", math.nan) for j in range(int(m.n_head))]
            for i, (_, m) in enumerate(attn)]
