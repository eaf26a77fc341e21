"""Hostile inputs: data (rows of tests/test_hostile.py).

Token dataset folders (``train.bin`` / ``val.bin`` + ``meta.json`` or nanoGPT's ``meta.pkl``) and text inputs, through
``weightgeom data info``, ``weightgeom data prepare`` and ``weightgeom train --set data.kind=bin|text``: a meta.pkl
never runs code, the dtype and vocabulary that ``meta.json`` records are honoured and checked against the ids, and
every broken folder, bad ``data.val_fraction``, non-UTF-8 text or unwritable output ends with one line and exit 2,
before anything is written. Training rows use a one-layer GPT for 2 steps (about a second on a CPU); refusals happen
before the model is built.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import resource
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hostile_cases import Hostile, assert_one_line_error, cli, evil_pickle_bytes, marker_path

TINY_TRAIN = ("train.max_steps=2", "train.eval_iters=1", "train.eval_every=0", "model.n_layer=1", "model.n_head=2",
              "model.n_embd=16", "data.block_size=16", "data.batch_size=4")


def _train(run: Path, *overrides: str):
    """``weightgeom train tiny-shakespeare`` shrunk to a 2-step one-layer run, with ``overrides`` applied last."""
    sets = [a for o in (*TINY_TRAIN, *overrides) for a in ("--set", o)]
    return cli("train", "tiny-shakespeare", "--out", str(run), "--no-progress", *sets)


def _train_bin(tmp: Path, folder: Path, *overrides: str):
    return _train(tmp / "run", "data.kind=bin", f"data.path={folder}", *overrides)


def _bins(folder: Path, train: np.ndarray, val: np.ndarray, meta: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    train.tofile(folder / "train.bin")
    val.tofile(folder / "val.bin")
    if meta is not None:
        (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def _ids(n: int, vocab: int, dtype: str, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(dtype)


def _within(seconds: float, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run in a daemon thread that must finish within ``seconds`` (a hang fails instead of blocking)."""
    box: dict[str, Any] = {}

    def work() -> None:
        box["value"] = fn(*args)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)}{args} still running after {seconds} s (a hang)"
    return box["value"]


#: Seconds a refused meta.pkl may take (the refusal itself takes milliseconds; a hang never ends).
HANG_LIMIT_S = 30


def _assert_not_trained(tmp: Path) -> None:
    """A refused run writes nothing: no run directory at all."""
    assert not (tmp / "run").exists(), sorted(p.name for p in (tmp / "run").iterdir())


# ---------------------------------------------------------------------------------------------------------- meta.pkl
def _evil_meta_pkl(tmp: Path) -> None:
    folder = _bins(tmp / "ds", _ids(2000, 65, "uint16"), _ids(400, 65, "uint16"))
    (folder / "meta.pkl").write_bytes(evil_pickle_bytes(marker_path(tmp)))
    assert_one_line_error(cli("data", "info", str(folder)), "meta.pkl", "refused", "builtins.exec")
    assert not marker_path(tmp).exists()
    assert_one_line_error(_train_bin(tmp, folder), "meta.pkl", "refused")
    assert not marker_path(tmp).exists()
    _assert_not_trained(tmp)


def _nanogpt_meta_pkl_still_works(tmp: Path) -> None:
    import pickle

    chars = sorted(set("hello world, this is a tiny char corpus\n"))
    folder = _bins(tmp / "ds", _ids(2000, len(chars), "uint16"), _ids(400, len(chars), "uint16"))
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}
    (folder / "meta.pkl").write_bytes(pickle.dumps(meta))
    res = cli("data", "info", str(folder), "--sample", "20")
    assert res.rc == 0, res.err
    assert f"vocab_size: {len(chars)} (from meta.pkl" in res.out and "sample:" in res.out
    res = _train_bin(tmp, folder)
    assert res.rc == 0, res.err
    assert f"vocab_size = {len(chars)}" in (tmp / "run" / "config.resolved.toml").read_text()


def _refused_quickly(tmp: Path, value: object, *expect: str) -> None:
    """A meta.pkl holding ``value`` is refused, naming it, by ``data info`` and training within HANG_LIMIT_S."""
    folder = _bins(tmp / "ds", _ids(2000, 65, "uint16"), _ids(400, 65, "uint16"))
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65, "x": value}, protocol=4))
    assert len((folder / "meta.pkl").read_bytes()) < 2000  # tiny on disk: the pickle memo shares the lists
    assert_one_line_error(_within(HANG_LIMIT_S, cli, "data", "info", str(folder)), "meta.pkl", "refused", *expect)
    assert_one_line_error(_within(HANG_LIMIT_S, _train_bin, tmp, folder), "meta.pkl", "refused", *expect)
    _assert_not_trained(tmp)


def _self_referencing_meta_pkl(tmp: Path) -> None:
    loop: list = []
    loop.append(loop)
    _refused_quickly(tmp, loop, "reached twice")


def _billion_laughs_meta_pkl(tmp: Path) -> None:
    laughs: list = []
    for _ in range(60):  # each level holds the previous one twice: 2**60 items if unfolded
        laughs = [laughs, laughs]
    _refused_quickly(tmp, laughs)


# ------------------------------------------------------------------------------------------------ vocabulary / dtype
def _uint16_vocab_70000(tmp: Path) -> None:
    folder = _bins(tmp / "ds", _ids(3000, 65536, "uint16"), _ids(500, 65536, "uint16"),
                   {"dtype": "uint16", "vocab_size": 70000})
    for res in (cli("data", "info", str(folder)), _train_bin(tmp, folder)):
        assert_one_line_error(res, "meta.json", "vocab_size 70000", "uint16")
    _assert_not_trained(tmp)



def _uint32_vocab_from_meta_json(tmp: Path) -> None:
    vocab = 70000
    train, val = _ids(3000, vocab, "uint32"), _ids(500, vocab, "uint32", seed=1)
    train[7] = vocab - 1
    folder = _bins(tmp / "ds", train, val, {"dtype": "uint32", "vocab_size": vocab})
    res = _train_bin(tmp, folder)
    assert res.rc == 0, res.err
    assert json.loads(res.out.strip().splitlines()[-1])["step"] == 2
    assert f"vocab_size = {vocab}" in (tmp / "run" / "config.resolved.toml").read_text()
    assert json.loads((tmp / "run" / "meta.json").read_text())["data"]["dtype"] == "uint32"


def _token_id_not_below_vocab(tmp: Path) -> None:
    train = _ids(3000, 1000, "uint16")
    train[1234] = 1500
    folder = _bins(tmp / "ds", train, _ids(500, 1000, "uint16"), {"dtype": "uint16", "vocab_size": 1000})
    line = assert_one_line_error(_train_bin(tmp, folder), "train.bin", "token id 1500", "position 1234",
                                 "vocabulary size 1000", "meta.json")
    assert "Traceback" not in line
    _assert_not_trained(tmp)
    assert_one_line_error(cli("data", "info", str(folder)), "train.bin", "token id 1500", "vocabulary size 1000")


def _bare_nanogpt_ids_above_gpt2(tmp: Path) -> None:
    val = _ids(500, 50257, "uint16")
    val[10] = 60000
    folder = _bins(tmp / "ds", _ids(3000, 50257, "uint16"), val)
    assert_one_line_error(_train_bin(tmp, folder), "val.bin", "token id 60000", "vocabulary size 50257", "meta.json")
    _assert_not_trained(tmp)


def _model_vocab_too_small(tmp: Path) -> None:
    folder = _bins(tmp / "ds", _ids(3000, 500, "uint16"), _ids(500, 500, "uint16"), {"vocab_size": 500})
    assert_one_line_error(_train_bin(tmp, folder, "model.vocab_size=100"), "model.vocab_size=100", "500")
    _assert_not_trained(tmp)


# ---------------------------------------------------------------------------------------------------- broken folders
def _broken_folders(tmp: Path) -> None:
    good = _ids(3000, 100, "uint16")
    cases = {
        "empty": (lambda f: (f / "train.bin").write_bytes(b""), ("train.bin", "empty")),
        "odd": (lambda f: (f / "train.bin").write_bytes(good.tobytes() + b"\x01"), ("train.bin", "not a multiple")),
        "noval": (lambda f: (f / "val.bin").unlink(), ("val.bin", "not found")),
        "badjson": (lambda f: (f / "meta.json").write_text("{vocab_size: 100"), ("meta.json", "not valid JSON")),
        "baddtype": (lambda f: (f / "meta.json").write_text('{"dtype": "int8"}'), ("meta.json", "'int8'")),
        "badvocab": (lambda f: (f / "meta.json").write_text('{"vocab_size": -3}'), ("meta.json", "vocab_size -3")),
        "truncated": (lambda f: (f / "meta.json").write_text('{"vocab_size": 100, "train_tokens": 5000}'),
                      ("train.bin", "3000 tokens", "train_tokens=5000")),
    }
    for name, (spoil, expect) in cases.items():
        folder = _bins(tmp / name, good, good[:500], {"vocab_size": 100})
        spoil(folder)
        assert_one_line_error(_train_bin(tmp, folder), *expect)
        _assert_not_trained(tmp)
        assert_one_line_error(cli("data", "info", str(folder)), *expect)


def _special_files_in_dataset(tmp: Path) -> None:
    good = _ids(3000, 100, "uint16")

    def fifo(name: str) -> Callable[[Path], None]:
        def spoil(f: Path) -> None:
            (f / name).unlink(missing_ok=True)
            os.mkfifo(f / name)
        return spoil

    def to_dev_zero(f: Path) -> None:
        (f / "meta.json").unlink()
        (f / "meta.json").symlink_to("/dev/zero")

    def sparse_meta(f: Path) -> None:
        with open(f / "meta.json", "r+b") as fh:
            fh.truncate(3 << 30)

    cases = {
        "fifo-meta-json": (fifo("meta.json"), ("meta.json", "FIFO")),
        "fifo-train-bin": (fifo("train.bin"), ("train.bin", "FIFO")),
        "fifo-meta-pkl": (lambda f: ((f / "meta.json").unlink(), fifo("meta.pkl")(f)), ("meta.pkl", "FIFO")),
        "dir-val-bin": (lambda f: ((f / "val.bin").unlink(), (f / "val.bin").mkdir()), ("val.bin", "directory")),
        "dev-zero-meta": (to_dev_zero, ("meta.json", "character device")),
        "sparse-meta": (sparse_meta, ("meta.json", "3221225472 bytes")),
    }
    for name, (spoil, expect) in cases.items():
        folder = _bins(tmp / name, good, good[:500], {"vocab_size": 100})
        spoil(folder)
        assert_one_line_error(_within(HANG_LIMIT_S, _train_bin, tmp, folder), *expect)
        _assert_not_trained(tmp)
        assert_one_line_error(_within(HANG_LIMIT_S, cli, "data", "info", str(folder)), *expect)
    os.mkfifo(tmp / "corpus.txt")
    res = _within(HANG_LIMIT_S, cli, "data", "prepare", str(tmp / "corpus.txt"), "--out", str(tmp / "out"), "--quiet")
    assert_one_line_error(res, "corpus.txt", "FIFO")
    assert not (tmp / "out").exists()


def _split_shorter_than_block(tmp: Path) -> None:
    folder = _bins(tmp / "ds", _ids(3000, 100, "uint16"), _ids(10, 100, "uint16"), {"vocab_size": 100})
    assert_one_line_error(_train_bin(tmp, folder), "val.bin", "10 tokens", "data.block_size+2=18")
    _assert_not_trained(tmp)


# ---------------------------------------------------------------------------------------------------- val_fraction
def _bad_val_fraction(tmp: Path) -> None:
    for value in ("1.5", "0", "-0.2", "1", "nan", "inf"):
        res = _train(tmp / "run", f"data.val_fraction={value}")
        line = assert_one_line_error(res, "data.val_fraction")
        assert "between 0 and 1" in line, line
        _assert_not_trained(tmp)
    assert_one_line_error(_train(tmp / "run", "data.val_fraction=abc"), "data.val_fraction", "abc")


# -------------------------------------------------------------------------------------------------- text / prepare
def _not_utf8_text(tmp: Path) -> None:
    src = tmp / "latin1.txt"
    src.write_bytes("Le café crème est très bon.\n".encode("latin-1") * 50)
    assert_one_line_error(cli("data", "prepare", str(src), "--out", str(tmp / "out"), "--quiet"),
                          "latin1.txt", "not UTF-8", "0xe9")
    assert not (tmp / "out").exists()
    assert_one_line_error(_train(tmp / "run", "data.kind=text", f"data.path={src}"),
                          "data.path", "latin1.txt", "not UTF-8", "0xe9")
    _assert_not_trained(tmp)
    res = cli("data", "prepare", str(src), "--out", str(tmp / "out"), "--quiet", "--tokenizer", "char",
              "--encoding-errors", "replace")
    assert res.rc == 0, res.err


def _failed_force_keeps_dataset(tmp: Path) -> None:
    good, bad = tmp / "a.txt", tmp / "b.txt"
    good.write_text("a perfectly fine document\n" * 100, encoding="utf-8")
    bad.write_bytes(b"\xff\xfe not utf-8 at all")
    out = tmp / "out"
    assert cli("data", "prepare", str(good), "--out", str(out), "--quiet", "--tokenizer", "char").rc == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    res = cli("data", "prepare", str(good), str(bad), "--out", str(out), "--quiet", "--force", "--tokenizer", "char")
    assert_one_line_error(res, "b.txt", "not UTF-8")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def _unwritable_output(tmp: Path) -> None:
    import errno
    import importlib
    import types
    from unittest import mock

    src = tmp / "a.txt"
    src.write_text("some text\n" * 100, encoding="utf-8")
    blocker = tmp / "file"
    blocker.write_text("a file, not a folder")
    for out, msg in ((blocker / "sub", "cannot create the output folder"), (blocker, "is a file, not a folder")):
        assert_one_line_error(cli("data", "prepare", str(src), "--out", str(out), "--quiet", "--tokenizer", "char"),
                              str(out), msg)
    assert blocker.read_text() == "a file, not a folder"
    # a disk that fills up at the last file (meta.json) of a --force rewrite: the old dataset stays whole
    out = tmp / "out"
    assert cli("data", "prepare", str(src), "--out", str(out), "--quiet", "--tokenizer", "char").rc == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "meta.json"))

    prep = importlib.import_module("weightgeom.data.prepare")
    with mock.patch.object(prep, "json", types.SimpleNamespace(dumps=full)):
        res = cli("data", "prepare", str(src), "--out", str(out), "--quiet", "--force", "--tokenizer", "gpt2")
    assert_one_line_error(res, "meta.json", "No space left on device")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def _broken_gzip_input(tmp: Path) -> None:
    (tmp / "a.jsonl.gz").write_bytes(b"this is not gzip data")
    assert_one_line_error(cli("data", "prepare", str(tmp / "a.jsonl.gz"), "--out", str(tmp / "out"), "--quiet"),
                          "a.jsonl.gz", "gzip")
    assert not (tmp / "out").exists()


ADDRESS_SPACE_CAP = 3 << 30
"""``ulimit -v`` of :func:`_bounded_reads_under_ulimit`'s process (bytes): what Python and numpy need, far less than
the 8 GiB bound a text file is read under."""


def _bounded_reads_under_ulimit(tmp: Path) -> None:
    # clusters and containers set ulimit -v: a bounded read must reserve what the file holds, not its 8 GiB bound
    text = "To be, or not to be, that is the question.\n" * 2000
    (tmp / "a.txt").write_text(text)
    (tmp / "b.txt.gz").write_bytes(gzip.compress(text.encode()))

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_CAP, ADDRESS_SPACE_CAP))

    res = subprocess.run([sys.executable, "-m", "weightgeom", "data", "prepare", "a.txt", "b.txt.gz", "--out", "d",
                          "--tokenizer", "char", "--quiet"], cwd=tmp, preexec_fn=cap, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert json.loads((tmp / "d" / "meta.json").read_text())["vocab_size"] > 0


CASES: list[Hostile] = [
    Hostile("evil-meta-pkl", "data",
            "a dataset folder whose nanoGPT meta.pkl would run code is refused by `weightgeom data info` and by "
            "training, naming the file; no code runs and no run directory is written", _evil_meta_pkl),
    Hostile("plain-meta-pkl", "data",
            "a real nanoGPT meta.pkl (vocab_size, itos, stoi) is still read, as plain data, for the vocabulary and a "
            "char tokenizer", _nanogpt_meta_pkl_still_works),
    Hostile("self-referencing-meta-pkl", "data",
            "a meta.pkl holding a list that contains itself is refused at once by `data info` and by training, "
            "naming the file; no run directory is written", _self_referencing_meta_pkl),
    Hostile("billion-laughs-meta-pkl", "data",
            "a tiny meta.pkl of 60 nested lists each holding the previous one twice (2^60 items unfolded) is refused "
            "at once by `data info` and by training, naming the file; no run directory is written",
            _billion_laughs_meta_pkl),
    Hostile("uint16-vocab-70000", "data",
            "a meta.json recording dtype uint16 with vocab_size 70000 (ids cannot reach the vocabulary) is refused "
            "by `data info` and by training, naming meta.json; no run directory is written", _uint16_vocab_70000),
    Hostile("uint32-vocab-70000", "data",
            "a uint32 dataset whose meta.json records vocab_size 70000 trains (the model gets 70000 embeddings)",
            _uint32_vocab_from_meta_json),
    Hostile("token-id-not-below-vocab", "data",
            "a token id at or above the vocabulary size recorded in meta.json is refused before training, naming the "
            "file, the id, its position and the size", _token_id_not_below_vocab),
    Hostile("bare-nanogpt-ids-above-gpt2", "data",
            "a folder without meta.json (uint16, GPT-2's 50257 assumed) holding an id ≥ 50257 is refused, naming the "
            "file and asking for a meta.json", _bare_nanogpt_ids_above_gpt2),
    Hostile("model-vocab-too-small", "data",
            "an explicit model.vocab_size smaller than the data's vocabulary is refused, naming both",
            _model_vocab_too_small),
    Hostile("broken-bin-folder", "data",
            "an empty train.bin, a .bin of odd byte length, a missing val.bin, a meta.json that is not JSON or has a "
            "bad dtype or vocab_size, or token counts that disagree with the files: one line naming the file, exit 2",
            _broken_folders),
    Hostile("split-shorter-than-block", "data",
            "a split with fewer than data.block_size+2 tokens is refused before training, naming the file",
            _split_shorter_than_block),
    Hostile("bad-val-fraction", "data",
            "data.val_fraction of 1.5, 0, -0.2, 1, nan, inf or a non-number is refused with one line naming the key "
            "and value", _bad_val_fraction),
    Hostile("not-utf8-text", "data",
            "a text file that is not UTF-8 is refused by `data prepare` and `data.kind=text`, naming the file and the "
            "first bad byte (`--encoding-errors replace` opts in to replacement)", _not_utf8_text),
    Hostile("failed-force-keeps-dataset", "data",
            "a `data prepare --force` that fails midway leaves the existing dataset byte for byte as it was",
            _failed_force_keeps_dataset),
    Hostile("unwritable-output", "data",
            "`data prepare` into an output that cannot be a folder, or onto a disk that fills up, is one line naming "
            "the path, exit 2; an existing dataset in the output is left byte for byte as it was",
            _unwritable_output),
    Hostile("special-files-in-dataset", "data",
            "a FIFO `meta.json`, `meta.pkl` or `train.bin`, a directory named `val.bin`, `meta.json` linked to "
            "`/dev/zero` or a 3 GiB sparse `meta.json` in a dataset folder (`train`, `data info`), and a FIFO input "
            "to `data prepare`: one line naming the file and what it is, exit 2, no hang, nothing written",
            _special_files_in_dataset),
    Hostile("broken-gzip-input", "data",
            "a .gz input that is not gzip is one line naming it, exit 2, no output folder left behind",
            _broken_gzip_input),
    Hostile("bounded-reads-under-ulimit", "data",
            "`weightgeom data prepare` of a small .txt and .txt.gz under an address-space limit (`ulimit -v`, 3 GiB) "
            "exits 0: a bounded read reserves what the file holds (+1 byte), never its 8 GiB bound (that was a "
            "MemoryError traceback in `train` and `eval`)", _bounded_reads_under_ulimit),
]
