"""The manifolds recipe's boundary / attribution / mechanism presets, the ladder's stop at a diverged rung, the
stability-boundary table, strategy ``auto`` (AutoAssign) and per-head attention statistics."""

from __future__ import annotations

import json
import math
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import weightgeom.experiments.report.manifolds as report_manifolds
import weightgeom.experiments.runner as runner
from weightgeom.diagnostics.monitors import collect, logit_stats
from weightgeom.experiments.callbacks import build_callbacks
from weightgeom.experiments.cli import execute, get_recipe
from weightgeom.experiments.manifolds import ATTRIBUTION_ARMS, DEFAULT_LADDER, PAPER_STRATEGIES
from weightgeom.experiments.report.common import fmt
from weightgeom.experiments.report.manifolds import (
    attention_comparison,
    boundary_table,
    largest_stable_lr,
)
from weightgeom.experiments.runner import Variant, load_parts, plan, preset_dirs, run_sweep
from weightgeom.manifolds import get as get_manifold
from weightgeom.models import GPT, GPTConfig
from weightgeom.optim import Muon, MuonConfig, param_groups
from weightgeom.train import train
from weightgeom.train.auto_assign import AUTO_FILE, AutoAssign, logit_bound
from weightgeom.train.callbacks import TrainContext
from weightgeom.train.head_stats import HEADS_FILE, HeadStats

# the tests start from random weights: their retraction onto the manifold at the first step is expected
pytestmark = [pytest.mark.filterwarnings("ignore::weightgeom.optim.muon.FarRetractionWarning"),
              pytest.mark.usefixtures("one_torch_thread")]

TINY = {
    "run": {"device": "cpu"},
    "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "bias": False},
    "data": {"kind": "shakespeare", "tokenizer": "char", "block_size": 16, "batch_size": 4},
    "optim": {"name": "muon", "strategy": "auto", "muon": {"lr": 0.05, "dual": {"steps": 2}}},
    "schedule": {"kind": "constant"},
    "train": {"max_steps": 4, "eval_every": 0, "eval_iters": 1, "log_every": 1},
}


def _preset(name: str) -> Path:
    return preset_dirs()[0] / f"manifolds-{name}.toml"


# ------------------------------------------------------------------------------------------------------ planning
def test_boundary_preset_plans_ladders_that_stop_at_divergence():
    parts, sweep = load_parts("boundary", "manifolds")[1:]
    assert "boundary" in parts and sweep["seeds"] == [0, 1, 2]
    variants = get_recipe("manifolds").variants(parts, sweep, None)
    ladder = [v for v in variants if v.tags.get("study") == "boundary"]
    ours = [v for v in ladder if v.tags["algorithm"] == "ours"]
    assert [v.name for v in ours[:8]] == [f"unconstrained-ours-lr{lr:g}" for lr in DEFAULT_LADDER]
    assert {v.tags["strategy"] for v in ours} == set(PAPER_STRATEGIES)
    assert ours[0].after == "" and ours[1].after == ours[0].name and ours[7].after == ours[6].name
    v = next(v for v in ours if v.name == "all-dgram-ours-lr0.16")
    assert v.overrides["optim.strategy"] == "all-dgram" and v.overrides["optim.muon.lr"] == 0.16
    assert v.part == "boundary" and v.group == "all-dgram-ours"
    runs = plan("manifolds", variants, parts, seeds=[0, 2], only=["all-dgram-ours"])
    assert len(runs) == 16 and runs[2].name == "all-dgram-ours-lr0.01-s0"
    assert runs[2].after == "all-dgram-ours-lr0.005-s0" and runs[3].after == "all-dgram-ours-lr0.005-s2"
    assert runs[0].config["train"]["diverge_factor"] == 1.5
    # the after-chain only links planned variants: a rung chosen alone runs on its own
    assert plan("manifolds", variants, parts, [0], only=["all-dgram-ours-lr0.16"])[0].after == ""
    # the CPU preset runs the published algorithm with its msign in float32 (paper_msign_dtype)
    assert next(v for v in variants if v.name == "hetero-paper-lr0.04").overrides["optim.muon.msign_dtype"] == "float32"
    aparts, asweep = load_parts("attribution", "manifolds")[1:]
    attr = get_recipe("manifolds").variants(aparts, asweep, None)
    assert all(v.tags.get("study") == "attribution" and v.part == "attribution" for v in attr)
    assert {v.tags["strategy"] for v in attr} == {"all-dgram", "hetero-inv"}
    arms = {v.tags["arm"] for v in attr}
    assert {"ours", "sum-momentum", "bf16-msign"} <= arms and arms <= {"ours", "paper", "paper-fp32-msign",
                                                                       *ATTRIBUTION_ARMS}
    fp32 = next(v for v in attr if v.name == "attr-all-dgram-paper-fp32-msign")  # what bf16 changes, as a pair
    assert fp32.overrides["optim.muon.msign_dtype"] == "float32" and fp32.overrides["optim.preset"] == "paper"
    sm = next(v for v in attr if v.name == "attr-hetero-inv-sum-momentum")
    assert sm.overrides["optim.muon.momentum_form"] == "sum" and sm.overrides["optim.muon.lr"] == 0.32
    assert next(v for v in attr if v.name == "attr-all-dgram-paper").overrides["optim.muon.msign_dtype"] == "bfloat16"
    bf = next(v for v in attr if v.name == "attr-all-dgram-bf16-msign")
    assert bf.overrides["optim.muon.msign_dtype"] == "bfloat16" and bf.overrides["optim.muon.ns_steps"] == 10
    # the published algorithm: every [optim.muon] value of the preset forced, whatever the part's own [optim.muon]
    paper = next(v for v in variants if v.name == "all-dgram-paper-lr0.16")
    assert paper.overrides["optim.preset"] == "paper" and paper.overrides["optim.muon.dual.steps"] == 20
    assert paper.overrides["optim.muon.momentum_form"] == "sum" and paper.overrides["optim.muon.lr"] == 0.16
    cfg = plan("manifolds", variants, parts, [0], only=["all-dgram-paper-lr0.16"])[0].resolved()
    assert cfg["optim.muon.msign_method"] == "polar_express_paper" and cfg["optim.muon.retraction"] == "paper"
    assert cfg["optim.muon.dual.steps"] == 20 and cfg["optim.muon.dual.keep"] == "last"
    assert plan("manifolds", variants, parts, [0], only=["all-dgram-ours-lr0.16"])[0].resolved()[
        "optim.muon.dual.steps"] == MuonConfig().dual.steps  # ours: the library's defaults


def test_mechanism_and_main_presets_declare_their_controls():
    parts, sweep = load_parts("mechanism", "manifolds")[1:]
    assert sweep["mechanism_algorithms"] == ["paper"]
    variants = get_recipe("manifolds").variants(parts, {**sweep, "mechanism_algorithms": ["ours", "paper"]}, None)
    steps = parts["mechanism"]["train"]["max_steps"]
    demo_steps = load_parts("tiny-shakespeare", "manifolds")[1]["main"]["train"]["max_steps"]
    assert steps >= 4 * demo_steps
    assert variants and all(v.controls.get("head_stats_every") for v in variants)
    assert {v.tags["strategy"] for v in variants} >= {"all-dgram", "hetero"}
    parts, sweep = load_parts("tiny-shakespeare", "manifolds")[1:]
    auto = next(v for v in get_recipe("manifolds").variants(parts, sweep, None) if v.name == "auto")
    assert auto.overrides["optim.strategy"] == "auto" and auto.controls["auto_assign"]["threshold"] > 0
    assert isinstance(build_callbacks(auto.controls)[0], AutoAssign)


def test_long_preset_plans_the_published_algorithm_at_four_learning_rates():
    parts, sweep = load_parts("long", "manifolds")[1:]
    variants = get_recipe("manifolds").variants(parts, sweep, None)
    assert len(variants) == 16 and all(v.tags["study"] == "long" and v.part == "long" for v in variants)
    assert {v.tags["strategy"] for v in variants} == {"all-dgram", "hetero-inv", "hetero", "all-stiefel"}
    demo = load_parts("tiny-shakespeare", "manifolds")[1]["main"]
    assert parts["long"]["model"] == {k: demo["model"][k] for k in parts["long"]["model"]}  # the demo's model
    lrs = sorted({v.overrides["optim.muon.lr"] for v in variants})
    assert lrs == [demo["optim"]["muon"]["lr"] * m for m in (1, 2, 4, 8)]
    assert all(v.overrides["optim.preset"] == "paper" and v.overrides["optim.muon.dual.steps"] == 20
               and v.overrides["optim.muon.msign_dtype"] == "float32" and v.tags["msign_dtype"] == "float32"
               and v.controls == {"head_stats_every": 50} for v in variants)
    train_cfg, sched = parts["long"]["train"], parts["long"]["schedule"]
    assert train_cfg["max_steps"] >= 3000 and parts["long"]["diagnostics"]["every"] == 50
    # warm-up and cosine decay shaped as published: 1000 of 50000 steps (2 %), down to lr/10
    assert sched["kind"] == "cosine" and sched["warmup"] == 0.02 * train_cfg["max_steps"]
    assert sched["min_lr_ratio"] == 0.1
    # the first round of jobs holds every strategy at ×1; the ×8 runs are not all queued behind the rest
    assert [v.tags["lr_multiplier"] for v in variants[:4]] == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="long_lr_multipliers"):
        get_recipe("manifolds").variants(parts, {**sweep, "long_lr_multipliers": [0]}, None)


class _Run:
    """The attributes of a run the long-run record reads (its series come from the monkeypatched readers)."""

    def __init__(self, name: str, strategy: str, diverged_at: int | None):
        self.name, self.diverged = name, diverged_at is not None
        self.tags = {"strategy": strategy, "lr": 0.16, "lr_multiplier": 8, "msign_dtype": "float32"}
        self.status = {"step": diverged_at if diverged_at is not None else 3000}
        self.experiment = {"overrides": {"optim.strategy": strategy}}
        self.config = {"optim": {"strategy": strategy}}


@pytest.mark.parametrize("sat,diverged_at,follows", [
    ([0.0, 0.01, 0.2, 0.3], 400, "yes (saturated at 200, diverged at 400)"),
    ([0.0, 0.0, 0.0, 0.0], 400, "no: diverged at 400 without saturation"),
    ([0.0, 0.0, 0.0, 0.3], 200, "no: diverged at 200 without saturation"),  # saturation only after it
    ([0.0, 0.2, 0.3, 0.3], None, "no divergence"),
])
def test_long_record_says_whether_divergence_followed_saturation(monkeypatch, sat, diverged_at, follows):
    steps = [0, 100, 200, 300]
    series = {"qk_sigma_prod": [0.1, 1.0, 2.5, 4.0], "logit_max": [0.5, 5.0, 12.0, 30.0]}
    monkeypatch.setattr(report_manifolds, "diag_aggregate", lambda run, suffix, how="max": pd.Series(
        series[suffix], index=steps))
    monkeypatch.setattr(report_manifolds, "head_saturation_series", lambda run: pd.Series(sat, index=steps))
    monkeypatch.setattr(report_manifolds, "loss_series", lambda run, split="val": pd.Series([3.0, 2.0],
                                                                                             index=[0, 300]))
    rec = report_manifolds.long_record(_Run("r", "all-dgram", diverged_at))
    assert rec["follows"] == follows
    assert rec["sigma_at"] == 200 and rec["logit_at"] == 200  # first step above 2 and above 10
    assert rec["sigma"] == (0.1, 4.0) and rec["attn"] == "dgram"
    assert rec["sat_at"] == next((s for s, v in zip(steps, sat) if v > 0.05), None)
    stiefel = report_manifolds.long_record(_Run("q", "all-stiefel", None))
    verdict = "\n".join(report_manifolds.long_verdict([rec, stiefel]))
    if diverged_at is None:
        assert "Diverged: DGram attention 0 of 1; Stiefel attention 0 of 1" in verdict
        assert "**Not reproduced at this size**: no run diverged" in verdict
        assert "a run at the peak learning rate (`weightgeom sweep manifolds long-const`)" in verdict
    else:
        assert f"DGram attention 1 of 1 (all-dgram ×8 at step {diverged_at})" in verdict
        assert "**Reproduced at this size**" in verdict



@pytest.mark.parametrize("schedule,steps,says", [
    ("cosine", 3000, "a run at the peak learning rate (`weightgeom sweep manifolds long-const`) or the paper's"),
    ("constant", 10000, "held the peak learning rate for 10,000 steps; the next larger setting is a run to the "
                        "paper's blow-up steps (`--steps 20000`) or the paper's own model"),
    ("constant", 20000, "held the peak learning rate for 20,000 steps; the next larger setting is the paper's own "
                        "model"),
])
def test_long_verdict_names_a_next_setting_the_runs_have_not_already_been(schedule, steps, says):
    """Runs in which nothing diverged point to the next larger setting: never to a length they already ran."""
    recs = [{"attn": attn, "diverged": None, "strategy": s, "mult": 8, "sat": 0.5, "logit": (1.0, 30.0),
             "sigma": (1.0, 2.0), "sat_at": None, "schedule": schedule, "steps": steps}
            for attn, s in (("dgram", "all-dgram"), ("stiefel", "hetero"))]
    verdict = "\n".join(report_manifolds.long_verdict(recs))
    assert "**Not reproduced at this size**: no run diverged." in verdict and says in verdict
    assert "`--steps 10000`" not in verdict

def test_trend_recovers_a_planted_growth_rate_and_extrapolates_it():
    steps = np.arange(2000, 10001, 50)
    sigma = pd.Series(2.0 * 1.5 ** (steps / 1000), index=steps)
    per, (at15, at20) = report_manifolds.trend(sigma, 6000, log=True)
    assert per == pytest.approx(1.5, rel=1e-9)
    assert at15 == pytest.approx(2.0 * 1.5 ** 15, rel=1e-9) and at20 == pytest.approx(2.0 * 1.5 ** 20, rel=1e-9)
    sat = pd.Series(0.02 + 0.01 * steps / 1000, index=steps)
    per, (at15, at20) = report_manifolds.trend(sat, 6000, log=False)
    assert per == pytest.approx(0.01) and at15 == pytest.approx(0.17) and at20 == pytest.approx(0.22)
    per, at = report_manifolds.trend(pd.Series(0.3 + 0.1 * steps / 1000, index=steps), 6000, log=False)
    assert at == [1.0, 1.0]  # a fraction: the line is clipped to [0, 1]
    per, at = report_manifolds.trend(sigma.iloc[:2], 0, log=True)  # too few points: no line
    assert math.isnan(per) and all(math.isnan(v) for v in at)
    per, at = report_manifolds.trend(sigma.loc[:2900], 0, log=True)  # 900 steps: too short a span to extrapolate
    assert math.isnan(per) and all(math.isnan(v) for v in at)
    steep = pd.Series(np.exp(0.06 * steps), index=steps)  # grows past the float range by step 20,000: inf, no error
    per, at = report_manifolds.trend(steep, 6000, log=True)
    assert per == pytest.approx(math.exp(60)) and at == [math.inf, math.inf]


def test_constant_lr_report_gives_the_divergence_step_or_the_growth_and_the_training_time(monkeypatch):
    """`long-const`'s report: a diverged DGram-attention run by its step, one that ran to the end by its growth per
    1,000 steps (fitted on the later half after warm-up) and the values extrapolated to the paper's 15k/20k."""
    steps = list(range(0, 10001, 50))
    grow = {"qk_sigma_prod": [2.0 * 1.2 ** (s / 1000) for s in steps], "logit_max": [10.0 * 1.1 ** (s / 1000)
                                                                                        for s in steps]}
    monkeypatch.setattr(report_manifolds, "diag_aggregate", lambda run, suffix, how="max": pd.Series(
        grow[suffix], index=steps))
    monkeypatch.setattr(report_manifolds, "head_saturation_series", lambda run: pd.Series(
        [0.1 + 0.005 * s / 1000 for s in steps], index=steps))
    monkeypatch.setattr(report_manifolds, "loss_series", lambda run, split="val": pd.Series([3.0, 2.0],
                                                                                             index=[0, 10000]))
    monkeypatch.setattr(report_manifolds, "run_file", lambda run, name, shape: {"device_kind": "CPU test"})
    runs = [_Run("d", "all-dgram", None), _Run("h", "hetero-inv", 4200), _Run("s", "hetero", None)]
    for r in runs:
        r.status["step"] = 10000 if not r.diverged else r.status["step"]
        r.config["schedule"] = {"kind": "constant", "warmup": 200}
        r.experiment["final"] = {"train_time_s": 3600.0}
    lines = "\n".join(report_manifolds.constant_lr_lines([report_manifolds.long_record(r) for r in runs]))
    assert "- all-dgram ×8: no divergence in 10,000 steps. Over steps 5,100–10,000, σQ·σK changes ×1.2 per " in lines
    assert f"line at 15k/20k: {fmt(2.0 * 1.2 ** 15)}/{fmt(2.0 * 1.2 ** 20)}" in lines
    assert "logit max ×1.1 (" in lines and "head saturation +0.005 (" in lines
    assert "- hetero-inv ×8: diverged at step 4200." in lines
    assert "hetero ×8" not in lines.split("| ")[-1] and "- hetero ×8" not in lines  # Stiefel attention: table only
    assert "3.0 h over 3 of 3 runs, on CPU test" in lines
    cosine = report_manifolds.long_record(_Run("c", "all-dgram", None))  # no schedule recorded: not constant
    assert report_manifolds.constant_lr_lines([cosine]) == []
    unknown = _Run("u", "all-dgram", 4200)
    unknown.status = {}  # a diverged run whose status.json step was unusable: its last train step, never 0
    monkeypatch.setattr(report_manifolds, "loss_series", lambda run, split="val": pd.Series([3.0, 9.0],
                                                                                             index=[0, 4150]))
    unknown.diverged = True
    assert report_manifolds.long_record(unknown)["diverged"] == 4150


def test_the_report_says_where_the_attention_scale_sits_at_the_newest_checkpoint(tmp_path):
    """From a run's newest checkpoint, with the model rebuilt from its config: σQ·σK on the weights, the input norm's
    gain and the product with it folded in. A checkpoint whose weights moved ×1/30 into a ×30 gain shows σQ·σK ÷ 900
    and the same folded product; a corrupt checkpoint or one of another model is a problem line, not an error."""
    from weightgeom.train.checkpoint import checkpoint_name, save_checkpoint

    model_cfg = {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "vocab_size": 32, "block_size": 8,
                 "bias": False}
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{k: v for k, v in model_cfg.items() if k != "kind"}))

    def run_at(name: str, step: int) -> _Run:
        r = _Run(name, "all-dgram+qk-clip", None)
        r.path, r.problems = tmp_path / name, []
        r.config = {"model": model_cfg, "schedule": {"kind": "constant"}}
        (r.path / "checkpoints").mkdir(parents=True)
        save_checkpoint(r.path / "checkpoints" / checkpoint_name(step), {"model": model.state_dict(), "step": step})
        return r

    base = report_manifolds.scale_at_last_checkpoint(run_at("base", 500))
    with torch.no_grad():
        for blk in model.transformer.h:
            blk.attn.c_attn.weight /= 30.0
            blk.ln_1.weight *= 30.0
    moved_run = run_at("moved", 1000)
    moved = report_manifolds.scale_at_last_checkpoint(moved_run)
    assert moved["step"] == 1000 and moved["gain"] == pytest.approx(30.0) and base["gain"] == pytest.approx(1.0)
    assert moved["sigma"] == pytest.approx(base["sigma"] / 900, rel=1e-4)
    assert moved["sigma_gain"] == pytest.approx(base["sigma_gain"], rel=1e-4)
    assert base["sigma_gain"] == pytest.approx(base["sigma"], rel=1e-6)  # unit gain: the same product
    rec = {"run": moved_run, "schedule": "constant", "strategy": "all-dgram+qk-clip", "mult": 8,
           "curves": (None, pd.Series([3.0, 12.5]), None, None)}
    text = "\n".join(report_manifolds.scale_lines([rec]))
    assert f"| `moved` | all-dgram+qk-clip | ×8 | 1,000 | {fmt(moved['sigma'])} | 30.000 |" in text
    other = run_at("other", 500)
    other.config["model"] = {**model_cfg, "n_embd": 32}
    (tmp_path / "bad" / "checkpoints").mkdir(parents=True)
    bad = _Run("bad", "all-dgram", None)
    bad.path, bad.problems, bad.config = tmp_path / "bad", [], {"model": model_cfg}
    (bad.path / "checkpoints" / checkpoint_name(500)).write_bytes(b"WGCKPT2 0 5\nhello")
    for r in (other, bad):
        assert report_manifolds.scale_at_last_checkpoint(r) is None
        assert len(r.problems) == 1 and "attention scale not computed from" in r.problems[0], r.problems
    # what a checkpoint may not make the report do: crash the section on its step, allocate beyond the file (a
    # stride-0 view claiming a 4096² matrix from one float), build more layers than it has
    odd_step = run_at("odd-step", 5)
    save_checkpoint(odd_step.path / "checkpoints" / checkpoint_name(6), {"model": model.state_dict(), "step": "abc"})
    big = {k: v for k, v in model.state_dict().items()}
    big["transformer.h.0.attn.c_attn.weight"] = torch.ones(1).expand(4096, 4096)
    expanded = run_at("expanded", 5)
    save_checkpoint(expanded.path / "checkpoints" / checkpoint_name(6), {"model": big, "step": 6})
    deep = run_at("deep", 5)
    deep.config["model"] = {**model_cfg, "n_layer": 1_000_000}
    for r, why in ((odd_step, "its step is 'abc'"), (expanded, "claim"), (deep, "model.n_layer = 1000000 but the "
                                                                             "checkpoint has 2 layers")):
        assert report_manifolds.scale_at_last_checkpoint(r) is None and why in r.problems[0], r.problems
    empty = run_at("empty", 5)
    (empty.path / "checkpoints" / checkpoint_name(5)).unlink()
    assert report_manifolds.scale_at_last_checkpoint(empty) is None and not empty.problems  # nothing to say


def test_report_names_the_msign_arithmetic_of_the_published_algorithm():
    run = _Run("r", "all-dgram", None)
    run.tags["algorithm"] = "paper"
    run.config = {"optim": {"muon": {"msign_dtype": "float32"}}}
    assert report_manifolds.algorithm_label(run) == "paper (dual-ascent msign float32)"
    run.config = {"optim": {"muon": {"msign_dtype": "bfloat16"}}}
    assert report_manifolds.algorithm_label(run) == "paper"  # as published: nothing to say
    run.tags["algorithm"] = "ours"
    run.config = {"optim": {"muon": {"msign_dtype": "float32"}}}
    assert report_manifolds.algorithm_label(run) == "ours"
    rec = {"strategy": "all-dgram", "diverged": False, "val_loss": 3.2, "sigma_growth": 2.0, "saturation": 0.01,
           "logit_max": 9.0, "seed": 0, "step": 60}
    lines = report_manifolds.bf16_lines([{**rec, "arm": "paper"}, {**rec, "arm": "paper-fp32-msign",
                                                                  "sigma_growth": 3.0}])
    assert len(lines) == 4 and lines[2].startswith("- `all-dgram`: bf16 msign (as published) val loss 3.2")
    assert "float32 msign val loss 3.2" in lines[2] and "×3.000" in lines[2]
    assert report_manifolds.bf16_lines([{**rec, "arm": "paper"}]) == []  # the pair is needed


def test_log_axes_of_report_plots_have_plain_tick_labels():
    """Mathtext is off in report plots (names from run directories are never parsed), so matplotlib's log formatter
    printed its ticks as raw "$\\mathdefault{10^{1}}$"; every log axis gets plain labels when a plot is saved."""
    from weightgeom.experiments.report.common import _plain_log_ticks, _plt

    fig, (a, b) = _plt().subplots(1, 2)
    a.plot([1, 2, 3], [0.17, 1.0, 5.0])
    a.set_yscale("log")
    b.plot([1, 1e4], [1, 2])
    b.set_xscale("log")
    _plain_log_ticks(fig)
    fig.canvas.draw()
    labels = [t.get_text() for ax in (a, b) for axis in (ax.xaxis, ax.yaxis)
              for t in axis.get_ticklabels(which="both")]
    assert labels and not any("$" in t or "mathdefault" in t for t in labels), labels
    assert {"0.2", "0.5", "1", "2", "5"} <= set(labels) and {"1", "10", "100"} <= set(labels)
    _plt().close(fig)


def test_unknown_strategy_in_the_sweep_table_is_one_line():
    parts, sweep = load_parts("boundary", "manifolds")[1:]
    with pytest.raises(ValueError, match="strategies: unknown strategy 'all-dgramm'"):
        get_recipe("manifolds").variants(parts, {**sweep, "strategies": ["all-dgramm"]}, None)


# ---------------------------------------------------------------------------------------- ladder stop in the runner
def _fake_ladder_train(spec, run_dir: Path, progress: bool) -> dict:
    """A rung diverges (at step 7) from lr 0.04 up; below it trains."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lr = spec.config["optim"]["muon"]["lr"]
    state, step = ("diverged", 7) if lr >= 0.04 else ("done", 10)
    (run_dir / "status.json").write_text(json.dumps({"state": state, "step": step}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "split": "val", "loss": 4.0}) + "\n")
    return {"status": state, "step": step, "final": {}}


def _threaded(self, todo):
    """``_Sweep.run_parallel`` with threads for worker processes: the pool's scheduling, in this process."""
    ex = ThreadPoolExecutor(max_workers=self.jobs)
    self._drive_pool(ex, todo, wait, FIRST_COMPLETED)
    ex.shutdown(wait=True)


@pytest.mark.parametrize("jobs", [1, 2])
def test_ladder_stops_at_the_first_diverged_rung(tmp_path, monkeypatch, jobs):
    base = {"main": dict(TINY)}
    variants, prev = [], ""
    for lr in (0.01, 0.02, 0.04, 0.08, 0.16):
        name = f"r{lr:g}"
        variants.append(Variant(name, {"optim.muon.lr": lr}, after=prev))
        prev = name
    runs = plan("manifolds", variants, base, seeds=[0, 1])
    monkeypatch.setattr(runner._Sweep, "run_parallel", _threaded)
    man = run_sweep(runs, tmp_path / "sw", train_fn=_fake_ladder_train, progress=False, jobs=jobs)
    by = {r["name"]: r for r in man["runs"]}
    for s in (0, 1):
        assert by[f"r0.02-s{s}"]["status"] == "done" and by[f"r0.04-s{s}"]["status"] == "diverged"
        for lr in ("0.08", "0.16"):
            rec = by[f"r{lr}-s{s}"]
            assert rec["status"] == "skipped" and f"r0.04-s{s} diverged at step 7" in rec["reason"]
            assert not (tmp_path / "sw" / f"r{lr}-s{s}").exists()
    # a re-run decides again (and skips again) instead of trusting the old record
    man = run_sweep(runs, tmp_path / "sw", train_fn=_fake_ladder_train, progress=False)
    assert {r["status"] for r in man["runs"] if r["name"].startswith("r0.16")} == {"skipped"}


# ------------------------------------------------------------------------------------------------ boundary table
def _rec(strategy, lr, seed, state="done", val=2.5, step=40, alg="ours"):
    return {"strategy": strategy, "algorithm": alg, "lr": lr, "seed": seed, "state": state, "step": step,
            "val_loss": val if state == "done" else float("nan"), "val_loss0": 4.2}


def test_boundary_table_from_run_records():
    ladder = [0.01, 0.02, 0.04, 0.08]
    recs = []
    for seed in (0, 1, 2):
        # DGram attention: 0.04 diverges (seed 2 already at 0.02, step 5); Stiefel attention: stable to the top
        recs += [_rec("all-dgram", 0.01, seed)]
        if seed == 2:
            recs += [_rec("all-dgram", 0.02, seed, "diverged", step=5)]
        else:
            recs += [_rec("all-dgram", 0.02, seed), _rec("all-dgram", 0.04, seed, "diverged", step=12 + seed)]
        recs += [_rec("hetero", lr, seed, val=2.4) for lr in ladder]
    assert largest_stable_lr([r for r in recs if r["strategy"] == "all-dgram" and r["seed"] == 0], ladder) == (0.02,
                                                                                                            False)
    assert largest_stable_lr([r for r in recs if r["strategy"] == "hetero" and r["seed"] == 0], ladder) == (0.08,
                                                                                                         True)
    # a rung whose loss never went below the initial one does not count as training
    stuck = [_rec("x", 0.01, 0), _rec("x", 0.02, 0, val=4.3)]
    assert largest_stable_lr(stuck, [0.01, 0.02]) == (0.01, False)
    assert largest_stable_lr([_rec("x", 0.01, 0, "diverged", step=3)], [0.01]) == (None, False)
    # a rung not run yet above a stable one: the ladder is unfinished (a report of a running sweep), not broken
    assert largest_stable_lr([_rec("x", 0.01, 0)], [0.01, 0.02]) == (0.01, None)
    assert attention_comparison([_rec("all-dgram", 0.01, 0), _rec("hetero", 0.01, 0)], [0.01, 0.02]) == []
    header, rows = boundary_table(recs, ladder)
    assert header[:3] == ["strategy", "algorithm", "largest stable LR (per seed)"] and header[-2].startswith("first")
    dg = next(r for r in rows if r[0] == "`all-dgram`")
    assert dg[2] == "0.02, 0.02, 0.01"
    assert dg[3] == "2.500" and dg[4] == "2.500 (1 div)" and dg[5] == "div@12" and dg[6] == "—"
    assert dg[-2] == "0.02, step 5 (3/3 seeds diverged)" and dg[-1] == "none"
    st = next(r for r in rows if r[0] == "`hetero`")
    assert st[2].startswith("≥ 0.08 (none diverged)") and st[-2] == "none"
    _, rows = boundary_table(stuck, [0.01, 0.02])
    assert rows[0][4] == "4.300 (1 no progress)" and rows[0][-1] == "0.02"
    lines = attention_comparison(recs, ladder)
    assert len(lines) == 1 and "reproduced" in lines[0] and "`all-dgram` (DGram attention) vs `hetero`" in lines[0]
    # swapped roles: Stiefel attention breaks first → reversed
    swapped = [{**r, "strategy": {"all-dgram": "hetero", "hetero": "all-dgram"}[r["strategy"]]} for r in recs]
    assert "**reversed**" in attention_comparison(swapped, ladder)[0]
    both = [r for r in recs if r["strategy"] == "hetero"] + [{**r, "strategy": "all-dgram"} for r in recs
                                                              if r["strategy"] == "hetero"]
    assert "both boundaries lie above the ladder's top rung" in attention_comparison(both, ladder)[0]
    assert boundary_table(both, ladder)[1][0][2] == "≥ 0.08 (none diverged) (all 3 seeds)"


# -------------------------------------------------------------------------------------------------- strategy auto
def _auto_setup(threshold: float):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8))
    opt = Muon(param_groups(model, "auto", lr=0.05, dual={"steps": 2}, verbose=False))
    cb = AutoAssign(threshold=threshold)
    ctx = TrainContext(model=model, optimizer=opt, config=None, run_dir=Path("."), max_steps=10, is_main=False)
    cb.on_train_start(ctx)
    return model, opt, cb, ctx


def _step(model, opt, cb, ctx, k):
    x = torch.randint(0, 32, (4, 8))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    ctx.step = k
    cb.on_step_end(ctx)


def test_auto_strategy_groups_each_attention_matrix_alone():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8))
    groups = param_groups(model, "auto", verbose=False)
    attn = [g for g in groups if any(".attn." in n for n in g["names"])]
    assert len(attn) == 4 and all(len(g["params"]) == 1 and g["manifold"] == "dgram" for g in attn)
    mlp = [g for g in groups if any(".mlp." in n for n in g["names"])]
    assert len(mlp) == 1 and mlp[0]["manifold"] == "dgram"
    with pytest.raises(ValueError, match="shares its optimizer group"):  # ALL-DGRAM merges them: no auto there
        AutoAssign(1.0).on_train_start(TrainContext(model=model, optimizer=Muon(param_groups(
            model, "all-dgram", verbose=False)), config=None, run_dir=Path("."), is_main=False))


def test_auto_moves_a_layer_to_stiefel_when_its_logit_bound_crosses():
    model, opt, cb, ctx = _auto_setup(threshold=1e-3)  # any bound crosses: every layer moves at the first check
    _step(model, opt, cb, ctx, 1)
    assert [m["layer"] for m in cb.moves] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert all(m["step"] == 1 and m["bound"] > 1e-3 for m in cb.moves)
    stiefel = get_manifold("stiefel")
    for i in range(2):
        p = model.transformer.h[i].attn.c_attn.weight
        g = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
        assert g["manifold"] == "stiefel"
        assert stiefel.check(p.detach(), 1e-4).ok  # retracted at the switch
        assert "dual_multiplier" not in opt.state[p]
        assert cb.moves[i]["qk_sigma_prod_after"] <= 1.0 + 1e-4
    c_proj = model.transformer.h[0].attn.c_proj.weight  # not in the logit bound: stays DGram
    assert next(g for g in opt.param_groups if any(q is c_proj for q in g["params"]))["manifold"] == "dgram"
    _step(model, opt, cb, ctx, 2)  # the moved layers keep training on Stiefel
    assert stiefel.check(model.transformer.h[0].attn.c_attn.weight.detach(), 1e-3).ok and len(cb.moves) == 2
    # a threshold above every bound moves nothing
    model, opt, cb, ctx = _auto_setup(threshold=1e6)
    _step(model, opt, cb, ctx, 1)
    assert cb.moves == [] and all(g["manifold"] in ("dgram", None) for g in opt.param_groups)
    assert 0 < max(cb.max_bound.values()) < 1e6


def test_logit_bound_bounds_the_logits():
    model, opt, cb, ctx = _auto_setup(threshold=1e6)
    _step(model, opt, cb, ctx, 1)
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.weight.mul_(30.0)  # large logits in layer 1
    x = torch.randint(0, 32, (4, 8))
    model.train()
    model(x)  # the training forward the bound is measured on
    cb.max_bound.clear()
    ctx.step = 2
    cb.on_step_end(ctx)
    d = collect(model, x, grads=False)
    for i in range(2):
        bound = cb.max_bound[f"transformer.h.{i}.attn"]
        assert 0.01 * bound < d[f"attn.{i}.logit_max"] <= bound * (1 + 1e-5)
    assert cb.max_bound["transformer.h.1.attn"] > 100 * cb.max_bound["transformer.h.0.attn"]
    assert logit_bound(2.0, 16.0, 4) == pytest.approx(16.0)
    with pytest.raises(ValueError, match="controls.auto_assign.threshold"):
        AutoAssign(threshold=-1)
    with pytest.raises(ValueError, match="controls.auto_assign.action"):
        AutoAssign(threshold=1.0, action="oblique")


def test_auto_in_training_records_the_move_and_resumes(tmp_path):
    cfg = {**TINY, "train": {**TINY["train"], "ckpt_every": 2}}
    res = train(cfg, run_dir=tmp_path / "r", progress=False, callbacks=[AutoAssign(threshold=1e-3, every=2)])
    assert res["status"] == "done"
    rows = [json.loads(line) for line in (tmp_path / "r" / AUTO_FILE).read_text().splitlines()]
    moves = [r for r in rows if r.get("event") == "move"]
    assert len(moves) == 2 and {m["step"] for m in moves} == {2}
    assert any(r.get("attn.0.moved") == 1 and "attn.0.logit_bound" in r for r in rows)
    # resume past the end: the optimizer's checkpoint still has the moved groups on Stiefel, the callback its moves
    cb = AutoAssign(threshold=1e-3, every=2)
    res = train({**cfg, "train": {**cfg["train"], "max_steps": 6}}, run_dir=tmp_path / "r", progress=False,
                callbacks=[cb])
    assert res["status"] == "done" and len(cb.moves) == 2 and cb.summary()["auto_layers"] == 2


def test_strategy_auto_alone_runs_the_rule(tmp_path):
    """`optim.strategy = "auto"` without an AutoAssign callback gets one (the trainer adds it): the run watches its
    attention layers instead of training as plain ALL-DGRAM."""
    res = train(TINY, run_dir=tmp_path / "r", progress=False)
    assert res["status"] == "done"
    rows = [json.loads(line) for line in (tmp_path / "r" / AUTO_FILE).read_text().splitlines()]
    assert rows and all("attn.0.logit_bound" in r for r in rows if r.get("event") != "move")


# ------------------------------------------------------------------------------------------------ per-head statistics
def test_logit_stats_per_head_matches_each_head_alone():
    T = 6
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    z = (torch.randn(2, 3, T, T) * torch.tensor([0.1, 5.0, 100.0])[None, :, None, None]).masked_fill(
        ~mask, float("-inf"))
    st = logit_stats(z, per_head=True)
    for j in range(3):
        one = logit_stats(z[:, j:j + 1])
        for k in ("logit_max", "entropy", "saturation"):
            assert st[f"{k}_h{j}"] == pytest.approx(one[k], rel=1e-6, abs=1e-7)
    assert st["saturation_h2"] > st["saturation_h0"] and st["entropy_h2"] < st["entropy_h0"]
    assert "entropy_h0" not in logit_stats(z)


def test_head_stats_recorder_writes_per_head_rows(tmp_path):
    cfg = {**TINY, "optim": {**TINY["optim"], "strategy": "all-dgram"}}
    res = train(cfg, run_dir=tmp_path / "h", progress=False, callbacks=[HeadStats(2)])
    assert res["status"] == "done"
    rows = [json.loads(line) for line in (tmp_path / "h" / HEADS_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    keys = {k for k in rows[0] if k.startswith("attn.")}
    assert {f"attn.{i}.{m}_h{j}" for i in range(2) for j in range(2) for m in ("entropy", "saturation",
                                                                             "logit_max")} <= keys
    assert all(math.isfinite(rows[-1][k]) for k in keys)
    with pytest.raises(ValueError, match="head_stats_every"):
        build_callbacks({"head_stats_every": 0})


# ------------------------------------------------------------------------------------------------- end to end
def test_long_preset_end_to_end_tiny(tmp_path):
    text = _preset("long").read_text().replace("head_stats_every = 50", "head_stats_every = 2").replace(
        "diagnostics = { every = 50 }", "diagnostics = { every = 2 }")
    cfg = tmp_path / "manifolds-long-tiny.toml"
    cfg.write_text(text)
    manifest, path = execute("manifolds", str(cfg), seeds=[0], steps=6, out=tmp_path / "sw", progress=False,
                             only=["long-all-dgram-x8", "long-all-stiefel-x8"], threads=1)
    assert {r["status"] for r in manifest["runs"]} <= {"done", "diverged"} and len(manifest["runs"]) == 2
    report = path.read_text()
    assert "### The instability at length (the published algorithm)" in report
    assert "the dual ascent's msign in float32 — not the published bfloat16" in report
    row = next(line for line in report.splitlines() if line.startswith("| `long-all-dgram-x8-s0` |"))
    assert "| all-dgram | 0.16 (×8) | float32 | 6 |" in row, row
    assert "- Diverged: DGram attention" in report
    assert (path.parent / "manifolds_long.png").exists() and (path.parent / "manifolds_long_heads.png").exists()


def test_boundary_preset_end_to_end_tiny(tmp_path):
    text = _preset("boundary").read_text().replace(
        "ladder = [0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64]", "ladder = [0.02, 1e4]")
    cfg = tmp_path / "manifolds-boundary-tiny.toml"
    cfg.write_text(text)
    manifest, path = execute("manifolds", str(cfg), seeds=[0], steps=8, out=tmp_path / "sw", progress=False,
                             only=["all-dgram-ours"], sets=["train.diverge_warmup=2"], threads=1)
    assert {r["status"] for r in manifest["runs"]} <= {"done", "diverged", "skipped"}
    report = path.read_text()
    assert "**stability boundary**" in report
    row = next(line for line in report.splitlines() if line.startswith("| `all-dgram` | ours |"))
    # the absurd rung does not count as training: it diverges (NaN, a loss explosion) or makes no progress
    cells = [c.strip() for c in row.split("|")]
    assert "≥ 10000" not in cells[3]
    assert "no progress" in cells[5] or "div" in cells[5] or cells[5] == "—", cells
    assert (path.parent / "manifolds_boundary.png").exists()
    manifest, path = execute("manifolds", "attribution", seeds=[0], steps=6, out=tmp_path / "attr", progress=False,
                             only=["attr-all-dgram-sum-momentum"], threads=1)
    assert manifest["runs"][0]["status"] in ("done", "diverged")
    assert "### Attribution" in path.read_text() and "| `all-dgram` | sum-momentum |" in path.read_text()


def test_long_const_preset_holds_the_peak_lr_for_10k_steps_with_scale_control_arms():
    """`long-const`: constant lr after warm-up, ≥ 10,000 steps, the four strategies at ×8 and ×16, QK-clip and σ-cap
    arms beside each DGram-attention arm only, diagnostics and per-head statistics as in `long`, checkpoints so it
    resumes."""
    from weightgeom.train.callbacks import SigmaCap
    from weightgeom.train.qk_clip import QKClip

    parts, sweep = load_parts("long-const", "manifolds")[1:]
    variants = get_recipe("manifolds").variants(parts, sweep, None)
    cfg = parts["long"]
    assert cfg["schedule"]["kind"] == "constant" and cfg["schedule"]["warmup"] > 0
    assert cfg["train"]["max_steps"] >= 10_000 and 0 < cfg["train"]["ckpt_every"] <= 1000
    assert cfg["diagnostics"]["every"] == sweep["head_stats_every"] == 50
    assert sorted({v.tags["lr_multiplier"] for v in variants}) == [8, 16]
    plain = [v for v in variants if "control" not in v.tags]
    assert {v.tags["strategy"] for v in plain} == {"all-dgram", "hetero-inv", "hetero", "all-stiefel"}
    controlled = [v for v in variants if "control" in v.tags]
    assert {(v.tags["strategy"], v.tags["control"]) for v in controlled} == {
        (s, c) for s in ("all-dgram", "hetero-inv") for c in ("qk-clip", "sigma-cap")}
    assert len(variants) == 16 and all(v.controls["head_stats_every"] == 50 for v in variants)
    kinds = {v.tags["control"]: type(build_callbacks({k: x for k, x in v.controls.items()
                                                      if k != "head_stats_every"})[0]) for v in controlled}
    assert kinds == {"qk-clip": QKClip, "sigma-cap": SigmaCap}
    with pytest.raises(ValueError, match="long_scale_controls"):
        get_recipe("manifolds").variants(parts, {**sweep, "long_scale_controls": ["qk-norm"]}, None)
