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

from weightgeom.experiments import report as rep
from weightgeom.experiments.cli import execute, get_recipe
from weightgeom.experiments.controls import ContinuityRecorder, SigmaCap, pair_continuity
from weightgeom.experiments.runner import Variant, load_parts, parse_set, plan, run_sweep

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
    runs = plan("manifolds", variants, parts, seeds=[0, 1], steps=20, sets=parse_set(["optim.lr=0.01"]))
    assert len(runs) == 2 * len(variants) and len({r.name for r in runs}) == len(runs)
    r = next(r for r in runs if r.name == "hetero-s1")
    assert r.config["optim"]["strategy"] == "hetero" and r.config["run"]["seed"] == 1
    assert r.config["train"]["max_steps"] == 20 and r.config["train"]["eval_every"] <= 5
    assert r.config["optim"]["lr"] == 0.01
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
                                    "adam-b2-0", "adam-b1-0-b2-0", "llama-silu", "llama-none"]
    runs = plan("continuity", vs, parts, [0], steps=16)
    assert next(r for r in runs if r.variant == "nores").config["model"]["residual"] is False
    assert next(r for r in runs if r.variant == "adam-b2-0").config["optim"]["betas"] == [0.9, 0.0]
    assert all(r.controls["continuity_every"] == 2 for r in runs if r.part == "resmlp")
    _, parts, sweep = load_parts(str(base_cfg))
    md = get_recipe("md").variants(parts, {"widths": [16, 32], "lrs": {"adamw": [1e-3, 1e-2], "muon": [0.01, 0.02],
                                                                       "adamw-md": [1e-3], "muon-md": [0.02]}}, 20)
    lr_runs = [v for v in md if v.tags["kind"] == "lr"]
    assert len(lr_runs) == 2 * 2 + 2 * 2 + 2 + 2
    adam = next(v for v in md if v.name == "adamw-w32-lr0.01")
    assert adam.overrides["optim.adamw_lr"] == 0.01 and adam.overrides["model.n_embd"] == 32
    wu = [v for v in md if v.tags["kind"] == "warmup"]
    assert len(wu) == 4 and all(v.overrides["schedule.warmup"] == 2 for v in wu)


def test_unknown_preset_and_recipe_errors():
    with pytest.raises(FileNotFoundError, match="unknown preset"):
        load_parts("no-such-preset-xyz")
    with pytest.raises(ValueError, match="unknown recipe"):
        get_recipe("nope")
    with pytest.raises(ValueError, match="section.key=value"):
        parse_set(["novalue"])


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
    assert json.loads((out / "hetero-s0" / "experiment.json").read_text())["variant"] == "hetero"
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
    assert "7/7" in text  # synthetic llama pattern matches the seed's
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
def test_sigma_cap_bounds_qk_product():
    d = 8
    W = nn.Parameter(torch.randn(3 * d, d) * 3)
    opt = torch.optim.SGD([{"params": [W], "names": ["transformer.h.0.attn.c_attn.weight"]}], lr=0.0)
    with SigmaCap(2.0) as cap:
        W.grad = torch.zeros_like(W)
        opt.step()
    sq = torch.linalg.matrix_norm(W[:d].detach(), ord=2)
    sk = torch.linalg.matrix_norm(W[d:2 * d].detach(), ord=2)
    assert float(sq * sk) == pytest.approx(2.0, rel=1e-4)
    assert cap.summary()["rescales"] == 1 and cap.summary()["layers"] == 1
    # the hook is gone after the context
    W.data.mul_(5)
    opt.step()
    assert float(torch.linalg.matrix_norm(W[:d].detach(), ord=2)) > 2 * float(sq)


def test_continuity_recorder_and_pair_metrics(tmp_path):
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(4))
    names = [f"blocks.{i}.fc.weight" for i in range(4)]
    opt = torch.optim.SGD([{"params": [b.weight for b in blocks], "names": names}], lr=0.5)
    rec = ContinuityRecorder(every=2, max_steps=3)
    x = torch.randn(32, 16)
    with rec:
        for _ in range(3):
            h = x
            for b in blocks:
                h = h + torch.relu(b(h))
            loss = h.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    rec.write(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "continuity.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == {0, 2, 3}
    assert {r["kind"] for r in rows} == {"weight", "grad", "delta"}
    assert all(0 <= r["cv"] <= 1 + 1e-9 and r["dominance"] > 0 for r in rows if r["kind"] == "delta")
    # identical layers → continuity 1; proportional Grams → alignment 1
    W = torch.randn(5, 7)
    m = pair_continuity(torch.stack([W, 2 * W, -W]))
    assert torch.allclose(m["cv"], torch.ones(2, dtype=torch.float64)) and torch.allclose(
        m["align_in"], torch.ones(2, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------- end to end
def _trainer_available() -> bool:
    try:
        from weightgeom.train import train  # noqa: F401
    except ImportError:
        return False
    return True


needs_trainer = pytest.mark.skipif(not _trainer_available(), reason="weightgeom.train.train not available yet")


def _e2e(tmp_path, recipe, only):
    from weightgeom.experiments.runner import repo_root

    cfg = repo_root() / "configs" / "experiments" / f"{recipe}-ci.toml"
    manifest, path = execute(recipe, str(cfg), seeds=[0], out=tmp_path / recipe, only=only, progress=False)
    bad = [(r["name"], r.get("reason")) for r in manifest["runs"] if r["status"] not in ("done", "diverged")]
    assert not bad, bad
    posts = [(r["name"], r["post_error"]) for r in manifest["runs"] if r.get("post_error")]
    assert not posts, posts
    text = path.read_text()
    assert text.startswith("# weightgeom sweep") and list(path.parent.glob("*.png"))
    return manifest, text


@needs_trainer
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


@needs_trainer
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["manifolds", "continuity", "md"])
def test_recipe_end_to_end_full_ci_preset(tmp_path, recipe):
    _e2e(tmp_path, recipe, None)
