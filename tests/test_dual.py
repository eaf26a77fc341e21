"""``DualAscent``: manifold Muon's dual-ascent settings as one value, every default defined once, and the older
``dual_<field>`` spellings (keywords, group keys, config keys) still taken with one DeprecationWarning line."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import warnings

import pytest
import torch

from weightgeom.optim import DUAL_PRESETS, DualAscent, Muon, build_optimizer, state_compat
from weightgeom.optim.config import PAPER_MUON, AdamWConfig, MuonConfig, OptimConfig
from weightgeom.optim.muon_checks import MUON_DEFAULTS
from weightgeom.optim.param_groups import param_groups
from weightgeom.train.config import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAPER = {"steps": 20, "lr": 0.1, "tol": 1e-6, "schedule": "linear", "ns_steps": None, "project": False,
         "normalize": False, "warm_start": False, "keep": "last"}  # the published loop (tests/test_paper_preset.py)


def _p(shape=(8, 4), seed=0) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))


def test_every_default_is_defined_once():
    sig = {k: p.default for k, p in inspect.signature(Muon.__init__).parameters.items()
           if p.default is not inspect.Parameter.empty}
    assert sig == MUON_DEFAULTS  # the signature is the table
    cfg = MuonConfig()
    for f in dataclasses.fields(MuonConfig):
        assert getattr(cfg, f.name) == MUON_DEFAULTS[f.name], f.name
    assert tuple(AdamWConfig().betas) == MUON_DEFAULTS["betas"] and AdamWConfig().eps == MUON_DEFAULTS["adamw_eps"]
    assert state_compat.ADAMW_EPS == MUON_DEFAULTS["adamw_eps"]
    opt = Muon([_p()])
    assert DualAscent.from_group(opt.defaults) == DualAscent() == DUAL_PRESETS["default"]
    assert {k: opt.defaults[k] for k in MUON_DEFAULTS if k in opt.defaults} == {
        k: v for k, v in MUON_DEFAULTS.items() if k not in ("dual", "on_nonfinite")}
    # torch.optim.Muon's keywords keep torch's spelling
    assert set(state_compat.TORCH_MUON) <= set(sig)


def test_the_published_preset_is_the_published_loop():
    assert dataclasses.asdict(DualAscent.preset("published")) == PAPER
    assert PAPER_MUON["dual"] == DUAL_PRESETS["published"] == OptimConfig(preset="paper").muon.dual
    opt = Muon([_p()], manifold="stiefel", dual="published", init="retract")
    assert opt.param_groups[0]["dual_steps"] == 20 and opt.param_groups[0]["dual_keep"] == "last"


@pytest.mark.parametrize("field,value,why", [
    ("steps", 0, "must be an int ≥ 1"), ("steps", 2.5, "must be an int ≥ 1"), ("steps", True, "must be an int ≥ 1"),
    ("lr", 0.0, "> 0"), ("lr", float("nan"), "> 0"), ("tol", -1e-3, "≥ 0"), ("schedule", "cosine", "linear"),
    ("ns_steps", 0, "or None"), ("project", "yes", "True or False"), ("keep", "first", "best"),
])
def test_a_bad_field_is_one_line_naming_it(field, value, why):
    with pytest.raises(ValueError) as e:
        DualAscent(**{field: value})
    msg = str(e.value)
    assert msg.startswith(f"DualAscent: {field}=") and why in msg and "\n" not in msg
    with pytest.raises(ValueError, match=f"dual_{field}="):  # the same rule on a group's flattened key
        Muon([{"params": [_p()], f"dual_{field}": value}])


def test_presets_and_tables_resolve_per_group_over_the_optimizers_value():
    a, b, c = _p(seed=1), _p(seed=2), _p(seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = Muon([{"params": [a], "dual": {"steps": 3}}, {"params": [b], "dual": "published"}, {"params": [c]}],
                   manifold="stiefel", init="retract", dual=DualAscent(lr=0.3, keep="last"))
    got = [DualAscent.from_group(g) for g in opt.param_groups]
    assert got == [DualAscent(steps=3, lr=0.3, keep="last"), DualAscent.preset("published"),
                   DualAscent(lr=0.3, keep="last")]
    assert all("dual" not in g for g in opt.param_groups)  # held flattened: state_dict's layout is unchanged
    with pytest.raises(ValueError, match="Muon group 0: DualAscent preset 'publishd' is unknown.*'published'"):
        Muon([{"params": [_p()], "dual": "publishd"}])
    with pytest.raises(ValueError, match="no field 'step'"):
        Muon([{"params": [_p()], "dual": {"step": 2}}])
    with pytest.raises(TypeError, match="unexpected keyword argument 'dual_stepz'"):
        Muon([_p()], dual_stepz=2)


def test_dual_set_on_an_added_group_is_refused_not_ignored():
    p = _p()
    opt = Muon([p], manifold="stiefel", init="retract")
    opt.param_groups[0]["dual"] = DualAscent(steps=3)
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="Muon group 0: the key 'dual' was set on a group already added.*group_keys"):
        opt.step()
    assert torch.equal(p.detach(), before)
    del opt.param_groups[0]["dual"]
    opt.param_groups[0].update(DualAscent(steps=3).group_keys())  # the way that is read
    opt.step()
    assert opt.last_stats and DualAscent.from_group(opt.param_groups[0]).steps == 3


def _one_deprecation(fn):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fn()
    dep = [w for w in rec if issubclass(w.category, DeprecationWarning)]
    assert len(dep) == 1, [str(w.message) for w in dep]
    msg = str(dep[0].message)
    assert "\n" not in msg and "deprecated" in msg
    return out, msg


def _gpt():
    from weightgeom.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=11, block_size=8, bias=False))


def _muon_dual(opt, only=""):
    return {DualAscent.from_group(g) for g in opt.param_groups
            if g["algorithm"] == "muon" and all(only in n for n in g.get("names", [""]))}


# each older spelling → (what it builds, the new spelling its warning names)
OLD_SPELLINGS = {
    "keyword": (lambda: _muon_dual(Muon([_p()], dual_steps=5, dual_keep="last")),
                "use dual=DualAscent(steps=5, keep='last')"),
    "group key": (lambda: _muon_dual(Muon([{"params": [_p()], "dual_steps": 5, "dual_keep": "last"}])),
                  "use the group key 'dual': DualAscent(steps=5, keep='last')"),
    "MuonConfig keyword": (lambda: {MuonConfig(dual_steps=5, dual_keep="last").dual},
                           "use dual=DualAscent(steps=5, keep='last')"),
    "config file key": (lambda: {load_config({"optim": {"muon": {"dual_steps": 5, "dual_keep": "last"}}}).optim.muon
                                 .dual}, "use optim.muon.dual.steps=5, optim.muon.dual.keep='last'"),
    "--set": (lambda: {load_config(None, ["optim.muon.dual_steps=5", "optim.muon.dual_keep=last"]).optim.muon.dual},
              "use optim.muon.dual.steps=5, optim.muon.dual.keep='last'"),
    "build_optimizer keyword": (lambda: _muon_dual(build_optimizer(_gpt(), dual_steps=5, dual_keep="last")),
                                "use dual=DualAscent(steps=5, keep='last')"),
    "rule key": (lambda: _muon_dual(build_optimizer(_gpt(), rules={"c_attn": {"dual_steps": 5, "dual_keep": "last"}}),
                                    only="c_attn"), "use the key dual = DualAscent(steps=5, keep='last')"),
    "param_groups keyword": (lambda: _muon_dual(Muon(param_groups(_gpt(), dual_steps=5, dual_keep="last"))),
                             "use the group key 'dual': DualAscent(steps=5, keep='last')"),
}


@pytest.mark.parametrize("how", list(OLD_SPELLINGS))
def test_older_spellings_still_work_with_one_line_naming_the_new(how):
    build, new = OLD_SPELLINGS[how]
    got, msg = _one_deprecation(build)
    assert got == {DualAscent(steps=5, keep="last")}, got
    assert new in msg, msg


def test_checkpoints_and_group_copies_load_silently():
    p, q = _p(seed=1), _p(seed=2)
    opt = Muon([p], manifold="stiefel", init="retract", dual=DualAscent(steps=3))
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    assert {k for k in sd["param_groups"][0] if k.startswith("dual")} == {f"dual_{f}" for f in PAPER}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other = Muon([_p(seed=1)], manifold="stiefel", init="retract", dual=DualAscent(steps=3))
        other.load_state_dict(sd)  # an older checkpoint holds the same flattened keys
        copy = {k: v for k, v in opt.param_groups[0].items() if k not in ("params", "names")}
        opt.add_param_group({**copy, "params": [q]})  # a copy of one of Muon's own groups (as md_setup makes)
    assert other.param_groups[0]["dual_steps"] == 3 and opt.param_groups[1]["dual_steps"] == 3


def test_shipped_configs_and_presets_use_the_new_spelling():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for path in sorted((ROOT / "src/weightgeom/configs").glob("*.toml")):
            load_config(str(path))
    shipped = [*(ROOT / "src/weightgeom").rglob("*.toml"), *(ROOT / "examples").rglob("*.py")]
    old = [f"{p.relative_to(ROOT)}: {line.strip()}" for p in shipped for line in p.read_text().splitlines()
           if any(f"dual_{f} " in line or f"dual_{f}=" in line or f"muon.dual_{f}" in line for f in PAPER)]
    assert not old, old
