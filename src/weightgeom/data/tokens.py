"""Token datasets stored nanoGPT-style: ``train.bin`` / ``val.bin`` flat arrays of token ids, read by memmap.

A folder written by ``weightgeom data prepare`` also has ``meta.json`` (dtype, vocab size, tokenizer). Existing
nanoGPT folders load as they are: without meta.json the dtype is uint16 (nanoGPT's) and, if a nanoGPT ``meta.pkl``
(shakespeare_char) is present, its ``vocab_size`` and ``itos`` give the vocabulary and a char tokenizer.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .tokenizers import CharTokenizer, Tokenizer, tokenizer_from_meta

SPLITS = ("train", "val")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def token_dtype(vocab_size: int) -> str:
    """``uint16`` when every id fits (vocab_size ≤ 65536), else ``uint32``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


class TokenDataset:
    """Train/val token streams in a folder, sampled as random (x, y) windows.

    Args:
        path: folder holding ``train.bin`` and ``val.bin`` (and optionally ``meta.json`` / nanoGPT ``meta.pkl``).
        dtype: override the token dtype (``uint16`` | ``uint32``); default from meta.json, else uint16.

    Attributes:
        meta: the meta.json contents ({} for a bare nanoGPT folder).
        dtype: numpy dtype of the ids.
        vocab_size: from the metadata, or None when unknown (see ``max_token``).

    Raises:
        FileNotFoundError: naming a missing ``.bin`` file.
        ValueError: an unknown dtype, or a file whose size is not a multiple of the item size.
    """

    def __init__(self, path: str | os.PathLike, dtype: str | None = None) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise FileNotFoundError(f"token dataset folder {self.path} does not exist")
        self.meta: dict[str, Any] = {}
        meta_json = self.path / "meta.json"
        if meta_json.is_file():
            self.meta = json.loads(meta_json.read_text(encoding="utf-8"))
        self._pkl: dict[str, Any] | None = None
        if not self.meta and (self.path / "meta.pkl").is_file():
            with open(self.path / "meta.pkl", "rb") as f:  # nanoGPT's own metadata (a trusted local file)
                self._pkl = pickle.load(f)
        name = dtype or self.meta.get("dtype", "uint16")
        if name not in DTYPES:
            raise ValueError(f"unknown token dtype {name!r}; choose one of {', '.join(DTYPES)}")
        self.dtype_name = name
        self.dtype = np.dtype(DTYPES[name])
        self.files = {s: self.path / f"{s}.bin" for s in SPLITS}
        for f in self.files.values():
            if not f.is_file():
                raise FileNotFoundError(f"{f} not found (a token dataset needs train.bin and val.bin)")
            if f.stat().st_size % self.dtype.itemsize:
                raise ValueError(f"{f}: size {f.stat().st_size} bytes is not a multiple of {name}'s itemsize")
        vs = self.meta.get("vocab_size", (self._pkl or {}).get("vocab_size"))
        self.vocab_size: int | None = int(vs) if vs is not None else None

    def memmap(self, split: str) -> np.memmap:
        """A fresh read-only memmap of one split (nanoGPT re-opens per batch to avoid a memmap memory leak)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose train or val")
        return np.memmap(self.files[split], dtype=self.dtype, mode="r")

    def num_tokens(self, split: str) -> int:
        """Number of tokens in a split."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose train or val")
        return self.files[split].stat().st_size // self.dtype.itemsize

    def get_batch(
        self,
        split: str,
        batch_size: int,
        block_size: int,
        generator: torch.Generator | None = None,
        device: str | torch.device = "cpu",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: x = ids[i : i+block_size], y = ids[i+1 : i+1+block_size].

        Args:
            split: ``train`` or ``val``.
            batch_size: windows per batch.
            block_size: tokens per window.
            generator: a torch.Generator for reproducible offsets (the global RNG when None).
            device: where to put the batch (pinned, non-blocking copy for CUDA).

        Returns:
            (x, y), each (batch_size, block_size) int64.

        Raises:
            ValueError: when the split has fewer than block_size + 1 tokens.
        """
        data = self.memmap(split)
        n = len(data) - block_size
        if n <= 0:
            raise ValueError(
                f"the {split} split of {self.path} has {len(data)} tokens, fewer than block_size+1={block_size + 1}"
            )
        ix = torch.randint(n, (batch_size,), generator=generator).tolist()
        x = torch.from_numpy(np.stack([data[i : i + block_size].astype(np.int64) for i in ix]))
        y = torch.from_numpy(np.stack([data[i + 1 : i + 1 + block_size].astype(np.int64) for i in ix]))
        if torch.device(device).type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)

    def max_token(self) -> int:
        """Largest id in either split (a full scan; use when ``vocab_size`` is None: vocab ≥ max_token()+1)."""
        return max(int(self.memmap(s).max()) if self.num_tokens(s) else -1 for s in SPLITS)

    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer that wrote the data (from meta.json or nanoGPT's meta.pkl), or None if unknown."""
        if self.meta.get("tokenizer"):
            return tokenizer_from_meta(self.meta)
        if self._pkl and "itos" in self._pkl:
            itos = self._pkl["itos"]
            return CharTokenizer([itos[i] for i in range(len(itos))])
        return None

    def __repr__(self) -> str:
        return (
            f"TokenDataset({str(self.path)!r}, dtype={self.dtype_name}, vocab_size={self.vocab_size}, "
            f"train={self.num_tokens('train')}, val={self.num_tokens('val')})"
        )
