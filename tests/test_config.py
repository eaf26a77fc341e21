"""Typed configuration: one definition of every setting for Python, files and the CLI.

Files (TOML/YAML), ``--set`` overrides (TOML literal values) and Python dicts become the same dataclasses, with one
set of defaults shared with the optimizer classes; the resolved config a run writes loads back to an equal object;
errors are one line naming the key; a manifold step trained through the CLI moves a matrix by ‖ΔW‖₂ = lr.
"""

import dataclasses
import inspect
import math

import pytest
import torch

from hostile_cases import assert_one_line_error, cli
from weightgeom.optim import DualAscent, MagnitudeDirection, Muon, build_optimizer
from weightgeom.optim.build import resolve_config
from weightgeom.optim.config import AdamWConfig, MDConfig, MuonConfig, OptimConfig
from weightgeom.schema import ConfigError, parse_value, to_dict
from weightgeom.train.config import (
    Config,
    bundled_configs,
    config_hash,
    dump_toml,
    load_config,
    parse_overrides,
    resolve_config_path,
)
from weightgeom.train.schedule import apply_lr, lr_factor

# Muon keywords that are not MuonConfig fields, and why: per-group keys param_groups sets (algorithm, manifold,
# layout, split), and the AdamW-path settings Muon carries for its AdamW groups (from AdamWConfig).
_MUON_NOT_IN_CONFIG = {"params", "algorithm", "manifold", "layout", "split", "betas", "adamw_eps", "adamw_lr"}


def _defaults(fn, skip=()) -> dict:
    return {k: p.default for k, p in inspect.signature(fn).parameters.items()
            if k not in skip and p.default is not inspect.Parameter.empty}


def test_muon_config_has_every_muon_keyword_with_the_same_default():
    sig = _defaults(Muon.__init__, skip=_MUON_NOT_IN_CONFIG)
    fields = {f.name: getattr(MuonConfig(), f.name) for f in dataclasses.fields(MuonConfig)}
    assert set(fields) == set(sig), set(fields) ^ set(sig)
    for k, v in sig.items():
        assert fields[k] == v, (k, fields[k], v)


def test_md_and_adamw_configs_share_the_classes_defaults():
    sig = _defaults(MagnitudeDirection.__init__, skip={"base_optimizer", "model"})
    md = MDConfig()
    assert {f.name for f in dataclasses.fields(MDConfig)} == set(sig)
    for k, v in sig.items():
        got = getattr(md, k)
        assert (list(got) if isinstance(got, (list, tuple)) else got) == (list(v) if isinstance(v, tuple) else v), k
    a = AdamWConfig()
    m = _defaults(Muon.__init__)
    assert tuple(a.betas) == tuple(m["betas"]) and a.eps == m["adamw_eps"]


def test_defaults_are_one_set_for_python_and_files():
    cfg = load_config(None)
    assert isinstance(cfg, Config) and cfg == Config()
    assert cfg.optim == OptimConfig() and cfg.optim.muon == MuonConfig()
    # build_optimizer with no config builds exactly OptimConfig()'s settings
    assert resolve_config() == OptimConfig()


def test_toml_and_yaml_equivalent(tmp_path):
    (tmp_path / "a.toml").write_text("[train]\nmax_steps = 7\n[optim.adamw]\nbetas = [0.8, 0.9]\n"
                                     "[model]\nn_layer = 2\n")
    (tmp_path / "a.yaml").write_text("train:\n  max_steps: 7\noptim:\n  adamw:\n    betas: [0.8, 0.9]\n"
                                     "model:\n  n_layer: 2\n")
    a, b = load_config(tmp_path / "a.toml"), load_config(tmp_path / "a.yaml")
    assert a == b
    assert a.train.max_steps == 7 and a.optim.adamw.betas == (0.8, 0.9) and a.model["n_layer"] == 2


def test_overrides_are_toml_literals_coerced_to_the_field_type():
    cfg = load_config(None, ["train.max_steps=12", "optim.muon.lr=3e-2", "optim.muon.nesterov=false",
                             "optim.adamw.betas=[0.5, 0.6]", "run.name=x", "train.grad_clip=2", "model.n_embd=64",
                             "optim.md.gains=row", "optim.md.gain_lr=1e-3", "optim.muon.msign_dtype=bfloat16",
                             "optim.muon.adjust_lr_fn=none", "optim.muon.ns_steps=6"])
    assert cfg.train.max_steps == 12 and isinstance(cfg.train.max_steps, int)
    assert cfg.optim.muon.lr == 0.03 and cfg.optim.muon.nesterov is False
    assert cfg.optim.adamw.betas == (0.5, 0.6)
    assert cfg.train.grad_clip == 2.0 and isinstance(cfg.train.grad_clip, float)
    assert cfg.model["n_embd"] == 64
    assert cfg.optim.md.gains == "row"
    assert cfg.optim.md.gain_lr == 0.001 and isinstance(cfg.optim.md.gain_lr, float)  # was the string '1e-3'
    assert cfg.optim.muon.msign_dtype == "bfloat16" and cfg.optim.muon.adjust_lr_fn == "none"
    assert cfg.optim.muon.ns_steps == 6
    # the one parser: a quoted number is a string, a bare word is a string, TOML numbers are numbers
    assert parse_overrides(["a.b=1e-3", "a.c='1e-3'", "a.d=cosine", "a.e=[1, 2]", "a.f=true"]) == {
        "a.b": 1e-3, "a.c": "1e-3", "a.d": "cosine", "a.e": [1, 2], "a.f": True}
    assert parse_value("0x10") == 16 and parse_value("all-dgram") == "all-dgram"


@pytest.mark.parametrize("override, fragment", [
    ("train.max_stepz=3", "train.max_stepz; did you mean 'max_steps'"),
    ("trian.max_steps=3", "unknown config section [trian]; did you mean 'train'"),
    ("train.max_steps=abc", "train.max_steps: expected an integer, got 'abc'"),
    ("train.max_steps=2.5", "expected an integer"),
    ("optim.muon.nesterov=maybe", "expected true or false"),
    ("schedule.kind=cosin", "schedule.kind='cosin': must be one of 'cosine', 'linear', 'constant'; did you mean "
                            "'cosine'"),
    ("train.max_steps=0", "train.max_steps=0: must be > 0"),
    ("data.val_fraction=nan", "data.val_fraction=nan: must be finite and between 0 and 1 (> 0, < 1)"),
    ("schedule.min_lr_ratio=2", "schedule.min_lr_ratio=2.0: must be between 0 and 1 (>= 0, <= 1)"),
    ("max_steps=3", "must be section.key"),
    ("train.max_steps", "expected section.key=value"),
    ("model.n_layrs=2", "model.n_layrs for model.kind='gpt'; did you mean 'n_layer'"),
    ("data.kind=bin", "data.path is required"),
    ("optim.lr=0.1", "optim.lr: moved to optim.muon.lr"),
    ("optim.adamw_lr=0.1", "optim.adamw_lr: moved to optim.adamw.lr"),
    ("optim.muon_weight_decay=0", "moved to optim.muon.weight_decay"),
    ("optim.dual_steps=3", "moved to optim.muon.dual.steps"),
    ("optim.muon.msign_dtype=bf16", "optim.muon.msign_dtype='bf16': must be one of"),
    ("optim.muon.msign_method=polarexpress", "did you mean 'polar_express'"),
    ("optim.md.gain_lr=fast", "optim.md.gain_lr: expected a number, got 'fast'"),
    ("optim.md.gains=rows", "did you mean 'row'"),
    ("optim.strategy=hetro", "did you mean 'hetero'"),
    ("optim.adamw.betas=[0.9]", "optim.adamw.betas: expected 2 values"),
    ("optim.muon.momentum=1", "optim.muon.momentum=1.0: must be between 0 and 1 (>= 0, < 1)"),
    ("run.name=../../x", "run.name='../../x': must not contain '..'"),
    ("run.name=/tmp/x", "run.name='/tmp/x': must be relative to run.out_dir, not an absolute path"),
    ("run.name=", "run.name='': must be a non-empty name"),
    ("optim.muon.retraction=bogus", "optim.muon.retraction='bogus': must be one of"),  # was found only mid-sweep
    ("optim.muon.retraction=colum_polar", "did you mean 'column_polar'"),
])
def test_override_errors_are_one_clear_line(override, fragment):
    with pytest.raises(ValueError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert fragment in msg, msg
    assert "\n" not in msg


def test_adamw_name_with_a_strategy_is_refused():
    with pytest.raises(ValueError, match="optim.strategy='hetero': needs a Muon name"):
        load_config(None, ["optim.name=adamw", "optim.strategy=hetero"])


def test_python_construction_is_checked_too():
    with pytest.raises(ConfigError, match="optim.muon.lr: expected a number, got 'x'"):
        MuonConfig(lr="x")
    with pytest.raises(ConfigError, match="optim.md.gains='rows'"):
        MDConfig(gains="rows")
    assert MuonConfig(lr=1).lr == 1.0 and isinstance(MuonConfig(lr=1).lr, float)


def test_file_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nmax_stepss = 3\n")
    with pytest.raises(ValueError, match=r"config bad.toml: unknown config key train.max_stepss; did you mean"):
        load_config(bad)
    (tmp_path / "sec.toml").write_text("[optimizer]\nlr = 1\n")
    with pytest.raises(ValueError, match=r"unknown config section \[optimizer\]; did you mean 'optim'"):
        load_config(tmp_path / "sec.toml")
    (tmp_path / "old.toml").write_text("[optim]\nadamw_lr = 1e-3\n")
    with pytest.raises(ValueError, match=r"config old.toml: unknown config key optim.adamw_lr: moved to"):
        load_config(tmp_path / "old.toml")
    (tmp_path / "syntax.toml").write_text("[train\n")
    with pytest.raises(ValueError, match="cannot parse"):
        load_config(tmp_path / "syntax.toml")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="unknown extension"):
        load_config(tmp_path / "x.json")
    with pytest.raises(ValueError, match="neither a file nor a bundled config.*tiny-shakespeare"):
        load_config("tiny-shakespear")


@pytest.mark.parametrize("comments", [False, True])
def test_bundled_configs_round_trip_through_the_resolved_file(tmp_path, comments):
    names = bundled_configs()
    assert {"gpt2-small-owt", "tiny-shakespeare", "resmlp-mnist"} <= set(names)
    for n in names:
        cfg = load_config(n, ["optim.muon.ns_steps=7", "optim.rules={'lm_head' = 'adamw'}"])
        assert resolve_config_path(n).is_file()
        p = tmp_path / f"{n}.toml"
        p.write_text(dump_toml(cfg, comments=comments))
        back = load_config(p)
        assert back == cfg  # the resolved config loads back to the same objects
        assert config_hash(back) == config_hash(cfg)


def test_paper_config_values():
    c = load_config("gpt2-small-owt")
    m, o, s, t, d = c.model, c.optim, c.schedule, c.train, c.data
    assert (m["n_layer"], m["n_head"], m["n_embd"], m["bias"]) == (12, 12, 768, False)
    assert d.batch_size * t.grad_accum == 64 and d.block_size == 1024 and d.kind == "bin"
    assert t.max_steps == 50000 and t.grad_clip == 1.0
    assert (o.name, o.strategy, o.muon.lr, o.adamw.lr, o.adamw.weight_decay) == ("muon", "hetero", 0.02, 6e-4, 0.1)
    assert o.adamw.betas == (0.9, 0.95) and o.muon.momentum == 0.95 and o.muon.nesterov
    assert o.muon.momentum_form == "sum" and o.muon.weight_decay == 0.0
    assert o.muon.adjust_lr_fn is None  # manifold groups step η = lr
    assert (s.kind, s.warmup) == ("cosine", 1000) and math.isclose(6e-4 * s.min_lr_ratio, 6e-5)


def test_config_hash_ignores_max_steps_only():
    a = load_config(None)
    assert config_hash(a) == config_hash(load_config(a, ["train.max_steps=5"]))
    assert config_hash(a) != config_hash(load_config(a, ["optim.muon.lr=0.5"]))


def test_build_optimizer_takes_the_config_and_every_muon_keyword():
    from weightgeom.models import build_model

    model = build_model("gpt", n_layer=1, n_head=2, n_embd=16, vocab_size=11, block_size=8)
    muon = MuonConfig(lr=0.01, ns_steps=6, msign_dtype="float32", retraction=None,
                      dual=DualAscent(steps=3, schedule="constant", ns_steps=4, project=True))
    cfg = OptimConfig(name="muon", strategy="hetero", muon=muon,
                      adamw=AdamWConfig(lr=1e-3, weight_decay=0.0))
    opt = build_optimizer(model, config=cfg)
    g = next(g for g in opt.param_groups if g["manifold"] == "stiefel")
    a = next(g for g in opt.param_groups if g["algorithm"] == "adamw")
    assert a["lr"] == 1e-3 and a["weight_decay"] in (0.0,)
    assert g["ns_steps"] == 6 and g["msign_dtype"] is torch.float32 and g["dual_ns_steps"] == 4
    assert g["dual_schedule"] == "constant" and g["dual_project"] is True and g["lr"] == 0.01
    # the same from a nested dict, and the shorthands override it
    opt2 = build_optimizer(model, config=to_dict(cfg), lr=0.05)
    g2 = next(g for g in opt2.param_groups if g["manifold"] == "stiefel")
    assert g2["lr"] == 0.05 and g2["ns_steps"] == 6
    with pytest.raises(ValueError, match="optim.muon.msign_dtype"):
        build_optimizer(model, msign_dtype="bf16")
    with pytest.raises(TypeError, match="unknown keyword argument"):
        build_optimizer(model, ns_step=3)


def _spectral_step(run_dir, name: str) -> float:
    from weightgeom.train.checkpoint import list_checkpoints, load_checkpoint

    (_, c1), (_, c2) = list_checkpoints(run_dir / "checkpoints")[-2:]
    w1, w2 = (load_checkpoint(c)["model"][name].double() for c in (c1, c2))
    return float(torch.linalg.matrix_norm(w2 - w1, ord=2))


# ‖ΔW‖₂/lr bounds. At these settings (tiny matrices, default 20 dual steps) the dual ascent stops at a tangent
# residual of ~2e-2, and the retraction keeps the tangent part of the direction, whose spectral norm exceeds 1: measured
# 1.09–1.15 (all-stiefel and all-dgram, 2-core AMD EPYC). Getting that part to 1 is the dual ascent's accuracy (its own
# issue). The shape scale a config used to force on manifold groups gave 1.97 on c_attn and 2.29 on c_fc here.
_STEP_BOUNDS = {"all-stiefel": (0.9, 1.3), "all-dgram": (0.9, 1.3)}


@pytest.mark.parametrize("strategy", sorted(_STEP_BOUNDS))
def test_manifold_step_through_the_cli_is_lr(tmp_path, strategy):
    """‖W₂ − W₁‖₂ = lr on every constrained matrix trained through ``weightgeom train``."""
    lr = 0.01
    res = cli("train", "tiny-shakespeare", "--no-progress", "--out", tmp_path / "r",
              "--set", f"optim.strategy={strategy}", "--set", f"optim.muon.lr={lr}",
              "--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "data.batch_size=4",
              "--set", "data.block_size=16", "--set", "train.max_steps=2", "--set", "train.ckpt_every=1",
              "--set", "train.keep_checkpoints=2", "--set", "train.eval_iters=1", "--set", "schedule.kind=constant",
              "--set", "schedule.warmup=0")
    assert res.rc == 0, res.err[-2000:]
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight",
                 "transformer.h.0.mlp.c_proj.weight"):
        ratio = _spectral_step(tmp_path / "r", name) / lr
        lo, hi = _STEP_BOUNDS[strategy]
        assert lo < ratio < hi, (name, ratio)


def test_set_errors_through_the_cli_are_one_line(tmp_path):
    res = cli("train", "tiny-shakespeare", "--out", tmp_path / "r", "--set", "optim.md.gain_lr=fast")
    assert_one_line_error(res, "optim.md.gain_lr: expected a number, got 'fast'")
    res = cli("train", "tiny-shakespeare", "--out", tmp_path / "r", "--set", "optim.lr=0.1")
    assert_one_line_error(res, "optim.lr: moved to optim.muon.lr")
    assert not (tmp_path / "r").exists()


def test_schedule_shapes():
    # warmup: (s+1)/(w+1); cosine reaches min at decay_steps; linear halfway at the middle
    assert lr_factor(0, "cosine", warmup=9, decay_steps=100) == pytest.approx(0.1)
    assert lr_factor(9, "cosine", warmup=10, decay_steps=100) == pytest.approx(10 / 11)
    assert lr_factor(10, "cosine", warmup=10, decay_steps=100, min_lr_ratio=0.1) == pytest.approx(1.0)
    assert lr_factor(100, "cosine", warmup=10, decay_steps=100, min_lr_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(500, "cosine", warmup=10, decay_steps=100, min_lr_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(55, "cosine", warmup=10, decay_steps=100, min_lr_ratio=0.0) == pytest.approx(0.5)
    assert lr_factor(55, "linear", warmup=10, decay_steps=100, min_lr_ratio=0.0) == pytest.approx(0.5)
    assert lr_factor(70, "constant", warmup=10, decay_steps=100) == 1.0
    with pytest.raises(ValueError, match="schedule kind 'step'"):
        lr_factor(0, "step")


def test_apply_lr_scales_every_group_including_muon_keys():
    w = torch.nn.Parameter(torch.zeros(2, 2))
    b = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [w], "lr": 0.02}, {"params": [b], "lr": 6e-4}], lr=1.0)
    opt.param_groups[0]["adamw_lr"] = 1e-3
    apply_lr(opt, 0.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    assert opt.param_groups[0]["adamw_lr"] == pytest.approx(5e-4)
    assert opt.param_groups[1]["lr"] == pytest.approx(3e-4)
    apply_lr(opt, 1.0)  # always relative to the peak, never compounding
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02)


# ------------------------------------------------------------------------------------- hostile config inputs
@pytest.mark.parametrize("override, fragment", [
    ('optim.rules={"attn"={nesterov="no"}}', "optim.rules['attn'].nesterov: expected true or false"),
    ('optim.rules={"attn"={ns_steps=2.5}}', "optim.rules['attn'].ns_steps: expected an integer"),
    ('optim.rules={"attn"={lr=[1]}}', "optim.rules['attn'].lr: expected a number"),
    ('optim.rules={"attn"={lr="fast"}}', "optim.rules['attn'].lr: expected a number, got 'fast'"),
    ('optim.rules={"attn"={lrr=1}}', "unknown config key optim.rules['attn'].lrr; did you mean 'lr'"),
    ('optim.rules={"("="stiefel"}', "not a valid regex"),
    ('optim.rules={"attn"=3}', "expected 'adamw', 'muon', a manifold name or a table"),
    ("optim.muon.lr=inf", "optim.muon.lr=inf: must be finite and >= 0"),
    ("optim.adamw.eps=inf", "must be finite"),
    ("train.grad_clip=inf", "must be finite"),
    ("optim.muon.dual.steps=0", "steps=0 is invalid: must be an int ≥ 1"),
    ("optim.muon.dual=publishd", "optim.muon.dual='publishd': must be one of default, published"),
    ("run.seed=18446744073709551616", "run.seed="),
    ("model.block_size=8", "model.block_size=8: shorter than data.block_size="),
    ("run.name=2024-01-01", "quote it"),
    ("optim.muon.msign_method=SVD", "did you mean 'svd'"),
])
def test_hostile_overrides_are_one_line(override, fragment):
    with pytest.raises(ValueError) as e:
        load_config("tiny-shakespeare", [override])
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_rule_group_keys_are_coerced_like_their_fields():
    cfg = load_config(None, ['optim.rules={"attn"={manifold="stiefel", lr=1, nesterov=false}, "lm_head"="adamw"}'])
    assert cfg.optim.rules == {"attn": {"manifold": "stiefel", "lr": 1.0, "nesterov": False}, "lm_head": "adamw"}
    assert isinstance(cfg.optim.rules["attn"]["lr"], float)


def test_deep_or_exploding_configs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="nested deeper than"):
        load_config(None, ["optim.rules=" + "{a=" * 600 + "1" + "}" * 600])  # tomllib recursion or our depth cap
    (tmp_path / "deep.toml").write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ValueError, match="deep.toml: nested deeper than"):
        load_config(tmp_path / "deep.toml")
    (tmp_path / "loop.yaml").write_text("optim:\n  rules: &r {x: *r}\n")
    with pytest.raises(ValueError, match="loop.yaml"):
        load_config(tmp_path / "loop.yaml")
    bomb = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [
        f"{c}: &{c} [{', '.join(['*' + p] * 9)}]" for p, c in zip("abcdefg", "bcdefgh")]
    (tmp_path / "bomb.yaml").write_text("\n".join(bomb) + "\n")
    with pytest.raises(ValueError, match="more than 100000 values"):
        load_config(tmp_path / "bomb.yaml")


def test_odd_but_valid_inputs(tmp_path):
    import numpy as np

    (tmp_path / "bom.toml").write_bytes("\ufeff[train]\nmax_steps = 3\n".encode())
    assert load_config(tmp_path / "bom.toml").train.max_steps == 3
    assert load_config(None, [" train . max_steps =4"]).train.max_steps == 4
    with pytest.raises(ValueError, match="--set train.max_steps: value .* must be one value on one line"):
        load_config(None, ["train.max_steps=2\ntrain.eval_every=5"])
    cfg = load_config(None, ["data.path=a\x7fb", "data.kind=text"])
    (tmp_path / "del.toml").write_text(dump_toml(cfg))
    assert load_config(tmp_path / "del.toml") == cfg  # DEL escaped in the dump
    assert MuonConfig(lr=np.float32(0.5), dual={"steps": np.int64(3)}).dual.steps == 3
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, rules={"weight": "muon"}, msign_dtype=torch.float32)
    assert next(g for g in opt.param_groups if g["algorithm"] == "muon")["msign_dtype"] is torch.float32


def test_retraction_names_are_the_manifolds_own():
    """optim.muon.retraction accepts exactly the variants some manifold's constructor accepts (class attributes)."""
    from weightgeom import manifolds

    names = set(manifolds.retraction_names())
    assert names == {"polar", "paper", "column_polar", "normalize"}
    for name in ("stiefel", "dgram", "oblique"):
        cls = type(manifolds.get(name))
        for r in cls.retractions:
            cls(retraction=r)  # each accepted


def test_explicit_fields_record_what_was_written():
    from weightgeom.schema import explicit_fields, from_dict

    assert explicit_fields(MuonConfig()) == frozenset()
    assert explicit_fields(MuonConfig(dual=DualAscent(steps=1))) == {"dual"}
    assert explicit_fields(MuonConfig(dual=DualAscent(steps=1)).dual) == {"steps"}
    assert explicit_fields(from_dict(MuonConfig, {"dual": {"keep": "last"}}).dual) == {"keep"}
    assert explicit_fields(from_dict(MuonConfig, {"lr": 0.02, "momentum": 0.9})) == {"lr", "momentum"}
    assert explicit_fields(OptimConfig().muon) == frozenset()  # the default factory's copy keeps the record
    assert explicit_fields(dataclasses.replace(MuonConfig(lr=0.1))) == {f.name for f in dataclasses.fields(MuonConfig)}


def test_model_preset_reports_the_fields_it_did_not_set():
    from weightgeom.train.config import describe_presets, preset_report

    cfg = load_config({"model": {"kind": "gpt", "preset": "gpt-nano", "n_layer": 1}})
    rep = preset_report(cfg)["model.preset"]
    assert rep["kept"] == {"model.n_layer": [1, 3]} and rep["set"]["model.n_embd"] == 48
    assert "model.n_layer=1 (the preset's: 3)" in describe_presets(preset_report(cfg))[0]


@pytest.mark.parametrize("overrides, expect", [
    (["model.kind=resmlp", "data.kind=mnist", "optim.strategy=auto"], "model.kind='resmlp' has none"),
    (["optim.name=muon-md", "optim.strategy=auto"], "magnitude–direction wrapper"),
])
def test_strategy_auto_refused_where_it_cannot_work(overrides, expect):
    with pytest.raises(ValueError, match=expect):
        load_config(None, overrides)
