"""Recipe ``md`` (the MD paper, arXiv:2606.25971): LR sweep over widths for AdamW, Muon, AdamW+MD, Muon+MD; warmup
vs none; compute.

Variants:

* ``<opt>-w<width>-lr<lr>`` for every optimizer × width × LR of the grid (``kind = "lr"``): does the optimal LR
  stay put as the width grows (zero-shot transfer, the paper's claim for MD)?
* ``<opt>-w<width>-lr<lr>-warmup<W>`` (``kind = "warmup"``): the middle width at the centre LR of each optimizer,
  once with ``schedule.warmup = W`` (the LR-sweep runs at that point are the no-warmup arm, which the report pairs
  with them). The paper: MD needs no warmup.
* loss vs compute comes from the LR-sweep runs (6·N·tokens).

The preset's ``[sweep]`` table sets ``widths`` (values of the width key), ``width_key`` (``model.n_embd`` for GPT,
``model.dim`` for Llama, ``model.width`` for ResMLP), ``optimizers``, ``lrs.<optimizer>`` (grid per optimizer),
``warmup`` (steps, default 10% of max_steps) and ``seeds``. MD arms run without weight decay (paper recipe).
"""

from __future__ import annotations

from typing import Any

from weightgeom.experiments.runner import Recipe, Variant
from weightgeom.train.config import get_key

OPTIMIZERS = ("adamw", "muon", "adamw-md", "muon-md")
DEFAULT_LRS = {
    "adamw": [3e-4, 1e-3, 3e-3, 1e-2],
    "adamw-md": [3e-4, 1e-3, 3e-3, 1e-2],
    "muon": [0.005, 0.01, 0.02, 0.04],
    "muon-md": [0.005, 0.01, 0.02, 0.04],
}
DEFAULT_WIDTHS = {"gpt": [64, 128, 256], "llama": [64, 128, 256], "resmlp": [64, 128, 256]}
WIDTH_KEY = {"gpt": "model.n_embd", "llama": "model.dim", "resmlp": "model.width"}


def lr_key(opt: str) -> str:
    """The config key the LR sweep varies: the matrix LR for Muon, the AdamW LR for AdamW."""
    return "optim.adamw.lr" if opt.startswith("adamw") else "optim.muon.lr"


def variants(parts: dict[str, dict[str, Any]], sweep: dict[str, Any], steps: int | None = None) -> list[Variant]:
    """Optimizer × width × LR grid plus the warmup arm."""
    base = parts["main"]
    kind = str(get_key(base, "model.kind", "gpt"))
    wkey = str(sweep.get("width_key", WIDTH_KEY.get(kind, "model.n_embd")))
    widths = [int(w) for w in sweep.get("widths", DEFAULT_WIDTHS.get(kind, [64, 128, 256]))]
    opts = list(sweep.get("optimizers", OPTIMIZERS))
    lrs = {**DEFAULT_LRS, **dict(sweep.get("lrs", {}))}
    max_steps = int(steps or get_key(base, "train.max_steps", 1000))
    warm = int(sweep.get("warmup", max(1, max_steps // 10)))
    out: list[Variant] = []
    for opt in opts:
        if opt not in lrs:
            raise ValueError(f"md recipe: no LR grid for optimizer {opt!r} (set [sweep.lrs] {opt} = [...])")
        grid = [float(x) for x in lrs[opt]]
        extra: dict[str, Any] = {"optim.name": opt, "schedule.warmup": 0}
        if opt.endswith("-md"):
            extra["optim.adamw.weight_decay"] = 0.0
        for w in widths:
            for lr in grid:
                ov = {**extra, wkey: w, lr_key(opt): lr}
                out.append(Variant(f"{opt}-w{w}-lr{lr:g}", ov, f"{opt}, width {w}, lr {lr:g}", group=opt,
                                   tags={"kind": "lr", "optimizer": opt, "width": w, "lr": lr, "warmup": 0}))
        w = widths[len(widths) // 2]
        lr = grid[len(grid) // 2]
        ov = {**extra, wkey: w, lr_key(opt): lr, "schedule.warmup": warm}
        out.append(Variant(f"{opt}-w{w}-lr{lr:g}-warmup{warm}", ov, f"{opt}, width {w}, lr {lr:g}, warmup {warm}",
                           group=opt, tags={"kind": "warmup", "optimizer": opt, "width": w, "lr": lr,
                                            "warmup": warm}))
    return out


RECIPE = Recipe(
    name="md",
    default_config="tiny",
    default_seeds=(0,),
    variants=variants,
    doc="MD paper: LR × width sweep for adamw / muon / adamw-md / muon-md, warmup vs none, loss vs compute",
)
