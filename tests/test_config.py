"""Trainer configs: loading TOML/YAML, --set overrides with type coercion, clear errors, bundled configs, schedules."""

import math

import pytest

from weightgeom.train.config import (
    DEFAULTS,
    apply_overrides,
    bundled_configs,
    config_hash,
    dump_toml,
    load_config,
    resolve_config_path,
)
from weightgeom.train.schedule import apply_lr, lr_factor


def test_defaults_validate():
    cfg = load_config(None)
    assert set(cfg) == set(DEFAULTS)
    assert cfg["train"]["max_steps"] == DEFAULTS["train"]["max_steps"]


def test_toml_and_yaml_equivalent(tmp_path):
    (tmp_path / "a.toml").write_text('[train]\nmax_steps = 7\n[optim]\nbetas = [0.8, 0.9]\n[model]\nn_layer = 2\n')
    (tmp_path / "a.yaml").write_text("train:\n  max_steps: 7\noptim:\n  betas: [0.8, 0.9]\nmodel:\n  n_layer: 2\n")
    a, b = load_config(tmp_path / "a.toml"), load_config(tmp_path / "a.yaml")
    assert a == b
    assert a["train"]["max_steps"] == 7 and a["optim"]["betas"] == [0.8, 0.9] and a["model"]["n_layer"] == 2


def test_overrides_coerce_by_default_type():
    cfg = load_config(None, ["train.max_steps=12", "optim.lr=3e-2", "optim.nesterov=false", "optim.betas=0.5,0.6",
                             "run.name=x", "train.grad_clip=2", "model.n_embd=64", "optim.md.gains=row"])
    assert cfg["train"]["max_steps"] == 12 and isinstance(cfg["train"]["max_steps"], int)
    assert cfg["optim"]["lr"] == 0.03
    assert cfg["optim"]["nesterov"] is False
    assert cfg["optim"]["betas"] == [0.5, 0.6]
    assert cfg["train"]["grad_clip"] == 2.0 and isinstance(cfg["train"]["grad_clip"], float)
    assert cfg["model"]["n_embd"] == 64
    assert cfg["optim"]["md"] == {"gains": "row"}
    assert load_config(None, ["optim.betas=[0.1, 0.2]"])["optim"]["betas"] == [0.1, 0.2]


@pytest.mark.parametrize("override, fragment", [
    ("train.max_stepz=3", "train.max_stepz; did you mean 'max_steps'"),
    ("trian.max_steps=3", "unknown section 'trian'; did you mean 'train'"),
    ("train.max_steps=abc", "'train.max_steps': expected an integer, got 'abc'"),
    ("train.max_steps=2.5", "expected an integer"),
    ("optim.nesterov=maybe", "expected a bool"),
    ("schedule.kind=cosin", "schedule.kind='cosin': must be one of cosine, linear, constant; did you mean 'cosine'"),
    ("train.max_steps=0", "train.max_steps=0: must be > 0"),
    ("schedule.min_lr_ratio=2", "schedule.min_lr_ratio=2.0: must be in [0, 1]"),
    ("max_steps=3", "must be section.key"),
    ("train.max_steps", "expected section.key=value"),
    ("model.n_layrs=2", "model.n_layrs; did you mean 'n_layer'"),
    ("data.kind=bin", "data.path is required"),
    ("run.name=../../x", "run.name='../../x': must not contain '..'"),
    ("run.name=a/../../b", "must not contain '..'"),
    ("run.name=/tmp/x", "run.name='/tmp/x': must be relative to run.out_dir, not an absolute path"),
    ("run.name=~/x", "not an absolute path"),
    ("run.name=", "run.name='': must be a non-empty name"),
])
def test_override_errors_are_one_clear_line(override, fragment):
    with pytest.raises(ValueError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert fragment in msg, msg
    assert "\n" not in msg


def test_run_name_may_name_a_subdirectory_and_out_dir_may_be_absolute(tmp_path):
    cfg = load_config(None, ["run.name=sweep/a-s0", f"run.out_dir={tmp_path}"])
    assert cfg["run"]["name"] == "sweep/a-s0" and cfg["run"]["out_dir"] == str(tmp_path)


def test_file_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nmax_stepss = 3\n")
    with pytest.raises(ValueError, match=r"config bad.toml: unknown key train.max_stepss; did you mean 'max_steps'"):
        load_config(bad)
    (tmp_path / "sec.toml").write_text("[optimizer]\nlr = 1\n")
    with pytest.raises(ValueError, match=r"unknown section \[optimizer\]; did you mean 'optim'"):
        load_config(tmp_path / "sec.toml")
    (tmp_path / "syntax.toml").write_text("[train\n")
    with pytest.raises(ValueError, match="cannot parse"):
        load_config(tmp_path / "syntax.toml")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="unknown extension"):
        load_config(tmp_path / "x.json")
    with pytest.raises(ValueError, match="neither a file nor a bundled config.*tiny-shakespeare"):
        load_config("tiny-shakespear")


def test_bundled_configs_by_name_and_roundtrip(tmp_path):
    names = bundled_configs()
    assert {"gpt2-small-owt", "tiny-shakespeare", "resmlp-mnist"} <= set(names)
    for n in names:
        cfg = load_config(n)
        assert resolve_config_path(n).is_file()
        p = tmp_path / f"{n}.toml"
        p.write_text(dump_toml(cfg))
        assert load_config(p) == cfg  # the resolved config round-trips
        assert config_hash(load_config(p)) == config_hash(cfg)


def test_paper_config_matches_spec():
    c = load_config("gpt2-small-owt")
    m, o, s, t, d = c["model"], c["optim"], c["schedule"], c["train"], c["data"]
    assert (m["n_layer"], m["n_head"], m["n_embd"], m["bias"]) == (12, 12, 768, False)
    assert d["batch_size"] * t["grad_accum"] == 64 and d["block_size"] == 1024 and d["kind"] == "bin"
    assert t["max_steps"] == 50000 and t["grad_clip"] == 1.0
    assert (o["name"], o["strategy"], o["lr"], o["adamw_lr"], o["weight_decay"]) == ("muon", "hetero", 0.02, 6e-4, 0.1)
    assert o["betas"] == [0.9, 0.95] and o["momentum"] == 0.95 and o["nesterov"] and o["momentum_form"] == "sum"
    assert o["muon_weight_decay"] == 0.0
    assert (s["kind"], s["warmup"]) == ("cosine", 1000) and math.isclose(6e-4 * s["min_lr_ratio"], 6e-5)


def test_config_hash_ignores_max_steps_only():
    a = load_config(None)
    assert config_hash(a) == config_hash(apply_overrides(a, ["train.max_steps=5"]))
    assert config_hash(a) != config_hash(apply_overrides(a, ["optim.lr=0.5"]))


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
    import torch

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
