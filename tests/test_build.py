"""One-line builders: names, groups, MD wiring, and bad input."""

from __future__ import annotations

import pytest
import torch

from weightgeom.models import build_model
from weightgeom.optim.build import adamw_groups, build_optimizer, canonical_name
from weightgeom.optim.dual import DualAscent
from weightgeom.optim.magnitude_direction import MagnitudeDirection


def _gpt(**kw):
    torch.manual_seed(0)
    cfg = dict(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=16)
    cfg.update(kw)
    return build_model("gpt", **cfg)


def _train(model, opt, steps=6):
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        _, loss = model(idx, idx)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


BLOCK_MATRICES = {f"transformer.h.{i}.{m}.weight" for i in range(1)
                  for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}


@pytest.mark.parametrize("spelling,expect", [("AdamW", "adamw"), ("MuonMD", "muon-md"), ("adamw_md", "adamw-md"),
                                             ("muon+md", "muon-md"), ("adamwmd", "adamw-md")])
def test_canonical_names(spelling, expect):
    assert canonical_name(spelling) == expect


def test_adamw_groups_and_hyperparameters():
    model = _gpt()
    opt = build_optimizer(model, "adamw", lr=0.02, adamw_lr=1e-3, adamw_weight_decay=0.05, weight_decay=0.0)
    assert type(opt) is torch.optim.AdamW
    decay, no_decay = opt.param_groups
    assert decay["lr"] == 1e-3 and decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in no_decay["params"])
    assert "transformer.wte.weight" in decay["names"]
    n_params = sum(len(g["params"]) for g in adamw_groups(model, 0.1))
    assert n_params == len([p for p in model.parameters() if p.requires_grad])
    plain = build_optimizer(model, "adamw", lr=3e-4)  # adamw_lr absent → lr
    assert plain.param_groups[0]["lr"] == 3e-4 and plain.param_groups[0]["weight_decay"] == 0.1


def test_adamw_md_one_line_trains():
    model = _gpt()
    opt = build_optimizer(model, "adamw-md", adamw_lr=3e-3, md={"gains": "row", "gain_lr": 1e-2})
    assert isinstance(opt, MagnitudeDirection) and opt.gains == "row"
    assert set(opt.decoupled_names) == BLOCK_MATRICES  # wte (tied lm_head) is an embedding: excluded
    assert set(opt.weight_decay_overridden) == BLOCK_MATRICES
    assert opt.param_groups[-1]["lr"] == 1e-2
    losses = _train(model, opt)
    assert losses[-1] < losses[0]


def test_adamw_md_unit_row_embeddings():
    model = _gpt()
    opt = build_optimizer(model, "adamw-md", md={"embeddings": "unit_rows"})
    assert opt.unit_row_names == ["transformer.wte.weight", "transformer.wpe.weight"]
    _train(model, opt, steps=2)
    norms = model.transformer.wte.weight.norm(dim=1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5)


def test_bad_input():
    model = _gpt()
    with pytest.raises(ValueError, match="unknown optimizer name"):
        build_optimizer(model, "sgd")
    with pytest.raises(ValueError, match="no magnitude"):
        build_optimizer(model, "adamw", md={"gains": "row"})
    with pytest.raises(ValueError, match="unknown md option"):
        build_optimizer(model, "adamw-md", md={"gain": "row"})
    with pytest.raises(TypeError, match="unknown keyword"):
        build_optimizer(model, "adamw", learning_rate=1e-3)
    with pytest.raises(ValueError, match="strategy"):
        build_optimizer(model, "adamw", strategy="all-stiefel")
    # Muon-only keys (the trainer passes one config for every name) are accepted and ignored by AdamW
    build_optimizer(model, "adamw", momentum=0.9, dual=DualAscent(steps=5), split_qkv=False)


@pytest.mark.parametrize("name,strategy", [("muon", "unconstrained"), ("muon-md", "unconstrained"),
                                           ("muon-md", "hetero"), ("muon-md", "all-stiefel")])
def test_muon_names_train(name, strategy):
    model = _gpt()
    opt = build_optimizer(model, name, strategy=strategy, lr=0.02, adamw_lr=3e-3, dual={"steps": 5})
    if name.endswith("-md"):
        assert isinstance(opt, MagnitudeDirection)
        assert BLOCK_MATRICES <= set(opt.decoupled_names)
    losses = _train(model, opt, steps=4)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_stiefel_attention_plus_md_one_liner():
    model = _gpt()
    opt = build_optimizer(model, "muon-md", rules={r"\.attn\.": "stiefel"}, md={"gains": "row+col"}, dual={"steps": 5})
    manifolds = {n: g.get("manifold") for g in opt.base_optimizer.param_groups for n in g.get("names", [])}
    assert manifolds["transformer.h.0.attn.c_attn.weight"] == "stiefel"
    assert manifolds["transformer.h.0.mlp.c_fc.weight"] is None
    losses = _train(model, opt)
    assert losses[-1] < losses[0]


def test_muon_md_manifold_checkpoint_round_trip():
    import io

    def make(seed):
        model = _gpt()
        torch.manual_seed(seed)
        opt = build_optimizer(model, "muon-md", strategy="hetero", split_qkv=True, dual={"steps": 2},
                              md={"gain_lr": 1e-2})
        return model, opt

    model, opt = make(0)
    _train(model, opt, steps=2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, steps=2)
    model2, opt2 = make(1)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    _train(model2, opt2, steps=2)
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), n
