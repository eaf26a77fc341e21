"""Experiment recipes, sweep runner, controls and reports.

Runner and report are tested on synthetic run directories (a fake train function writes metrics.jsonl /
status.json / config.resolved.toml like the trainer does); the end-to-end tests run every recipe for a few steps
through the real trainer and are skipped while it is not importable.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from weightgeom.analysis.recorder import ContinuityRecorder
from weightgeom.experiments import report as rep
from weightgeom.experiments.callbacks import register_callback
from weightgeom.experiments.cli import execute, get_recipe
from weightgeom.experiments.runner import (
    SweepSettingsError,
    Variant,
    load_parts,
    plan,
    run_sweep,
    settings_differences,
)
from weightgeom.train.callbacks import SigmaCap
from weightgeom.train.config import parse_overrides

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

BASE_TOML = """
[run]
device = "cpu"
[model]
kind = "gpt"
n_layer = 2
n_head = 2
n_embd = 32
block_size = 16
[data]
kind = "shakespeare"
block_size = 16
batch_size = 4
[optim]
name = "muon"
[train]
max_steps = 200
eval_every = 50
log_every = 10
[diagnostics]
every = 50
"""


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _toml(cfg: dict) -> str:
    lines = []
    for sec, tab in cfg.items():
        lines.append(f"[{sec}]")
        for k, v in tab.items():
            if isinstance(v, dict):
                continue
            lines.append(f"{k} = {json.dumps(v)}")
    return "\n".join(lines) + "\n"


def fake_train(spec, run_dir: Path, progress: bool, grow: bool = True) -> dict:
    """Write a run directory like the trainer: DGram-attention strategies grow σ/logits and diverge."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = spec.config
    steps = int(cfg["train"]["max_steps"])
    strat = cfg.get("optim", {}).get("strategy", "")
    dgram_attn = strat in ("all-dgram", "hetero-inv") and not spec.controls and grow
    seed = spec.seed
    lines = []
    state, last = "done", steps
    for s in range(0, steps + 1, max(1, steps // 10)):
        loss = 4.0 * math.exp(-s / steps) + 0.01 * seed
        growth = math.exp(3 * s / steps) if dgram_attn else 1.0
        if dgram_attn and strat == "all-dgram" and s > 0.6 * steps:
            state, last = "diverged", s
            lines.append({"step": s, "split": "train", "loss": 50.0})
            break
        lines.append({"step": s, "split": "train", "loss": loss, "lr": 0.02})
        lines.append({"step": s, "split": "val", "loss": loss + 0.1})
        for layer in range(2):
            lines.append({"step": s, "split": "diag", f"attn.{layer}.qk_sigma_prod": 0.9 * growth,
                          f"attn.{layer}.logit_max": 2.0 * growth, f"attn.{layer}.entropy": 2.0 / growth,
                          f"attn.{layer}.saturation": min(1.0, 0.05 * growth)})
    with open(run_dir / "metrics.jsonl", "w") as f:
        for r in lines:
            f.write(json.dumps(r) + "\n")
    (run_dir / "metrics.jsonl").open("a").write('{"step": 3, "spl')  # a partial line from a killed run
    (run_dir / "config.resolved.toml").write_text(_toml(cfg))
    status = {"state": state, "step": last, "reason": "loss exploded" if state == "diverged" else None}
    (run_dir / "status.json").write_text(json.dumps(status))
    final = [r for r in lines if "loss" in r][-1]["loss"]
    return {"status": state, "run_dir": str(run_dir), "step": last, "final": {"val_loss": final}}


@pytest.fixture
def base_cfg(tmp_path) -> Path:
    return _write(tmp_path / "base.toml", BASE_TOML)


# ------------------------------------------------------------------------------------------------------ planning
def test_plan_manifolds_expands_variants_seeds_and_steps(base_cfg):
    recipe = get_recipe("manifolds")
    label, parts, sweep = load_parts(str(base_cfg), "manifolds")
    assert label == "base" and "main" in parts and "gpt" in parts
    variants = recipe.variants(parts, sweep, None)
    names = [v.name for v in variants]
    assert names[:5] == ["unconstrained", "all-stiefel", "all-dgram", "hetero", "hetero-inv"]
    assert {"all-dgram-capped", "hetero-md"} <= set(names)
    runs = plan("manifolds", variants, parts, seeds=[0, 1], steps=20, sets=parse_overrides(["optim.muon.lr=0.01"]))
    assert len(runs) == 2 * len(variants) and len({r.name for r in runs}) == len(runs)
    r = next(r for r in runs if r.name == "hetero-s1")
    assert r.config["optim"]["strategy"] == "hetero" and r.config["run"]["seed"] == 1
    assert r.config["train"]["max_steps"] == 20 and r.config["train"]["eval_every"] <= 5
    assert r.config["optim"]["muon"]["lr"] == 0.01
    capped = next(r for r in runs if r.variant == "all-dgram-capped")
    assert capped.controls["sigma_cap"] > 0
    assert next(r for r in runs if r.variant == "hetero-md").config["optim"]["name"] == "muon-md"
    # identical everything else: the five strategies differ only in optim.strategy
    cfgs = [r.config for r in runs if r.seed == 0 and r.variant in ("unconstrained", "hetero")]
    for c in cfgs:
        c["optim"].pop("strategy")
        c["run"].pop("name")
    assert cfgs[0] == cfgs[1]
    assert [r.variant for r in plan("manifolds", variants, parts, [0], only=["hetero*"])] == ["hetero", "hetero-inv",
                                                                                               "hetero-md"]
    with pytest.raises(ValueError, match="matches no variant"):
        plan("manifolds", variants, parts, [0], only=["nope"])


def test_plan_continuity_and_md(tmp_path, base_cfg):
    sweep_file = _write(tmp_path / "cont.toml", """
[sweep]
seeds = [3]
continuity_every = 10
llama_activations = ["silu", "none"]
[parts.resmlp.model]
kind = "resmlp"
depth = 4
[parts.llama.model]
kind = "llama"
""")
    _, parts, sweep = load_parts(str(sweep_file))
    vs = get_recipe("continuity").variants(parts, sweep, None)
    assert [v.name for v in vs] == ["res-relu", "nores", "res-none", "res-radial", "init-small", "init-large",
                                    "adam-b2-0", "adam-b1-0-b2-0", "res-ln", "res-relu-ln", "llama-silu",
                                    "llama-none"]
    assert all(v.controls == {"continuity_every": 10} for v in vs if v.part == "resmlp")
    # --steps reaches the recipe: it shrinks its recording interval (the runner has no rule for any control)
    runs = plan("continuity", get_recipe("continuity").variants(parts, sweep, 16), parts, [0], steps=16)
    assert next(r for r in runs if r.variant == "nores").config["model"]["residual"] is False
    assert next(r for r in runs if r.variant == "adam-b2-0").config["optim"]["adamw"]["betas"] == [0.9, 0.0]
    assert all(r.controls["continuity_every"] == 2 for r in runs if r.part == "resmlp")
    _, parts, sweep = load_parts(str(base_cfg))
    md = get_recipe("md").variants(parts, {"widths": [16, 32], "lrs": {"adamw": [1e-3, 1e-2], "muon": [0.01, 0.02],
                                                                       "adamw-md": [1e-3], "muon-md": [0.02]}}, 20)
    lr_runs = [v for v in md if v.tags["kind"] == "lr"]
    assert len(lr_runs) == 2 * 2 + 2 * 2 + 2 + 2
    adam = next(v for v in md if v.name == "adamw-w32-lr0.01")
    assert adam.overrides["optim.adamw.lr"] == 0.01 and adam.overrides["model.n_embd"] == 32
    wu = [v for v in md if v.tags["kind"] == "warmup"]
    assert len(wu) == 4 and all(v.overrides["schedule.warmup"] == 2 for v in wu)


def test_unknown_preset_and_recipe_errors():
    with pytest.raises(FileNotFoundError, match="unknown preset"):
        load_parts("no-such-preset-xyz")
    with pytest.raises(ValueError, match="unknown recipe"):
        get_recipe("nope")
    with pytest.raises(ValueError, match="section.key=value"):
        parse_overrides(["novalue"])


# --------------------------------------------------------------------------------------------- runner + report
def test_sweep_runs_resumes_and_reports_manifolds(tmp_path, base_cfg, capsys):
    calls = []

    def counting(spec, run_dir, progress):
        calls.append(spec.name)
        if spec.variant == "hetero-md" and spec.seed == 1:
            raise ValueError("unknown optimizer 'muon-md'")
        return fake_train(spec, run_dir, progress)

    out = tmp_path / "sweep"
    manifest, path = execute("manifolds", str(base_cfg), seeds=[0, 1], steps=40, out=out, train_fn=counting)
    assert len(calls) == 14
    st = {r["name"]: r["status"] for r in manifest["runs"]}
    assert st["hetero-s0"] == "done" and st["all-dgram-s1"] == "diverged" and st["hetero-md-s1"] == "failed"
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["recipe"] == "manifolds" and len(saved["runs"]) == 14
    exp = json.loads((out / "hetero-s0" / "experiment.json").read_text())
    final = next(r["final"] for r in manifest["runs"] if r["name"] == "hetero-s0")
    assert exp["variant"] == "hetero" and exp["final"] == final
    assert "final" not in json.loads((out / "hetero-md-s1" / "experiment.json").read_text())  # failed: no result
    # resume: only the failed run is tried again
    calls.clear()
    execute("manifolds", str(base_cfg), seeds=[0, 1], steps=40, out=out, train_fn=counting, report=False)
    assert calls == ["hetero-md-s1"]
    text = path.read_text()
    assert "| `hetero` |" in text and "`all-dgram-s0` diverged at step" in text
    assert "σ growth → logit growth → saturation is visible" in text
    for png in ("manifolds_loss.png", "manifolds_mechanism.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    assert "3.3544" in text  # the paper column
    capsys.readouterr()


def test_parallel_jobs_match_sequential(tmp_path, base_cfg):
    recipe = get_recipe("manifolds")
    _, parts, sweep = load_parts(str(base_cfg))
    runs = plan("manifolds", recipe.variants(parts, sweep, None), parts, [0], steps=10, only=["all-*", "unconstrained"])
    man = run_sweep(runs, tmp_path / "par", train_fn=fake_train, progress=False, jobs=2, threads=1)
    assert [r["status"] for r in man["runs"]] == ["done", "done", "diverged", "done"]
    assert all((tmp_path / "par" / r.name / "experiment.json").exists() for r in runs)


def slow_train(spec, run_dir: Path, progress: bool) -> dict:
    """``fake_train`` after 2 s at step 3 (a status.json as the trainer writes it at a checkpoint)."""
    import time

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "status.json").write_text(json.dumps({"state": "running", "step": 3}))
    time.sleep(2.0)
    return fake_train(spec, run_dir, progress)


def test_a_parallel_sweep_says_where_its_running_runs_are(tmp_path, base_cfg, monkeypatch, capsys):
    """With --jobs the trainers print no progress bar; every PROGRESS_EVERY_S the sweep prints each running run's
    last recorded step of its max_steps and how many runs ended."""
    import weightgeom.experiments.runner as runner

    monkeypatch.setattr(runner, "PROGRESS_EVERY_S", 0.5)
    recipe = get_recipe("manifolds")
    _, parts, sweep = load_parts(str(base_cfg))
    runs = plan("manifolds", recipe.variants(parts, sweep, None), parts, [0], steps=10, only=["all-stiefel", "hetero"])
    man = run_sweep(runs, tmp_path / "par", train_fn=slow_train, progress=True, jobs=2, threads=1)
    assert [r["status"] for r in man["runs"]] == ["done"] * len(runs)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("sweep: running ")]
    assert lines and f"0 of {len(runs)} runs ended" in lines[0]
    assert any(f"{runs[0].name} step 3/10, {runs[1].name} step 3/10;" in x for x in lines)


def test_mechanism_absent_is_reported_honestly(tmp_path, base_cfg):
    def flat(spec, run_dir, progress):
        return fake_train(spec, run_dir, progress, grow=False)  # no σ growth anywhere

    out = tmp_path / "s"
    _, path = execute("manifolds", str(base_cfg), seeds=[0], steps=20, out=out, train_fn=flat,
                      only="all-stiefel,all-dgram,hetero-inv", progress=False)
    text = path.read_text()
    assert "not** visible" in text and "**no**" in text


def _continuity_dir(root: Path, variant: str, grad: float, weight: float, resmlp: bool = True,
                    state: str = "done") -> None:
    d = root / f"{variant}-s0"
    d.mkdir(parents=True)
    rows = []
    if resmlp:
        for step in (0, 10, 20, 30):
            for layer in range(3):
                rows.append({"step": step, "kind": "weight", "role": "fc", "layer": layer, "cv": weight * step / 30,
                             "cu": 0.1, "align_in": 0.5, "align_out": 0.4})
                rows.append({"step": step, "kind": "grad", "role": "fc", "layer": layer, "cv": grad, "cu": grad,
                             "align_in": 0.9, "align_out": 0.9})
                if step:
                    rows.append({"step": step, "kind": "delta", "role": "fc", "layer": layer, "cv": 0.7, "cu": 0.6,
                                 "align_in": 0.8, "align_out": 0.8, "dominance": step / 15})
        exp = {"recipe": "continuity", "variant": variant, "seed": 0, "part": "resmlp"}
    else:
        for role, (cv, cu) in {"q": (0.8, 0.2), "k": (0.7, 0.1), "v": (0.1, 0.1), "o": (0.2, 0.6),
                               "gate": (0.9, 0.1), "up": (0.6, 0.2), "down": (0.1, 0.7)}.items():
            rows.append({"step": 30, "kind": "weight", "role": role, "layer": 0, "cv": cv, "cu": cu,
                         "align_in": 0.5, "align_out": 0.5})
        exp = {"recipe": "continuity", "variant": variant, "seed": 0, "part": "llama"}
    (d / "continuity.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (d / "experiment.json").write_text(json.dumps(exp))
    reason = "non-finite gradient norm (inf) at step 30" if state == "diverged" else None
    (d / "status.json").write_text(json.dumps({"state": state, "step": 30, "reason": reason}))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 30, "split": "val", "loss": 0.3, "acc": 0.9}) + "\n")


def test_report_continuity_tables_and_plots(tmp_path):
    root = tmp_path / "cont"
    _continuity_dir(root, "res-relu", 0.9, 0.8)
    _continuity_dir(root, "nores", 0.05, 0.05)
    _continuity_dir(root, "res-none", 0.93, 0.2)
    _continuity_dir(root, "adam-b2-0", 0.9, 0.1, state="diverged")
    _continuity_dir(root, "llama-silu", 0, 0, resmlp=False)
    path = rep.make_report([root])
    text = path.read_text()
    assert "| `adam-b2-0` | 1/1 |" in text and "| `nores` | 0/1 |" in text
    assert "- `adam-b2-0-s0` diverged at step 30 — non-finite gradient norm (inf) at step 30" in text
    assert "| `nores` |" in text and "gradient continuity ≈ 0.05" in text
    assert "NoRes gradient C_v 0.05 vs Res+ReLU 0.90" in text and "reproduced" in text
    assert "crossing step" in text and "| 15 |" in text.replace(" (n=1)", "")  # dominance reaches 1 at step 15
    assert "7/7" in text  # synthetic llama pattern matches the continuity paper's
    for png in ("continuity_training.png", "continuity_llama_projections.png"):
        assert (root / png).read_bytes()[:8] == PNG_MAGIC


def test_report_md_lr_transfer(tmp_path):
    root = tmp_path / "md"
    for opt, best in (("adamw", {64: 1e-3, 128: 3e-3}), ("muon-md", {64: 0.02, 128: 0.02})):
        for w in (64, 128):
            for lr in ((1e-3, 3e-3, 1e-2) if opt == "adamw" else (0.01, 0.02, 0.04)):
                for kind in ("lr", "warmup") if lr == best[w] and w == 64 else ("lr",):
                    d = root / f"{opt}-w{w}-lr{lr:g}{'-warmup5' if kind == 'warmup' else ''}-s0"
                    d.mkdir(parents=True)
                    final = 1.0 + abs(math.log(lr / best[w])) + (0.05 if kind == "warmup" else 0)
                    rows = [{"step": s, "split": "val", "loss": final + 1.0 / (s + 1)} for s in (0, 10, 20)]
                    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
                    (d / "status.json").write_text('{"state": "done", "step": 20}')
                    (d / "config.resolved.toml").write_text('[data]\nbatch_size = 4\nblock_size = 8\n')
                    tags = {"kind": kind, "optimizer": opt, "width": w, "lr": lr, "warmup": 5 if kind == "warmup"
                            else 0}
                    (d / "experiment.json").write_text(json.dumps({"recipe": "md", "variant": d.name[:-3],
                                                                   "seed": 0, "tags": tags}))
    path = rep.make_report([root], out=tmp_path / "out")
    text = path.read_text()
    assert "adamw: optimal LR by width 64: 0.001, 128: 0.003" in text
    assert "muon-md: optimal LR by width 64: 0.02, 128: 0.02 → spread 0 grid step(s): transfers" in text
    assert "### Warmup vs no warmup" in text
    for png in ("md_lr_sweep.png", "md_optimal_lr.png", "md_loss_vs_compute.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == PNG_MAGIC


def test_report_cli_and_errors(tmp_path, base_cfg, capsys):
    from weightgeom.cli import main

    out = tmp_path / "sw"
    run_sweep(plan("manifolds", [Variant("hetero", {"optim.strategy": "hetero"})], load_parts(str(base_cfg))[1],
                   [0], steps=10), out, train_fn=fake_train, progress=False)
    assert main(["report", str(out / "hetero-s0"), "--out", str(tmp_path / "r")]) == 0
    assert "report:" in capsys.readouterr().out
    assert (tmp_path / "r" / "report.md").exists()
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------- controls
def _ctx(model, tmp_path, **kw):
    from weightgeom.train.callbacks import TrainContext

    return TrainContext(model=model, optimizer=None, config={}, run_dir=tmp_path, **kw)


def test_sigma_cap_bounds_qk_product(tmp_path):
    d = 8
    torch.manual_seed(0)
    model = nn.ModuleDict({"h0": nn.ModuleDict({"c_attn": nn.Linear(d, 3 * d, bias=False)}),
                           "h1": nn.ModuleDict({"q_proj": nn.Linear(d, d, bias=False),
                                                "k_proj": nn.Linear(d, d, bias=False)})})
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(20)
    W, Wq, Wk = model["h0"]["c_attn"].weight, model["h1"]["q_proj"].weight, model["h1"]["k_proj"].weight
    v_before = W[2 * d:].detach().clone()
    cap = SigmaCap(2.0)
    ctx = _ctx(model, tmp_path)
    cap.on_train_start(ctx)
    ctx.step = 1
    cap.on_step_end(ctx)

    def sig(m):
        return float(torch.linalg.matrix_norm(m.detach(), ord=2))

    assert sig(W[:d]) * sig(W[d:2 * d]) == pytest.approx(2.0, rel=1e-4)
    assert sig(Wq) * sig(Wk) == pytest.approx(2.0, rel=1e-4)
    ratio = W[2 * d:].detach() / v_before  # the fused weight is rescaled as a whole (V too), by one scalar
    assert torch.allclose(ratio, ratio.flatten()[0].expand_as(ratio)) and float(ratio.flatten()[0]) < 1
    assert cap.summary()["rescales"] == 2 and cap.summary()["layers"] == 2
    # counters survive a resume through the state dict
    again = SigmaCap(2.0)
    again.load_state_dict(cap.state_dict())
    assert again.summary()["rescales"] == 2 and again.summary()["max_product_seen"] == cap.max_seen
    with pytest.raises(ValueError, match="no attention weights"):
        SigmaCap(2.0).on_train_start(_ctx(nn.Linear(3, 3), tmp_path))
    with pytest.raises(ValueError, match="sigma_cap"):
        SigmaCap(0.0)


RESMLP = {"model": {"kind": "resmlp", "depth": 4, "width": 16}, "data": {"kind": "mnist", "batch_size": 16},
          "optim": {"name": "adamw", "adamw": {"lr": 3e-3}},
          "train": {"max_steps": 8, "eval_every": 0, "eval_iters": 1, "log_every": 1, "ckpt_every": 2}}


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "continuity.jsonl").read_text().splitlines()]


def test_continuity_recorder_during_training(tmp_path):
    from weightgeom.analysis import dominance_ratio, stack_continuity
    from weightgeom.train import train
    from weightgeom.train.checkpoint import load_checkpoint

    rec = ContinuityRecorder(every=3)
    res = train({**RESMLP, "train": {**RESMLP["train"], "keep_checkpoints": 10}}, run_dir=tmp_path / "r",
                progress=False, callbacks=[rec])
    assert res["status"] == "done"
    rows = _rows(tmp_path / "r")
    assert {(r["step"], r["kind"]) for r in rows} == {(0, "weight"), (0, "grad")} | {
        (s, k) for s in (3, 6, 8) for k in ("weight", "grad", "delta")}
    assert {r["role"] for r in rows} == {"mlp"} and {r["layer"] for r in rows} == {0, 1, 2}
    assert rec.summary() == {"continuity_rows": len(rows), "continuity_roles": ["mlp"]}
    # the numbers are weightgeom.analysis's, on the weights the checkpoint of that step holds
    ck6 = load_checkpoint(tmp_path / "r" / "checkpoints" / "ckpt_00000006.pt")["model"]
    W6 = torch.stack([ck6[f"blocks.{i}.fc.weight"] for i in range(4)])
    cols, _ = stack_continuity(W6.double(), method="svd")  # exact top singular vectors
    w6 = sorted((r for r in rows if r["step"] == 6 and r["kind"] == "weight"), key=lambda r: r["layer"])
    assert [r["cv"] for r in w6] == pytest.approx(cols["cv"], abs=1e-6)
    assert [r["cu"] for r in w6] == pytest.approx(cols["cu"], abs=1e-6)
    assert [r["align_out"] for r in w6] == pytest.approx(cols["gram_out"], abs=1e-12)
    assert [r["cv_rand"] for r in w6] == pytest.approx(cols["cv_rand"])
    W0 = rec.state_dict()["w0"]["mlp"]
    dom = [r["dominance"] for r in sorted((r for r in rows if r["step"] == 6 and r["kind"] == "delta"),
                                          key=lambda r: r["layer"])]
    assert dom == pytest.approx([dominance_ratio(W6[i], W0[i]) for i in range(3)], rel=1e-12)


def test_continuity_record_survives_a_kill_and_resume(tmp_path, monkeypatch):
    from weightgeom.train import read_status, train
    from weightgeom.train.batches import Batches

    train(RESMLP, run_dir=tmp_path / "full", progress=False, callbacks=[ContinuityRecorder(every=2)])
    orig = Batches.get

    def dying_get(self, split, step, index, device="cpu"):
        if split == "train" and step == 5:  # dies computing step 6, after the checkpoint at step 4
            raise KeyboardInterrupt
        return orig(self, split, step, index, device)

    monkeypatch.setattr(Batches, "get", dying_get)
    with pytest.raises(KeyboardInterrupt):
        train(RESMLP, run_dir=tmp_path / "cut", progress=False, callbacks=[ContinuityRecorder(every=2)])
    assert read_status(tmp_path / "cut")["state"] == "failed"
    with open(tmp_path / "cut" / "continuity.jsonl", "a") as f:
        f.write('{"step": 6, "ki')  # a partial line of the killed writer
    monkeypatch.setattr(Batches, "get", orig)
    rec = ContinuityRecorder(every=2)
    train(RESMLP, run_dir=tmp_path / "cut", progress=False, callbacks=[rec])
    # W_0 came back from the checkpoint; the record equals the uninterrupted run's, row for row (ΔW from the first
    # session's W_0; the rows of the redone step 5 are not repeated)
    assert _rows(tmp_path / "cut") == _rows(tmp_path / "full")
    assert [r["step"] for r in _rows(tmp_path / "cut") if r["kind"] == "weight" and r["layer"] == 0] == [0, 2, 4, 6, 8]


def test_continuity_recorder_resumes_a_run_recorded_by_an_older_version(tmp_path):
    """A checkpoint without recorder state (written before callbacks existed): W_0 comes from the older
    ``continuity_w0.safetensors`` (key ``w0``); the rows up to the resume step are kept."""
    from safetensors.torch import save_file

    from weightgeom.analysis.recorder import W0_FILE

    torch.manual_seed(0)
    model = nn.ModuleDict({"blocks": nn.ModuleList(nn.ModuleDict({"fc": nn.Linear(8, 8, bias=False)})
                                                   for _ in range(3))})
    w0 = torch.randn(3, 8, 8)
    save_file({"w0": w0}, str(tmp_path / W0_FILE))
    (tmp_path / "continuity.jsonl").write_text('{"step": 2, "kind": "weight", "role": "fc", "layer": 0, "cv": 0.5}\n'
                                               '{"step": 6, "kind": "weight", "role": "fc", "layer": 0, "cv": 0.5}\n')
    rec = ContinuityRecorder(every=2)
    rec.on_train_start(_ctx(model, tmp_path, step=4, start_step=4, resumed=True, max_steps=8))
    assert torch.equal(rec.state_dict()["w0"]["mlp"], w0)
    assert [r["step"] for r in _rows(tmp_path)] == [2]


def test_runner_knows_no_specific_control():
    import subprocess
    import sys

    code = ("import sys, weightgeom.experiments.runner as r\n"
            "assert 'weightgeom.experiments.controls' not in sys.modules\n"
            "assert not [m for m in sys.modules if m.startswith('weightgeom.analysis')], 'runner imports analysis'\n"
            "import inspect; src = inspect.getsource(r)\n"
            "assert 'sigma_cap' not in src and 'continuity_every' not in src and 'controls import' not in src\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


class _CountSteps:
    """A control the runner has never heard of: counts the optimizer steps it saw."""

    def __init__(self, tag):
        self.tag, self.steps = tag, 0

    def on_step_end(self, ctx):
        self.steps += 1

    def summary(self):
        return {"count_steps": self.steps, "tag": self.tag}


def test_variant_declares_any_registered_callback(tmp_path, base_cfg):
    register_callback("count_steps", _CountSteps, replace=True)
    _, parts, _ = load_parts(str(base_cfg))
    v = Variant("counted", {"optim.strategy": "hetero"}, controls={"count_steps": "x"})
    runs = plan("manifolds", [v], parts, [0], steps=3)
    assert runs[0].resolved()["controls.count_steps"] == "x"
    manifest = run_sweep(runs, tmp_path / "sw", progress=False)
    assert manifest["runs"][0]["status"] == "done"
    assert json.loads((tmp_path / "sw" / "counted-s0" / "controls.json").read_text()) == {"count_steps": 3,
                                                                                          "tag": "x"}
    with pytest.raises(ValueError, match="variant 'bad': unknown callback 'nope'; known: .*sigma_cap"):
        plan("manifolds", [Variant("bad", controls={"nope": 1})], parts, [0], steps=3)
    with pytest.raises(ValueError, match="variant 'bad': callback sigma_cap=-1"):
        plan("manifolds", [Variant("bad", controls={"sigma_cap": -1})], parts, [0], steps=3)


# ---------------------------------------------------------------------------------------------- end to end

def _e2e(tmp_path, recipe, only):
    from weightgeom.experiments.runner import preset_dirs

    cfg = preset_dirs()[0] / f"{recipe}-ci.toml"
    manifest, path = execute(recipe, str(cfg), seeds=[0], out=tmp_path / recipe, only=only, progress=False)
    bad = [(r["name"], r.get("reason")) for r in manifest["runs"] if r["status"] not in ("done", "diverged")]
    assert not bad, bad
    posts = [(r["name"], r["post_error"]) for r in manifest["runs"] if r.get("post_error")]
    assert not posts, posts
    text = path.read_text()
    assert text.startswith("# weightgeom sweep") and list(path.parent.glob("*.png"))
    return manifest, text


@pytest.mark.parametrize("recipe,only", [
    ("manifolds", "all-stiefel,all-dgram-capped,hetero-md"),  # a manifold, the σ-cap control, the MD wrapper
    ("continuity", "res-relu,nores,llama-silu"),  # recorder during training + Llama checkpoint analysis
    ("md", "adamw-w32-lr0.001,adamw-w64-lr0.001,muon-md-w64*"),  # two widths, MD, the warmup arm
])
def test_recipe_end_to_end_tiny(tmp_path, recipe, only):
    manifest, text = _e2e(tmp_path, recipe, only)
    if recipe == "manifolds":
        assert "attn.0.qk_sigma_prod" in (tmp_path / recipe / "all-stiefel-s0" / "metrics.jsonl").read_text()
        ctl = json.loads((tmp_path / recipe / "all-dgram-capped-s0" / "controls.json").read_text())
        assert ctl["layers"] == 2 and ctl["max_product_seen"] > 0
        assert "σQ·σK last" in text
    if recipe == "continuity":
        rows = (tmp_path / recipe / "res-relu-s0" / "continuity.jsonl").read_text()
        assert '"kind": "delta"' in rows and '"kind": "grad"' in rows
        assert '"role": "gate"' in (tmp_path / recipe / "llama-silu-s0" / "continuity.jsonl").read_text()
        assert "| `nores` |" in text and "per-projection" in text
    if recipe == "md":
        assert "Does the optimal LR transfer" in text and "Warmup vs no warmup" in text


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["manifolds", "continuity", "md"])
def test_recipe_end_to_end_full_ci_preset(tmp_path, recipe):
    _e2e(tmp_path, recipe, None)


# ------------------------------------------------------------------------------ one writer, honest resume, input
def _md_runs(base_cfg, steps=10, sets=(), only=("adamw-w16-lr0.001", "adamw-w16-lr0.01")):
    _, parts, sweep = load_parts(str(base_cfg))
    vs = get_recipe("md").variants(parts, {"widths": [16], "optimizers": ["adamw"],
                                           "lrs": {"adamw": [1e-3, 1e-2]}}, steps)
    return plan("md", vs, parts, [0], steps=steps, only=list(only), sets=parse_overrides(sets))


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_sweep_refuses_runs_recorded_with_other_settings(tmp_path, base_cfg):
    out = tmp_path / "sw"
    calls = []

    def counting(spec, run_dir, progress):
        calls.append(spec.name)
        return fake_train(spec, run_dir, progress)

    run_sweep(_md_runs(base_cfg), out, train_fn=counting, progress=False)
    exp = json.loads((out / "adamw-w16-lr0.001-s0" / "experiment.json").read_text())
    assert exp["settings"]["train.max_steps"] == 10 and exp["settings_hash"]
    man = json.loads((out / "sweep.json").read_text())
    assert all(r["settings_hash"] for r in man["runs"])
    before = _files(out)
    with pytest.raises(SweepSettingsError, match=r"run adamw-w16-lr0.001-s0 was trained with train.max_steps=10, "
                                                 r"the command asks 20"):
        run_sweep(_md_runs(base_cfg, steps=20), out, train_fn=counting, progress=False)
    with pytest.raises(SweepSettingsError, match=r"optim.adamw.weight_decay=0.1, the command asks 0.3"):
        run_sweep(_md_runs(base_cfg, sets=["optim.adamw.weight_decay=0.3"]), out, train_fn=counting, progress=False)
    assert _files(out) == before and calls == ["adamw-w16-lr0.001-s0", "adamw-w16-lr0.01-s0"]
    # a run recorded before settings were kept: the trainer's config.resolved.toml still tells
    p = out / "adamw-w16-lr0.01-s0" / "experiment.json"
    p.write_text(json.dumps({k: v for k, v in json.loads(p.read_text()).items() if k != "settings"}))
    with pytest.raises(SweepSettingsError, match=r"run adamw-w16-lr0.01-s0 was trained with train.max_steps=10"):
        run_sweep(_md_runs(base_cfg, steps=20, only=["adamw-w16-lr0.01"]), out, train_fn=counting, progress=False)
    # a run killed half-way is "started", not "trained"
    (out / "adamw-w16-lr0.01-s0" / "status.json").write_text('{"state": "running", "step": 4}')
    with pytest.raises(SweepSettingsError, match=r"adamw-w16-lr0.01-s0 was started with train.max_steps=10"):
        run_sweep(_md_runs(base_cfg, steps=20, only=["adamw-w16-lr0.01"]), out, train_fn=counting, progress=False)
    # the same settings resume; without sweep-level settings (run_sweep called directly, not the CLI) another
    # --only subset with its own settings goes into the same directory
    calls.clear()
    run_sweep(_md_runs(base_cfg, only=["adamw-w16-lr0.001"]), out, train_fn=counting, progress=False)
    assert calls == []
    man = run_sweep(_md_runs(base_cfg, steps=20, only=["adamw-w16-lr0.01-warmup*"]), out, train_fn=counting,
                    progress=False)
    assert calls == ["adamw-w16-lr0.01-warmup2-s0"] and len(man["runs"]) == 3


def test_sweep_no_resume_trains_fresh_and_hands_the_old_record_to_previous(tmp_path, base_cfg):
    out = tmp_path / "sw"
    run_sweep(_md_runs(base_cfg, only=["adamw-w16-lr0.001"]), out, train_fn=fake_train, progress=False)
    old = (out / "adamw-w16-lr0.001-s0" / "experiment.json").read_text()
    fresh = []

    def recording(spec, run_dir, progress):
        fresh.append(spec.fresh)
        return fake_train(spec, run_dir, progress)

    man = run_sweep(_md_runs(base_cfg, steps=20, only=["adamw-w16-lr0.001"]), out, train_fn=recording,
                    resume=False, progress=False)
    assert fresh == [True] and man["runs"][0]["status"] == "done"
    # the trainer moves experiment.previous.json into previous/<time>/ with the rest of the earlier run
    assert (out / "adamw-w16-lr0.001-s0" / "experiment.previous.json").read_text() == old
    assert json.loads((out / "adamw-w16-lr0.001-s0" / "experiment.json").read_text())["settings"][
        "train.max_steps"] == 20


MD_SWEEP = """
[sweep]
widths = [16]
optimizers = ["adamw"]
[sweep.lrs]
adamw = [0.001, 0.01]
"""


def _md_sweep_file(tmp_path: Path, base_toml: str = BASE_TOML, name: str = "md-sweep.toml") -> Path:
    return _write(tmp_path / name, base_toml + MD_SWEEP)


def _md_execute(cfg: Path, out: Path, only: str, **kw):
    return execute("md", str(cfg), out=out, only=only, train_fn=fake_train, report=False, progress=False, **kw)


def test_sweep_directory_keeps_one_set_of_sweep_level_settings(tmp_path):
    cfg, out = _md_sweep_file(tmp_path), tmp_path / "sw"
    _md_execute(cfg, out, "adamw-w16-lr0.001", steps=10)
    before = _files(out)
    refusals = [
        (dict(steps=20), r"sweep .*sw was run with --steps 10, the command gives --steps 20; use --out for a new "
                         r"sweep directory \(--no-resume would leave 1 of its runs, e.g. adamw-w16-lr0.001-s0, "),
        (dict(steps=20, resume=False), r"--steps 10, the command gives --steps 20.*--no-resume would leave"),
        (dict(steps=10, sets=["optim.adamw.weight_decay=0.3"]),
         r"run without --set optim.adamw.weight_decay, the command sets optim.adamw.weight_decay=0.3"),
        (dict(), r"run with --steps 10, the command gives no --steps"),
    ]
    for kw, match in refusals:  # only other runs are planned: the per-run check alone would let them in
        with pytest.raises(SweepSettingsError, match=match):
            _md_execute(cfg, out, "adamw-w16-lr0.01", **kw)
        with pytest.raises(SweepSettingsError, match=match):  # --dry-run predicts the same refusal
            _md_execute(cfg, out, "adamw-w16-lr0.01", dry_run=True, **kw)
    _md_execute(cfg, out, "adamw-w16-lr0.01", steps=10, dry_run=True)  # what the sweep would accept, it accepts
    wider = BASE_TOML.replace("n_embd = 32", "n_embd = 64")
    other = _md_sweep_file(tmp_path / "elsewhere", wider)
    with pytest.raises(SweepSettingsError, match=r"run from config .*md-sweep.toml, whose trainer configs differ "
                                                 r"from those of the command's .*elsewhere.md-sweep.toml; use --out"):
        _md_execute(other, out, "adamw-w16-lr0.01", steps=10)
    cfg.write_text(wider + MD_SWEEP)
    with pytest.raises(SweepSettingsError, match=r"from another content of config .*md-sweep.toml \(its trainer"):
        _md_execute(cfg, out, "adamw-w16-lr0.01", steps=10)
    assert _files(out) == before
    cfg.write_text(BASE_TOML + MD_SWEEP)
    # other --only subsets and --seeds are free, and the same trainer configs under another path are the same
    # config; the manifest keeps every invocation and the union of the seeds
    man, _ = _md_execute(_md_sweep_file(tmp_path / "copy"), out, "adamw-w16-lr0.01", steps=10, seeds=[1])
    assert sorted(r["name"] for r in man["runs"]) == ["adamw-w16-lr0.001-s0", "adamw-w16-lr0.01-s1"]
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["seeds"] == [0, 1] and saved["steps"] == 10 and saved["sweep_settings"]["steps"] == 10
    assert [(i["only"], i["seeds"]) for i in saved["invocations"]] == [(["adamw-w16-lr0.001"], [0]),
                                                                       (["adamw-w16-lr0.01"], [1])]
    # --no-resume may change the sweep-level settings when it trains every run of the directory again
    man, _ = _md_execute(cfg, out, "adamw-w16-lr0.001,adamw-w16-lr0.01", steps=20, seeds=[0, 1], resume=False)
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["sweep_settings"]["steps"] == 20 and len(saved["invocations"]) == 3
    assert {r["status"] for r in man["runs"]} == {"done"}


def test_sweep_level_settings_of_an_older_manifest(tmp_path):
    cfg, out = _md_sweep_file(tmp_path), tmp_path / "sw"
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"recipe": "md", "steps": 10, "seeds": [0], "command": "old",
                                                "created": "2026-01-01T00:00:00Z", "runs": []}))
    with pytest.raises(SweepSettingsError, match=r"run with --steps 10, the command gives --steps 20"):
        _md_execute(cfg, out, "adamw-w16-lr0.01", steps=20)
    _md_execute(cfg, out, "adamw-w16-lr0.01", steps=10, seeds=[2])  # what it recorded agrees: accepted
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["seeds"] == [0, 2] and [i["command"] for i in saved["invocations"]][0] == "old"
    (out / "sweep.json").write_text(json.dumps({"runs": saved["runs"]}))  # nothing comparable recorded
    _md_execute(cfg, out, "adamw-w16-lr0.01", steps=10, seeds=[2], sets=["optim.adamw.weight_decay=0.1"])


def test_report_warns_when_compared_runs_have_other_max_steps(tmp_path, base_cfg, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    run_sweep(_md_runs(base_cfg, only=["adamw-w16-lr0.001"]), a, train_fn=fake_train, progress=False)
    run_sweep(_md_runs(base_cfg, steps=20, only=["adamw-w16-lr0.01"]), b, train_fn=fake_train, progress=False)
    capsys.readouterr()
    path = rep.make_report([a], out=tmp_path / "ra")
    assert capsys.readouterr().err == "" and "Warning" not in path.read_text()
    path = rep.make_report([a, b], out=tmp_path / "rab")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning" in err[0] and "train.max_steps: 10 (1 run: adamw-w16-lr0.001-s0), " \
        "20 (1 run: adamw-w16-lr0.01-s0)" in err[0], err
    assert "**Warning:** the md runs compared here were trained for different train.max_steps" in path.read_text()


def test_settings_differences_ignore_version_only_schema_keys():
    planned = {"train.max_steps": 10, "optim.muon.lr": 0.02, "model.n_embd": 32, "controls.sigma_cap": 2.0}
    # a schema key another version did not know is not a difference; a free key (model field, control) is
    assert settings_differences({**planned, "train.some_old_key": 1}, {**planned, "optim.muon.lr": 0.02}) == []
    assert settings_differences({k: v for k, v in planned.items() if k != "train.max_steps"}, planned) == []
    assert settings_differences({"model.n_embd": 32, "controls.sigma_cap": 2.0, "optim.muon.lr": 0.02,
                                 "train.max_steps": 10.0}, planned) == []
    d = settings_differences({k: v for k, v in planned.items() if k != "controls.sigma_cap"}, planned)
    assert [x[0] for x in d] == ["controls.sigma_cap"]
    d = settings_differences({**planned, "model.dropout": 0.1}, planned)
    assert [x[0] for x in d] == ["model.dropout"]


def test_second_sweep_in_an_owned_directory_is_refused(tmp_path, base_cfg, capsys):
    import platform
    import subprocess

    from weightgeom.cli import main
    from weightgeom.train.rundir import LOCK_NAME, _proc_start_time

    out = tmp_path / "sw"
    out.mkdir()
    owner = subprocess.Popen(["sleep", "60"])
    try:
        (out / LOCK_NAME).write_text(json.dumps({"pid": owner.pid, "host": platform.node(),
                                                 "start": _proc_start_time(owner.pid), "command": ["sweep"]}))
        rc = main(["sweep", "manifolds", str(base_cfg), "--only", "hetero", "--steps", "2", "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "Traceback" not in err[0]
        assert f"sweep directory {out} is in use by pid {owner.pid} on host {platform.node()}" in err[0]
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # refused before anything was written
    finally:
        owner.kill()
        owner.wait()


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] not in (b"Z", b"X")


def _wait_until(cond, timeout: float) -> bool:
    import time

    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_parent_watchdog_without_pdeathsig(tmp_path):
    """The portable fallback alone (no prctl): an orphaned worker exits within a poll interval or two.

    The whole path (``--jobs 2``, ``kill -9`` of the sweep, workers gone, a re-run finishes) is the ``sweep``
    rows of tests/test_hostile.py."""
    import os
    import signal
    import subprocess
    import sys

    child = ("import os, time; from weightgeom.experiments.runner import die_with_parent; "
             "die_with_parent(os.getppid(), poll_s=0.1, pdeathsig=False); print('ready', flush=True); time.sleep(60)")
    parent = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
              "stdout=subprocess.PIPE, text=True); p.stdout.readline(); print(p.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", parent, child], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    try:
        assert _running(pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _wait_until(lambda: not _running(pid), 3)
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
        proc.stdout.close()


@pytest.mark.parametrize("name,text,expect", [
    ("bad.toml", "[model\nkind = 1", "cannot parse"),
    ("bad.yaml", "model: [1,\n", "cannot parse"),
    ("bad.toml", "parts = [1, 2]\n", "[parts] must hold tables"),
    ("bad.toml", "sweep = 3\n[model]\nkind = 'gpt'\n", "[sweep] must be a table"),
    ("bad.toml", "[sweep]\nwidths = 'wide'\n[model]\nkind = 'gpt'\n", "does not fit recipe md"),
])
def test_bad_sweep_file_is_one_line(tmp_path, capsys, name, text, expect):
    from weightgeom.cli import main

    cfg = _write(tmp_path / name, text)
    rc = main(["sweep", "md", str(cfg), "--out", str(tmp_path / "sw")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and expect in err[0], err
    assert not (tmp_path / "sw").exists()


@pytest.mark.parametrize("args,expect", [
    (["--set", "train.nope=1"], "unknown config key train.nope"),
    (["--set", "data.batch_size=0"], "data.batch_size"),
    (["--steps", "0"], "--steps"),
    (["--jobs", "-1"], "--jobs"),
])
def test_bad_sweep_arguments_are_one_line_and_write_nothing(tmp_path, base_cfg, capsys, args, expect):
    from weightgeom.cli import main

    try:
        rc = main(["sweep", "manifolds", str(base_cfg), "--only", "hetero", "--steps", "2", "--out",
                   str(tmp_path / "sw"), *args])
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and expect in err[-1] and "Traceback" not in "\n".join(err), err
    assert not (tmp_path / "sw").exists()


def test_sweep_out_is_a_file(tmp_path, base_cfg, capsys):
    from weightgeom.cli import main

    f = _write(tmp_path / "afile", "keep")
    assert main(["sweep", "manifolds", str(base_cfg), "--only", "hetero", "--out", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "afile: exists and is not a directory" in err[0]
    assert f.read_text() == "keep"


def test_unreadable_manifest_is_kept_aside(tmp_path, base_cfg, capsys):
    out = tmp_path / "sw"
    out.mkdir()
    (out / "sweep.json").write_text('{"runs": [')
    run_sweep(_md_runs(base_cfg, only=["adamw-w16-lr0.001"]), out, train_fn=fake_train, progress=False)
    kept = list(out.glob("sweep.unreadable-*.json"))
    assert len(kept) == 1 and kept[0].read_text() == '{"runs": ['
    assert json.loads((out / "sweep.json").read_text())["runs"][0]["status"] == "done"
    assert "unreadable" in capsys.readouterr().err


def test_report_reads_table_valued_controls_without_a_warning():
    """A control declared with keyword arguments (the demo's ``auto`` arm: ``auto_assign = {threshold = 10}``) is
    kept as a table in ``experiment.json``'s controls and settings; before, every demo report warned that it was "not
    a plain value" and dropped it. A deeper table is still refused, naming it."""
    from weightgeom.experiments.report.inputs import EXPERIMENT, Problems, conform

    problems = Problems()
    exp = {"controls": {"auto_assign": {"threshold": 10.0}, "sigma_cap": 2.0},
           "settings": {"controls.auto_assign": {"threshold": 10.0}, "optim.muon.lr": 0.02}}
    got = conform(exp, EXPERIMENT, "experiment.json", problems)
    assert not problems and got == exp
    got = conform({"controls": {"auto_assign": {"threshold": {"deep": 1}}}}, EXPERIMENT, "e.json", problems)
    assert got == {"controls": {}} and problems.lines == [
        "e.json:controls:auto_assign: dict is not a plain value; ignored"]


def test_report_plots_label_axes_with_units_and_keep_overlapping_arms_apart(tmp_path, monkeypatch):
    """Two arms with identical curves (the common case of a report's overlapping arms) stay distinguishable by line
    style and marker, not colour alone; every panel's axes carry a label with a unit."""
    from weightgeom.experiments.report import common
    from weightgeom.experiments.report import manifolds as rman

    figs = []
    monkeypatch.setattr(common, "_savefig", lambda fig, path, rect=None: figs.append(fig) or path)
    monkeypatch.setattr(rman, "_savefig", lambda fig, path, rect=None: figs.append(fig) or path)
    groups = {}
    for name in ("all-dgram", "hetero-inv"):
        d = tmp_path / f"{name}-s0"
        d.mkdir()
        rows = [{"step": s, "split": split, "loss": 2.0 - s / 100, **({"attn.0.logit_max": 1.0 + s} if split ==
                                                                       "diag" else {})}
                for s in range(0, 50, 5) for split in ("train", "val", "diag")]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        (d / "status.json").write_text(json.dumps({"state": "done", "step": 45}))
        groups[name] = [rep.load_run(d)]
    common.plot_loss_curves(groups, tmp_path / "loss.png", "t")
    rman.plot_mechanism(groups, tmp_path / "mech.png")
    assert len(figs) == 2
    for fig in figs:
        for ax in fig.get_axes():
            if not ax.get_lines():
                continue
            assert "(" in ax.get_xlabel() and "(" in ax.get_ylabel(), (ax.get_xlabel(), ax.get_ylabel())
            styles = {(ln.get_linestyle(), ln.get_marker()) for ln in ax.get_lines() if ln.get_label()[:1] != "_"}
            assert len(styles) == 2, styles  # one (line style, marker) per arm


def test_a_compress_sweep_dry_run_writes_nothing(tmp_path, capsys):
    """--dry-run on a compress preset lists its points and touches nothing (it used to load the model and run)."""
    from weightgeom.cli import main as cli_main

    out = tmp_path / "c"
    assert cli_main(["sweep", "continuity", "compress", "--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "dry run" in printed and "72 points" in printed
    assert not out.exists()
    assert cli_main(["sweep", "continuity", "compress", "--launcher", "slurm", "--out", str(out)]) == 2
    assert "run it without --launcher" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("manifest,says", [
    ({"runs": [{}], "wall_s": 12.34}, "1 run, 12.3 s"),
    ({"runs": [{}, {}], "invocations": [{"time": "t"}]}, "2 runs, stopped before it ended"),
    ({"runs": [{}] * 16, "invocations": [{"wall_s": 100.0}, {}, {"wall_s": 2345.68}]},
     "16 runs in 3 sittings, 2445.7 s of wall time in the 2 that ended; 1 stopped before it ended"),
    ({"runs": [{}] * 16, "invocations": [{}, {"wall_s": float("nan")}]},
     "16 runs in 2 sittings; 2 stopped before they ended"),
])
def test_report_times_a_sweep_by_its_sittings(manifest, says):
    """A sweep resumed across sittings is timed by the sittings that ended (the manifest's own wall_s is the last
    sitting's), and a sweep whose sitting was stopped says so instead of '? s'."""
    assert rep.sweep_timing(manifest) == says
