"""QK-clip: a planted logit explosion (W_Q × 50) is brought to ≤ τ by one clip on every supported attention layout
(ours and Hugging Face's, fused and split QKV, GQA), per manifold policy (free: per head; DGram: as a whole, staying
on the manifold; Stiefel: skipped; refuse), its counts reach the run's metrics, and its settings are checked."""

from __future__ import annotations

import math

import pytest
import torch

from weightgeom import manifolds
from weightgeom.diagnostics.monitors import attention_modules, head_logit_maxima
from weightgeom.models import GPT, GPTConfig, Llama, LlamaConfig
from weightgeom.train import train
from weightgeom.train.logging import read_metrics
from weightgeom.train.qk_clip import QKClip, QKClipConfig

VOCAB, T = 32, 12


def _gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32, **kw))


def _llama():
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                             max_seq_len=16))


def _hf(kind):
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=16,
                            attn_implementation="eager")
        return tf.GPT2LMHeadModel(cfg)
    if kind == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                             intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=16,
                             attn_implementation="eager")
        return tf.LlamaForCausalLM(cfg)
    cfg = tf.BertConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=48,
                        vocab_size=VOCAB, max_position_embeddings=16, attn_implementation="eager")
    return tf.BertModel(cfg)


# every layout the clip supports: ours fused / split QKV (with biases) / GQA, Hugging Face GPT-2 (Conv1D fused,
# biases), Llama (GQA, RoPE) and BERT (biases, bidirectional)
MODELS = {"gpt-fused": lambda: _gpt(), "gpt-split-bias": lambda: _gpt(separate_qkv=True, bias=True),
          "llama-gqa": _llama, "hf-gpt2": lambda: _hf("gpt2"), "hf-llama-gqa": lambda: _hf("llama"),
          "hf-bert": lambda: _hf("bert")}


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (4, T), generator=g)


def _plant(model, factor: float = 50.0, layer: int = 0):
    """W_Q (and its bias) of one attention layer × factor: the planted logit explosion."""
    with torch.no_grad():
        wq, _ = attention_modules(model)[layer][1].qk_weights()
        wq.mul_(factor)


def _max(model) -> list[float]:
    return [max(row) for row in head_logit_maxima(model, _batch())]


@pytest.mark.parametrize("name", list(MODELS))
def test_one_clip_brings_a_planted_explosion_to_tau(name):
    model = MODELS[name]()
    before = _max(model)
    _plant(model)
    planted = _max(model)
    assert planted[0] > 10 * before[0]
    tau = planted[0] / 4  # the exploded layer is over τ, the others are not
    assert planted[1] < tau
    w_other = [w.clone() for w in attention_modules(model)[1][1].qk_weights()]
    clip = QKClip(tau=tau)
    n = clip.clip(model, _batch())
    after = _max(model)
    assert after[0] <= tau * (1 + 1e-4) and after[0] > 0.5 * tau  # clipped to τ, not far below it
    assert n >= 1 and clip.rescales == n and clip.clips == 1 and clip.skipped == 0
    assert all(torch.equal(a, b) for a, b in zip(attention_modules(model)[1][1].qk_weights(), w_other))
    assert clip.clip(model, _batch()) == 0  # nothing over τ any more


def test_gqa_key_heads_take_the_largest_logit_of_the_query_heads_sharing_them():
    """Plant the explosion in one query head only: its key head (shared with another query head) is scaled by that
    head's η^(1−α), the other key head not at all; the other query head sharing the key shrinks by η^(1−α) only."""
    model = _llama()
    site = attention_modules(model)[0][1]
    wq, wk = site.qk_weights()
    d = site.head_dim
    with torch.no_grad():
        wq[0:d].mul_(50.0)  # query head 0 (key head 0, shared with query head 1)
    heads = head_logit_maxima(model, _batch())[0]
    tau = heads[0] / 9
    assert max(heads[1:]) < tau
    wk0 = wk.clone()
    QKClip(tau=tau, alpha=0.5).clip(model, _batch())
    eta = tau / heads[0]
    assert torch.allclose(wk[:d], wk0[:d] * eta ** 0.5, rtol=1e-5)
    assert torch.equal(wk[d:], wk0[d:])
    after = head_logit_maxima(model, _batch())[0]
    assert after[0] <= tau * (1 + 1e-4)
    assert after[1] == pytest.approx(heads[1] * eta ** 0.5, rel=1e-4)


class _Groups:
    """An optimizer's ``param_groups`` as QK-clip reads them (the manifold of each parameter)."""

    def __init__(self, model, manifold, **extra):
        self.param_groups = [{"params": [p], "algorithm": "muon", "manifold": manifold, **extra}
                             for n, p in model.named_parameters() if n.endswith("c_attn.weight")]


# (manifold of the fused c_attn, policy, what happens): DGram clipped as a whole and stays on DGram; Stiefel skipped
CONSTRAINED = [("dgram", "auto", "whole"), ("dgram", "skip", "skip"), ("stiefel", "auto", "skip"),
               ("stiefel", "refuse", "refuse"), ("dgram", "refuse", "refuse")]


@pytest.mark.parametrize("manifold,policy,outcome", CONSTRAINED)
def test_constrained_attention_is_clipped_as_a_whole_skipped_or_refused(manifold, policy, outcome):
    model = _gpt()
    man = manifolds.get(manifold)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("c_attn.weight"):
                p.copy_(man.retract(p * 20))  # on the manifold, large enough to explode under DGram
    if manifold == "stiefel":
        _plant(model, 1.0)
    planted = _max(model)
    tau = planted[0] / 4
    clip = QKClip(tau=tau, constrained=policy)
    groups = _Groups(model, manifold)
    if outcome == "refuse":
        with pytest.raises(ValueError, match="qk_clip.constrained='refuse'"):
            clip.find(model, groups)
        return
    clip._layers = clip.find(model, groups)
    c_attn = [p.clone() for n, p in model.named_parameters() if n.endswith("c_attn.weight")]
    clip.clip(model, _batch())
    after = [p for n, p in model.named_parameters() if n.endswith("c_attn.weight")]
    if outcome == "skip":
        assert all(torch.equal(a, b) for a, b in zip(after, c_attn)) and clip.skipped > 0 and clip.rescales == 0
        return
    assert _max(model)[0] <= tau * (1 + 1e-4) and clip.rescales >= 1
    assert float(man.constraint_violation(after[0].detach())) < 1e-4  # still on DGram: a scalar on the whole


def test_trainer_runs_the_config_key_and_counts_rescales_in_the_metrics(tmp_path):
    cfg = {"model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
           "data": {"kind": "synthetic", "block_size": 16, "batch_size": 4},
           "optim": {"name": "adamw", "adamw": {"lr": 3e-2}},
           "train": {"max_steps": 4, "eval_every": 0, "eval_iters": 1, "log_every": 1},
           "qk_clip": {"enabled": True, "tau": 1e-3}}  # every step clips
    res = train(cfg, run_dir=tmp_path / "r", progress=False)
    assert res["status"] == "done"
    rows = read_metrics(tmp_path / "r", "train")
    counts = [r["qk_clip_rescales"] for r in rows]
    assert counts == sorted(counts) and counts[-1] >= 4 and all(math.isfinite(r["qk_clip_max_logit"]) for r in rows)


@pytest.mark.parametrize("kw,match", [({"tau": 0}, "qk_clip.tau"), ({"alpha": 1.5}, "qk_clip.alpha"),
                                      ({"constrained": "retract"}, "qk_clip.constrained")])
def test_bad_settings_are_refused_in_one_line(kw, match):
    with pytest.raises(ValueError, match=match):
        QKClip(**kw)
    assert QKClipConfig().build() is None and isinstance(QKClipConfig(enabled=True).build(), QKClip)



def test_ddp_ranks_rescale_alike_from_the_maxima_over_every_rank(monkeypatch):
    """Each rank measures its own micro-batch; the maxima are all-reduced (max) so every replica clips alike (the
    other rank's maxima stand in through a patched all_reduce; NaN: a head with no visible entry)."""
    import torch.distributed as dist

    from weightgeom.train.qk_clip import _across_ranks

    other = torch.tensor([[20.0, 5.0], [2.0, -1.0]], dtype=torch.float64)

    def all_reduce(t, op=None):
        assert op == dist.ReduceOp.MAX
        t.copy_(torch.maximum(t, other))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert _across_ranks([[1.0, 50.0], [float("nan"), 3.0]]) == [[20.0, 50.0], [2.0, 3.0]]


def test_dgram_with_split_qkv_clips_q_and_k_blocks_each_as_a_whole():
    """With split_qkv (group key split=3) Q, K and V are separate DGram matrices: Q and K are each scaled as a whole
    (η^α, η^(1−α)), V is untouched, and each block stays on DGram."""
    model = _gpt()
    man = manifolds.get("dgram")
    C = 32
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("c_attn.weight"):
                for b in range(3):
                    p[b * C:(b + 1) * C] = man.retract(p[b * C:(b + 1) * C] * 20)
    tau = _max(model)[0] / 4
    clip = QKClip(tau=tau)
    clip._layers = clip.find(model, _Groups(model, "dgram", split=3))
    w = next(p for n, p in model.named_parameters() if n.endswith("h.0.attn.c_attn.weight"))
    v0 = w[2 * C:].clone()
    clip.clip(model, _batch())
    assert _max(model)[0] <= tau * (1 + 1e-4) and torch.equal(w[2 * C:], v0)
    assert all(float(man.constraint_violation(w[b * C:(b + 1) * C].detach())) < 1e-4 for b in range(2))


def test_a_run_checkpointed_before_the_qk_clip_section_still_resumes():
    """The [qk_clip] section at its defaults hashes like a config without it (checkpoints made before it existed keep
    their hash); turning it on changes the hash."""
    from weightgeom.train.config import config_hash, config_to_dict, load_config

    cfg = config_to_dict(load_config(None))
    old = {k: v for k, v in cfg.items() if k != "qk_clip"}
    assert config_hash(cfg) == config_hash(old)
    assert config_hash({**cfg, "qk_clip": {**cfg["qk_clip"], "enabled": True}}) != config_hash(old)
