"""param_groups: strategies and name rules on our models and on tiny HF GPT-2 / Llama / BERT (no downloads)."""

from __future__ import annotations

import pytest
import torch
import transformers

from weightgeom.models import build_model
from weightgeom.optim import STRATEGIES, DualAscent, Muon, param_groups


def _hf_gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _hf_llama():
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(cfg)


def _hf_bert():
    cfg = transformers.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                  vocab_size=64, max_position_embeddings=16)
    return transformers.BertModel(cfg)


MODELS = {
    "ours-gpt": lambda: build_model("gpt", n_layer=2, n_head=2, n_embd=16, vocab_size=64, block_size=16),
    "ours-gpt-sepqkv": lambda: build_model("gpt", n_layer=1, n_head=2, n_embd=16, vocab_size=64, block_size=16,
                                           separate_qkv=True, bias=True),
    "ours-llama": lambda: build_model("llama", n_layers=2, dim=16, n_heads=4, n_kv_heads=2, vocab_size=64),
    "ours-resmlp": lambda: build_model("resmlp"),
    "hf-gpt2": _hf_gpt2,
    "hf-llama": _hf_llama,
    "hf-bert": _hf_bert,
}
# (model, parameter name) → expected role, spot checks per family
EXPECTED_ROLES = {
    "ours-gpt": {"transformer.h.0.attn.c_attn.weight": "attn", "transformer.h.1.mlp.c_proj.weight": "mlp",
                 "transformer.wte.weight": "adamw", "transformer.ln_f.weight": "adamw"},
    "ours-gpt-sepqkv": {"transformer.h.0.attn.k_proj.weight": "attn", "transformer.h.0.attn.k_proj.bias": "adamw"},
    "ours-llama": {"model.layers.0.self_attn.o_proj.weight": "attn", "model.layers.1.mlp.gate_proj.weight": "mlp",
                   "model.embed_tokens.weight": "adamw", "model.norm.weight": "adamw"},
    "ours-resmlp": {"blocks.0.fc.weight": "mlp", "inp.weight": "adamw", "head.weight": "adamw"},
    "hf-gpt2": {"transformer.h.0.attn.c_attn.weight": "attn", "transformer.h.1.mlp.c_fc.weight": "mlp",
                "transformer.wpe.weight": "adamw", "transformer.h.0.attn.c_attn.bias": "adamw"},
    "hf-llama": {"model.layers.1.self_attn.k_proj.weight": "attn", "model.layers.0.mlp.down_proj.weight": "mlp",
                 "lm_head.weight": "adamw", "model.layers.0.input_layernorm.weight": "adamw"},
    "hf-bert": {"encoder.layer.0.attention.self.query.weight": "attn",
                "encoder.layer.0.attention.output.dense.weight": "attn",
                "encoder.layer.1.intermediate.dense.weight": "mlp", "encoder.layer.1.output.dense.weight": "mlp",
                "embeddings.word_embeddings.weight": "adamw", "pooler.dense.weight": "adamw"},
}


def _assignment(groups):
    out = {}
    for g in groups:
        for n in g["names"]:
            assert n not in out, f"{n} claimed twice"
            out[n] = g
    return out


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_param_claimed_once_and_roles(model_name, strategy):
    model = MODELS[model_name]()
    groups = param_groups(model, strategy, verbose=False)
    by_name = _assignment(groups)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(by_name) == trainable
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids))
    for name, role in EXPECTED_ROLES[model_name].items():
        g = by_name[name]
        if role == "adamw":
            assert g["algorithm"] == "adamw", name
        else:
            want = STRATEGIES[strategy][role]
            assert g["algorithm"] == ("adamw" if want == "adamw" else "muon"), name
            if want != "adamw":
                assert g["manifold"] == want, (name, g["manifold"])
    for g in groups:
        if g["algorithm"] == "adamw" and any(p.ndim < 2 for p in g["params"]):
            assert g.get("weight_decay", 0.0) == 0.0 and all(p.ndim < 2 for p in g["params"])


@pytest.mark.parametrize("model_name", ["ours-gpt", "hf-gpt2", "hf-llama", "hf-bert"])
def test_optimizer_steps_every_model(model_name):
    model = MODELS[model_name]()
    opt = Muon(param_groups(model, "hetero", split_qkv=True, verbose=False, adamw_hparams={"lr": 1e-3}),
               dual=DualAscent(steps=2))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)
    assert all(st["dual_iters"] >= 1 for st in opt.last_stats.values()) and opt.last_stats


def test_hf_gpt2_conv1d_layout_and_split_along_out_dim():
    model = _hf_gpt2()
    groups = param_groups(model, "all-stiefel", split_qkv=True, verbose=False)
    by_name = _assignment(groups)
    g = by_name["transformer.h.0.attn.c_attn.weight"]
    assert g["layout"] == "in_out" and g["split"] == 3
    assert by_name["transformer.h.0.mlp.c_fc.weight"]["layout"] == "in_out"
    assert "split" not in by_name["transformer.h.0.mlp.c_fc.weight"]
    opt = Muon(groups, dual=DualAscent(steps=2))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    W = model.transformer.h[0].attn.c_attn.weight.detach()  # (in, 3·out): Q | K | V column blocks
    for block in W.split(16, dim=1):
        torch.testing.assert_close(block.T @ block, torch.eye(16), atol=1e-5, rtol=0)
    # the fused matrix as a whole is not orthonormal across blocks in general (separate constraints)
    assert float((W @ W.T - torch.eye(16)).abs().max()) > 1e-3


def test_our_gpt_split_qkv_rows():
    model = MODELS["ours-gpt"]()
    opt = Muon(param_groups(model, "all-dgram", split_qkv=True, verbose=False), dual=DualAscent(steps=2))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    W = model.transformer.h[0].attn.c_attn.weight.detach()  # (3·out, in): Q; K; V row blocks, each 16×16 (tall view)
    for block in W.split(16, dim=0):
        S = block.T @ block  # DGram: orthogonal columns of the tall view
        off = S - torch.diag(torch.diagonal(S))
        assert float(off.abs().max()) < 1e-5


def test_rules_override_and_errors():
    model = MODELS["ours-gpt"]()
    groups = param_groups(model, "hetero", verbose=False,
                          rules=[(r"\.mlp\.c_proj\.weight$", "stiefel"), (r"wpe", {"algorithm": "adamw", "lr": 1e-4})])
    by_name = _assignment(groups)
    assert by_name["transformer.h.0.mlp.c_proj.weight"]["manifold"] == "stiefel"
    assert by_name["transformer.h.0.mlp.c_fc.weight"]["manifold"] == "dgram"
    assert by_name["transformer.wpe.weight"]["lr"] == 1e-4
    with pytest.raises(ValueError, match="matched no trainable parameter"):
        param_groups(model, "hetero", rules={r"does_not_exist": "stiefel"}, verbose=False)
    with pytest.raises(ValueError, match="unknown manifold"):
        param_groups(model, "hetero", rules={r"c_fc": "hyperbolic"}, verbose=False)
    with pytest.raises(ValueError, match="ln_f.weight.*2-D"):
        param_groups(model, "hetero", rules={r"ln_f": "muon"}, verbose=False)
    with pytest.raises(ValueError, match="unknown strategy"):
        param_groups(model, "all-sphere", verbose=False)


def test_frozen_params_excluded_and_hparams_routed():
    model = MODELS["ours-gpt"]()
    model.transformer.wte.weight.requires_grad_(False)
    groups = param_groups(model, "unconstrained", verbose=False, lr=0.03, momentum=0.9,
                          adamw_hparams={"lr": 6e-4, "weight_decay": 0.1})
    by_name = _assignment(groups)
    assert "transformer.wte.weight" not in by_name
    assert by_name["transformer.h.0.attn.c_proj.weight"]["lr"] == 0.03
    assert by_name["transformer.wpe.weight"]["lr"] == 6e-4 and by_name["transformer.wpe.weight"]["weight_decay"] == 0.1
    assert by_name["transformer.ln_f.weight"]["weight_decay"] == 0.0


def test_unknown_model_is_an_error_and_table_prints(capsys):
    with pytest.raises(ValueError, match="no attention/MLP matrices"):
        param_groups(torch.nn.Sequential(torch.nn.Linear(4, 4)), "hetero", verbose=False)
    param_groups(torch.nn.Sequential(torch.nn.Linear(4, 4)), "hetero", rules={r"0\.weight": "stiefel"}, verbose=True)
    out = capsys.readouterr().out
    assert "0.weight" in out and "stiefel" in out and "rule" in out
    param_groups(_hf_llama(), "hetero", verbose=True)
    out = capsys.readouterr().out
    assert "wide: constrained as its transpose" in out  # k_proj is (8, 16)


# ---- hyperparameter routing: each keyword goes to the groups that read it; a key nobody reads is an error ----------
def test_readme_snippet_routes_adamw_lr_to_adamw_groups():
    model = MODELS["ours-gpt"]()
    groups = param_groups(model, "hetero", lr=0.02, adamw_lr=3e-3, dual=DualAscent(steps=5), verbose=False)
    by_name = _assignment(groups)
    adamw = [g for g in groups if g["algorithm"] == "adamw"]
    muon = [g for g in groups if g["algorithm"] == "muon"]
    assert adamw and muon
    assert all(g["lr"] == 3e-3 and "dual" not in g for g in adamw)
    assert all(g["lr"] == 0.02 and g["dual"] == DualAscent(steps=5) and "adamw_lr" not in g for g in muon)
    opt = Muon(groups)  # the optimizer sees the same lrs (no optimizer-level default overrides them)
    assert all(g["dual_steps"] == 5 for g in opt.param_groups if g["algorithm"] == "muon")
    lrs = {n: g["lr"] for g in opt.param_groups for n in g["names"]}
    assert lrs["transformer.wte.weight"] == 3e-3 and lrs["transformer.h.0.mlp.c_fc.weight"] == 0.02
    assert by_name["transformer.ln_f.weight"]["weight_decay"] == 0.0


def test_adamw_keywords_and_adamw_hparams_are_one_rule():
    model = MODELS["ours-gpt"]()
    kw = param_groups(model, "hetero", verbose=False, lr=0.01, weight_decay=0.05, adamw_lr=1e-3,
                      adamw_weight_decay=0.2, betas=(0.8, 0.99), eps=1e-6)
    hp = param_groups(model, "hetero", verbose=False, lr=0.01, weight_decay=0.05,
                      adamw_hparams={"lr": 1e-3, "weight_decay": 0.2, "betas": (0.8, 0.99), "eps": 1e-6})
    pre = param_groups(model, "hetero", verbose=False, lr=0.01, weight_decay=0.05, adamw_lr=1e-3,
                       adamw_weight_decay=0.2, adamw_betas=(0.8, 0.99), adamw_eps=1e-6)

    def strip(gs):
        return [{k: v for k, v in g.items() if k != "params"} for g in gs]

    assert strip(kw) == strip(hp) == strip(pre)
    by_name = _assignment(kw)
    wte, c_fc = by_name["transformer.wte.weight"], by_name["transformer.h.0.mlp.c_fc.weight"]
    # Muon's AdamW groups read their ε as adamw_eps ('eps' is torch.optim.Muon's Newton–Schulz ε)
    assert (wte["lr"], wte["weight_decay"], wte["betas"], wte["adamw_eps"]) == (1e-3, 0.2, (0.8, 0.99), 1e-6)
    assert (c_fc["lr"], c_fc["weight_decay"]) == (0.01, 0.05)
    assert "betas" not in c_fc and "eps" not in c_fc and "adamw_eps" not in c_fc
    with pytest.raises(ValueError, match=r"AdamW 'lr' is given twice.*'adamw_lr'.*adamw_hparams\['lr'\]"):
        param_groups(model, "hetero", verbose=False, adamw_lr=1e-3, adamw_hparams={"lr": 2e-3})
    with pytest.raises(ValueError, match="AdamW 'betas' is given twice"):
        param_groups(model, "hetero", verbose=False, betas=(0.9, 0.9), adamw_betas=(0.9, 0.95))


@pytest.mark.parametrize("kwargs, match", [
    (dict(dual_step=5), r"unknown keyword 'dual_step'.*did you mean 'dual_steps'"),
    (dict(adamw_wd=0.1), r"unknown keyword 'adamw_wd'"),
    (dict(adamw_weight_decy=0.1), r"unknown keyword 'adamw_weight_decy'.*did you mean 'adamw_weight_decay'"),
    (dict(adamw_momentum=0.9), r"unknown keyword 'adamw_momentum'"),
    (dict(split_qvk=True), r"unknown keyword 'split_qvk'.*did you mean 'split_qkv'"),
    (dict(inti="keep"), r"unknown keyword 'inti'.*did you mean 'init'"),
    (dict(manifold="stiefel"), r"'manifold' is not a keyword: the strategy, rules"),
    (dict(adamw_hparams={"weight_decy": 0.1}), r"adamw_hparams key 'weight_decy'.*did you mean 'weight_decay'"),
    (dict(adamw_hparams={"momentum": 0.9}), r"adamw_hparams key 'momentum' is not read by AdamW groups"),
    (dict(rules={r"wpe": {"algorithm": "adamw", "momentum": 0.9}}), r"key 'momentum' is not read by AdamW"),
    (dict(rules={r"c_fc": {"manifold": "stiefel", "dual_step": 3}}), r"'dual_step'.*did you mean 'dual_steps'"),
])
def test_unused_keys_are_refused_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as e:
        param_groups(MODELS["ours-gpt"](), "hetero", verbose=False, **kwargs)
    assert "\n" not in str(e.value)


def test_every_muon_keyword_is_accepted_including_init():
    import inspect

    from weightgeom.optim.param_groups import muon_group_keys

    sig = set(inspect.signature(Muon.__init__).parameters) - {"self", "params"}
    keys = set(muon_group_keys())
    assert "init" in keys and "dual" in keys and "dual_steps" in keys  # dual_steps: the older spelling, still taken
    assert keys == (sig - {"algorithm", "manifold", "layout", "split", "betas", "eps", "adamw_eps", "adamw_lr",
                           "deprecated"}) | {f"dual_{f}" for f in ("steps", "lr", "tol", "schedule", "ns_steps",
                                                                  "project", "normalize", "warm_start", "keep")}
    groups = param_groups(MODELS["ours-gpt"](), "hetero", verbose=False, init="keep")
    assert all(g.get("init") == "keep" for g in groups if g["algorithm"] == "muon")
    assert all("init" not in g for g in groups if g["algorithm"] == "adamw")
    Muon(groups)  # Muon accepts every group param_groups builds


# ---- a quiet API: nothing printed unless asked; the table through logging, describe() and the run directory -------
def test_param_groups_and_builders_are_quiet_unless_asked(capsys, caplog):
    import logging

    from weightgeom.optim import build_optimizer, describe
    from weightgeom.optim.config import OptimConfig

    model = MODELS["ours-gpt"]()
    with caplog.at_level(logging.WARNING, logger="weightgeom.optim.param_groups"):
        groups = param_groups(model, "hetero")
        build_optimizer(model, config=OptimConfig(strategy="hetero"))
    assert capsys.readouterr().out == "" and not caplog.records
    with caplog.at_level(logging.INFO, logger="weightgeom.optim.param_groups"):
        param_groups(model, "hetero")
    assert capsys.readouterr().out == "" and "param_groups(strategy='hetero')" in caplog.text
    table = describe(Muon(groups), model)  # the same table for a built optimizer, roles from the model
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert table.startswith(f"Muon: {len(names)} trainable parameters") and all(n in table for n in names)
    row = next(line for line in table.splitlines() if "attn.c_attn.weight" in line)
    assert " attn " in row and "muon" in row and "stiefel" in row
    plain = describe(torch.optim.AdamW(model.parameters()))
    assert plain.startswith("AdamW:") and "group0.param0" in plain and "adamw" in plain


def test_trainer_writes_the_table_into_the_run_directory_and_prints_none(tmp_path, capsys):
    from weightgeom.train import train

    cfg = {"run": {"device": "cpu"}, "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16, "bias": False},
           "data": {"kind": "shakespeare", "tokenizer": "char", "block_size": 16, "batch_size": 2},
           "optim": {"name": "muon", "strategy": "hetero"},
           "train": {"max_steps": 1, "eval_every": 0, "eval_iters": 1, "log_every": 1}}
    train(cfg, run_dir=tmp_path / "r", progress=True)
    assert "trainable parameters" not in capsys.readouterr().out
    table = (tmp_path / "r" / "param_groups.txt").read_text()
    assert table.startswith("Muon:") and "transformer.h.0.attn.c_attn.weight" in table and "stiefel" in table
