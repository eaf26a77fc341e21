"""Numerics as a value (``weightgeom.linalg.numerics``): resolved once per device from the ``WEIGHTGEOM_*`` overrides
and the autotuner, kept on the optimizer, shown by ``describe``/``summary``, saved in its state dict and meta.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from weightgeom.linalg.numerics import Numerics, resolve_numerics
from weightgeom.optim import Muon, describe

pytestmark = pytest.mark.usefixtures("one_torch_thread", "fixed_msign")

SRC = Path(__file__).resolve().parents[1] / "src" / "weightgeom"

# (environment, expected fields of resolve_numerics("cpu")); the fixed_msign fixture sets WEIGHTGEOM_MSIGN=float32:5
OVERRIDES = {
    "conftest": ({}, {"msign_dtype": torch.float32, "msign_steps": 5, "msign_source": "WEIGHTGEOM_MSIGN",
                      "kernels": True, "kernels_source": "default", "cuda_graphs": False}),
    "msign-bf16-steps": ({"WEIGHTGEOM_MSIGN": "bfloat16:6"}, {"msign_dtype": torch.bfloat16, "msign_steps": 6}),
    "no-kernels": ({"WEIGHTGEOM_NO_KERNELS": "1"}, {"kernels": False, "kernels_source": "WEIGHTGEOM_NO_KERNELS set"}),
    "products-ieee": ({"WEIGHTGEOM_PRODUCTS": "ieee"}, {"products": "ieee",
                                                        "products_source": "WEIGHTGEOM_PRODUCTS=ieee"}),
    "split-off": ({"WEIGHTGEOM_SPLIT_PRODUCTS": "1", "WEIGHTGEOM_PRODUCTS": "ieee"},
                  {"products": "ieee", "products_source": "WEIGHTGEOM_PRODUCTS=ieee"}),
    "graphs-cap": ({"WEIGHTGEOM_CUDA_GRAPHS_MAX_MB": "inf"}, {"cuda_graphs_max_mb": math.inf}),
}


@pytest.mark.parametrize("name", list(OVERRIDES))
def test_an_environment_override_is_the_value(name, monkeypatch):
    """Each WEIGHTGEOM_* override gives the Numerics field it names, with its source; as_dict round-trips."""
    env, want = OVERRIDES[name]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    n = resolve_numerics("cpu", constraint_products="products" in want)  # measuring them takes seconds
    assert {k: getattr(n, k) for k in want} == want
    assert Numerics.from_dict(json.loads(json.dumps(n.as_dict()))) == n


@pytest.mark.parametrize("var, value", [("WEIGHTGEOM_MSIGN", "float16"), ("WEIGHTGEOM_PRODUCTS", "fast"),
                                        ("WEIGHTGEOM_SPLIT_PRODUCTS", "yes"), ("WEIGHTGEOM_CUDA_GRAPHS_MAX_MB", "-1")])
def test_an_invalid_override_is_refused_naming_the_variable(var, value, monkeypatch):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"{var}={value!r} is invalid"):
        resolve_numerics("cpu", constraint_products="PRODUCTS" in var)


def test_the_variables_are_read_in_one_module():
    """Only weightgeom/_numerics_env.py names the numerics variables as strings (everyone else asks it)."""
    names = ("WEIGHTGEOM_MSIGN", "WEIGHTGEOM_PRODUCTS", "WEIGHTGEOM_SPLIT_PRODUCTS", "WEIGHTGEOM_NO_KERNELS",
             "WEIGHTGEOM_CUDA_GRAPHS")
    readers = sorted(str(f.relative_to(SRC)) for f in SRC.rglob("*.py")
                     if any(f'"{v}' in f.read_text() or f"'{v}" in f.read_text() for v in names))
    assert readers == ["_numerics_env.py"], readers


def test_muon_keeps_shows_and_saves_its_numerics_and_loads_a_state_dict_without_them():
    """Resolved once per device when the groups are added: opt.numerics, in describe(opt), summary() and the state
    dict (plain values); a state dict without "numerics" (an older one) loads the same."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(16, 8)) for _ in range(2)]
    opt = Muon([{"params": ps, "names": ["a", "b"]}], lr=0.02)
    n = opt.numerics["cpu"]
    assert n == resolve_numerics("cpu", constraint_products=False)
    assert n.describe() in describe(opt) and n.describe() in opt.summary()
    for p in ps:
        p.grad = torch.randn(p.shape)
    opt.step()
    sd = opt.state_dict()
    assert sd["numerics"] == {"cpu": n.as_dict()}
    assert all(isinstance(v, (str, int, float, bool)) for v in sd["numerics"]["cpu"].values())
    old = {k: v for k, v in sd.items() if k != "numerics"}
    other = Muon([{"params": [torch.nn.Parameter(p.detach().clone()) for p in ps], "names": ["a", "b"]}], lr=0.02)
    other.load_state_dict(old)
    assert all(torch.equal(other.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"])
               for p, q in zip(ps, other.param_groups[0]["params"]))


def test_a_run_records_its_numerics_in_meta_json(tmp_path, monkeypatch):
    from weightgeom.train import train

    monkeypatch.setenv("WEIGHTGEOM_NO_KERNELS", "1")
    cfg = {"run": {"device": "cpu"},
           "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16, "bias": False},
           "data": {"kind": "shakespeare", "tokenizer": "char", "block_size": 16, "batch_size": 2},
           "optim": {"name": "muon"}, "train": {"max_steps": 1, "eval_every": 0, "eval_iters": 1, "log_every": 1}}
    train(cfg, run_dir=tmp_path / "run")
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    rec = meta["numerics"]["cpu"]
    assert rec["msign_source"] == "WEIGHTGEOM_MSIGN" and rec["kernels"] is False
    assert Numerics.from_dict(rec) == resolve_numerics("cpu", constraint_products=False)


def test_the_step_takes_its_cuda_graph_setting_from_the_value_not_the_environment(monkeypatch):
    """A plain-Muon step hands msign the resolved CUDA-graph setting (0 on the CPU), read from opt.numerics, not the
    environment at step time."""
    import weightgeom.linalg.graphs as graphs

    seen = []
    real = graphs.replay

    def spy(*a, max_mb=None, **k):
        seen.append(max_mb)
        return real(*a, max_mb=max_mb, **k)

    monkeypatch.setattr(graphs, "replay", spy)
    p = torch.nn.Parameter(torch.randn(16, 8))
    opt = Muon([p], lr=0.02)
    monkeypatch.setenv("WEIGHTGEOM_CUDA_GRAPHS_MAX_MB", "not a number")  # never read by the step
    p.grad = torch.randn(p.shape)
    opt.step()
    assert seen == [opt.numerics["cpu"].graphs_max_mb] == [0.0]
