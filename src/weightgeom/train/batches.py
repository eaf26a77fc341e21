"""Batch sampling for the trainer: counter-based, so a batch is a pure function of (seed, split, step, index).

Every micro-batch draws its random offsets from a fresh ``torch.Generator`` seeded with a hash of
``(run.seed, split, step, micro_index)``. Consequences: resuming from a checkpoint needs no data-loader state and
reproduces the same batches bit for bit; a 2-rank run where rank r takes micro-batches ``r·k … r·k+k−1`` of a step
sees exactly the global batch of a 1-rank run with ``grad_accum = 2k``; evaluation uses the same fixed val batches
every time (comparable curves). Sampling is with replacement (random windows, as nanoGPT's ``get_batch``).

Sources (``[data] kind``): ``shakespeare`` (weightgeom.data corpus, char or GPT-2 tokens), ``text`` (a file),
``bin`` (nanoGPT ``train.bin``/``val.bin`` uint16 memmaps in ``data.path``), ``mnist`` (flattened 784-d images),
``synthetic`` (a learnable random token process for tests and benchmarks; no files).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["Batches", "build_batches", "batch_seed"]

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


def _split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:n], tokens[n:]


def _char_encode(text: str) -> tuple[np.ndarray, dict[str, Any]]:
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    dtype = np.uint8 if len(chars) < 256 else np.int32
    return np.array([stoi[c] for c in text], dtype=dtype), {"tokenizer": "char", "vocab_size": len(chars),
                                                            "chars": "".join(chars)}


def _gpt2_encode(text: str) -> tuple[np.ndarray, dict[str, Any]]:
    from weightgeom.data import get_tokenizer

    ids = get_tokenizer("gpt2").encode(text)
    return np.array(ids, dtype=np.uint16), {"tokenizer": "gpt2", "vocab_size": 50257}


def _encode(text: str, tokenizer: str) -> tuple[np.ndarray, dict[str, Any]]:
    return _char_encode(text) if tokenizer == "char" else _gpt2_encode(text)


def _shakespeare_text() -> str:
    """The bundled Shakespeare corpus (``weightgeom.data.shakespeare_text``)."""
    from weightgeom.data import shakespeare_text

    return shakespeare_text()


def _synthetic(n: int, vocab: int, seed: int) -> np.ndarray:
    """A learnable token stream: t_{i+1} = (3·t_i + t_{i-1} + noise) mod V, noise in {0, 1} w.p. 0.1."""
    g = np.random.default_rng(seed)
    t = np.zeros(n, dtype=np.int64)
    t[:2] = g.integers(vocab, size=2)
    noise = (g.random(n) < 0.1).astype(np.int64)
    for i in range(2, n):
        t[i] = (3 * t[i - 1] + t[i - 2] + noise[i]) % vocab
    return t.astype(np.int32)


def build_batches(cfg: dict[str, Any]) -> Batches:
    """A :class:`Batches` for the ``[data]`` section of a resolved config.

    Raises:
        ValueError: missing files or unusable data, naming the config key.
    """
    d, seed = cfg["data"], cfg["run"]["seed"]
    kind, B, T = d["kind"], d["batch_size"], d["block_size"]
    if kind == "synthetic":
        vocab = int(cfg["model"].get("vocab_size") or 16)
        tr = _synthetic(20_000, vocab, 1234)
        va = _synthetic(4_000, vocab, 4321)
        return Batches("lm", tr, va, B, T, vocab, seed=seed, meta={"tokenizer": "synthetic", "vocab_size": vocab})
    if kind in ("shakespeare", "text"):
        if kind == "text":
            p = Path(d["path"]).expanduser()
            if not p.is_file():
                raise ValueError(f"config key data.path={d['path']!r}: no such file")
            text = p.read_text(encoding="utf-8", errors="replace")
        else:
            text = _shakespeare_text()
        tokens, meta = _encode(text, d["tokenizer"])
        tr, va = _split(tokens, d["val_fraction"])
        return Batches("lm", tr, va, B, T, meta["vocab_size"], seed=seed, meta={**meta, "tokens": len(tokens)})
    if kind == "bin":
        p = Path(d["path"]).expanduser()
        files = {s: p / f"{s}.bin" for s in ("train", "val")}
        for f in files.values():
            if not f.is_file():
                raise ValueError(f"config key data.path={d['path']!r}: {f} not found (expected nanoGPT-style "
                                 f"train.bin/val.bin of uint16 tokens; see `weightgeom data prepare`)")
        tr = np.memmap(files["train"], dtype=np.uint16, mode="r")
        va = np.memmap(files["val"], dtype=np.uint16, mode="r")
        return Batches("lm", tr, va, B, T, 50257, seed=seed,
                       meta={"tokenizer": d["tokenizer"], "train_tokens": len(tr), "val_tokens": len(va)})
    if kind == "mnist":
        from weightgeom.data import load_mnist

        xtr, ytr, xva, yva, _xte, _yte = load_mnist()  # evaluation on the validation split; the test split is untouched
        return Batches("cls", (xtr, ytr), (xva, yva), B, 0, 10, input_dim=xtr.shape[1], seed=seed,
                       meta={"dataset": "mnist", "train": len(ytr), "val": len(yva)})
    raise ValueError(f"config key data.kind={kind!r}: unknown")
