"""QK-clip: bound each attention head's logits by rescaling its query and key weights after the optimizer step.

The rule is Megatron-LM's ``qk_clip`` and Kimi K2's MuonClip: after a step, per attention head h with largest
attention logit max_h (scaled pre-softmax logit, max |Z| over the step's batch),

    η_h = min(1, τ / max_h),   W_Q,h ← η_h^α · W_Q,h,   W_K,h ← η_h^(1−α) · W_K,h,

so the head's logits shrink by η_h and its largest logit on that batch lands at τ. Defaults τ = 100, α = 0.5. Under
grouped-query attention a key head serves several query heads; it is scaled by η^(1−α) with η the smallest η_h of
the query heads it serves (their largest logit), so every head's logits shrink by at least its own η_h. Biases of the
query and key projections (GPT-2, BERT, Llama with ``attention_bias``) are scaled with their rows, so q and k scale
exactly and the logit bound holds also with biases.

The logit maxima are the ones the diagnostics measure (:func:`weightgeom.diagnostics.monitors.head_logit_maxima`,
the ``attn.<i>.logit_max_h<j>`` of ``collect``): one no-grad forward of the step's last micro-batch (at most
``max_seqs`` sequences) with the weights just updated, so after a clip the largest logit on that batch is ≤ τ (the
published recipes reuse the maxima of the training forward, i.e. of the weights before the update). Under DDP each
rank measures its own micro-batch and the maxima are all-reduced (max), so every replica rescales alike.

**Constrained matrices.** A rescale moves a constrained matrix off its manifold unless the manifold allows it:

* free (no manifold: unconstrained Muon, AdamW) — per-head clip as above;
* DGram (orthogonal columns, free norms) — only a scalar on the whole matrix keeps the columns orthogonal, so the
  layer gets one η = min_h η_h: W_Q ← η^α W_Q and W_K ← η^(1−α) W_K as wholes; a fused QKV weight whose Q, K and V
  share one Gram constraint (``split`` unset) is scaled as a whole by √η (V included), which shrinks the logits by η
  and keeps the constraint. The layer stays on its manifold and its largest logit on the batch lands at ≤ τ;
* Stiefel and Oblique (fixed norms: σ_max(W_Q) = 1 or unit columns) — the scale is not free to grow and a rescale
  would leave the manifold, to be undone by the next retraction: the layer is skipped (counted in ``skipped``).

``constrained = "skip"`` clips free layers only; ``"refuse"`` refuses a run whose query/key weights are constrained
(``ValueError`` before the run directory is written). The magnitude–direction wrapper recomposes the weight from
its sphere-bound direction every step, so a rescale has no lasting effect there (as for the σ cap).

Counted (checkpointed, so they cover the run across resumes): ``steps`` checked, ``clips`` (steps with at least one
rescale), ``rescales`` (query heads rescaled, or layers for a whole-matrix clip), ``skipped`` (heads above τ in
layers left alone), ``max_logit_seen``. The trainer adds ``qk_clip_rescales``, ``qk_clip_skipped`` and
``qk_clip_max_logit`` (the last check's largest logit, before its clip) to each train line of ``metrics.jsonl``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from weightgeom.diagnostics.monitors import MAX_SEQS, attention_modules, head_logit_maxima
from weightgeom.schema import ConfigError, Section, setting
from weightgeom.train.callbacks import Callback, TrainContext

__all__ = ["QKClip", "QKClipConfig", "POLICIES", "FREE", "SCALE_FREE", "FIXED_NORM", "DEFAULT_TAU", "DEFAULT_ALPHA"]

DEFAULT_TAU = 100.0
"""Megatron-LM's default logit threshold τ."""
DEFAULT_ALPHA = 0.5
"""Megatron-LM's default split α of the rescale between W_Q (η^α) and W_K (η^(1−α))."""
POLICIES = ("auto", "skip", "refuse")
"""What QK-clip does with a constrained query/key weight (module docstring)."""
FREE = (None, "none", "euclidean")
"""Manifold names (optimizer group ``manifold``) of unconstrained weights: clipped per head."""
SCALE_FREE = ("dgram",)
"""Manifolds a scalar keeps a matrix on: clipped as a whole under ``constrained = "auto"``."""
FIXED_NORM = ("stiefel", "oblique")
"""Manifolds that fix the scale: never rescaled."""
SLACK = 1e-5
"""Relative slack: a head whose largest logit is within τ·(1 + SLACK) is not rescaled (the float32 rounding of a
head clipped to τ the step before must not count as a new rescale every step)."""


@dataclass
class QKClipConfig(Section):
    """QK-clip after each optimizer step (``[qk_clip]``; :class:`QKClip`)."""

    _prefix: ClassVar[str] = "qk_clip"

    enabled: bool = setting(False, "rescale W_Q, W_K per head after each step so no attention logit exceeds tau")
    tau: float = setting(DEFAULT_TAU, "largest attention logit allowed (scaled pre-softmax logit, dimensionless)",
                         gt=0)
    alpha: float = setting(DEFAULT_ALPHA, "share of the rescale on W_Q (eta^alpha; W_K gets eta^(1-alpha))",
                           ge=0, le=1)
    constrained: Literal["auto", "skip", "refuse"] = setting(
        "auto", "constrained W_Q/W_K: auto (DGram clipped as a whole, Stiefel/Oblique skipped) | skip (clip free "
                "weights only) | refuse (refuse the run)")
    max_seqs: int = setting(MAX_SEQS, "sequences of the step's batch the logit-measuring forward uses", gt=0)

    def check(self) -> None:
        if not math.isfinite(self.tau):
            raise ConfigError(f"config key qk_clip.tau={self.tau}: must be a finite number > 0")

    def build(self) -> QKClip | None:
        """The callback these settings describe (None when ``enabled`` is false)."""
        return QKClip(self.tau, self.alpha, self.constrained, self.max_seqs) if self.enabled else None


@dataclass
class _Layer:
    index: int
    name: str
    mode: str  # "heads" | "whole" | "skip"
    wq: torch.Tensor  # (H·d_h, d_model) view, (out, in)
    wk: torch.Tensor  # (H_kv·d_h, d_model) view
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    fused: torch.Tensor | None  # the shared Q/K/V parameter scaled as a whole (mode "whole", one constraint)
    fused_bias: torch.Tensor | None  # its bias (Q, K and V), scaled with it
    n_head: int
    n_kv_head: int
    manifold: str | None


def _owner(view: torch.Tensor, named: Sequence[tuple[str, nn.Parameter]]) -> tuple[str, nn.Parameter] | None:
    ptr = view.untyped_storage().data_ptr()
    return next(((n, p) for n, p in named if p.untyped_storage().data_ptr() == ptr), None)


def _group(optimizer: Any, p: torch.Tensor) -> dict[str, Any]:
    for g in getattr(optimizer, "param_groups", []):
        if any(q is p for q in g["params"]):
            return g
    return {}


def _biases(site: Any, n_q: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The query and key biases of an attention layer (views; None where it has none)."""
    m = getattr(site, "module", site)  # HFAttention wraps the module
    if getattr(site, "family", None) == "bert":
        return m.query.bias, m.key.bias
    if getattr(m, "q_proj", None) is not None and getattr(m, "k_proj", None) is not None:
        return m.q_proj.bias, m.k_proj.bias
    b = getattr(getattr(m, "c_attn", None), "bias", None)
    return (b[:n_q], b[n_q:2 * n_q]) if b is not None else (None, None)


def _across_ranks(maxima: list[list[float]]) -> list[list[float]]:
    """The per-head maxima over every rank's batch under torch.distributed (each rank measures its own micro-batch;
    the rescale must be the same on every replica); unchanged in a single process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or not maxima:
        return maxima
    width = max(len(row) for row in maxima)
    t = torch.tensor([[x if math.isfinite(x) else -1.0 for x in row] + [-1.0] * (width - len(row)) for row in maxima],
                     dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [[float(x) if x >= 0 else math.nan for x in row[:len(orig)]] for row, orig in zip(t.cpu().tolist(), maxima)]


class QKClip(Callback):
    """QK-clip (Megatron-LM ``qk_clip``, Kimi K2 MuonClip) after every optimizer step; see the module docstring.

    Args:
        tau: largest attention logit allowed (> 0, finite).
        alpha: share of the rescale on W_Q, in [0, 1].
        constrained: ``"auto"`` | ``"skip"`` | ``"refuse"`` (what to do with manifold-constrained W_Q / W_K).
        max_seqs: sequences of the step's batch the measuring forward uses.

    Raises:
        ValueError: a setting out of range (one line naming ``qk_clip.<key>``); at the start of training: FSDP
            shards, no attention layer, query/key weights that are not the model's parameters, or (``"refuse"``) a
            constrained query/key weight.
    """

    state_key = "qk_clip"

    def __init__(self, tau: float = DEFAULT_TAU, alpha: float = DEFAULT_ALPHA, constrained: str = "auto",
                 max_seqs: int = MAX_SEQS) -> None:
        tau, alpha = float(tau), float(alpha)
        if not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"qk_clip.tau={tau}: must be a finite number > 0")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"qk_clip.alpha={alpha}: must lie in [0, 1]")
        if constrained not in POLICIES:
            raise ValueError(f"qk_clip.constrained={constrained!r}: one of {', '.join(POLICIES)}")
        if int(max_seqs) < 1:
            raise ValueError(f"qk_clip.max_seqs={max_seqs}: must be ≥ 1")
        self.tau, self.alpha, self.constrained, self.max_seqs = tau, alpha, constrained, int(max_seqs)
        self.steps = self.clips = self.rescales = self.skipped = 0
        self.max_seen = 0.0
        self.last_max = math.nan
        self._layers: list[_Layer] | None = None

    # ------------------------------------------------------------------------------------------------ setup
    def on_setup(self, ctx: TrainContext) -> None:
        """Find the attention layers, the manifold of their query/key weights, and how each is clipped.

        Raises:
            ValueError: see the class docstring.
        """
        if ctx.fsdp:
            raise ValueError("qk_clip needs whole attention weights; it does not work with run.parallel='fsdp'")
        self._layers = self.find(ctx.model, ctx.optimizer)

    def on_train_start(self, ctx: TrainContext) -> None:
        if self._layers is None:  # a caller that skipped on_setup
            self.on_setup(ctx)

    def find(self, model: nn.Module, optimizer: Any = None) -> list[_Layer]:
        """The attention layers of ``model`` and their clip mode under ``optimizer``'s groups (None: all free)."""
        named = list(model.named_parameters())
        layers = []
        for i, (name, site) in enumerate(attention_modules(model)):
            wq, wk = site.qk_weights()
            owners = [_owner(w, named) for w in (wq, wk)]
            if any(o is None for o in owners):
                raise ValueError(f"qk_clip: the query/key weights of attention layer {name!r} are not parameters of "
                                 "the model")
            groups = [_group(optimizer, o[1]) for o in owners]
            mans = {g.get("manifold") for g in groups}
            man = next((m for m in mans if m not in FREE), None)
            if man is None:
                mode = "heads"
            elif self.constrained == "refuse":
                raise ValueError(f"qk_clip: attention layer {name!r} has {man} query/key weights "
                                 f"(qk_clip.constrained='refuse'); use 'auto' or 'skip', or an unconstrained strategy")
            elif self.constrained == "auto" and man in SCALE_FREE and mans <= {*FREE, *SCALE_FREE}:
                mode = "whole"
            else:
                mode = "skip"
            shared = owners[0][1] is owners[1][1] and not groups[0].get("split")
            bq, bk = _biases(site, wq.shape[0])
            fused = owners[0][1] if shared and mode == "whole" else None
            fused_bias = (_owner(bq, [(n, p) for n, p in named if p is not fused]) or (None, None))[1] \
                if fused is not None and bq is not None else None
            n_head = int(site.n_head)
            layers.append(_Layer(i, name, mode, wq, wk, bq, bk, fused, fused_bias, n_head,
                                 int(getattr(site, "n_kv_head", None) or n_head), man))
        if not layers:
            raise ValueError("qk_clip found no attention layer in the model (this package's GPT/Llama, Hugging Face "
                             "GPT-2, Llama or BERT attention)")
        return layers

    # ------------------------------------------------------------------------------------------------ the clip
    def on_step_end(self, ctx: TrainContext) -> None:
        self.steps += 1
        if ctx.batch is None:
            return
        if self._layers is None:
            self._layers = self.find(ctx.model, ctx.optimizer)
        self.clip(ctx.model, ctx.batch)

    @torch.no_grad()
    def clip(self, model: nn.Module, batch: Any) -> int:
        """Measure the per-head logit maxima on ``batch`` and rescale; returns the rescales made."""
        if self._layers is None:
            self._layers = self.find(model)
        maxima = _across_ranks(head_logit_maxima(model, batch, max_seqs=self.max_seqs))
        done = 0
        finite = [x for row in maxima for x in row if math.isfinite(x)]
        self.last_max = max(finite, default=math.nan)
        self.max_seen = max(self.max_seen, self.last_max) if finite else self.max_seen
        for layer, row in zip(self._layers, maxima):
            eta = [self.tau / x if math.isfinite(x) and x > self.tau * (1 + SLACK) else 1.0 for x in row]
            over = sum(e < 1.0 for e in eta)
            if not over:
                continue
            if layer.mode == "skip":
                self.skipped += over
            elif layer.mode == "whole":
                self._scale_whole(layer, min(eta))
                done += 1
            else:
                self._scale_heads(layer, eta)
                done += over
        self.rescales += done
        self.clips += bool(done)
        return done

    def _scale_heads(self, layer: _Layer, eta: Sequence[float]) -> None:
        H, Hkv = layer.n_head, layer.n_kv_head
        dq, dk = layer.wq.shape[0] // H, layer.wk.shape[0] // Hkv
        group = H // Hkv
        for h, e in enumerate(eta):
            if e < 1.0:
                s = e ** self.alpha
                layer.wq[h * dq:(h + 1) * dq].mul_(s)
                if layer.bq is not None:
                    layer.bq[h * dq:(h + 1) * dq].mul_(s)
        for g in range(Hkv):
            e = min(eta[g * group:(g + 1) * group])  # the largest logit among the query heads sharing key head g
            if e < 1.0:
                s = e ** (1.0 - self.alpha)
                layer.wk[g * dk:(g + 1) * dk].mul_(s)
                if layer.bk is not None:
                    layer.bk[g * dk:(g + 1) * dk].mul_(s)

    def _scale_whole(self, layer: _Layer, eta: float) -> None:
        if layer.fused is not None:  # Q, K, V share one Gram constraint: one scalar on all of it
            layer.fused.mul_(math.sqrt(eta))
            if layer.fused_bias is not None:
                layer.fused_bias.mul_(math.sqrt(eta))
            return
        for w, b, s in ((layer.wq, layer.bq, eta ** self.alpha), (layer.wk, layer.bk, eta ** (1.0 - self.alpha))):
            w.mul_(s)
            if b is not None:
                b.mul_(s)

    # ----------------------------------------------------------------------------------------------- records
    def metrics(self) -> dict[str, float]:
        """Numbers for the trainer's train lines: ``qk_clip_rescales``, ``qk_clip_skipped`` (whole run so far) and
        ``qk_clip_max_logit`` (the last check's largest logit, before its clip)."""
        return {"qk_clip_rescales": self.rescales, "qk_clip_skipped": self.skipped,
                "qk_clip_max_logit": self.last_max}

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "clips": self.clips, "rescales": self.rescales, "skipped": self.skipped,
                "max_logit_seen": self.max_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.clips = int(state["steps"]), int(state["clips"])
        self.rescales, self.skipped = int(state["rescales"]), int(state["skipped"])
        self.max_seen = float(state["max_logit_seen"])

    def summary(self) -> dict[str, Any]:
        """``qk_clip_tau``, ``alpha``, ``constrained``, ``steps``, ``clips``, ``rescales``, ``skipped``,
        ``max_logit_seen`` and the layers per mode (``layers_heads``, ``layers_whole``, ``layers_skipped``)."""
        modes = [la.mode for la in self._layers or []]
        return {"qk_clip_tau": self.tau, "alpha": self.alpha, "constrained": self.constrained, "steps": self.steps,
                "clips": self.clips, "rescales": self.rescales, "skipped": self.skipped,
                "max_logit_seen": self.max_seen, "layers_heads": modes.count("heads"),
                "layers_whole": modes.count("whole"), "layers_skipped": modes.count("skip")}
