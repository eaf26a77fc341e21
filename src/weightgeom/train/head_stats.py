"""Per-head attention statistics over training: a trainer callback for the mechanism runs.

The trainer's diagnostics (``[diagnostics] every``) record each attention layer's softmax entropy and saturation
averaged over its heads. The manifold-assignment paper's mechanism (σ growth → large logits → saturated softmax →
vanishing softmax Jacobian → instability) can act on a single head while the layer mean hides it, so
:class:`HeadStats` records the same statistics per head: every ``every`` optimizer steps (and at the last one), one
diagnostics forward of the step's batch (at most ``diagnostics.max_seqs`` sequences, the model in eval mode, the
RNG untouched) through :func:`weightgeom.diagnostics.collect` with ``per_head=True``, written to
``run_dir/heads.jsonl`` in ``metrics.jsonl``'s format: ``step``, ``split`` = ``"heads"``, and per layer i and head j
``attn.<i>.entropy_h<j>`` (nats), ``attn.<i>.saturation_h<j>`` (fraction of query rows whose max probability
exceeds ``diagnostics.saturation_threshold``), ``attn.<i>.logit_max_h<j>`` (max |logit|), plus
``attn.<i>.qk_sigma_prod``.

Declared in a recipe as the control ``head_stats_every`` (the interval), or ``callbacks=[HeadStats(25)]``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from weightgeom._files import open_append, write_atomic
from weightgeom.diagnostics.monitors import MAX_SEQS, SATURATION_THRESHOLD, collect
from weightgeom.train.callbacks import Callback, TrainContext
from weightgeom.train.logging import truncate_jsonl

__all__ = ["HeadStats", "HEADS_FILE"]

HEADS_FILE = "heads.jsonl"
"""File of a run directory :class:`HeadStats` writes to."""

_KEEP = re.compile(r"^attn\.\d+\.((logit_max|entropy|saturation)_h\d+|qk_sigma_prod)$")


class HeadStats(Callback):
    """Record softmax entropy, saturation and logit max per attention head every ``every`` steps (module docstring).

    Args:
        every: recording interval in optimizer steps (≥ 1).

    Raises:
        ValueError: ``every`` < 1 (at construction); FSDP shards (at the start of training).
    """

    def __init__(self, every: int) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"head_stats_every must be an integer >= 1 (optimizer steps), got {every!r}")
        self.every = every
        self.rows = 0
        self._path: Path | None = None
        self._max_seqs = MAX_SEQS
        self._threshold = SATURATION_THRESHOLD

    def on_train_start(self, ctx: TrainContext) -> None:
        if ctx.fsdp:
            raise ValueError("head_stats_every needs whole attention weights; it does not work with "
                             "run.parallel='fsdp'")
        diag = getattr(ctx.config, "diagnostics", None)
        self._max_seqs = int(getattr(diag, "max_seqs", MAX_SEQS))
        self._threshold = float(getattr(diag, "saturation_threshold", SATURATION_THRESHOLD))
        if not ctx.is_main:
            return
        self._path = Path(ctx.run_dir) / HEADS_FILE
        if ctx.resumed:  # the rows of steps this session redoes move to the .dropped file
            truncate_jsonl(self._path, ctx.step)
        else:
            write_atomic(self._path, "")

    def on_step_end(self, ctx: TrainContext) -> None:
        if self._path is None or ctx.batch is None or (ctx.step % self.every and ctx.step != ctx.max_steps):
            return
        rng = torch.get_rng_state()
        was_training = ctx.model.training
        try:
            d = collect(ctx.model, None, ctx.batch, grads=False, per_head=True, max_seqs=self._max_seqs,
                        threshold=self._threshold)
        finally:
            torch.set_rng_state(rng)
            ctx.model.train(was_training)
        row: dict[str, Any] = {"step": ctx.step, "split": "heads"}
        row.update({k: v for k, v in d.items() if _KEEP.match(k)})
        with open_append(self._path) as f:
            f.write(json.dumps(row) + "\n")
        self.rows += 1

    def summary(self) -> dict[str, Any]:
        """``head_stats_every`` and ``head_stats_rows`` (rows written this session)."""
        return {"head_stats_every": self.every, "head_stats_rows": self.rows}
