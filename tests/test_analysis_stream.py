"""Streamed continuity analysis: files read one tensor at a time give the in-memory results; sharded indexes;
unused tensors never read; bounded memory on a ~300 MB checkpoint; Ctrl-C keeps the finished roles."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest
import torch

from weightgeom.analysis import analyze_full, load, stack_continuity
from weightgeom.analysis.loaders import TensorRef, open_lazy, permute_qk

# Streamed (one matrix at a time) vs batched/in-memory: the same float32 operations on the same numbers, up to
# BLAS blocking of batched vs single matmuls; measured ≤ 2e-6 with method="svd".
SAME_TOL = 1e-5
# Randomised top vectors: the random start differs between a batched and a single-matrix call; on these
# well-separated synthetic spectra the converged vectors agree to ≤ 1e-5 (measured), 1e-3 leaves margin.
RAND_TOL = 1e-3

HF = {"Q": "self_attn.q_proj", "K": "self_attn.k_proj", "V": "self_attn.v_proj", "O": "self_attn.o_proj",
      "Gate": "mlp.gate_proj", "Up": "mlp.up_proj", "Down": "mlp.down_proj"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _llama(L=4, d=64, f=96, kv=32, vocab=200, seed=0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Llama-named state dict with a drifting shared direction (metrics well above the random level)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"Q": (d, d), "K": (kv, d), "V": (kv, d), "O": (d, d), "Gate": (f, d), "Up": (f, d), "Down": (d, f)}
    sd = {"model.embed_tokens.weight": torch.randn(vocab, d, generator=g), "lm_head.weight": torch.randn(vocab, d,
                                                                                                         generator=g)}
    for role, (m, n) in shapes.items():
        a, b = torch.randn(m, generator=g), torch.randn(n, generator=g)
        for i in range(L):
            a = a + 0.3 * torch.randn(m, generator=g)
            b = b + 0.3 * torch.randn(n, generator=g)
            sd[f"model.layers.{i}.{HF[role]}.weight"] = 0.1 * torch.randn(m, n, generator=g) + torch.outer(a, b) / 8
        for i in range(L):
            sd[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(d)
    return {k: v.to(dtype) for k, v in sd.items()}


def _write_sharded_safetensors(d, sd, shards=3):
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    names = list(sd)
    wmap = {}
    for s in range(shards):
        part = names[s::shards]
        fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k].contiguous() for k in part}, str(d / fn))
        wmap.update(dict.fromkeys(part, fn))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))


def _write_sharded_bin(d, sd, shards=2):
    d.mkdir(parents=True, exist_ok=True)
    names = list(sd)
    wmap = {}
    for s in range(shards):
        part = names[s::shards]
        fn = f"pytorch_model-{s + 1:05d}-of-{shards:05d}.bin"
        torch.save({k: sd[k].clone() for k in part}, d / fn)
        wmap.update(dict.fromkeys(part, fn))
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": wmap}))


def _num(df: pd.DataFrame) -> np.ndarray:
    return df[[c for c in df.columns if df[c].dtype.kind == "f"]].to_numpy()


def _reads(monkeypatch) -> list[str]:
    """Names of the tensors materialised from file references from now on."""
    seen: list[str] = []
    orig = TensorRef.materialize

    def spy(self):
        seen.append(self.name)
        return orig(self)

    monkeypatch.setattr(TensorRef, "materialize", spy)
    return seen


def test_streamed_equals_batched_and_in_memory(tmp_path, monkeypatch):
    sd = _llama(L=5, dtype=torch.bfloat16)
    _write_sharded_safetensors(tmp_path / "st", sd)
    lazy = open_lazy(tmp_path / "st")
    assert all(isinstance(v, TensorRef) for v in lazy.tensors.values()) and set(lazy.tensors) == set(sd)
    assert any("3 shards" in n for n in lazy.notes)
    seen = _reads(monkeypatch)
    mets = ("cv", "cu", "gram", "idx")
    streamed = analyze_full(tmp_path / "st", metrics=mets, method="svd")
    # every role matrix read exactly once; embeddings, LM head and norms never
    assert sorted(seen) == sorted(k for k in sd if k.endswith("proj.weight"))
    in_memory = analyze_full(load(tmp_path / "st"), metrics=mets, method="svd")
    pd.testing.assert_frame_equal(streamed.pairs[["role", "layer", "layer_next"]],
                                  in_memory.pairs[["role", "layer", "layer_next"]])
    np.testing.assert_allclose(_num(streamed.pairs), _num(in_memory.pairs), atol=SAME_TOL)
    np.testing.assert_allclose(_num(streamed.layers), _num(in_memory.layers), atol=SAME_TOL, rtol=1e-6)
    # against the batched stack computation, role by role
    for role, name in HF.items():
        W = torch.stack([sd[f"model.layers.{i}.{name}.weight"].float() for i in range(5)])
        cols, vecs = stack_continuity(W, mets, method="svd")
        got = streamed.pairs[streamed.pairs.role == role]
        for c, v in cols.items():
            np.testing.assert_allclose(got[c].to_numpy(), v, atol=SAME_TOL, err_msg=f"{role} {c}")
        np.testing.assert_allclose(streamed.v1_cos[role], (vecs["v1"] @ vecs["v1"].T).abs().numpy(), atol=SAME_TOL)
    # the default randomised method too
    a = analyze_full(tmp_path / "st")
    b = analyze_full(sd)
    np.testing.assert_allclose(_num(a.pairs), _num(b.pairs), atol=RAND_TOL)


def test_reference_grads_and_nonfinite_streamed(tmp_path):
    sd0 = _llama(L=4, seed=1)
    sd = {k: v + 0.3 * torch.randn_like(v) for k, v in sd0.items()}
    sd["model.layers.2.mlp.up_proj.weight"][0, 0] = float("nan")
    _write_sharded_safetensors(tmp_path / "w", sd)
    _write_sharded_safetensors(tmp_path / "w0", sd0, shards=2)
    a = analyze_full(tmp_path / "w", reference=tmp_path / "w0", metrics=("cv", "gram"), method="svd")
    b = analyze_full(sd, reference=sd0, metrics=("cv", "gram"), method="svd")
    assert list(a.pairs.columns) == list(b.pairs.columns) and "delta_gram_in" in a.pairs.columns
    np.testing.assert_allclose(_num(a.pairs), _num(b.pairs), atol=SAME_TOL)
    up = a.pairs[a.pairs.role == "Up"]
    assert list(zip(up.layer, up.layer_next)) == [(0, 1)]  # layer 2 skipped, layer 3 alone
    assert a.meta["skipped"][0]["tensor"] == "model.layers.2.mlp.up_proj.weight"


@pytest.mark.parametrize("bad", ["missing_tensor", "outside"])
def test_sharded_index_errors(tmp_path, bad):
    sd = _llama(L=2)
    _write_sharded_safetensors(tmp_path, sd, shards=2)
    idx = tmp_path / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    if bad == "missing_tensor":
        doc["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
        want = "model.layers.9.mlp.up_proj.weight is listed in shard model-00001-of-00002.safetensors"
    else:
        doc["weight_map"]["model.layers.0.mlp.up_proj.weight"] = "../x.safetensors"
        want = "lists shard '../x.safetensors', outside"
    idx.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=want):
        open_lazy(tmp_path)


def test_sharded_bin_streamed(tmp_path, monkeypatch):
    sd = _llama(L=3)
    _write_sharded_bin(tmp_path, sd)
    lazy = open_lazy(tmp_path)
    assert lazy.format == "torch" and all(isinstance(v, TensorRef) for v in lazy.tensors.values())
    seen = _reads(monkeypatch)
    a = analyze_full(tmp_path, method="svd")
    assert "lm_head.weight" not in seen and "model.embed_tokens.weight" not in seen
    b = analyze_full(sd, method="svd")
    np.testing.assert_allclose(_num(a.pairs), _num(b.pairs), atol=SAME_TOL)


def test_gguf_streamed_dequantises_only_role_tensors(tmp_path, monkeypatch):
    import gguf
    from gguf.quants import quantize

    sd = _llama(L=3, d=64, f=96, kv=32)
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(3)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    gnames = {"Q": "attn_q", "K": "attn_k", "V": "attn_v", "O": "attn_output", "Gate": "ffn_gate", "Up": "ffn_up",
              "Down": "ffn_down"}
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("token_embd.weight", quantize(sd["model.embed_tokens.weight"].numpy(), q8), raw_dtype=q8)
    for i in range(3):
        for role, g in gnames.items():
            a = sd[f"model.layers.{i}.{HF[role]}.weight"].numpy()
            if role in ("Q", "K"):
                a = permute_qk(a, 4 if role == "Q" else 2)
            w.add_tensor(f"blk.{i}.{g}.weight", quantize(np.ascontiguousarray(a), q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    import weightgeom.analysis.loaders as loaders

    deq: list[str] = []
    orig = loaders._gguf_tensor
    monkeypatch.setattr(loaders, "_gguf_tensor", lambda t, p, q: (deq.append(t.name), orig(t, p, q))[1])
    a = analyze_full(path, method="svd", metrics=("cv", "cu", "gram"))
    assert "token_embd.weight" not in deq and len(deq) == 21
    b = analyze_full(load(path), method="svd", metrics=("cv", "cu", "gram"))  # every tensor dequantised up front
    assert "token_embd.weight" in deq
    np.testing.assert_allclose(_num(a.pairs), _num(b.pairs), atol=SAME_TOL)
    assert any("undid llama.cpp" in n for n in a.meta["notes"])
    # Q8_0 vs the float32 originals: the un-permuted Q/K match the HF rows
    q = loaders.materialize(open_lazy(path).tensors["blk.1.attn_k.weight"])
    torch.testing.assert_close(q, sd["model.layers.1.self_attn.k_proj.weight"], atol=0.02, rtol=0)


def test_gram_uses_the_small_side():
    """A 400000×3 role: an m×m Gram (640 GB in float32) would not fit; the k×k form takes milliseconds."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(400_000, 3, generator=g)
    sd = {f"blocks.{i}.w.weight": base + 0.1 * torch.randn(400_000, 3, generator=g) for i in range(3)}
    res = analyze_full(sd, roles={"X": "blocks.{i}.w.weight"}, metrics=("gram",))
    assert (res.pairs.gram_out > 0.9).all() and (res.pairs.gram_in > 0.9).all()


_MEM_SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    from weightgeom.analysis import analyze_full
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    base = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    res = analyze_full(sys.argv[1], metrics=("cv",), method="randomized")
    print(len(res.pairs), base, status("VmHWM:"))
""")


def test_memory_bound_on_a_300mb_checkpoint(tmp_path):
    """~300 MB bf16 (16 layers of 1024×2048 Up/Down = 128 MB of role matrices, embeddings and LM head 2×80 MB).

    Streamed, the peak RSS above the post-import baseline stays under 110 MB (measured 55–66 MB: a few float32 copies
    of one 8 MB matrix, its Gram, the safetensors reads); the load-everything path (``analyze_full(load(path))``)
    measured 172–185 MB on the same file (every role matrix resident, plus a float32 stack of a whole role).
    """
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(20480, 2048, generator=g).to(torch.bfloat16),
          "lm_head.weight": torch.randn(20480, 2048, generator=g).to(torch.bfloat16)}
    for i in range(16):
        sd[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(2048, 1024, generator=g).to(torch.bfloat16)
        sd[f"model.layers.{i}.mlp.down_proj.weight"] = torch.randn(1024, 2048, generator=g).to(torch.bfloat16)
    save_file(sd, str(tmp_path / "model.safetensors"))
    size = (tmp_path / "model.safetensors").stat().st_size
    del sd
    assert size > 290e6
    try:
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    out = subprocess.run([sys.executable, "-c", _MEM_SCRIPT, str(tmp_path / "model.safetensors")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pairs, base, peak = (int(x) for x in out.stdout.split())
    assert pairs == 30
    assert peak - base < 110e6, f"peak RSS {peak / 1e6:.0f} MB over a baseline of {base / 1e6:.0f} MB"


def test_ctrl_c_keeps_finished_roles(tmp_path, monkeypatch, capsys):
    import weightgeom.analysis.api as api
    from weightgeom.cli import main

    sd = _llama(L=3)
    _write_sharded_safetensors(tmp_path / "m", sd)
    orig = api.materialize

    def interrupt_at_v(t):
        if getattr(t, "name", "").endswith("v_proj.weight"):
            raise KeyboardInterrupt
        return orig(t)

    monkeypatch.setattr(api, "materialize", interrupt_at_v)
    out = tmp_path / "out"
    rc = main(["analyze", str(tmp_path / "m"), "--out", str(out), "--quiet"])
    assert rc == 130
    err = capsys.readouterr().err
    assert "missing: V, O, Gate, Up, Down" in err and "(Q, K:" in err
    doc = json.loads((out / "analysis.json").read_text())
    assert doc["meta"]["roles_missing"] == ["V", "O", "Gate", "Up", "Down"]
    assert set(pd.read_csv(out / "pairs.csv").role) == {"Q", "K"}
    assert not list(out.glob("*.tmp")) and not (out / "continuity.png").exists()


def test_progress_lines_with_eta(tmp_path, capsys):
    _write_sharded_safetensors(tmp_path, _llama(L=2), shards=1)
    analyze_full(tmp_path, metrics=("gram",), progress=True)
    err = capsys.readouterr().err.splitlines()
    lines = [x for x in err if "ETA" in x]
    assert len(lines) == 14 and lines[0].lstrip().startswith("[ 1/14] Q")
    assert "ETA 0 s" in lines[-1]


def test_scale_benchmark_generator_writes_a_readable_sharded_checkpoint(tmp_path):
    """The benchmark's streaming safetensors writer: a sharded checkpoint safetensors reads back, every shard used,
    with the planted cross-layer structure (C_v far above its random level)."""
    from weightgeom.benchmarks.analysis_scale import Shape, generate, sequential_read

    shape = Shape(layers=3, hidden=64, mlp=160, heads=4, kv_heads=2, vocab=300, shards=3)
    d = generate(shape, tmp_path)
    assert generate(shape, tmp_path) == d  # cached: not generated again
    lazy = open_lazy(d)
    assert len(lazy.tensors) == 3 * 9 + 3 and all(isinstance(v, TensorRef) for v in lazy.tensors.values())
    wmap = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(wmap.values())) == 3
    k = lazy.tensors["model.layers.1.self_attn.k_proj.weight"].materialize()
    assert k.dtype == torch.bfloat16 and tuple(k.shape) == (32, 64)
    res = analyze_full(d, metrics=("cv",))
    assert (res.pairs.cv > 5 * res.pairs.cv_rand).all()
    nbytes, secs = sequential_read(d)
    assert nbytes == sum(f.stat().st_size for f in d.glob("*.safetensors")) and secs >= 0


def test_powerlaw_alpha_recovers_a_planted_exponent():
    from weightgeom.analysis.continuity import powerlaw_alpha

    rng = np.random.default_rng(0)
    for a in (2.0, 3.0, 4.5):
        tail = (1 - rng.random(3000)) ** (-1 / (a - 1))  # Pareto, p(λ) ∝ λ^(-a) for λ ≥ 1
        fit = powerlaw_alpha(np.concatenate([tail, 0.9 * rng.random(1000)]))  # plus a bulk below the tail
        assert fit["alpha"] == pytest.approx(a, abs=0.15) and fit["alpha_xmin"] == pytest.approx(1.0, abs=0.15)
    assert np.isnan(powerlaw_alpha(np.ones(5))["alpha"])


def test_spectra_columns_streamed(tmp_path, capsys):
    from weightgeom.cli import main

    sd = _llama(L=3)
    _write_sharded_safetensors(tmp_path / "m", sd)
    res = analyze_full(tmp_path / "m", spectra=True)
    lay = res.layers
    assert {"alpha", "alpha_xmin", "alpha_ks", "alpha_tail", "sigma1", "stable_rank"} <= set(lay.columns)
    assert lay.alpha.notna().all() and (lay.alpha > 1).all()
    W = sd["model.layers.1.mlp.down_proj.weight"].double()
    s = torch.linalg.svdvals(W)
    row = lay[(lay.role == "Down") & (lay.layer == 1)].iloc[0]
    assert row.sigma1 == pytest.approx(float(s[0]), rel=1e-4)
    assert row.stable_rank == pytest.approx(float((s**2).sum() / s[0] ** 2), rel=1e-3)
    assert main(["analyze", str(tmp_path / "m"), "--spectra", "--quiet", "--no-plots", "--out",
                 str(tmp_path / "o")]) == 0
    assert "alpha" in pd.read_csv(tmp_path / "o" / "layers.csv").columns


def test_suggest_finds_a_planted_shared_basis(tmp_path, capsys):
    """Q layers 0-3 share one rank-8 input basis (different left factors), layers 4-6 are independent; Down layers
    2-5 share an output basis. --suggest names exactly those runs, in the right spaces."""
    from weightgeom.analysis.report import shared_basis_runs
    from weightgeom.cli import main

    g = torch.Generator().manual_seed(0)
    d, f, L = 64, 96, 7
    Bq = torch.linalg.qr(torch.randn(d, 8, generator=g))[0]
    Bd = torch.linalg.qr(torch.randn(d, 8, generator=g))[0]
    sd = {}
    for i in range(L):
        noise = 0.02 * torch.randn(d, d, generator=g)
        sd[f"model.layers.{i}.self_attn.q_proj.weight"] = (
            torch.randn(d, 8, generator=g) @ Bq.T + noise if i <= 3 else torch.randn(d, d, generator=g))
        nd = 0.02 * torch.randn(d, f, generator=g)
        sd[f"model.layers.{i}.mlp.down_proj.weight"] = (
            Bd @ torch.randn(8, f, generator=g) + nd if 2 <= i <= 5 else torch.randn(d, f, generator=g))
    _write_sharded_safetensors(tmp_path / "m", sd, shards=2)
    res = analyze_full(tmp_path / "m", suggest=True, metrics=("gram",))
    q = res.pairs[res.pairs.role == "Q"]
    assert (q.share_k8.iloc[:3] > 0.95).all() and (q.share_k8.iloc[3:] < 0.4).all()
    assert q.share_k8_rand.iloc[0] == pytest.approx(8 / d)
    runs = shared_basis_runs(res.pairs)
    got = {(r.role, r.space, r.first_layer, r.last_layer) for r in runs.itertuples()}
    assert got == {("Q", "input", 0, 3), ("Down", "output", 2, 5)}
    out = tmp_path / "o"
    assert main(["analyze", str(tmp_path / "m"), "--suggest", "--quiet", "--out", str(out), "--metrics", "gram"]) == 0
    text = capsys.readouterr().out
    assert "Q     input  layers 0-3 (3 pairs)" in text and "Down  output layers 2-5 (3 pairs)" in text
    assert (out / "suggest.csv").is_file() and (out / "suggest.png").is_file()


def test_sketched_gram_streamed_equals_in_memory_and_exact(tmp_path):
    """gram="sketch": streamed = in-memory (same operations), and within the named tolerance of the exact path; the
    default "auto" leaves a small model exact; spectra still come from the exact eigenvalues."""
    from weightgeom.analysis.continuity import SKETCH_TOL_SMALL

    sd = _llama(L=4, dtype=torch.bfloat16)
    _write_sharded_safetensors(tmp_path / "st", sd)
    streamed = analyze_full(tmp_path / "st", gram="sketch", spectra=True)
    in_memory = analyze_full(sd, gram="sketch", spectra=True)
    np.testing.assert_allclose(_num(streamed.pairs), _num(in_memory.pairs), atol=SAME_TOL)
    exact = analyze_full(sd, gram="exact", spectra=True)
    for c in ("gram_in", "gram_out", "gram_in_rand", "gram_out_rand"):
        np.testing.assert_allclose(streamed.pairs[c], exact.pairs[c], atol=SKETCH_TOL_SMALL, err_msg=c)
    # top vectors from the sketch's randomised top-r subspace: as accurate as the Gram-based ones here
    for c in ("cv", "cu"):
        np.testing.assert_allclose(streamed.pairs[c], exact.pairs[c], atol=RAND_TOL, err_msg=c)
    np.testing.assert_allclose(streamed.layers.alpha, exact.layers.alpha, rtol=1e-5)
    assert streamed.meta["gram_sketched_roles"] == list(HF) and exact.meta["gram_sketched_roles"] == []
    assert any("Gram alignment sketched" in n for n in streamed.meta["notes"])
    auto = analyze_full(sd)
    assert auto.meta["gram_sketched_roles"] == []
    np.testing.assert_allclose(_num(auto.pairs), _num(analyze_full(sd, gram="exact").pairs), atol=0)
    with pytest.raises(ValueError, match="unknown gram mode 'fast'"):
        analyze_full(sd, gram="fast")


def test_auto_sketches_only_matrices_with_long_sides(monkeypatch, capsys):
    """gram="auto" sketches where min(m, n) ≥ SKETCH_MIN_DIM and forms no k×k Gram there; the CLI flag reaches it."""
    from weightgeom.analysis import api
    from weightgeom.cli import main

    monkeypatch.setattr(api, "SKETCH_MIN_DIM", 64)
    sd = _llama(L=3)  # Q, O 64×64; Gate, Up 96×64; Down 64×96; K, V 32×64
    res = analyze_full(sd)
    assert res.meta["gram_sketched_roles"] == ["Q", "O", "Gate", "Up", "Down"]
    st = api._PairStream(("cv", "cu", "gram"), "randomized", None, gram="auto")
    st.push(sd["model.layers.0.mlp.up_proj.weight"])
    assert "G" not in st.prev and "sk" in st.prev
    st.reset()
    st.push(sd["model.layers.0.self_attn.k_proj.weight"])  # a 32×64 matrix: exact, with its 32×32 Gram
    assert st.prev["G"].shape == (32, 32)
    assert main(["analyze", "--gram", "exact", "--quiet", "--no-plots", "--out", "/nonexistent/x", "/nonexistent"]) == 2
    with pytest.raises(SystemExit) as e:
        main(["analyze", "--gram", "fast", "x"])
    assert e.value.code == 2 and "--gram" in capsys.readouterr().err
