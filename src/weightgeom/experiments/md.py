"""Recipe ``md`` (the MD paper, arXiv:2606.25971): LR sweep over widths for AdamW, Muon, AdamW+MD, Muon+MD; warmup
vs none; compute.

Variants:

* ``<opt>-w<width>-lr<lr>`` for every optimizer × width × LR of the grid (``kind = "lr"``): does the optimal LR
  stay put as the width grows (zero-shot transfer, the paper's claim for MD)?
* ``<opt>-w<width>-lr<lr>-warmup<W>`` (``kind = "warmup"``): the middle width at the centre LR of each optimizer,
  once with ``schedule.warmup = W`` (the LR-sweep runs at that point are the no-warmup arm, which the report pairs
  with them). The paper: MD needs no warmup.
* loss vs compute comes from the LR-sweep runs (6·N·tokens).
* ``<opt>-w<width>-lr<lr>-glr<g>`` (``kind = "gain_lr"``): the gains' Adam step size ``optim.md.gain_lr`` swept over
  ``gain_lrs`` for each MD optimizer of ``ablation_optimizers``, at the middle width and centre LR (the run at the
  base config's gain LR is the LR-sweep run at that point, which the report pairs with them).
* ``<opt>-w<width>-lr<lr>-<axis>-<value>`` (``kind = "ablation"``): the MD paper's ablations, one setting changed at
  a time at the same point — ``gains`` none / scalar / row / col (default row+col), ``parameterization`` exp /
  direct (default softplus), ``sphere`` row / col (default Frobenius), ``embeddings`` unit_rows (token and position
  embeddings kept at unit row L2 norm; default: left to the base optimizer). The default arm of every axis is the
  LR-sweep run at that point. The paper: row+col gains beat scalar or one-axis gains, softplus is slightly more
  consistent than exp or direct, the Frobenius sphere is about as good as row/col, unit-norm embeddings are
  slightly better.

The preset's ``[sweep]`` table sets ``widths`` (values of the width key), ``width_key`` (``model.n_embd`` for GPT,
``model.dim`` for Llama, ``model.width`` for ResMLP), ``optimizers``, ``lrs.<optimizer>`` (grid per optimizer),
``warmup`` (steps, default 10% of max_steps), ``seeds``, and the keys of :class:`MDSweepConfig` (``gain_lrs``,
``ablations``, ``ablation_optimizers``). MD arms run without weight decay (paper recipe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from weightgeom.experiments.runner import Recipe, Variant
from weightgeom.schema import ConfigError, Section, from_dict, setting
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

ABLATIONS: dict[str, tuple[str, ...]] = {
    "gains": ("none", "scalar", "row", "col"),
    "parameterization": ("exp", "direct"),
    "sphere": ("row", "col"),
    "embeddings": ("unit_rows",),
}
"""The MD paper's ablation axes (``optim.md.<axis>``) and the values the recipe runs; each axis's default
(row+col, softplus, frobenius, exclude) is the LR-sweep run at the same point."""


@dataclass
class MDSweepConfig(Section):
    """The ``[sweep]`` keys of the ``md`` recipe's gain-LR and ablation arms (the other ``[sweep]`` keys: module
    docstring)."""

    _prefix: ClassVar[str] = "sweep"

    gain_lrs: list[float] = setting([1e-4, 1e-3, 1e-2], "values of optim.md.gain_lr (Adam step size of the gains, "
                                    "gain-parameter units per step) swept for each MD optimizer", ge=0)
    ablations: list[str] = setting(list(ABLATIONS), "ablation axes to run: gains | parameterization | sphere | "
                                   "embeddings ([] for none)")
    ablation_optimizers: list[str] | None = setting(None, "MD optimizers that get the gain-LR and ablation arms "
                                                    "(unset: every -md optimizer of the sweep; [] for none)")

    def check(self) -> None:
        bad = [a for a in self.ablations if a not in ABLATIONS]
        if bad:
            raise ConfigError(f"config key sweep.ablations={self.ablations!r}: unknown axis {bad[0]!r}; choose from "
                              f"{', '.join(ABLATIONS)}")
        bad = [o for o in self.ablation_optimizers or [] if not str(o).endswith("-md")]
        if bad:
            raise ConfigError(f"config key sweep.ablation_optimizers={self.ablation_optimizers!r}: {bad[0]!r} is not "
                              f"an MD optimizer (adamw-md, muon-md)")


def sweep_config(sweep: dict[str, Any]) -> MDSweepConfig:
    """The typed :class:`MDSweepConfig` part of a preset's ``[sweep]`` table (other keys are the recipe's own)."""
    names = set(MDSweepConfig.__dataclass_fields__)
    return from_dict(MDSweepConfig, {k: v for k, v in sweep.items() if k in names})


def lr_key(opt: str) -> str:
    """The config key the LR sweep varies: the matrix LR for Muon, the AdamW LR for AdamW."""
    return "optim.adamw.lr" if opt.startswith("adamw") else "optim.muon.lr"


def variants(parts: dict[str, dict[str, Any]], sweep: dict[str, Any], steps: int | None = None) -> list[Variant]:
    """Optimizer × width × LR grid, the warmup arm, and the gain-LR and ablation arms of the MD optimizers."""
    base = parts["main"]
    kind = str(get_key(base, "model.kind", "gpt"))
    wkey = str(sweep.get("width_key", WIDTH_KEY.get(kind, "model.n_embd")))
    widths = [int(w) for w in sweep.get("widths", DEFAULT_WIDTHS.get(kind, [64, 128, 256]))]
    opts = list(sweep.get("optimizers", OPTIMIZERS))
    lrs = {**DEFAULT_LRS, **dict(sweep.get("lrs", {}))}
    max_steps = int(steps or get_key(base, "train.max_steps", 1000))
    warm = int(sweep.get("warmup", max(1, max_steps // 10)))
    extra_cfg = sweep_config(sweep)
    abl_opts = [o for o in opts if o.endswith("-md")] if extra_cfg.ablation_optimizers is None else [
        o for o in extra_cfg.ablation_optimizers if o in opts]
    base_glr = float(get_key(base, "optim.md.gain_lr", 1e-3))
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
        if opt not in abl_opts:
            continue
        point = {**extra, wkey: w, lr_key(opt): lr}
        tags = {"optimizer": opt, "width": w, "lr": lr, "warmup": 0}
        for g in extra_cfg.gain_lrs:
            if g == base_glr:
                continue  # the LR-sweep run at this point
            out.append(Variant(f"{opt}-w{w}-lr{lr:g}-glr{g:g}", {**point, "optim.md.gain_lr": g},
                               f"{opt}, width {w}, lr {lr:g}, gain lr {g:g}", group=opt,
                               tags={**tags, "kind": "gain_lr", "gain_lr": g}))
        for axis in extra_cfg.ablations:
            for value in ABLATIONS[axis]:
                out.append(Variant(f"{opt}-w{w}-lr{lr:g}-{axis}-{value}", {**point, f"optim.md.{axis}": value},
                                   f"{opt}, width {w}, lr {lr:g}, {axis} {value}", group=opt,
                                   tags={**tags, "kind": "ablation", "axis": axis, "value": value}))
    return out


RECIPE = Recipe(
    name="md",
    default_config="tiny",
    default_seeds=(0,),
    variants=variants,
    doc="MD paper: LR × width sweep for adamw / muon / adamw-md / muon-md, warmup vs none, loss vs compute",
)
