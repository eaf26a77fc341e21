"""Training-time monitors: pure functions against brute force, collect() on our GPT / Llama with and without an
optimizer, side-effect freedom (flags, mode, RNG, .grad), and the §C mechanism direction (bigger σ(W_Q)σ(W_K) →
bigger logits, lower entropy, more saturation)."""

import math

import pytest
import torch

from weightgeom.diagnostics import collect, grad_norms, logit_stats, matrix_stats, optimizer_stats, qk_sigma_prod

models = pytest.importorskip("weightgeom.models")

# float64 Gram + eigvalsh vs float64 svdvals on 40×24 matrices: agreement ~1e-12 (measured); 1e-8 is loose but
# still far below anything a diagnostic plot could show.
SIGMA_TOL = 1e-8
# logits recomputed in a separate forward: same kernels, identical up to float32 rounding (measured 0 difference).
LOGIT_TOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one torch thread is ~10x faster than two on the shared, oversubscribed 2-core CI machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
    optim = pytest.importorskip("weightgeom.optim")
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


def test_optimizer_stats_index_keys():
    p = torch.nn.Parameter(torch.randn(4, 4))

    class Fake:
        param_groups = [{"params": [p], "names": ["blk.w"], "algorithm": "muon", "manifold": "stiefel"}]
        last_stats = {0: {"tangent_residual": 1e-5, "dual_iters": 3}}

    d = optimizer_stats(Fake())
    assert d["muon.blk.w.dual_iters"] == 3 and d["muon.tangent_residual_max"] == 1e-5
