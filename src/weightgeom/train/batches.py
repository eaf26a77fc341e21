"""Batch sampling for the trainer: counter-based, so a batch is a pure function of (seed, split, step, index).

Every micro-batch draws its random offsets from a fresh ``torch.Generator`` seeded with a hash of
``(run.seed, split, step, micro_index)``. Consequences: resuming from a checkpoint needs no data-loader state and
reproduces the same batches bit for bit; a 2-rank run where rank r takes micro-batches ``r·k … r·k+k−1`` of a step
sees exactly the global batch of a 1-rank run with ``grad_accum = 2k``; evaluation uses the same fixed val batches
every time (comparable curves). Sampling is with replacement (random windows, as nanoGPT's ``get_batch``).

Sources (``[data] kind``): ``shakespeare`` (weightgeom.data corpus, char or GPT-2 tokens), ``text`` (a UTF-8 file),
``bin`` (``train.bin``/``val.bin`` memmaps in ``data.path``), ``mnist`` (flattened 784-d images), ``synthetic`` (a
learnable random token process for tests and benchmarks; no files).

``bin`` folders are read with :class:`weightgeom.data.TokenDataset`: the dtype and vocabulary size come from the
``meta.json`` that ``weightgeom data prepare`` writes (else nanoGPT's ``meta.pkl`` ``vocab_size``, read as plain data
and never executed; else uint16 and GPT-2's 50257), and every id is checked once at load (one chunked pass, about
0.02–0.2 s per 100M tokens) to be below that size. The model's ``vocab_size`` defaults to it.

Every unusable input is refused before training with a ``ValueError`` of one line naming the key or file:
``data.val_fraction`` not a number in (0, 1); a missing, unreadable, empty or non-UTF-8 ``data.path`` text file; a
``bin`` folder with a missing, empty or truncated ``.bin`` file, a bad ``meta.json``, a refused ``meta.pkl`` or an id
not below the vocabulary; a split shorter than ``data.block_size + 2`` tokens. (A model whose vocabulary is smaller
than the data's is refused by the trainer once the model is built, naming ``vocab_source``.)
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from weightgeom.data.corpora import decode_utf8, shakespeare_text
from weightgeom.data.mnist import load_mnist
from weightgeom.data.tokenizers import GPT2_VOCAB_SIZE, get_tokenizer
from weightgeom.data.tokens import TokenDataset
from weightgeom.train.config import Config

__all__ = ["Batches", "build_batches", "batch_seed", "char_encode", "shakespeare_corpus", "read_text_file"]

_SPLIT_ID = {"train": 0, "val": 1}


def batch_seed(seed: int, split: str, step: int, index: int) -> int:
    """A 63-bit generator seed from (seed, split, step, index) (stable across processes and Python versions)."""
    h = hashlib.blake2b(f"{seed}/{split}/{step}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


@dataclass
class Batches:
    """Samples (x, y) micro-batches.

    Attributes:
        kind: ``lm`` (x, y: (B, T) int64 token ids, y shifted by one) or ``cls`` (x: (B, D) float, y: (B,) int64).
        train, val: 1-D token arrays (lm) or (X, Y) tuples (cls).
        batch_size: sequences/examples per micro-batch.
        block_size: tokens per sequence (lm).
        vocab_size: tokenizer vocabulary size (lm) or number of classes (cls).
        input_dim: feature size (cls).
        seed: run seed.
        meta: tokenizer and corpus details written to meta.json.
        vocab_source: where ``vocab_size`` comes from, for messages (``"from meta.json"``, ``"char tokens of
            data.kind='text'"``).
    """

    kind: str
    train: Any
    val: Any
    batch_size: int
    block_size: int = 0
    vocab_size: int = 0
    input_dim: int = 0
    seed: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    vocab_source: str = ""

    def get(self, split: str, step: int, index: int, device: torch.device | str = "cpu"):
        """Micro-batch ``index`` of optimizer step ``step`` of ``split`` (``train`` | ``val``)."""
        g = torch.Generator().manual_seed(batch_seed(self.seed, split, step, index))
        src = self.train if split == "train" else self.val
        if self.kind == "lm":
            n = len(src) - self.block_size - 1
            if n <= 0:
                raise ValueError(f"data: the {split} split has {len(src)} tokens, fewer than data.block_size+2="
                                 f"{self.block_size + 2}; use a smaller block_size or more data")
            ix = torch.randint(n, (self.batch_size,), generator=g).tolist()
            T = self.block_size
            x = torch.from_numpy(np.stack([np.asarray(src[i:i + T], dtype=np.int64) for i in ix]))
            y = torch.from_numpy(np.stack([np.asarray(src[i + 1:i + 1 + T], dtype=np.int64) for i in ix]))
        else:
            X, Y = src
            ix = torch.randint(len(Y), (self.batch_size,), generator=g)
            x, y = X[ix], Y[ix]
        if torch.device(device).type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)


def check_val_fraction(value: Any) -> float:
    """``data.val_fraction`` as a float strictly between 0 and 1.

    Raises:
        ValueError: one line naming the key and the value (not a number, NaN, ≤ 0 or ≥ 1).
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 < value < 1
    if not ok:
        raise ValueError(f"config key data.val_fraction={value!r}: must be a number strictly between 0 and 1 "
                         "(the held-out share, e.g. 0.1)")
    return float(value)


def _split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:n], tokens[n:]


def char_encode(text: str) -> tuple[np.ndarray, dict[str, Any]]:
    """Character ids: the sorted distinct characters of ``text`` (by code point) numbered 0..V−1, vectorised through
    the UTF-32 code points (≈ 50× faster than a per-character dict lookup on the bundled corpus)."""
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    present = np.flatnonzero(np.bincount(codes)) if len(codes) else np.zeros(0, dtype=np.int64)
    lut = np.zeros(int(present[-1]) + 1 if len(present) else 1, dtype=np.int64)
    lut[present] = np.arange(len(present))
    chars = "".join(map(chr, present.tolist()))
    dtype = np.uint8 if len(chars) < 256 else np.int32
    return lut[codes].astype(dtype), {"tokenizer": "char", "vocab_size": len(chars), "chars": chars}


def _gpt2_encode(text: str) -> tuple[np.ndarray, dict[str, Any]]:
    try:
        tok = get_tokenizer("gpt2")
    except FileNotFoundError as e:  # the bundled BPE files are missing (a broken install)
        raise ValueError(f"config key data.tokenizer='gpt2': {e}") from None
    ids = tok.encode(text)
    return np.array(ids, dtype=np.uint16), {"tokenizer": "gpt2", "vocab_size": GPT2_VOCAB_SIZE}


def _encode(text: str, tokenizer: str) -> tuple[np.ndarray, dict[str, Any]]:
    return char_encode(text) if tokenizer == "char" else _gpt2_encode(text)


def shakespeare_corpus() -> str:
    """The bundled Shakespeare corpus (``weightgeom.data.shakespeare_text``); a missing one is a ValueError naming
    ``data.kind``."""
    try:
        return shakespeare_text()
    except FileNotFoundError as e:
        raise ValueError(f"config key data.kind='shakespeare': {e}") from None


def read_text_file(value: str) -> str:
    """The UTF-8 text of the ``data.path`` file for ``data.kind='text'``.

    Raises:
        ValueError: one line naming ``data.path``: no such file, unreadable, not UTF-8, or empty.
    """
    where = f"config key data.path={value!r}"
    p = Path(value).expanduser()
    if not p.is_file():
        raise ValueError(f"{where}: no such file")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ValueError(f"{where}: cannot read {p} ({e.strerror or e})") from None
    text = decode_utf8(raw, f"{where}: {p}", hint="")
    if not text:
        raise ValueError(f"{where}: {p} is empty")
    return text


def _check_lengths(tr: Any, va: Any, block_size: int, names: tuple[str, str], hint: str) -> None:
    """Refuse a split too short for one window: ``Batches.get`` needs ``block_size + 2`` tokens."""
    for data, name in ((tr, names[0]), (va, names[1])):
        if len(data) < block_size + 2:
            raise ValueError(f"data: {name} has {len(data)} tokens, fewer than data.block_size+2={block_size + 2}; "
                             f"use a smaller data.block_size or {hint}")


def _bin_batches(cfg: Config) -> Batches:
    """Batches over a ``train.bin``/``val.bin`` folder, with the dtype and vocabulary its metadata records."""
    d = cfg.data
    where = f"config key data.path={d.path!r}"
    try:
        ds = TokenDataset(d.path)
        if ds.vocab_size is not None:
            vocab, source = ds.vocab_size, f"from {ds.vocab_source}"
        else:
            vocab = GPT2_VOCAB_SIZE
            source = (f"GPT-2's, assumed: {ds.path} has no meta.json; write one with vocab_size and dtype, or use "
                      "`weightgeom data prepare`")
        ds.check_token_ids(vocab, source)
        tr, va = ds.memmap("train"), ds.memmap("val")
    except FileNotFoundError as e:
        raise ValueError(f"{where}: {e}; see `weightgeom data prepare`") from None
    except OSError as e:
        raise ValueError(f"{where}: cannot read {e.filename or d.path} ({e.strerror or e})") from None
    _check_lengths(tr, va, d.block_size, (str(ds.files["train"]), str(ds.files["val"])), "more data")
    meta = {"tokenizer": ds.meta.get("tokenizer") or d.tokenizer, "vocab_size": vocab, "dtype": ds.dtype_name,
            "train_tokens": len(tr), "val_tokens": len(va)}
    return Batches("lm", tr, va, d.batch_size, d.block_size, vocab, seed=cfg.run.seed, meta=meta,
                   vocab_source=source)


def _synthetic(n: int, vocab: int, seed: int) -> np.ndarray:
    """A learnable token stream: t_{i+1} = (3·t_i + t_{i-1} + noise) mod V, noise in {0, 1} w.p. 0.1."""
    g = np.random.default_rng(seed)
    t = np.zeros(n, dtype=np.int64)
    t[:2] = g.integers(vocab, size=2)
    noise = (g.random(n) < 0.1).astype(np.int64)
    for i in range(2, n):
        t[i] = (3 * t[i - 1] + t[i - 2] + noise[i]) % vocab
    return t.astype(np.int32)


def build_batches(cfg: Config) -> Batches:
    """A :class:`Batches` for the ``[data]`` section of a resolved config.

    Raises:
        ValueError: missing files or unusable data, naming the config key.
    """
    d, seed = cfg.data, cfg.run.seed
    kind, B, T = d.kind, d.batch_size, d.block_size
    val_fraction = check_val_fraction(d.val_fraction)
    if kind == "synthetic":
        vocab = int(cfg.model.get("vocab_size") or 16)
        tr = _synthetic(20_000, vocab, 1234)
        va = _synthetic(4_000, vocab, 4321)
        return Batches("lm", tr, va, B, T, vocab, seed=seed, meta={"tokenizer": "synthetic", "vocab_size": vocab})
    if kind in ("shakespeare", "text"):
        text = read_text_file(d.path) if kind == "text" else shakespeare_corpus()
        tokens, meta = _encode(text, d.tokenizer)
        tr, va = _split(tokens, val_fraction)
        _check_lengths(tr, va, T, ("the train split", "the val split"), "a data.val_fraction that leaves both splits "
                       f"long enough (now {val_fraction:g} of {len(tokens)} tokens)")
        return Batches("lm", tr, va, B, T, meta["vocab_size"], seed=seed, meta={**meta, "tokens": len(tokens)},
                       vocab_source=f"{meta['tokenizer']} tokens of data.kind={kind!r}")
    if kind == "bin":
        return _bin_batches(cfg)
    if kind == "mnist":
        try:  # evaluation on the validation split; the test split is untouched
            xtr, ytr, xva, yva, _xte, _yte = load_mnist()
        except (FileNotFoundError, ImportError) as e:
            raise ValueError(f"config key data.kind='mnist': {e}") from None
        return Batches("cls", (xtr, ytr), (xva, yva), B, 0, 10, input_dim=xtr.shape[1], seed=seed,
                       meta={"dataset": "mnist", "train": len(ytr), "val": len(yva)})
    raise ValueError(f"config key data.kind={kind!r}: unknown")
