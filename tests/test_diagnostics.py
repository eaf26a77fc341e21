"""Training-time monitors: pure functions against brute force, collect() on our GPT / Llama with and without an
optimizer, side-effect freedom (flags, mode, RNG, .grad), the mechanism direction (bigger σ(W_Q)σ(W_K) → bigger
logits, lower entropy, more saturation), and the attention monitors on tiny Hugging Face GPT-2, Llama and BERT
models built from configs (no download) against a slow direct computation."""

import math

import pytest
import torch

from weightgeom import models, optim
from weightgeom.diagnostics import (
    SATURATION_THRESHOLD,
    attention_modules,
    collect,
    grad_norms,
    logit_stats,
    matrix_stats,
    optimizer_stats,
    qk_scale,
    qk_sigma_prod,
)

# float64 Gram + eigvalsh vs float64 svdvals on 40×24 matrices: agreement ~1e-12 (measured); 1e-8 is loose but
# still far below anything a diagnostic plot could show.
SIGMA_TOL = 1e-8
# logits recomputed in a separate forward: same kernels, identical up to float32 rounding (measured 0 difference).
LOGIT_TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_matrix_stats_against_svd():
    for shape in ((40, 24), (24, 40)):
        W = torch.randn(*shape, dtype=torch.float64)
        st = matrix_stats(W)
        s = torch.linalg.svdvals(W)
        assert st["sigma_max"] == pytest.approx(float(s[0]), abs=SIGMA_TOL)
        assert st["sigma_min"] == pytest.approx(float(s[-1]), abs=SIGMA_TOL)
        A = W if shape[0] >= shape[1] else W.T
        G = A.T @ A
        off = torch.linalg.matrix_norm(G - torch.diag(torch.diag(G))) / torch.linalg.matrix_norm(G)
        assert st["gram_offdiag"] == pytest.approx(float(off), abs=1e-10)
        cn = A.norm(dim=0)
        assert st["colnorm_spread"] == pytest.approx(float((cn.max() - cn.min()) / cn.mean()), abs=1e-10)


def test_matrix_stats_float32_and_wrapped_names():
    W = torch.randn(40, 24)
    st = matrix_stats(W)
    s = torch.linalg.svdvals(W.double())
    # fp32 Gram: σ error ≲ 3e-4·σ_max (see matrix_stats); measured ~1e-6 here
    assert st["sigma_min"] == pytest.approx(float(s[-1]), abs=3e-4 * float(s[0]))
    m = _gpt()

    class Wrap(torch.nn.Module):  # DDP-style "module." prefix
        def __init__(self):
            super().__init__()
            self.module = m

    d = collect(Wrap())
    assert "mat.transformer.h.0.attn.c_attn.weight.sigma_max" in d


def test_matrix_stats_on_manifolds():
    Q = torch.linalg.qr(torch.randn(30, 12)).Q  # Stiefel: all zero / one
    st = matrix_stats(Q)
    assert st["sigma_max"] == pytest.approx(1.0, abs=1e-6) and st["sigma_min"] == pytest.approx(1.0, abs=1e-6)
    assert st["gram_offdiag"] < 1e-6 and st["colnorm_spread"] < 1e-6
    D = Q * torch.linspace(0.5, 2.0, 12)  # DGram: orthogonal columns, free norms
    st = matrix_stats(D.T)  # wide input is transposed to tall
    assert st["gram_offdiag"] < 1e-6 and st["colnorm_spread"] == pytest.approx(1.5 / 1.25, abs=1e-5)
    assert st["sigma_max"] == pytest.approx(2.0, abs=1e-5) and st["sigma_min"] == pytest.approx(0.5, abs=1e-5)
    O = torch.randn(30, 12)
    O = O / O.norm(dim=0)  # Oblique: unit columns, non-orthogonal
    st = matrix_stats(O)
    assert st["colnorm_spread"] < 1e-6 and st["gram_offdiag"] > 0.1


def test_qk_sigma_prod_gqa():
    H, Hkv, hd, d = 4, 2, 8, 32
    Wq, Wk = torch.randn(H * hd, d), torch.randn(Hkv * hd, d)
    st = qk_sigma_prod(Wq, Wk, H, Hkv)
    sv = torch.linalg.matrix_norm
    assert st["qk_sigma_prod"] == pytest.approx(float(sv(Wq, 2) * sv(Wk, 2)), rel=1e-5)
    per = [float(sv(Wq[h * hd:(h + 1) * hd], 2) * sv(Wk[(h // 2) * hd:(h // 2 + 1) * hd], 2)) for h in range(H)]
    assert st["qk_sigma_prod_head_max"] == pytest.approx(max(per), rel=1e-5)
    assert st["qk_sigma_prod_head_max"] <= st["qk_sigma_prod"] + 1e-4


def test_logit_stats():
    T = 6
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    z = torch.zeros(1, 1, T, T).masked_fill(~mask, float("-inf"))
    st = logit_stats(z)
    # uniform rows over k = 2..T visible keys (row 0 has one key and is left out)
    assert st["entropy"] == pytest.approx(sum(math.log(k) for k in range(2, T + 1)) / (T - 1), abs=1e-6)
    assert st["saturation"] == 0.0 and st["logit_max"] == 0.0
    big = torch.randn(2, 3, T, T) * 100
    st = logit_stats(big.masked_fill(~mask, float("-inf")))
    assert st["saturation"] > 0.8 and st["entropy"] < 0.1
    assert st["logit_max"] == pytest.approx(float(big.masked_fill(~mask, 0).abs().max()))


def test_grad_norms_grouping():
    g = grad_norms([("a.w", torch.ones(2, 2)), ("a.b", torch.ones(2)), ("c.w", None), ("d", 3 * torch.ones(1))])
    assert g["grad_norm.a"] == pytest.approx(math.sqrt(6)) and g["grad_norm.d"] == pytest.approx(3.0)
    assert "grad_norm.c" not in g and g["grad_norm.total"] == pytest.approx(math.sqrt(15))


def _gpt(**kw):
    return models.build_model("gpt", n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8, **kw)


def test_collect_gpt_keys_and_no_side_effects():
    m = _gpt()
    m.train()
    x = torch.randint(0, 32, (3, 8))
    y = torch.randint(0, 32, (3, 8))
    rng = torch.get_rng_state()
    with torch.no_grad():  # the trainer calls collect under no_grad
        d = collect(m, None, (x, y))
    assert torch.equal(rng, torch.get_rng_state())
    assert m.training and all(not a.record_logits and a.last_logits is None for _, a in models.iter_attention(m))
    assert all(p.grad is None for p in m.parameters())
    for i in range(2):
        for k in ("qk_sigma_prod", "qk_sigma_prod_head_max", "logit_max", "entropy", "saturation"):
            assert math.isfinite(d[f"attn.{i}.{k}"]), (i, k)
    for k in ("sigma_max", "sigma_min", "gram_offdiag", "colnorm_spread"):
        assert f"mat.transformer.h.0.attn.c_attn.weight.{k}" in d
    assert "mat.transformer.wte.weight.sigma_max" not in d  # embeddings are not monitored
    assert d["grad_norm.transformer.h.1.mlp.c_fc"] > 0 and "diag.time_ms" in d
    # logit max equals a separate explicit forward; grad norms equal a manual backward (eval mode)
    m.eval()
    models.set_record_logits(m, True)
    _, loss = m(x, y)
    z = [a.last_logits for _, a in models.iter_attention(m)]
    loss.backward()
    models.set_record_logits(m, False)
    for i, zi in enumerate(z):
        assert d[f"attn.{i}.logit_max"] == pytest.approx(float(zi[torch.isfinite(zi)].abs().max()), abs=LOGIT_TOL)
    g = m.transformer.h[1].mlp.c_fc.weight.grad.norm()
    assert d["grad_norm.transformer.h.1.mlp.c_fc"] == pytest.approx(float(g), rel=1e-4)
    # with .grad present, collect uses it and adds no backward
    d2 = collect(m, None, x)
    assert d2["grad_norm.transformer.h.1.mlp.c_fc"] == pytest.approx(float(g), rel=1e-6)


def test_collect_without_batch_and_resmlp():
    d = collect(_gpt())
    assert "attn.0.qk_sigma_prod" in d and "attn.0.logit_max" not in d
    r = models.build_model("resmlp", preset="resmlp-tiny")
    d = collect(r)
    assert any(k.startswith("mat.blocks.0.") for k in d) and not any(k.startswith("attn.") for k in d)


def test_collect_llama_gqa():
    m = models.build_model("llama", n_layers=2, n_heads=4, n_kv_heads=2, dim=32, vocab_size=32, max_seq_len=8)
    d = collect(m, None, torch.randint(0, 32, (2, 8)))
    assert d["attn.1.qk_sigma_prod_head_max"] > 0 and 0 <= d["attn.1.saturation"] <= 1


def test_mechanism_direction():
    """Scaling W_Q up (what DGram allows) raises σ(W_Q)σ(W_K) and the logits, lowers entropy, raises saturation."""
    m = _gpt()
    x = torch.randint(0, 32, (4, 8))
    base = collect(m, None, x, grads=False)
    with torch.no_grad():
        for blk in m.transformer.h:
            blk.attn.c_attn.weight[:16] *= 30.0
    big = collect(m, None, x, grads=False)
    for i in range(2):
        assert big[f"attn.{i}.qk_sigma_prod"] == pytest.approx(30 * base[f"attn.{i}.qk_sigma_prod"], rel=1e-4)
        assert big[f"attn.{i}.logit_max"] > 10 * base[f"attn.{i}.logit_max"]
        assert big[f"attn.{i}.entropy"] < base[f"attn.{i}.entropy"]
        assert big[f"attn.{i}.saturation"] >= base[f"attn.{i}.saturation"]


def test_collect_with_manifold_muon():
    m = _gpt()
    groups = optim.param_groups(m, strategy="hetero", verbose=False)
    opt = optim.Muon(groups)
    x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    _, loss = m(x, y)
    loss.backward()
    opt.step()
    d = collect(m, opt, (x, y))
    res = [k for k in d if k.endswith(".tangent_residual") and k.startswith("muon.transformer")]
    assert res and "muon.tangent_residual_max" in d and "muon.dual_iters_mean" in d
    assert not any(k.startswith("mat.transformer.wte") for k in d)
    # attention is Stiefel under "hetero": σ = 1, orthogonal columns (per block if the fused QKV is split)
    keys = [k for k in d if k.startswith("mat.transformer.h.0.attn.c_attn") and k.endswith("sigma_max")]
    assert keys and all(d[k] == pytest.approx(1.0, abs=1e-2) for k in keys)


def test_collect_reads_muon_stats_through_the_md_wrapper():
    """A MagnitudeDirection around manifold Muon: the per-matrix stats come from its base (the wrapper has none),
    for the same matrices as with Muon alone."""
    m = _gpt()
    opt = optim.MagnitudeDirection(optim.Muon(optim.param_groups(m, strategy="hetero", verbose=False)), model=m)
    x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    _, loss = m(x, y)
    loss.backward()
    opt.step()
    d = collect(m, opt, (x, y))
    res = {k for k in d if k.endswith(".tangent_residual")}
    assert res == {f"muon.{n}.tangent_residual" for n in opt.base_optimizer.last_stats}
    assert res and "muon.dual_iters_mean" in d


def test_optimizer_stats_index_keys():
    p = torch.nn.Parameter(torch.randn(4, 4))

    class Fake:
        param_groups = [{"params": [p], "names": ["blk.w"], "algorithm": "muon", "manifold": "stiefel"}]
        last_stats = {0: {"tangent_residual": 1e-5, "dual_iters": 3}}

    d = optimizer_stats(Fake())
    assert d["muon.blk.w.dual_iters"] == 3 and d["muon.tangent_residual_max"] == 1e-5


# ------------------------------------------------------- Hugging Face GPT-2 / Llama / BERT (built from configs)

ATTN_KEYS = ("qk_sigma_prod", "qk_sigma_prod_head_max", "logit_max", "entropy", "saturation")
# collect() recomputes q, k in float32 with the module's own projections; the reference below does it by hand in
# float64 from the hidden states the model returns. Logits of size ~100 agree to ~1e-5 relative (fp32 rounding).
HF_LOGIT_REL = 1e-4
# entropy: mean over rows of fp32 softmax entropies, collect's vs eager HF's probabilities: agree to ~1e-6 nats.
HF_ENTROPY_TOL = 1e-4
# saturation is a count of rows / rows, averaged in float32 by logit_stats (~3e-8 off the exact fraction); one row
# of the ~100 compared here moves it by ~1e-2, so 1e-6 still demands the exact count.
HF_SAT_TOL = 1e-6


def _transformers():
    return pytest.importorskip("transformers")


def _hf_gpt2(**kw):
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=32, n_positions=16, initializer_range=1.0,
                        attn_implementation="eager", **kw)
    return tf.GPT2LMHeadModel(cfg)


def _hf_llama():
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                         intermediate_size=64, vocab_size=32, max_position_embeddings=16, initializer_range=1.0,
                         attn_implementation="eager")
    return tf.LlamaForCausalLM(cfg)


def _hf_bert(mlm: bool = False):
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=16, intermediate_size=32,
                        vocab_size=32, max_position_embeddings=16, initializer_range=1.0, attn_implementation="eager")
    return tf.BertForMaskedLM(cfg) if mlm else tf.BertModel(cfg)


def _vis(pad: torch.Tensor | None, B: int, T: int, causal: bool) -> torch.Tensor:
    """(B, T, T) visible (query, key) pairs: causal and key padding; padding query rows see nothing."""
    v = torch.ones(B, T, T, dtype=torch.bool)
    if causal:
        v = v.tril()
    if pad is not None:
        v = v & pad.bool()[:, None, :] & pad.bool()[:, :, None]
    return v


def _ref_prob_stats(p: torch.Tensor, vis: torch.Tensor) -> tuple[float, float]:
    """Entropy (nats) and saturation from the model's own softmax probabilities (B, H, T, T), over the rows with
    at least two visible keys, straight from the definition."""
    p = p.detach().double()
    rows = (vis.sum(-1) >= 2)[:, None, :].expand(p.shape[:-1])
    ent = -(p * torch.log(p.clamp_min(1e-300))).where(p > 0, torch.zeros_like(p)).sum(-1)
    sat = (p.amax(-1) > SATURATION_THRESHOLD).double()
    return float(ent[rows].mean()), float(sat[rows].mean())


def _ref_logit_max(q: torch.Tensor, k: torch.Tensor, vis: torch.Tensor) -> float:
    """max |q kᵀ/√d| over visible pairs; q (B, H, T, d), k (B, H, T, d) float64."""
    z = q.detach() @ k.detach().transpose(-1, -2) / math.sqrt(q.shape[-1])
    return float(z.abs().masked_fill(~vis[:, None], 0).amax())


def _heads(t: torch.Tensor, n: int) -> torch.Tensor:
    B, T, C = t.shape
    return t.view(B, T, n, C // n).transpose(1, 2)


def _sigma_ref(Wq: torch.Tensor, Wk: torch.Tensor, H: int, Hkv: int) -> tuple[float, float]:
    """σ_max(W_Q)σ_max(W_K) and the per-head max, from float64 SVDs of explicit (out, in) weights."""
    Wq, Wk = Wq.detach().double(), Wk.detach().double()
    s2 = torch.linalg.matrix_norm
    dq, dk = Wq.shape[0] // H, Wk.shape[0] // Hkv
    per = [float(s2(Wq[h * dq:(h + 1) * dq], 2) * s2(Wk[(h // (H // Hkv)) * dk:(h // (H // Hkv) + 1) * dk], 2))
           for h in range(H)]
    return float(s2(Wq, 2) * s2(Wk, 2)), max(per)


def _check_attn(d: dict, i: int, logit_max: float, probs: torch.Tensor, vis: torch.Tensor,
                sigma: tuple[float, float]) -> None:
    ent, sat = _ref_prob_stats(probs, vis)
    assert d[f"attn.{i}.logit_max"] == pytest.approx(logit_max, rel=HF_LOGIT_REL), i
    assert d[f"attn.{i}.entropy"] == pytest.approx(ent, abs=HF_ENTROPY_TOL), i
    assert d[f"attn.{i}.saturation"] == pytest.approx(sat, abs=HF_SAT_TOL), i
    assert d[f"attn.{i}.qk_sigma_prod"] == pytest.approx(sigma[0], rel=1e-5), i
    assert d[f"attn.{i}.qk_sigma_prod_head_max"] == pytest.approx(sigma[1], rel=1e-5), i


@pytest.mark.parametrize("inv_layer", [False, True])
def test_hf_gpt2_dict_batch_against_direct_computation(inv_layer):
    """Left-padded dict batch (input_ids, attention_mask, labels) on GPT2LMHeadModel: every attention monitor equals
    a direct computation (explicit Conv1D W_Q/W_K, eager softmax probabilities under causal + padding mask); with
    ``scale_attn_by_inverse_layer_idx`` the logits of layer i are also divided by i + 1, as the model does."""
    m = _hf_gpt2(scale_attn_by_inverse_layer_idx=inv_layer)
    B, T, C, H = 10, 8, 16, 2
    x = torch.randint(0, 32, (B, T))
    pad = torch.ones(B, T, dtype=torch.long)
    pad[1, :3] = 0
    pad[4, :6] = 0
    m.train()
    d = collect(m, None, {"input_ids": x, "attention_mask": pad, "labels": x})  # 10 sequences, max_seqs=8 used
    assert m.training and not any(a._forward_pre_hooks for a in m.modules())
    assert all(p.grad is None for p in m.parameters())
    x, pad = x[:8], pad[:8]
    m.eval()
    out = m(input_ids=x, attention_mask=pad, labels=x, output_attentions=True, output_hidden_states=True)
    vis = _vis(pad, 8, T, causal=True)
    for i, blk in enumerate(m.transformer.h):
        W, b = blk.attn.c_attn.weight.double(), blk.attn.c_attn.bias.double()  # Conv1D: (in, 3C), y = x W + b
        qkv = blk.ln_1(out.hidden_states[i]).double() @ W + b
        q, k = _heads(qkv[..., :C], H), _heads(qkv[..., C:2 * C], H)
        sig = _sigma_ref(W[:, :C].T, W[:, C:2 * C].T, H, H)
        _check_attn(d, i, _ref_logit_max(q, k, vis) / (i + 1 if inv_layer else 1), out.attentions[i], vis, sig)
    assert 0 < d["attn.0.saturation"] < 1  # the weights give a mix of saturated and open rows: the test has teeth
    out.loss.backward()  # gradient norms: labels in the dict -> one extra backward, equal to a manual one
    g = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in m.parameters() if p.grad is not None))
    assert d["grad_norm.total"] == pytest.approx(g, rel=1e-4)


def test_hf_gpt2_padding_matters():
    """The padding mask changes the monitors (padded keys and query rows are left out), and the mask may come as a
    keyword argument instead of inside the batch."""
    m = _hf_gpt2()
    x = torch.randint(0, 32, (3, 8))
    pad = torch.ones(3, 8, dtype=torch.long)
    pad[0, :4] = 0
    a = collect(m, {"input_ids": x, "attention_mask": pad})
    b = collect(m, x, attention_mask=pad)
    c = collect(m, x)
    for i in range(2):
        for k in ("logit_max", "entropy", "saturation"):
            assert a[f"attn.{i}.{k}"] == b[f"attn.{i}.{k}"]
        assert a[f"attn.{i}.entropy"] != c[f"attn.{i}.entropy"]


def test_hf_llama_gqa_rope_against_direct_computation():
    """LlamaForCausalLM with GQA (4 query heads, 2 KV heads): logits after RoPE (rotate_half, positions 0..T-1,
    θ from the config) equal a hand computation; without RoPE they would not."""
    m = _hf_llama()
    B, T, H, Hkv = 3, 8, 4, 2
    x = torch.randint(0, 32, (B, T))
    d = collect(m, x)
    out = m(x, output_attentions=True, output_hidden_states=True)
    vis = _vis(None, B, T, causal=True)
    rp = getattr(m.config, "rope_parameters", None) or {}
    theta = rp.get("rope_theta", getattr(m.config, "rope_theta", 10000.0))
    hd = 32 // H
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()

    def rope(t):
        t1, t2 = t.chunk(2, dim=-1)
        return t * cos + torch.cat((-t2, t1), -1) * sin

    for i, layer in enumerate(m.model.layers):
        a = layer.self_attn
        h = layer.input_layernorm(out.hidden_states[i]).double()
        q = _heads(h @ a.q_proj.weight.double().T, H)
        k = _heads(h @ a.k_proj.weight.double().T, Hkv).repeat_interleave(H // Hkv, dim=1)
        sig = _sigma_ref(a.q_proj.weight, a.k_proj.weight, H, Hkv)
        _check_attn(d, i, _ref_logit_max(rope(q), rope(k), vis), out.attentions[i], vis, sig)
        assert abs(_ref_logit_max(q, k, vis) - d[f"attn.{i}.logit_max"]) > 1e-2 * d[f"attn.{i}.logit_max"]
    assert 0 < d["attn.0.saturation"] < 1


def test_hf_llama_tuple_batch_labels_and_padding():
    """(x, y) on a Hugging Face model means input_ids=x, labels=y (positionally y would be the attention mask):
    the gradient norms equal a manual backward with labels=y. A right-padded mask is respected."""
    m = _hf_llama()
    x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    d = collect(m, None, (x, y))
    assert all(p.grad is None for p in m.parameters())
    m(input_ids=x, labels=y).loss.backward()
    g = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in m.parameters() if p.grad is not None))
    assert d["grad_norm.total"] == pytest.approx(g, rel=1e-4)
    pad = torch.ones(2, 8, dtype=torch.long)
    pad[1, 5:] = 0
    m.zero_grad(set_to_none=True)
    d = collect(m, {"input_ids": x, "attention_mask": pad}, grads=False)
    out = m(x, attention_mask=pad, output_attentions=True)
    vis = _vis(pad, 2, 8, causal=True)
    for i in range(2):
        ent, sat = _ref_prob_stats(out.attentions[i], vis)
        assert d[f"attn.{i}.entropy"] == pytest.approx(ent, abs=HF_ENTROPY_TOL)
        assert d[f"attn.{i}.saturation"] == pytest.approx(sat, abs=HF_SAT_TOL)


@pytest.mark.parametrize("mlm", [False, True])
def test_hf_bert_padding_mask_against_direct_computation(mlm):
    """BertModel / BertForMaskedLM: bidirectional attention under the padding mask; q, k from self.query/self.key."""
    m = _hf_bert(mlm)
    B, T, H, C = 3, 8, 2, 16
    x = torch.randint(0, 32, (B, T))
    pad = torch.ones(B, T, dtype=torch.long)
    pad[0, 5:] = 0
    pad[2, 2:] = 0
    m.train()
    d = collect(m, {"input_ids": x, "attention_mask": pad})
    assert m.training
    m.eval()  # collect runs in eval mode (no dropout); so does the reference
    out = m(x, attention_mask=pad, output_attentions=True, output_hidden_states=True)
    vis = _vis(pad, B, T, causal=False)
    enc = (m.bert if mlm else m).encoder
    for i, layer in enumerate(enc.layer):
        s = layer.attention.self
        h = out.hidden_states[i].double()
        q = _heads(h @ s.query.weight.double().T + s.query.bias.double(), H)
        k = _heads(h @ s.key.weight.double().T + s.key.bias.double(), H)
        sig = _sigma_ref(s.query.weight, s.key.weight, H, H)
        _check_attn(d, i, _ref_logit_max(q, k, vis), out.attentions[i], vis, sig)
    assert any(0 < d[f"attn.{i}.saturation"] < 1 for i in range(2))
    assert C == s.query.weight.shape[1]


def test_hf_and_own_models_report_the_same_keys():
    own = collect(_gpt(), torch.randint(0, 32, (2, 8)), grads=False)
    own_keys = {k.split(".", 2)[2] for k in own if k.startswith("attn.")}
    gain = {"norm_gain_mean", "qk_sigma_prod_gain"}  # pre-norm blocks only: not BERT's post-norm
    assert own_keys == set(ATTN_KEYS) | gain
    for m, keys in ((_hf_gpt2(), own_keys), (_hf_llama(), own_keys), (_hf_bert(), set(ATTN_KEYS))):
        d = collect(m, torch.randint(0, 32, (2, 8)), grads=False)
        assert {k for k in d if k.startswith("attn.")} == {f"attn.{i}.{k}" for i in range(2) for k in keys}


def test_batch_forms_on_own_model():
    """Tensor, (x, y), collect(model, batch), a dict of forward keywords and an HF-style dict all work on our GPT."""
    m = _gpt()
    x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    ref = collect(m, None, (x, y))
    for batch in ({"idx": x, "targets": y}, {"input_ids": x, "labels": y}):
        d = collect(m, batch)
        for k in ("attn.1.logit_max", "attn.1.entropy", "grad_norm.total"):
            assert d[k] == pytest.approx(ref[k], rel=1e-6), (batch.keys(), k)
    d = collect(m, x, grads=False)
    assert d["attn.0.logit_max"] == pytest.approx(ref["attn.0.logit_max"], rel=1e-6)


def test_hooks_removed_after_an_exception():
    """An error in the middle of the forward (after the first attention layer ran) propagates; the attention hooks,
    record_logits flags and training mode are restored."""
    for m, later in ((_hf_gpt2(), lambda m: m.transformer.h[1].mlp), (_hf_llama(), lambda m: m.model.layers[1].mlp),
                     (_hf_bert(), lambda m: m.encoder.layer[1].output), (_gpt(), lambda m: m.transformer.h[1].mlp)):
        m.train()
        seen = []

        def boom(_mod, _inp, seen=seen, m=m):
            seen.append(sum(len(a._forward_pre_hooks) + len(a._forward_hooks) for a in m.modules()))
            raise RuntimeError("boom")

        h = later(m).register_forward_pre_hook(boom)
        with pytest.raises(RuntimeError, match="boom"):
            collect(m, torch.randint(0, 32, (2, 8)))
        h.remove()
        assert seen and seen[0] >= 3, type(m).__name__  # the diagnostic hooks were in place during the forward
        assert not any(a._forward_pre_hooks or a._forward_hooks for a in m.modules()), type(m).__name__
        assert m.training
        assert all(not a.record_logits for _, a in models.iter_attention(m))


def test_collect_refuses_unreadable_inputs():
    m = _hf_gpt2()
    x = torch.randint(0, 32, (2, 8))
    with pytest.raises(ValueError, match="padding attention_mask"):
        collect(m, x, attention_mask=torch.ones(2, 1, 8, 8))
    with pytest.raises(ValueError, match="given twice"):
        collect(m, {"input_ids": x, "attention_mask": torch.ones(2, 8)}, attention_mask=torch.ones(2, 8))
    with pytest.raises(ValueError, match="past_key_values"):
        collect(m, x, past_key_values=object())
    with pytest.raises(ValueError, match="batch of type str"):
        collect(m, None, "tokens")
    assert not any(a._forward_pre_hooks for a in m.modules())


@pytest.mark.cuda
def test_hf_monitors_on_cuda_match_cpu():
    """Same monitors on a CUDA device (float32; masks and RNG fork on the input's device) as on the CPU."""
    x = torch.randint(0, 32, (3, 8))
    pad = torch.ones(3, 8, dtype=torch.long)
    pad[0, :3] = 0
    for m in (_hf_gpt2(), _hf_llama(), _hf_bert(mlm=True)):
        cpu = collect(m, {"input_ids": x, "attention_mask": pad, "labels": x})
        gpu = collect(m.cuda(), {"input_ids": x.cuda(), "attention_mask": pad.cuda(), "labels": x.cuda()})
        for k, v in cpu.items():
            if k.startswith("attn.") and not k.endswith("saturation"):
                assert gpu[k] == pytest.approx(v, rel=1e-3, abs=1e-5), (type(m).__name__, k)
        assert gpu["grad_norm.total"] == pytest.approx(cpu["grad_norm.total"], rel=1e-3)


# model -> (the attention's input norm per layer, or None for a post-norm block; (W_Q, W_K) per layer)
QK_SCALE_MODELS = {
    "gpt": (lambda: _gpt(bias=False), lambda m: [b.ln_1 for b in m.transformer.h],
            lambda m: [b.attn.qk_weights() for b in m.transformer.h]),
    "llama-gqa": (lambda: models.build_model("llama", n_layers=2, n_heads=4, n_kv_heads=2, dim=32, vocab_size=32,
                                             max_seq_len=8),
                  lambda m: [b.input_layernorm for b in m.model.layers],
                  lambda m: [b.self_attn.qk_weights() for b in m.model.layers]),
    "hf-gpt2": (lambda: _hf_gpt2(), lambda m: [b.ln_1 for b in m.transformer.h],
                lambda m: [(b.attn.c_attn.weight[:, :16].T, b.attn.c_attn.weight[:, 16:32].T)
                           for b in m.transformer.h]),
    "hf-llama": (lambda: _hf_llama(), lambda m: [b.input_layernorm for b in m.model.layers],
                 lambda m: [(b.self_attn.q_proj.weight, b.self_attn.k_proj.weight) for b in m.model.layers]),
    "hf-bert": (lambda: _hf_bert(), lambda m: [None, None], lambda m: []),
}


@pytest.mark.parametrize("kind", list(QK_SCALE_MODELS))
def test_qk_scale_folds_the_input_norm_gain_into_the_product(kind):
    """attn.<i>.qk_sigma_prod_gain = σ_max(W_Q·diag g)·σ_max(W_K·diag g) against float64 SVD, with g the gain of the
    norm before the attention (a random one, so it matters); a post-norm block (BERT) reports none; collect() carries
    the same numbers."""
    build, norms, qk = QK_SCALE_MODELS[kind]
    m = build()
    torch.manual_seed(1)
    with torch.no_grad():
        for n in norms(m):
            if n is not None:
                n.weight.copy_(torch.rand_like(n.weight) * 3)
    d = qk_scale(m)
    if all(n is None for n in norms(m)):
        assert d == {} and not any("gain" in k for k in collect(m))
        return
    for i, (n, (wq, wk)) in enumerate(zip(norms(m), qk(m), strict=True)):
        g = n.weight.detach().double()
        sq, sk = (float(torch.linalg.svdvals(w.detach().double() * g)[0]) for w in (wq, wk))
        want = sq * sk
        assert d[f"attn.{i}.qk_sigma_prod_gain"] == pytest.approx(want, rel=1e-5), (kind, i)
        assert d[f"attn.{i}.norm_gain_mean"] == pytest.approx(float(g.abs().mean()), rel=1e-6)
    c = collect(m)
    assert {k: c[k] for k in d} == d


def test_qk_scale_sees_the_scale_moved_from_the_weights_into_the_gain():
    """The fused QKV matrix shrunk ×1/30 and the pre-norm's gain grown ×30 (the reparametrisation QK-clip's runs drifted
    into): the model computes the same (bias-free LayerNorm), so the logits are unchanged, σ_max(W_Q)·σ_max(W_K) falls
    ×900 and the gain-folded product stays."""
    m = _gpt(bias=False)
    x = torch.randint(0, 32, (4, 8))
    base = collect(m, None, x, grads=False)
    with torch.no_grad():
        for blk in m.transformer.h:
            blk.attn.c_attn.weight /= 30.0
            blk.ln_1.weight *= 30.0
    moved = collect(m, None, x, grads=False)
    for i in range(2):
        assert moved[f"attn.{i}.logit_max"] == pytest.approx(base[f"attn.{i}.logit_max"], rel=1e-4)
        assert moved[f"attn.{i}.qk_sigma_prod"] == pytest.approx(base[f"attn.{i}.qk_sigma_prod"] / 900, rel=1e-4)
        assert moved[f"attn.{i}.qk_sigma_prod_gain"] == pytest.approx(base[f"attn.{i}.qk_sigma_prod_gain"], rel=1e-4)
        assert moved[f"attn.{i}.norm_gain_mean"] == pytest.approx(30 * base[f"attn.{i}.norm_gain_mean"], rel=1e-5)


def test_qk_scale_never_breaks_collect():
    """A non-finite gain reads NaN (collect still returns every other metric); a huge gain stays finite (the Gram is
    formed after dividing by max |g|); a gain on the meta device is left out; Hugging Face GPT-2's cross-attention
    (keys from the encoder) gets no gain of the self-attention's norm."""
    m = _gpt(bias=False)
    with torch.no_grad():
        m.transformer.h[0].ln_1.weight[0] = float("nan")
        m.transformer.h[1].ln_1.weight.mul_(1e30)
    d = collect(m, torch.randint(0, 32, (2, 8)), grads=False)
    assert math.isnan(d["attn.0.qk_sigma_prod_gain"]) and math.isnan(d["attn.0.norm_gain_mean"])
    assert math.isfinite(d["attn.0.qk_sigma_prod"]) and "attn.1.entropy" in d  # the rest as before
    wq, wk = (w.detach().double() * 1e30 for w in m.transformer.h[1].attn.qk_weights())
    want = float(torch.linalg.svdvals(wq)[0]) * float(torch.linalg.svdvals(wk)[0])
    assert d["attn.1.qk_sigma_prod_gain"] == pytest.approx(want, rel=1e-5)
    m.transformer.h[0].ln_1.weight = torch.nn.Parameter(torch.ones(16, device="meta"))
    assert "attn.0.norm_gain_mean" not in collect(m) and "attn.1.norm_gain_mean" in collect(m)
    g = _hf_gpt2(add_cross_attention=True)
    names = [n for n, _ in attention_modules(g)]
    cross = [i for i, n in enumerate(names) if n.endswith("crossattention")]
    d = qk_scale(g)
    assert cross and all(f"attn.{i}.qk_sigma_prod_gain" not in d for i in cross)
    assert all(f"attn.{i}.qk_sigma_prod_gain" in d for i in range(len(names)) if i not in cross)
