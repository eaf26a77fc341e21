"""The papers' claims as data: every verdict comes from its claim's stated rule, the report carries the claims table
and ``claims.json``, and the README's table and docs/results.md are what ``weightgeom claims`` generates from the
recorded ``docs/results/claims.json`` — so the README, the docs and the reports cannot differ."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from weightgeom.experiments import report as rep
from weightgeom.experiments.report import claims as cl
from weightgeom.experiments.report import claims_page as cp
from weightgeom.experiments.report.inputs import Problems

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "results" / "claims.json"


# ------------------------------------------------------------------------------------------------ the table
def test_every_claim_is_tested_by_a_recipe_or_says_why_not():
    keys = [c.key for c in cl.CLAIMS]
    assert len(keys) == len(set(keys))
    for c in cl.CLAIMS:
        assert c.paper in ("manifold assignment", "continuity", "MD"), c
        if c.recipe is None:
            assert c.untested, c.key
        else:
            assert (c.recipe in cl.EVALUATORS or c.recipe == "compress") and c.rule, c.key


# (measured, Res+ReLU, expected verdict): the case — 0.30 against a random level of 0.05 is not "reproduced"
NORES = [(0.30, 0.94, "partly reproduced"), (0.19, 0.94, "partly reproduced"), (0.08, 0.94, "reproduced"),
         (0.90, 0.94, "not reproduced"), (0.95, 0.60, "reversed")]


def _cont_run(root: Path, variant: str, weight_cv: float, grad_cv: float, dominance: float = 0.3,
              seeds: tuple[int, ...] = (0, 1)) -> None:
    for seed in seeds:
        _cont_seed(root, variant, weight_cv, grad_cv, dominance, seed)


def _cont_seed(root: Path, variant: str, weight_cv: float, grad_cv: float, dominance: float, seed: int) -> None:
    d = root / f"{variant}-s{seed}"
    d.mkdir(parents=True)
    rows = []
    for layer in range(2):
        rows += [{"step": 20, "kind": "weight", "role": "mlp", "layer": layer, "cv": weight_cv, "cu": 0.1},
                 {"step": 20, "kind": "grad", "role": "mlp", "layer": layer, "cv": grad_cv, "cu": 0.1},
                 {"step": 20, "kind": "delta", "role": "mlp", "layer": layer, "cv": 0.9, "cu": 0.1,
                  "dominance": dominance}]
    (d / "continuity.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (d / "experiment.json").write_text(json.dumps({"recipe": "continuity", "variant": variant, "seed": seed,
                                                   "part": "resmlp"}))
    (d / "status.json").write_text(json.dumps({"state": "done", "step": 20}))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 20, "split": "val", "loss": 0.3}) + "\n")
    (d / "meta.json").write_text(json.dumps({"device_kind": "CPU AMX, 2 cores"}))


@pytest.mark.parametrize("nores,base,verdict", NORES)
def test_nores_verdict_follows_its_rule(tmp_path, nores, base, verdict):
    _cont_run(tmp_path / "c", "res-relu", 0.8, base)
    _cont_run(tmp_path / "c", "nores", 0.05, nores)
    found = {f.key: f for f in cl.findings([rep.load_run(d) for d in sorted((tmp_path / "c").iterdir())])}
    assert found["c-nores"].verdict == verdict
    assert f"NoRes gradient C_v {nores:.2f}" in found["c-nores"].evidence
    assert found["c-nores"].device == "CPU AMX, 2 cores" and found["c-nores"].runs == 4


@pytest.mark.parametrize("diff,verdict", [(0.0, "not reproduced"), (0.25, "not reproduced"), (0.26, "reproduced"),
                                          (-0.5, "reversed")])
def test_count_rule(diff, verdict):
    assert cl._count_verdict(diff) == verdict


@pytest.mark.parametrize("d,s,verdict", [(8.5, 1.0, "reproduced"), (1.4, 1.0, "not reproduced"),
                                         (1.0, 2.0, "reversed"), (float("nan"), 1.0, None)])
def test_growth_rule(d, s, verdict):
    assert cl._growth_verdict(d, s) == verdict


def test_dominance_rule(tmp_path):
    _cont_run(tmp_path / "a", "res-relu", 0.83, 0.94, dominance=0.34)   # continuous before ΔW dominates
    _cont_run(tmp_path / "a", "init-small", 0.96, 0.95, dominance=3.5)
    found = {f.key: f for f in cl.findings([rep.load_run(d) for d in sorted((tmp_path / "a").iterdir())])}
    assert found["c-dominance"].verdict == "not reproduced" and "res-relu: C_v 0.83 at 0.34" in found[
        "c-dominance"].evidence
    _cont_run(tmp_path / "b", "res-relu", 0.83, 0.94, dominance=1.5)
    found = {f.key: f for f in cl.findings([rep.load_run(d) for d in sorted((tmp_path / "b").iterdir())])}
    assert found["c-dominance"].verdict == "reproduced"


# (values compared per strategy, gap, margin, expected verdict): a verdict needs two seeds and a gap beyond the noise
EVIDENCE = [([[2.5], [2.4]], -0.1, 0.0, "inconclusive", "1 seed"),
            ([[2.5, 2.6], [2.4]], -0.1, 0.05, "inconclusive", "1 seed"),
            ([[2.5, 2.6], [2.4, 2.5]], -0.05, 0.08, "inconclusive", "within noise"),
            ([[2.5, 2.6], [2.4, 2.5]], -0.1, 0.08, "reproduced", "")]


@pytest.mark.parametrize("compared,gap,margin,verdict,reason", EVIDENCE)
def test_a_verdict_needs_two_seeds_and_a_gap_beyond_the_noise(compared, gap, margin, verdict, reason):
    v, ev = cl._evidence_gate("reproduced", "HETERO 2.4", gap, margin, compared)
    assert v == verdict
    assert cl.inconclusive_reason(cl.Finding("ma-hetero-best", v, ev, "s", 1, 1, "d")) == reason
    if reason:
        assert ev == f"{reason} — HETERO 2.4; by its rule alone: reproduced"


def _ma_run(root: Path, strategy: str, seed: int, lr: float, growth: float) -> None:
    d = root / f"{strategy}-lr{lr:g}-s{seed}"
    d.mkdir(parents=True)
    rows = [{"step": s, "split": "diag", "attn.0.qk_sigma_prod": 1.0 + (growth - 1.0) * s / 100,
             "attn.0.logit_max": 2.0} for s in (0, 50, 100)]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (d / "config.resolved.toml").write_text(f'[optim]\nstrategy = "{strategy}"\n[optim.muon]\nlr = {lr}\n')
    (d / "experiment.json").write_text(json.dumps({"recipe": "manifolds", "variant": strategy, "seed": seed}))
    (d / "status.json").write_text(json.dumps({"state": "done", "step": 100}))


# (seeds, Muon learning rates) of each side's runs -> σ-growth verdict: two strategies at one seed and one lr are one
# replicate; a ladder of lrs (the long sweep) or two seeds are two
CHAIN = [((0,), (0.02,), "inconclusive"), ((0, 1), (0.02,), "reproduced"), ((0,), (0.02, 0.04), "reproduced")]


@pytest.mark.parametrize("seeds,lrs,verdict", CHAIN)
def test_chain_claims_need_two_replicates_per_side(tmp_path, seeds, lrs, verdict):
    for strategy, growth in (("all-dgram", 9.0), ("hetero-inv", 8.0), ("all-stiefel", 1.1), ("hetero", 1.0)):
        for seed in seeds:
            for lr in lrs:
                _ma_run(tmp_path, strategy, seed, lr, growth)
    found = {f.key: f for f in cl.findings([rep.load_run(d) for d in sorted(tmp_path.iterdir())])}
    assert found["ma-sigma-growth"].verdict == verdict
    assert found["ma-sigma-growth"].evidence.startswith("1 seed — ") == (verdict == "inconclusive")


def _long_run(root: Path, strategy: str, mult: float, control: str | None, sat: float, val: float,
              seed: int = 0) -> None:
    name = f"long-{strategy}-x{mult:g}" + (f"-{control}" if control else "")
    d = root / f"{name}-s{seed}"
    d.mkdir(parents=True)
    rows = [{"step": s, "split": "diag", "attn.0.saturation": sat * s / 100, "attn.0.qk_sigma_prod": 1.0,
             "attn.0.logit_max": 2.0} for s in (0, 50, 100)] + [{"step": 100, "split": "val", "loss": val}]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (d / "config.resolved.toml").write_text(f'[optim]\nstrategy = "{strategy}"\n[optim.muon]\nlr = {0.02 * mult}\n')
    tags = {"study": "long", "strategy": strategy, "lr_multiplier": mult, **({"control": control} if control else {})}
    controls = {"head_stats_every": 50, **({"qk_clip": {"tau": 10.0}} if control == "qk-clip" else {}),
                **({"sigma_cap": 2.0} if control == "sigma-cap" else {})}
    (d / "experiment.json").write_text(json.dumps({"recipe": "manifolds", "variant": name, "seed": seed, "tags": tags,
                                                   "controls": controls}))
    (d / "status.json").write_text(json.dumps({"state": "done", "step": 100}))


def test_scale_control_claims_from_the_constant_lr_long_runs(tmp_path):
    """Plain DGram attention saturates at both learning rates; QK-clip removes it, the σ cap does not; the best
    controlled arm is within the match margin of HETERO at ×8 but not at ×16 → gain, no gain, no gain. The controlled
    arms stay out of the DGram-vs-Stiefel chain claims."""
    for m, het in ((8, 1.50), (16, 1.60)):
        _long_run(tmp_path, "all-dgram", m, None, 0.4, 1.7)
        _long_run(tmp_path, "hetero-inv", m, None, 0.3, 1.7)
        _long_run(tmp_path, "all-dgram", m, "qk-clip", 0.01, het + (0.03 if m == 8 else 0.2))
        _long_run(tmp_path, "all-dgram", m, "sigma-cap", 0.2, 1.9)
        _long_run(tmp_path, "hetero", m, None, 0.0, het)
        _long_run(tmp_path, "all-stiefel", m, None, 0.0, het + 0.1)
    found = {f.key: f for f in cl.findings([rep.load_run(d) for d in sorted(tmp_path.iterdir())])}
    assert found["ma-qk-clip"].verdict == "gain" and "ALL-DGRAM ×8: peak saturation 0.40 → with qk-clip (τ 10) " \
        "peak saturation 0.01" in found["ma-qk-clip"].evidence
    assert found["ma-sigma-cap"].verdict == "no gain" and "with sigma-cap (σ ≤ 2) peak saturation 0.20" in \
        found["ma-sigma-cap"].evidence
    # a val-loss comparison: two learning rates at one seed are not two seeds
    assert found["ma-controlled-match"].verdict == "inconclusive"
    assert found["ma-controlled-match"].evidence.startswith("1 seed — ×8: best controlled all-dgram+qk-clip 1.530 vs "
                                                            "HETERO 1.500 (+0.030); ×16")
    assert "by its rule alone: no gain" in found["ma-controlled-match"].evidence
    assert "4 of 4 DGram-attention" in found["ma-saturation"].evidence  # the plain arms only
    assert all(cl.CLAIM_BY_KEY[k].untested for k in ("ma-qk-clip", "ma-sigma-cap", "ma-controlled-match"))


# HETERO's and the controlled arm's final val loss per seed at one learning rate -> ma-controlled-match
MATCH = [
    ((1.50, 1.52), (1.52, 1.54), "gain"),  # +0.02, seed std 0.014: clearly within the 0.05 margin
    ((1.50, 1.52), (1.60, 1.62), "no gain"),  # +0.10: clearly above it
    ((1.50, 1.60), (1.52, 1.62), "inconclusive"),  # +0.02, but seed std 0.07: within noise of the margin
    ((1.50, 1.52), (1.52, math.inf), "no gain"),  # one controlled seed diverged
]


@pytest.mark.parametrize("het,arm,verdict", MATCH)
def test_controlled_match_is_a_val_loss_comparison_over_seeds(tmp_path, het, arm, verdict):
    for seed in (0, 1):
        _long_run(tmp_path, "all-dgram", 8, None, 0.4, 1.7, seed)
        _long_run(tmp_path, "hetero", 8, None, 0.0, het[seed], seed)
        if math.isfinite(arm[seed]):
            _long_run(tmp_path, "all-dgram", 8, "qk-clip", 0.01, arm[seed], seed)
        else:
            _long_run(tmp_path, "all-dgram", 8, "qk-clip", 0.01, 9.9, seed)
            d = tmp_path / "long-all-dgram-x8-qk-clip-s1"
            (d / "status.json").write_text(json.dumps({"state": "diverged", "step": 100, "reason": "loss is nan"}))
    found = {f.key: f for f in cl.findings([rep.load_run(d) for d in sorted(tmp_path.iterdir())])}
    f = found["ma-controlled-match"]
    assert f.verdict == verdict, f.evidence
    if verdict == "inconclusive":
        assert f.evidence.startswith("within noise — ")
    if math.isfinite(arm[1]):
        assert "mean of 2 seeds, seed std" in f.evidence
    qk = found["ma-qk-clip"]  # each seed is its own setting: a diverged seed is one where the control fails
    assert qk.verdict == ("gain" if math.isfinite(arm[1]) else "no gain") and "ALL-DGRAM ×8 seed 1:" in qk.evidence


def test_a_verdict_from_part_of_a_sweep_says_how_many_runs_were_not_finished(tmp_path):
    """A sweep stopped to be resumed (its sweep.json plans runs that have not finished) marks every finding read from
    it; a run the sweep skipped by its own rule is not counted; a finished sweep adds nothing."""
    _long_run(tmp_path, "all-dgram", 8, None, 0.4, 1.7)
    _long_run(tmp_path, "all-dgram", 8, "qk-clip", 0.3, 1.8)
    names = ["long-all-dgram-x8-s0", "long-all-dgram-x8-qk-clip-s0", "long-hetero-x8-s0", "long-all-dgram-x16-s0"]
    status = ["done", "done", "running", "skipped"]
    manifest = {"recipe": "manifolds", "label": "long-const",
                "runs": [{"name": n, "status": s} for n, s in zip(names, status, strict=True)]}
    (tmp_path / "sweep.json").write_text(json.dumps(manifest))
    runs = [rep.load_run(d) for d in sorted(tmp_path.iterdir()) if d.is_dir()]
    found = {f.key: f for f in cl.findings(runs)}
    assert found["ma-qk-clip"].evidence.endswith("(decided while 1 of the sweep's 4 runs were not finished)")
    partial = {f.key: f for f in cl.findings(runs)}["ma-qk-clip"]
    # a name listed twice counts once; a run recorded done whose directory is elsewhere is not "not finished"
    manifest["runs"] += [{"name": "long-hetero-x8-s0", "status": "running"}, {"name": "gone-s0", "status": "done"}]
    (tmp_path / "sweep.json").write_text(json.dumps(manifest))
    assert {f.key: f for f in cl.findings(runs)}["ma-qk-clip"].evidence.endswith(
        "(decided while 1 of the sweep's 5 runs were not finished)")
    manifest["runs"] = manifest["runs"][:2] + manifest["runs"][3:4]
    (tmp_path / "sweep.json").write_text(json.dumps(manifest))
    whole = {f.key: f for f in cl.findings(runs)}["ma-qk-clip"]
    assert "not finished" not in whole.evidence
    # the same finding read mid-sweep and at the end is one finding in the record, the end's
    assert cp.merge([partial, whole])["ma-qk-clip"] == [whole] == cp.merge([whole, partial])["ma-qk-clip"]


def test_quick_demo_reads_one_seed_as_inconclusive_and_says_it_is_a_smoke_test(tmp_path, monkeypatch, capsys):
    """The quick demo's own report path (demo → report → claims.json → console) on a one-seed continuity sweep: no
    bold verdict, each reads "inconclusive (1 seed)", and the report and console say the verdicts are a smoke test
    and point to the recorded table."""
    import argparse

    from weightgeom.experiments import cli as ecli
    from weightgeom.experiments import demo

    def execute(recipe, preset, out, **kw):
        _cont_run(out, "res-relu", 0.8, 0.94, seeds=(0,))
        _cont_run(out, "nores", 0.05, 0.30, seeds=(0,))
        (out / "sweep.json").write_text(json.dumps({"recipe": recipe, "label": preset,
                                                    "command": "weightgeom demo --quick"}))
        return {"runs": [{"status": "done"}] * 2}, None

    monkeypatch.setattr(ecli, "execute", execute)
    args = argparse.Namespace(quick=True, out=str(tmp_path / "q"), only="continuity", verbose=False, sets=[], jobs=1)
    assert demo.run(args) == 0
    text = (tmp_path / "q" / "report.md").read_text()
    section = text.split("## The papers' claims")[1].split("\n## ")[0]
    assert "| inconclusive | 1 seed — NoRes gradient C_v 0.30 vs Res+ReLU 0.94" in section
    assert "by its rule alone: partly reproduced" in section and "| **" not in section
    assert demo.SMOKE_NOTE in text.split("## ")[0] and "docs/results.md" in demo.SMOKE_NOTE
    assert "— **" not in text.split("## Geometric continuity")[1]  # the section's verdict lines: not bold either
    out = capsys.readouterr().out
    assert demo.SMOKE_NOTE in out and "inconclusive (1 seed)" in out
    assert not any(v in line for line in out.splitlines() if line.startswith("  ")
                   for v in ("  reproduced", "partly reproduced", "reversed"))


# ---------------------------------------------------------------------------------- report → claims → README
def test_report_carries_the_claims_table_and_claims_json(tmp_path):
    _cont_run(tmp_path / "c", "res-relu", 0.8, 0.94)
    _cont_run(tmp_path / "c", "nores", 0.05, 0.30)
    (tmp_path / "c" / "sweep.json").write_text(json.dumps({"recipe": "continuity", "label": "cpu",
                                                           "command": "weightgeom demo"}))
    path = rep.make_report([tmp_path / "c"])
    text = path.read_text()
    section = text.split("## The papers' claims")[1].split("\n## ")[0]
    assert "| **partly reproduced** | NoRes gradient C_v 0.30 vs Res+ReLU 0.94" in section
    assert "weightgeom sweep continuity cpu (in weightgeom demo), 4 runs × 20 steps" in section
    assert "Rules:" in section and f"within {cl.CV_TOLERANCE:g} of the paper's 0.05" in section
    # the continuity section's own verdict line says the same
    assert "NoRes gradient C_v 0.30 vs Res+ReLU 0.94 (random level" in text.split("## Geometric continuity")[1]
    assert "— **partly reproduced**" in text.split("## Geometric continuity")[1]
    found = cp.read_claims(path.parent / cp.CLAIMS_FILE, Problems())
    assert [f.key for f in found] == ["c-nores", "c-dominance"] and found[0].verdict == "partly reproduced"

    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{cp.README_BEGIN}\nOLD-TABLE\n{cp.README_END}\n\nafter\n")
    out = subprocess.run([sys.executable, "-m", "weightgeom", "claims", str(tmp_path / "c"), "--readme", str(readme),
                          "--page", str(tmp_path / "results.md"), "--record", str(tmp_path / "r" / "claims.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    new = readme.read_text()
    assert new.startswith("# x\n\n") and new.endswith("\n\nafter\n") and "OLD-TABLE" not in new
    row = next(line for line in new.splitlines() if "without residual connections" in line)
    assert "**partly reproduced**" in row and "`weightgeom sweep continuity cpu`" in row
    assert "| MD | Muon+MD saves about 2× compute" in new and "not tested" in new
    page = (tmp_path / "results.md").read_text()
    assert "Rule: NoRes gradient C_v" in page and "CPU AMX, 2 cores" in page
    # the record regenerates the same README block
    again = cp.readme_table(cp.merge(cp.read_claims(tmp_path / "r" / "claims.json", Problems())))
    assert again in new


def test_claims_command_refuses_bad_input_in_one_line(tmp_path):
    def claims(*args):
        return subprocess.run([sys.executable, "-m", "weightgeom", "claims", *map(str, args)],
                              capture_output=True, text=True, timeout=120)

    out = claims(tmp_path / "missing")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "does not exist" in out.stderr
    (tmp_path / "empty").mkdir()
    out = claims(tmp_path / "empty")
    assert out.returncode == 2 and "no claims.json" in out.stderr
    bad = tmp_path / "claims.json"
    bad.write_text(json.dumps({"findings": [{"key": "c-nores", "verdict": "proven", "evidence": "x", "source": "y",
                                             "steps": 1, "runs": 1, "device": "z"}, {"key": "nope"}]}))
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n")
    out = claims(bad, "--readme", readme)  # nothing readable: nothing written
    assert out.returncode == 2 and "nothing written" in out.stderr and "Traceback" not in out.stderr
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"findings": [_finding()]}))
    out = claims(good, "--readme", readme)
    assert out.returncode == 2 and "markers" in out.stderr and "Traceback" not in out.stderr
    assert readme.read_text() == "no markers here\n"  # nothing written
    out = claims(bad)
    assert out.returncode == 0 and "unknown verdict 'proven'" in out.stderr


def test_merge_heads_each_claim_with_its_longest_runs():
    short = cl.Finding("ma-saturation", "not reproduced", "a", "weightgeom sweep manifolds tiny-shakespeare", 250, 16,
                       "d")
    long = cl.Finding("ma-saturation", "reproduced", "b", "weightgeom sweep manifolds long", 3000, 16, "d")
    merged = cp.merge([short, long, short])
    assert [f.evidence for f in merged["ma-saturation"]] == ["b", "a"]
    assert cp.headline(cl.CLAIM_BY_KEY["ma-saturation"], merged["ma-saturation"]) == "reproduced"
    assert merged["md-compute"] == [] and set(merged) == set(cl.CLAIM_BY_KEY)
    row = next(x for x in cp.readme_table(merged).splitlines() if "softmax saturation" in x)
    assert "| **reproduced** | b: `weightgeom sweep manifolds long`; not reproduced in tiny-shakespeare |" in row
    # a longer sweep that cannot decide it (one seed) does not head it; alone, it does
    longer = cl.Finding("ma-saturation", "inconclusive", "1 seed — c", "weightgeom sweep manifolds long-const", 10000,
                        8, "d")
    merged = cp.merge([short, longer, long])["ma-saturation"]
    assert [f.evidence for f in merged] == ["b", "a", "1 seed — c"]
    assert cp.merge([longer, cl.Finding("ma-saturation", "inconclusive", "1 seed — a", "x", 250, 4, "d")])[
        "ma-saturation"][0] is longer
    untested = cl.Finding("ma-saturation", "not tested", "e", "hand-written", 50000, 1, "d")
    assert cp.merge([untested, long])["ma-saturation"][0] is long


@pytest.mark.parametrize("gemma_verdict,verdict", [("partly reproduced", "partly reproduced"),
                                                      ("reversed", "inconclusive")])
def test_merge_pools_the_pretrained_sharing_claim_over_the_models(gemma_verdict, verdict):
    """One whole-model compression sweep per model: one claims row, the models' common verdict, inconclusive when
    they disagree; a finding of another kind (per-role weight-only sweep) stays beside it."""
    ev = cl.MODEL_SCOPE_EVIDENCE
    smol = cl.Finding("c-pretrained", "partly reproduced", f"SmolLM2: {ev} at 20%: 176 vs 269 vs 178",
                      "weightgeom sweep continuity compress-model", 0, 32, "CPU AVX512-BF16, 2 cores")
    gemma = cl.Finding("c-pretrained", gemma_verdict, f"gemma: {ev} at 20%: 417 vs 617 vs 424",
                       "weightgeom sweep continuity compress-gemma", 0, 32, "CPU AVX512-BF16, 2 cores")
    per_role = cl.Finding("c-pretrained", "not reproduced", "per role", "weightgeom sweep manifolds long", 3000, 4,
                          "d")
    merged = cp.merge([gemma, smol, per_role])["c-pretrained"]
    assert len(merged) == 2 and merged[0] is per_role  # a trained finding is not a model's (and heads: more steps)
    pooled = merged[1]
    assert pooled.verdict == verdict and pooled.runs == 64 and pooled.device == "CPU AVX512-BF16, 2 cores"
    assert pooled.evidence.endswith(f"gemma: {ev} at 20%: 417 vs 617 vs 424; SmolLM2: {ev} at 20%: 176 vs 269 vs "
                                    "178")  # by source
    assert pooled.evidence.startswith("inconclusive (the models disagree)") == (verdict == "inconclusive")
    both = ["weightgeom sweep continuity compress-gemma", "weightgeom sweep continuity compress-model"]
    assert cp.sources(pooled) == both
    row = next(x for x in cp.readme_table(cp.merge([gemma, smol])).splitlines() if "sharing a basis" in x)
    assert row.endswith(f": `{both[0]}` and `{both[1]}` |")
    assert cp.merge([smol])["c-pretrained"] == [smol]  # one model: as it is
    # a per-role (weight-only) compression sweep of one model is not another model: not pooled with the whole-model one
    role_sweep = cl.Finding("c-pretrained", "reproduced", "SmolLM2: continuity over random in the paper's space Q 3×",
                            "weightgeom sweep continuity compress", 0, 72, "CPU AMX")
    assert sorted(f.runs for f in cp.merge([smol, role_sweep])["c-pretrained"]) == [32, 72]
    # the record keeps each model's finding: read back, alone or beside the sweeps' own files, it pools once
    rec = [cl.Finding(**f) for f in cp.record([gemma, smol])["findings"]]
    assert sorted(f.source for f in rec) == sorted([gemma.source, smol.source])
    again = cp.merge([*rec, gemma, smol])["c-pretrained"]
    assert [f.runs for f in again] == [64] and again[0].evidence == pooled.evidence


# ------------------------------------------------------------------------------- the repository's own pages
def test_readme_and_results_page_are_generated_from_the_recorded_claims():
    """README's claims table and docs/results.md are exactly what `weightgeom claims docs/results/claims.json`
    writes; the record holds what `weightgeom report` wrote for the demo and the recorded sweeps."""
    found = cp.read_claims(RECORD, problems := Problems())
    assert not problems, problems.lines
    merged = cp.merge(found)
    hint = ("stale: regenerate with `weightgeom claims docs/results/claims.json --readme README.md --page "
            "docs/results.md`")
    assert cp.readme_table(merged) in (ROOT / "README.md").read_text(), hint
    assert (ROOT / "docs" / "results.md").read_text() == cp.results_page(merged), hint
    demo = [f for f in found if "(in weightgeom demo)" in f.source]
    assert {f.source.split(" (")[0] for f in demo} >= {"weightgeom sweep manifolds tiny-shakespeare",
                                                         "weightgeom sweep continuity cpu"}


def test_pretrained_sharing_rule():
    def rows(role, paper_ppl, other_ppl, paper="input"):
        other = "output" if paper == "input" else "input"
        return [{"role": role, "arm": arm, "savings_target": lv, "ppl": ppl}
                for lv in (0.1, 0.5) for arm, ppl in ((paper, paper_ppl), (other, other_ppl))]

    def verdict(*role_rows):
        found = cl.compress_findings({"rows": [r for rs in role_rows for r in rs], "baseline": {"ppl": 10.0}})
        return found[0][1]

    assert verdict(rows("Q", 10, 20), rows("O", 10, 20, "output")) == "reproduced"
    assert verdict(rows("Q", 20, 10), rows("O", 20, 10, "output")) == "reversed"
    assert verdict(rows("Q", 10, 20), rows("Up", 20, 10)) == "partly reproduced"
    assert verdict(rows("Q", 10, 10.3), rows("K", 10.2, 10)) == "not reproduced"  # within PPL_MARGIN
    # a perplexity is quoted with its text and token budget (the record's baseline and settings)
    record = {"rows": rows("Q", 10, 20), "baseline": {"ppl": 68.68, "tokens": 1024}, "settings": {"text": None}}
    assert cl.compress_findings(record)[0][2].endswith(
        "(perplexity 68.7 uncompressed, over 1024 tokens of the held-out Shakespeare text)")
    record["settings"]["text"] = "/data/wiki.txt"
    assert "over 1024 tokens of wiki.txt)" in cl.compress_findings(record)[0][2]


@pytest.mark.parametrize("paper,other,svdw,verdict", [
    (100, 200, 150, "reproduced"),
    (100, 200, 90, "partly reproduced"),  # beats the other space, not per-layer whitened SVD
    (200, 100, 150, "reversed"),
    (100, 103, 300, "inconclusive"),  # paper vs other inside the 5 % noise
    (150, 170, 100, "not reproduced"),  # paper vs other: beyond the noise both ways, one level each
])
def test_pretrained_sharing_whole_model_rule(paper, other, svdw, verdict):
    def record(model, scale=1.0, second=None):
        pts = {"paper-a": paper, "paper-rev-a": other, "svd-w": svdw}
        rows = [{"method": m, "savings_target": lv, "ppl": p * scale * (1 + lv)} for lv in (0.1, 0.2)
                for m, p in pts.items()]
        if second is not None:  # the other space better at the second level
            rows = [r if not (r["method"] == "paper-rev-a" and r["savings_target"] == 0.2) else
                    {**r, "ppl": second} for r in rows]
        return {"scope": "model", "model": model, "rows": rows, "baseline": {"ppl": 68.68, "tokens": 1024},
                "settings": {"text": None}}

    second = paper * 1.2 * 0.8 if verdict == "not reproduced" else None
    (key, got, ev), = cl.compress_findings(record("m1", second=second))
    assert (key, got) == ("c-pretrained", verdict)
    assert ev.startswith("m1: perplexity in the paper's spaces vs the other space vs per-layer whitened SVD at 10%: ")
    assert "over 1024 tokens of the held-out Shakespeare text" in ev
    # two models that disagree: inconclusive, saying so first
    flipped = {"scope": "model", "model": "m2", "rows": [{**r, "ppl": {"paper-a": 2, "paper-rev-a": 1}.get(
        r["method"], 3) * 100.0} for r in record("m2")["rows"]], "baseline": {"ppl": 50.0}}
    (_, both, ev2), = cl.compress_model_findings([record("m1"), flipped])
    assert (both, ev2.startswith("inconclusive (the models disagree)")) == (
        (verdict, False) if verdict == "reversed" else ("inconclusive", True))


def _finding(**kw) -> dict:
    f = {"key": "c-nores", "verdict": "reproduced", "evidence": "NoRes 0.05",
         "source": "weightgeom sweep continuity cpu", "steps": 500, "runs": 2, "device": "CPU AMX, 2 cores"}
    return {**f, **kw}


def _claims_cli(*args):
    return subprocess.run([sys.executable, "-m", "weightgeom", "claims", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def test_claims_from_a_hostile_file_stay_inert_and_bounded(tmp_path):
    evil = tmp_path / "claims.json"
    evil.write_text(json.dumps({"findings": [
        _finding(source="a ` <script>alert(1)</script> ` b | c"),
        _finding(key="c-symmetry", evidence="x" * 5_000_000)]}))
    out = _claims_cli(evil)
    assert out.returncode == 0 and "evidence is longer than 1000 characters" in out.stderr
    row = next(line for line in out.stdout.splitlines() if "without residual connections" in line)
    # inside a code span (fence longer than any backtick run in it) a renderer shows the tag as text; no extra cell
    assert "``a ` <script>alert(1)</script> ` b \\| c``" in row and row.count(" | ") == 3
    assert "x" * 1001 not in out.stdout


def test_claims_never_rewrite_a_readme_from_nothing_or_through_a_link(tmp_path):
    readme = tmp_path / "README.md"
    body = f"# x\n\n{cp.README_BEGIN}\nOLD-TABLE\n{cp.README_END}\n"
    readme.write_text(body)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    out = _claims_cli(bad, "--readme", readme)
    assert out.returncode == 2 and "nothing written" in out.stderr and readme.read_text() == body
    good = tmp_path / "claims.json"
    good.write_text(json.dumps({"findings": [_finding()]}))
    link = tmp_path / "link.md"
    link.symlink_to(readme)
    out = _claims_cli(good, "--readme", link)
    assert out.returncode == 2 and "symbolic link" in out.stderr and link.is_symlink() and readme.read_text() == body
    twice = tmp_path / "twice.md"
    twice.write_text(body + body)
    out = _claims_cli(good, "--readme", twice)
    assert out.returncode == 2 and "more than once" in out.stderr and twice.read_text() == body + body


def test_merge_keeps_only_the_newest_reading_of_a_sweep_read_while_unfinished():
    """Reading a sweep at 8 of 16 runs and again when it is whole gives two different findings (more runs, other
    numbers): the record keeps the whole one. Two mid-sweep readings keep the one with more runs; another sweep's
    partial reading, and the whole readings of two sweeps, stay."""
    note = " (decided while 8 of the sweep's 16 runs were not finished)"
    src, other = "weightgeom sweep manifolds long-const", "weightgeom sweep manifolds long"
    early = cl.Finding("ma-qk-clip", "inconclusive", "1 seed — ×8: 1.00 → 0.96" + note, src, 10000, 4, "d")
    later = cl.Finding("ma-qk-clip", "inconclusive", "1 seed — ×8, ×16 in part" + note.replace("8 of", "4 of"), src,
                       10000, 6, "d")
    whole = cl.Finding("ma-qk-clip", "no gain", "×8: 1.00 → 0.96; ×16: 1.00 → 0.95", src, 10000, 8, "d")
    elsewhere = cl.Finding("ma-qk-clip", "inconclusive", "1 seed — cosine" + note, other, 3000, 2, "d")
    assert cp.merge([early, whole, elsewhere])["ma-qk-clip"] == [whole, elsewhere]
    assert cp.merge([whole, later, early])["ma-qk-clip"] == [whole]
    assert cp.merge([early, later])["ma-qk-clip"] == [later] == cp.merge([later, early])["ma-qk-clip"]
    whole2 = cl.Finding("ma-qk-clip", "gain", "another sweep of the same command", src, 10000, 8, "d")
    assert cp.merge([whole, whole2])["ma-qk-clip"] == [whole, whole2]  # both whole: both kept
