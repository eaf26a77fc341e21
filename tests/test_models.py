"""Models: shapes, losses, initialisation, weight tying, attention logits, activations, presets."""

import math

import pytest
import torch
import torch.nn.functional as F

from weightgeom.models import (
    GPT,
    PRESETS,
    GPTConfig,
    Llama,
    ResMLP,
    build_model,
    get_activation,
    iter_attention,
    radial,
    set_record_logits,
)

TINY_GPT = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50)
TINY_LLAMA = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=50, max_seq_len=16)


def _tokens(B=2, T=16, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


@pytest.mark.parametrize(
    "kind,cfg",
    [
        ("gpt", TINY_GPT),
        ("gpt", {**TINY_GPT, "separate_qkv": True, "bias": True, "tie_weights": False}),
        ("llama", TINY_LLAMA),
        ("llama", {**TINY_LLAMA, "activation": "radial", "mlp_gated": False, "tie_weights": True}),
    ],
)
def test_lm_shapes_and_loss(kind, cfg):
    m = build_model(kind, **cfg)
    idx, tgt = _tokens()
    logits, loss = m(idx)
    assert logits.shape == (2, 16, 50) and loss is None
    logits, loss = m(idx, tgt)
    # small init → near-uniform predictions: loss ≈ ln(vocab)
    assert abs(loss.item() - math.log(50)) < 0.3
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())
    with pytest.raises(ValueError, match="17"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_resmlp_shapes_loss_and_names():
    m = build_model("resmlp", depth=3, width=16)
    x, y = torch.randn(5, 1, 28, 28), torch.randint(0, 10, (5,))
    logits, loss = m(x, y)
    assert logits.shape == (5, 10) and loss.ndim == 0
    names = [n for n, _ in m.named_parameters()]
    assert names == ["inp.weight", "blocks.0.fc.weight", "blocks.1.fc.weight", "blocks.2.fc.weight", "head.weight"]
    with pytest.raises(ValueError, match="783"):
        m(torch.randn(2, 783))


def test_gpt_init_statistics_and_tying():
    cfg = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=32, vocab_size=500)
    m = GPT(cfg)
    p = dict(m.named_parameters())
    assert "lm_head.weight" not in p and m.lm_head.weight is m.transformer.wte.weight
    assert m.num_params() == sum(t.numel() for t in p.values())
    proj = torch.cat([p[f"transformer.h.{i}.mlp.c_proj.weight"].flatten() for i in range(4)])
    fc = torch.cat([p[f"transformer.h.{i}.mlp.c_fc.weight"].flatten() for i in range(4)])
    assert abs(proj.std().item() - 0.02 / math.sqrt(8)) < 5e-4
    assert abs(fc.std().item() - 0.02) < 5e-4
    assert abs(p["transformer.wte.weight"].std().item() - 0.02) < 1e-3
    assert torch.all(p["transformer.h.0.ln_1.weight"] == 1)
    untied = GPT(GPTConfig(**{**cfg.to_dict(), "tie_weights": False}))
    assert untied.num_params() == m.num_params() + 500 * 128


def test_gpt2_preset_sizes():
    # nanoGPT's "number of parameters" (non-embedding, bias=False, vocab 50304) for GPT-2 small: 123.59M
    assert PRESETS["gpt2"] == ("gpt", dict(n_layer=12, n_head=12, n_embd=768))
    with torch.device("meta"):
        m = build_model("gpt2")
    assert m.num_params(non_embedding=True) == 123_587_328
    with torch.device("meta"):
        m = build_model("llama-34m")
    assert 33e6 < m.num_params() < 35e6 and m.config.n_layers == 8


def test_separate_vs_fused_qkv_same_param_count():
    fused = build_model("gpt", **TINY_GPT)
    sep = build_model("gpt", **TINY_GPT, separate_qkv=True)
    assert fused.num_params() == sep.num_params()
    names = {n for n, _ in sep.named_parameters()}
    assert {"transformer.h.0.attn.q_proj.weight", "transformer.h.0.attn.k_proj.weight"} <= names
    # qk_weights are views of the fused c_attn rows [Q; K; V]
    a = fused.transformer.h[0].attn
    wq, wk = a.qk_weights()
    assert wq.shape == (32, 32) and torch.equal(wk, a.c_attn.weight[32:64])


def _gpt_layer0_logits(m, idx):
    T = idx.size(1)
    x = m.transformer.wte(idx) + m.transformer.wpe(torch.arange(T))
    a = m.transformer.h[0].attn
    xn = m.transformer.h[0].ln_1(x)
    wq, wk = a.qk_weights()
    q = (xn @ wq.T).view(idx.size(0), T, a.n_head, a.head_dim).transpose(1, 2)
    k = (xn @ wk.T).view(idx.size(0), T, a.n_head, a.head_dim).transpose(1, 2)
    z = q @ k.transpose(-2, -1) / math.sqrt(a.head_dim)
    return z.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))


@pytest.mark.parametrize("separate", [False, True])
def test_record_logits_matches_recomputed(separate):
    m = build_model("gpt", **TINY_GPT, separate_qkv=separate).eval()
    idx, _ = _tokens(T=8)
    assert set_record_logits(m, True) == 2
    with torch.no_grad():
        m(idx)
        ref = _gpt_layer0_logits(m, idx)
    got = m.transformer.h[0].attn.last_logits
    assert got.shape == (2, 2, 8, 8) and not got.requires_grad
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert torch.allclose(got[fin], ref[fin], atol=1e-5)
    set_record_logits(m, False)
    assert m.transformer.h[0].attn.last_logits is None


def test_llama_record_logits_uses_rope():
    m = build_model("llama", **TINY_LLAMA).eval()
    idx, _ = _tokens(T=8)
    set_record_logits(m, True)
    with torch.no_grad():
        m(idx)
        layer = m.model.layers[0]
        a = layer.self_attn
        xn = layer.input_layernorm(m.model.embed_tokens(idx))
        wq, wk = a.qk_weights()
        q = (xn @ wq.T).view(2, 8, a.n_head, a.head_dim).transpose(1, 2)
        k = (xn @ wk.T).view(2, 8, a.n_kv_head, a.head_dim).transpose(1, 2)
        q, k = a.rotary(q, k)
        k = k.repeat_interleave(a.n_head // a.n_kv_head, dim=1)
        ref = q @ k.transpose(-2, -1) / math.sqrt(a.head_dim)
    got = a.last_logits
    tri = torch.ones(8, 8, dtype=torch.bool).tril()
    assert torch.allclose(got[..., tri], ref[..., tri], atol=1e-5)
    assert torch.isinf(got[..., ~tri]).all()


@pytest.mark.parametrize("kind,cfg", [("gpt", TINY_GPT), ("llama", TINY_LLAMA)])
def test_sdpa_equals_explicit(kind, cfg):
    m = build_model(kind, **cfg).eval()
    idx, tgt = _tokens()
    with torch.no_grad():
        l1, loss1 = m(idx, tgt)
        set_record_logits(m, True)
        l2, loss2 = m(idx, tgt)
    assert torch.allclose(l1, l2, atol=1e-5)
    assert abs(loss1.item() - loss2.item()) < 1e-5
    assert len(list(iter_attention(m))) == 2


def test_rope_relative_position():
    # RoPE: q·k depends only on the offset between positions
    m = build_model("llama", **TINY_LLAMA)
    rot = m.model.layers[0].self_attn.rotary
    g = torch.Generator().manual_seed(1)
    qv, kv = torch.randn(8, generator=g), torch.randn(8, generator=g)
    q = qv.expand(1, 1, 16, 8).contiguous()
    k = kv.expand(1, 1, 16, 8).contiguous()
    qr, kr = rot(q, k)
    d1 = (qr[0, 0, 5] * kr[0, 0, 2]).sum()
    d2 = (qr[0, 0, 13] * kr[0, 0, 10]).sum()
    assert torch.allclose(d1, d2, atol=1e-5)
    assert torch.allclose(qr[0, 0, 0], qv)


def test_radial_activation():
    x = torch.randn(4, 7, dtype=torch.float64)
    y = radial(x)
    ref = x * torch.tanh(x.norm(dim=-1, keepdim=True))
    assert torch.allclose(y, ref)
    # rotation-equivariant: radial(x Rᵀ) = radial(x) Rᵀ; ReLU is not
    R, _ = torch.linalg.qr(torch.randn(7, 7, dtype=torch.float64))
    assert torch.allclose(radial(x @ R.T), y @ R.T)
    assert not torch.allclose(F.relu(x @ R.T), F.relu(x) @ R.T)
    assert get_activation("none")(x) is x
    with pytest.raises(ValueError, match="swish"):
        get_activation("swish")


@pytest.mark.parametrize("activation", ["relu", "gelu", "none", "radial"])
def test_resmlp_residual_on_off(activation):
    act = get_activation(activation)
    for residual in (True, False):
        m = ResMLP(dict(depth=2, width=8, in_dim=6, out_dim=3, residual=residual, activation=activation))
        x = torch.randn(4, 6)
        h = m.inp(x)
        for b in m.blocks:
            y = act(h @ b.fc.weight.T)
            h = h + y if residual else y
        assert torch.allclose(m(x)[0], m.head(h), atol=1e-6)


def test_resmlp_init_scale():
    torch.manual_seed(3)
    a = ResMLP(dict(depth=2, width=8))
    torch.manual_seed(3)
    b = ResMLP(dict(depth=2, width=8, init_scale=0.5))
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.allclose(pa * 0.5, pb)
    # default init: nn.Linear's U(±1/√fan_in)
    assert a.blocks[0].fc.weight.abs().max() <= 1 / math.sqrt(8)


def test_build_model_errors_name_the_value():
    with pytest.raises(ValueError, match="n_layers"):
        build_model("gpt", n_layers=2)
    with pytest.raises(ValueError, match="transformer"):
        build_model("transformer")
    with pytest.raises(ValueError, match="gpt2"):
        build_model("llama", preset="gpt2")
    with pytest.raises(ValueError, match="n_head=3"):
        build_model("gpt", n_embd=32, n_head=3)
    m = build_model("gpt-nano", vocab_size=65)
    assert isinstance(m, GPT) and m.config.n_embd == 48 and m.config.vocab_size == 65
    assert isinstance(build_model("llama", preset="llama-nano"), Llama)


def test_generate_is_deterministic():
    m = build_model("gpt", **TINY_GPT).eval()
    idx = torch.zeros(1, 1, dtype=torch.long)
    a = m.generate(idx, 20, generator=torch.Generator().manual_seed(0))
    b = m.generate(idx, 20, generator=torch.Generator().manual_seed(0), top_k=50)
    assert a.shape == (1, 21) and torch.equal(a, b)


@pytest.mark.slow
def test_llama_matches_hf_llama():
    import transformers
    m = build_model("llama", **TINY_LLAMA, rope_theta=10000.0).eval()
    hf_cfg = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(m.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    idx, _ = _tokens()
    with torch.no_grad():
        assert torch.allclose(hf(idx).logits, m(idx)[0], atol=1e-4)


@pytest.mark.slow
def test_gpt_matches_hf_gpt2():
    import transformers
    m = build_model("gpt", **TINY_GPT, bias=True, activation="gelu").eval()
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=50,
            n_positions=16,
            n_embd=32,
            n_layer=2,
            n_head=2,
            activation_function="gelu",
            resid_pdrop=0,
            embd_pdrop=0,
            attn_pdrop=0,
        )
    ).eval()
    sd = {}
    for k, v in m.state_dict().items():
        is_conv = any(k.endswith(s) for s in ("c_attn.weight", "c_proj.weight", "c_fc.weight"))
        sd[k] = v.T if is_conv else v  # HF Conv1D stores (in, out)
    hf.load_state_dict(sd, strict=False)
    idx, _ = _tokens()
    with torch.no_grad():
        assert torch.allclose(hf(idx).logits, m(idx)[0], atol=1e-4)
