"""Tokenise documents into nanoGPT-style ``train.bin`` / ``val.bin`` (+ ``meta.json``), and a cache of defaults.

Layout of a prepared folder::

    train.bin   flat token ids (uint16 when vocab ≤ 65536, else uint32), native little-endian
    val.bin     the last ``val_fraction`` of the token stream (nanoGPT's shakespeare split: a tail split)
    meta.json   {"tokenizer", "tokenizer_config", "vocab_size", "dtype", "train_tokens", "val_tokens", ...}

Writing is all or nothing: every output is first written to a hidden temporary file in ``out`` and only renamed into
place once train.bin, val.bin and meta.json are all complete, so a failure (bad input, full disk, Ctrl-C) leaves an
existing dataset in ``out`` as it was and removes a folder it created. An output folder that cannot be created or
written raises ``OSError`` (``weightgeom data prepare`` prints one line naming the path, exit code 2).

Documents are joined by a separator: GPT-2's ``<|endoftext|>`` (id 50256) for ``gpt2``, a newline for ``char``; so
decoding train + val gives back ``separator.join(documents)`` exactly.

Long documents are cut at BPE-safe points (a single newline between non-space characters, where GPT-2's
pre-tokeniser always splits) and encoded in parallel threads; the ids equal those of encoding the whole text.

Cache: ``cache_dir()`` is weightgeom's one cache root (``$WEIGHTGEOM_CACHE_DIR``, else ``~/.cache/weightgeom``).
``load_token_dataset("shakespeare", tokenizer="char")`` prepares the bundled corpus there once (atomically:
concurrent runs are safe) and reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from weightgeom._cache import cache_root

from .corpora import expand_inputs, iter_documents, shakespeare_text
from .tokenizers import CharTokenizer, GPT2Tokenizer, Tokenizer, get_tokenizer
from .tokens import TokenDataset, token_dtype

FORMAT = "weightgeom.tokens/1"
OUTPUT_FILES = ("train.bin", "val.bin", "meta.json")
CHUNK_CHARS = 1 << 20  # target piece size for parallel BPE (characters)
BATCH_CHARS = 16 << 20  # characters encoded per batch of pieces


def cache_dir() -> Path:
    """weightgeom's cache root, ``weightgeom._cache.cache_root()``: ``$WEIGHTGEOM_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/weightgeom`` (``~/.cache/weightgeom``); created on demand."""
    return cache_root().expanduser()


def bpe_safe_pieces(text: str, target: int = CHUNK_CHARS) -> list[str]:
    """Cut ``text`` into pieces of about ``target`` characters whose GPT-2 encodings concatenate to the whole's.

    A cut is made only after a lone ``\\n`` that has a non-whitespace character on both sides: GPT-2's pre-tokeniser
    makes that newline its own pre-token in the whole text and at the end of a piece alike.
    """
    if len(text) <= target:
        return [text]
    pieces, start = [], 0
    while len(text) - start > target:
        pos = start + target
        cut = -1
        while True:
            i = text.find("\n", pos, start + 4 * target)
            if i < 0:
                break
            if 0 < i < len(text) - 1 and not text[i - 1].isspace() and not text[i + 1].isspace():
                cut = i + 1
                break
            pos = i + 1
        if cut < 0:
            break  # no safe point nearby: keep the rest whole
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


class _Progress:
    """A tqdm bar on stderr (or nothing)."""

    def __init__(self, enabled: bool, desc: str) -> None:
        self.bar = None
        if enabled:
            self.bar = tqdm(desc=desc, unit=" docs", file=sys.stderr, dynamic_ncols=True)

    def update(self, docs: int, tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(docs)
            self.bar.set_postfix(tokens=f"{tokens:,}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _encode_stream(
    docs: Iterable[str], tok: Tokenizer, sep_ids: list[int], progress: _Progress
) -> Iterator[tuple[np.ndarray, int]]:
    """Yield (ids, n_docs) blocks: the documents' ids with ``sep_ids`` between consecutive documents."""
    is_bpe = isinstance(tok, GPT2Tokenizer)
    threads = max(1, min(8, os.cpu_count() or 1))
    buf: list[tuple[str, bool]] = []  # (piece, starts_a_new_document)
    buf_chars = 0
    first = True

    def flush() -> np.ndarray:
        texts = [p for p, _ in buf]
        enc = tok.encode_batch(texts, num_threads=threads) if is_bpe else [tok.encode(t) for t in texts]
        out: list[int] = []
        for (_, new_doc), ids in zip(buf, enc):
            if new_doc:
                out.extend(sep_ids)
            out.extend(ids)
        return np.asarray(out, dtype=np.int64)

    n_docs = 0
    for doc in docs:
        pieces = bpe_safe_pieces(doc) if is_bpe else [doc[i : i + CHUNK_CHARS] for i in range(0, len(doc), CHUNK_CHARS)]
        pieces = pieces or [""]
        for j, piece in enumerate(pieces):
            buf.append((piece, j == 0 and not first))
            buf_chars += len(piece)
        first = False
        n_docs += 1
        if buf_chars >= BATCH_CHARS:
            yield flush(), n_docs
            buf, buf_chars, n_docs = [], 0, 0
    if buf:
        yield flush(), n_docs


def write_token_dataset(
    docs: Callable[[], Iterable[str]],
    out: str | os.PathLike,
    tokenizer: str | Tokenizer = "gpt2",
    val_fraction: float = 0.1,
    force: bool = False,
    progress: bool = True,
    extra_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Tokenise documents into ``out/train.bin``, ``out/val.bin`` and ``out/meta.json``.

    Args:
        docs: a function returning a fresh iterable of documents (called twice for a char vocabulary).
        out: output folder (created).
        tokenizer: ``gpt2`` | ``char`` or a tokenizer object (a char vocabulary is built from the documents).
        val_fraction: share of the token stream, taken from its end, written to val.bin; in (0, 1).
        force: overwrite existing output files.
        progress: show a progress bar on stderr.
        extra_meta: more keys for meta.json.

    Returns:
        The meta.json contents.

    Raises:
        ValueError: a bad val_fraction, no text at all, too few tokens for two splits, or ``out`` is a file.
        FileExistsError: output files exist and ``force`` is False.
        OSError: ``out`` cannot be created or written (nothing already in ``out`` is changed).
    """
    if not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} is a file, not a folder")
    existing = [f for f in OUTPUT_FILES if (out / f).exists()]
    if existing and not force:
        raise FileExistsError(f"{out / existing[0]} already exists; use --force (force=True) to overwrite")
    if isinstance(tokenizer, str):
        if tokenizer == "char":
            tok: Tokenizer = CharTokenizer.from_text(_with_newline(docs()))
        else:
            tok = get_tokenizer(tokenizer)
    else:
        tok = tokenizer
    if isinstance(tok, CharTokenizer):
        if "\n" not in tok.stoi:
            raise ValueError("the char vocabulary must contain '\\n' (the document separator)")
        sep_ids, sep = [tok.stoi["\n"]], "\n"
    else:
        sep_ids, sep = [tok.eot_token if tok.eot_token is not None else 0], "<|endoftext|>"
    dtype = token_dtype(tok.vocab_size)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"cannot create the output folder: {e.strerror}", str(out)) from None
    tag = uuid.uuid4().hex  # this call's temporary files (a concurrent prepare into the same folder keeps its own)
    tmp, val_tmp, meta_tmp = (out / f".{name}.{tag}.tmp" for name in ("all.bin", "val.bin", "meta.json"))
    total = n_docs = 0
    bar = _Progress(progress, f"tokenising ({tok.name})")
    try:
        with open(tmp, "wb") as f:
            for ids, k in _encode_stream(docs(), tok, sep_ids, bar):
                if ids.size and (ids.min() < 0 or ids.max() >= tok.vocab_size):
                    raise ValueError(f"token id outside [0, {tok.vocab_size}) from tokenizer {tok.name!r}")
                ids.astype(dtype).tofile(f)
                total += int(ids.size)
                n_docs += k
                bar.update(k, total)
        bar.close()
        if total - max(0, n_docs - 1) * len(sep_ids) <= 0:
            where = ", ".join((extra_meta or {}).get("sources", [])) or "the inputs"
            raise ValueError(f"no text found in {where} (every document is empty)")
        n_val = max(1, int(round(total * float(val_fraction))))
        n_train = total - n_val
        if n_train < 1:
            raise ValueError(f"only {total} tokens: too few for a train and a val split")
        itemsize = np.dtype(dtype).itemsize
        all_ids = np.memmap(tmp, dtype=dtype, mode="r")
        np.asarray(all_ids[n_train:]).tofile(val_tmp)
        del all_ids
        with open(tmp, "r+b") as f:
            f.truncate(n_train * itemsize)
        meta = _meta(tok, dtype, n_train, n_val, val_fraction, n_docs, sep, extra_meta)
        meta_tmp.write_text(json.dumps(meta, ensure_ascii=False, indent=1), encoding="utf-8")
        os.replace(tmp, out / "train.bin")
        os.replace(val_tmp, out / "val.bin")
        os.replace(meta_tmp, out / "meta.json")
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        bar.close()
        for p in (tmp, val_tmp, meta_tmp):
            p.unlink(missing_ok=True)
    return meta


def _meta(
    tok: Tokenizer,
    dtype: str,
    n_train: int,
    n_val: int,
    val_fraction: float,
    n_docs: int,
    sep: str,
    extra_meta: dict[str, Any] | None,
) -> dict[str, Any]:
    """The meta.json contents of a prepared dataset."""
    return {
        "format": FORMAT,
        "tokenizer": tok.name,
        "tokenizer_config": tok.to_meta(),
        "vocab_size": tok.vocab_size,
        "dtype": dtype,
        "train_tokens": n_train,
        "val_tokens": n_val,
        "val_fraction": float(val_fraction),
        "documents": n_docs,
        "separator": sep,
        **(extra_meta or {}),
    }


def _with_newline(docs: Iterable[str]) -> Iterator[str]:
    yield "\n"
    yield from docs


def prepare(
    inputs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    tokenizer: str = "gpt2",
    val_fraction: float = 0.1,
    text_field: str = "text",
    force: bool = False,
    progress: bool = True,
    encoding_errors: str = "strict",
) -> dict[str, Any]:
    """``weightgeom data prepare``: tokenise text / JSONL / parquet files or folders into ``out``.

    Args:
        inputs: files and/or folders (see ``weightgeom.data.corpora``).
        out: output folder.
        tokenizer: ``gpt2`` | ``char``.
        val_fraction: tail share of the tokens for val.bin.
        text_field: JSONL field / parquet column holding the text.
        force: overwrite existing outputs.
        progress: progress bar on stderr.
        encoding_errors: ``strict`` (a text / JSONL file that is not UTF-8 is refused, naming it) or ``replace``
            (undecodable bytes become U+FFFD).

    Returns:
        The meta.json contents.

    Raises:
        ValueError / FileNotFoundError / FileExistsError / OSError: one line naming the input or output at fault; see
            :func:`write_token_dataset` and ``weightgeom.data.corpora``.
    """
    files = expand_inputs(inputs)  # fail fast on missing / unsupported inputs
    extra: dict[str, Any] = {"sources": [str(p) for p in files], "text_field": text_field}
    if encoding_errors != "strict":
        extra["encoding_errors"] = encoding_errors
    return write_token_dataset(
        lambda: iter_documents(files, text_field, encoding_errors),
        out,
        tokenizer,
        val_fraction,
        force,
        progress,
        extra_meta=extra,
    )


def _atomic_prepare(target: Path, build: Callable[[Path], Any]) -> Path:
    """Build into a temporary sibling folder and rename it into place (first finisher wins)."""
    if (target / "meta.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "meta.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def prepare_shakespeare(
    tokenizer: str = "char", val_fraction: float = 0.1, cache: str | os.PathLike | None = None, progress: bool = False
) -> Path:
    """The bundled Shakespeare corpus tokenised once into the cache; returns the folder."""
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    target = root / f"shakespeare-{tokenizer}-val{val_fraction:g}"
    return _atomic_prepare(
        target,
        lambda d: write_token_dataset(
            lambda: [shakespeare_text()],
            d,
            tokenizer,
            val_fraction,
            progress=progress,
            extra_meta={"sources": ["shakespeare (shksprdata/texts/*_gut.txt)"]},
        ),
    )


def prepare_cached(
    inputs: Sequence[str | os.PathLike],
    tokenizer: str = "char",
    val_fraction: float = 0.1,
    text_field: str = "text",
    cache: str | os.PathLike | None = None,
    progress: bool = False,
) -> Path:
    """``prepare`` into the cache, keyed by the inputs' paths, sizes and mtimes and the options; returns the folder."""
    files = expand_inputs(inputs)
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(f"{tokenizer}|{val_fraction}|{text_field}".encode())
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    target = root / f"text-{tokenizer}-{h.hexdigest()[:16]}"
    return _atomic_prepare(
        target, lambda d: prepare(files, d, tokenizer, val_fraction, text_field, force=False, progress=progress)
    )


def load_token_dataset(
    kind: str,
    path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    tokenizer: str = "char",
    val_fraction: float = 0.1,
    text_field: str = "text",
    cache: str | os.PathLike | None = None,
    progress: bool = False,
) -> TokenDataset:
    """A ``TokenDataset`` for a ``[data]`` config section.

    Args:
        kind: ``shakespeare`` (bundled corpus, prepared once in the cache), ``text`` (file(s)/folder(s) at ``path``,
            prepared once in the cache), ``bin`` (an existing train.bin/val.bin folder at ``path``, loaded as is).
        path: see ``kind``.
        tokenizer: ``char`` | ``gpt2`` (shakespeare / text).
        val_fraction: tail share for val (shakespeare / text).
        text_field: JSONL field / parquet column (text).
        cache: cache root (default ``cache_dir()``).
        progress: progress bar while preparing.

    Raises:
        ValueError: unknown kind or a missing path.
    """
    if kind == "shakespeare":
        return TokenDataset(prepare_shakespeare(tokenizer, val_fraction, cache, progress))
    if kind in ("text", "bin") and path is None:
        raise ValueError(f"data kind {kind!r} needs a path")
    if kind == "text":
        paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        return TokenDataset(prepare_cached(paths, tokenizer, val_fraction, text_field, cache, progress))
    if kind == "bin":
        return TokenDataset(path)  # type: ignore[arg-type]
    raise ValueError(f"unknown token data kind {kind!r}; choose shakespeare, text or bin")
