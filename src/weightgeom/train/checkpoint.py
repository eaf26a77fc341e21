"""Atomic, verified checkpoints that load as tensors only.

File layout (``ckpt_00001000.pt``): one header line ``WGCKPT2 <sha256 hex> <payload bytes>\\n`` followed by the
``torch.save`` payload. Writing goes to a temporary file in the same directory, is flushed and fsync'd, then
``os.replace``-d onto the final name (atomic on POSIX) and the directory is fsync'd: a process killed mid-write leaves
only a stray ``.tmp`` file, never a truncated checkpoint under a final name, and the previous checkpoint stays
loadable. Loading checks the header, the length and the hash, then reads the payload with
``torch.load(weights_only=True)``: PyTorch's restricted unpickler, which builds tensors and plain containers and refuses
any other Python object before constructing it. The header proves integrity, not origin (anyone can write a valid one),
so a payload that pickles a Python object (a class, a function, ``os.system``) is refused with one line naming the file
and the object, and no code from the file runs.

A payload holds ``step``, ``config_hash``, ``config``, ``model``, ``optimizer``, ``rng`` (torch CPU/CUDA, Python,
NumPy) and ``trainer`` (smoothed loss, best loss, ...): tensors and JSON-like values only (dict, list, tuple, str, int,
float, bool, None; :func:`save_checkpoint` refuses anything else, naming its key, before writing). The RNG states are
stored in that form by :func:`rng_state` (NumPy's key array as an int64 tensor, Python's state as a list of ints).
Under torchrun with a sharded optimizer each rank r > 0 also writes ``ckpt_XXXXXXXX.rank{r}.pt`` (its optimizer shard
and RNG), and rank 0 writes the main file last, after a barrier, so the main file's presence means the whole checkpoint
is complete.

Format history: ``WGCKPT1`` files (weightgeom before tensors-only loading) stored NumPy objects that need the full
unpickler; they are refused with one line saying so (see :data:`OLD_FORMAT_HINT`).
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import re
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from weightgeom._files import write_atomic

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints",
           "prune_checkpoints", "rng_state", "set_rng_state", "atomic_write_bytes", "checkpoint_name",
           "is_checkpoint_file", "safe_torch_load", "weights_only_refusal", "MAGIC", "STALE_TMP_AGE_S"]

MAGIC = b"WGCKPT2"
"""Header tag of the current format (tensors and plain values; loads with ``weights_only=True``)."""

_OLD_MAGICS = (b"WGCKPT1",)
OLD_FORMAT_HINT = ("written by an older weightgeom (format WGCKPT1, whose RNG state needs Python's full unpickler); "
                   "this version loads checkpoints as tensors only and will not unpickle it — start a new run "
                   "(--fresh or another --out), or finish this one with the weightgeom version that wrote it")

STALE_TMP_AGE_S = 60.0
"""A checkpoint ``.tmp`` file untouched for this many seconds (and older than the newest checkpoint) is stale."""

_NAME = re.compile(r"^ckpt_(\d{8})\.pt$")
# atomic_write_bytes' temporary names for checkpoint files: ".ckpt_00000012.pt.<random>.tmp" (and rank shards)
_TMP_NAME = re.compile(r"^\.ckpt_\d{8}(\.rank\d+)?\.pt\.[A-Za-z0-9_]+\.tmp$")
_PLAIN = (str, bytes, int, float, bool, complex, type(None), torch.Size, torch.dtype, torch.device)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: truncated, corrupted, wrong format, or from a different config."""


def checkpoint_name(step: int, rank: int = 0) -> str:
    """File name of the checkpoint at ``step`` (``rank > 0``: that rank's shard file)."""
    return f"ckpt_{step:08d}.pt" if rank == 0 else f"ckpt_{step:08d}.rank{rank}.pt"


def is_checkpoint_file(head: bytes) -> bool:
    """True if ``head`` (a file's first bytes) starts with a weightgeom checkpoint tag (any format version)."""
    return head.startswith(b"WGCKPT")


def atomic_write_bytes(path: str | os.PathLike, chunks) -> None:
    """Write byte ``chunks`` (bytes or an iterable of bytes) to ``path`` atomically: :func:`weightgeom._files.
    write_atomic` (tmp + fsync + os.replace; a link at ``path`` is replaced, never followed; permissions as an
    ordinary ``open(path, "w")`` would give)."""
    write_atomic(path, chunks)


# ---- RNG state in a tensors-only form ---------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Snapshot of the torch (CPU and CUDA), Python and NumPy RNG states, as tensors and plain values.

    Returns:
        ``{"torch": ByteTensor, "python": {"version", "state" (list of 625 ints), "gauss_next"}, "numpy": {"kind",
        "keys" (int64 tensor of the 624 MT19937 words), "pos", "has_gauss", "cached_gaussian"}}`` plus ``"cuda"``
        (list of ByteTensors) when CUDA is initialised. Every part loads with ``torch.load(weights_only=True)``.
    """
    version, words, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    st: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": int(version), "state": [int(x) for x in words], "gauss_next": gauss_next},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _python_state(py: Any) -> tuple:
    if isinstance(py, dict):
        return int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]
    return py  # the in-memory tuple of random.getstate()


def _numpy_state(st: Any) -> tuple:
    if isinstance(st, dict):
        keys = st["keys"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        return (str(st["kind"]), keys.astype(np.uint32), int(st["pos"]), int(st["has_gauss"]),
                float(st["cached_gaussian"]))
    return st  # the in-memory tuple of np.random.get_state()


def set_rng_state(st: dict[str, Any]) -> None:
    """Restore a snapshot from :func:`rng_state` (CUDA states only when CUDA is available).

    Also accepts the tuples that ``random.getstate()`` / ``np.random.get_state()`` return.

    Raises:
        CheckpointError: the snapshot is malformed (missing key, wrong type or size).
    """
    try:
        torch.set_rng_state(st["torch"])
        random.setstate(_python_state(st["python"]))
        np.random.set_state(_numpy_state(st["numpy"]))
        if "cuda" in st and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(st["cuda"])
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        msg = f"{type(e).__name__}: {e}".replace("\n", " ")
        raise CheckpointError(f"checkpoint RNG state is malformed ({msg})") from None


# ---- tensors-only serialisation -----------------------------------------------------------------------------------
def _unsafe_item(obj: Any, where: str) -> str | None:
    """The key path of the first value in ``obj`` that ``torch.load(weights_only=True)`` would refuse, or None."""
    if isinstance(obj, torch.Tensor) or type(obj) in _PLAIN:
        return None
    if type(obj) in (dict, OrderedDict):
        for k, v in obj.items():
            if type(k) not in _PLAIN and not isinstance(k, tuple):
                return f"{where} (key {k!r} of type {type(k).__name__})"
            bad = _unsafe_item(v, f"{where}[{k!r}]")
            if bad:
                return bad
        return None
    if type(obj) in (list, tuple, set):
        for i, v in enumerate(obj):
            bad = _unsafe_item(v, f"{where}[{i}]")
            if bad:
                return bad
        return None
    return f"{where} (type {type(obj).__module__}.{type(obj).__qualname__})"


# What PyTorch's restricted unpickler says when a pickle needs a Python object (torch/_weights_only_unpickler.py):
# an import of a class/function (allowed-globals and blocked-module forms), a call, an instantiation or a BUILD of one.
_PICKLED_OBJECT_PATTERNS = (  # (regex whose group 1 names the object, whether it names a GLOBAL)
    (r"Unsupported global: GLOBAL (\S+) was not an allowed global", True),
    (r"unsupported GLOBAL (\S+) whose module \S+ is blocked", True),
    (r"call reduce for unrecognized function (.+?)(?: which belongs to .*)?$", False),
    (r"Can only create new object for .* but got (.+)$", False),
    (r"Can only build Tensor, .* but got (.+)$", False),
)

# Lines of torch's error text that are PyTorch's own advice (e.g. to turn ``weights_only`` off), never repeated.
_TORCH_ADVICE = ("weights_only", "Weights only load failed", "Check the documentation", "Please file an issue",
                 "arbitrary code execution", "trusted source")


def _pickled_object(text: str) -> str | None:
    """``"GLOBAL posix.system, i.e. os.system"`` when ``text`` says the pickle needs a Python object, else None."""
    for pattern, is_global in _PICKLED_OBJECT_PATTERNS:
        m = re.search(pattern, text, re.MULTILINE)
        if not m:
            continue
        name = m.group(1).strip().rstrip(".")
        if not is_global:
            return name
        module, _, attr = name.partition(".")
        return f"GLOBAL {name}" + (f", i.e. os.{attr}" if module in ("posix", "nt") and attr else "")
    return None


def _unpickler_reason(text: str) -> str:
    """The restricted unpickler's own words in torch's error text, without PyTorch's advice around them."""
    m = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    if m:
        return m.group(1).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not any(a in line for a in _TORCH_ADVICE):
            return line
    return ""


def weights_only_refusal(exc: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, in a few words (from its exception).

    Covers every form of PyTorch's weights-only refusal (a global that is not allow-listed, one from a blocked module
    such as ``os``/``posix``, a call, instantiation or build of an unknown object) and never repeats PyTorch's advice
    to switch the weights-only safety off.

    Returns:
        ``"holds pickled Python objects (GLOBAL posix.system, i.e. os.system)"`` for a pickled class/function,
        otherwise a short description of the failure (``"truncated or corrupt (not a complete PyTorch zip
        archive)"``, ``"empty or truncated"``, ``"not a PyTorch tensor file (...)"``).
    """
    text = str(exc)
    obj = _pickled_object(text)
    if obj:
        return f"holds pickled Python objects ({obj})"
    if isinstance(exc, EOFError) or "Ran out of input" in text:
        return "empty or truncated"
    if "PytorchStreamReader" in text or "zip archive" in text:
        return "truncated or corrupt (not a complete PyTorch zip archive)"
    reason = _unpickler_reason(text)[:200]
    if "Weights only load failed" in text or "WeightsUnpickler" in text:
        return f"not a PyTorch tensor file (the weights-only unpickler stops at: {reason or type(exc).__name__})"
    return f"not a readable PyTorch file ({reason or type(exc).__name__})"


def safe_torch_load(source: str | os.PathLike | io.BytesIO, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(source, weights_only=True)`` with PyTorch's warnings about pickle protocols silenced.

    Raises:
        Exception: whatever ``torch.load`` raises (``pickle.UnpicklingError`` for a pickled Python object,
            ``RuntimeError`` for a broken zip archive, ``EOFError``, ...); :func:`weights_only_refusal` describes it.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(source, map_location=map_location, weights_only=True, mmap=mmap)


def save_checkpoint(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Serialise ``payload`` with ``torch.save`` and write it atomically with a hash header.

    Args:
        path: final file path.
        payload: dict of tensors and plain values (dict, list, tuple, str, int, float, bool, None; see the module
            docstring for the trainer's keys).

    Returns:
        The path written.

    Raises:
        CheckpointError: ``payload`` holds a value the tensors-only loader would refuse (names its key); nothing is
            written.
    """
    bad = _unsafe_item(payload, "payload")
    if bad:
        raise CheckpointError(f"checkpoint {path}: cannot store {bad}: checkpoints hold tensors and plain values only "
                              "(convert it to a tensor, number, string, list or dict)")
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getbuffer()
    header = MAGIC + b" " + hashlib.sha256(data).hexdigest().encode() + b" " + str(len(data)).encode() + b"\n"
    atomic_write_bytes(path, [header, data])
    return Path(path)


def _verified_payload_bytes(path: Path) -> memoryview:
    """The payload bytes of checkpoint ``path`` after the header, length and hash checks (one-line errors)."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: cannot read ({e.strerror or e})") from None
    nl = raw.find(b"\n", 0, 200)
    head = raw[:nl].split(b" ") if nl > 0 else []
    if head and head[0] in _OLD_MAGICS:
        raise CheckpointError(f"checkpoint {path}: {OLD_FORMAT_HINT}")
    if len(head) != 3 or head[0] != MAGIC:
        raise CheckpointError(f"checkpoint {path}: not a weightgeom checkpoint (bad header); corrupt or wrong file")
    try:
        size = int(head[2])
    except ValueError:
        raise CheckpointError(f"checkpoint {path}: corrupt header") from None
    data = memoryview(raw)[nl + 1:]
    if len(data) != size:
        raise CheckpointError(f"checkpoint {path}: truncated or corrupt ({len(data)} of {size} payload bytes)")
    if hashlib.sha256(data).hexdigest().encode() != head[1]:
        raise CheckpointError(f"checkpoint {path}: corrupt (SHA-256 mismatch)")
    return data


def load_checkpoint(path: str | os.PathLike, *, expected_hash: str | None = None,
                    map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read and verify a checkpoint; the payload is unpickled with ``weights_only=True`` (tensors and plain values).

    Args:
        path: checkpoint file.
        expected_hash: if given, the payload's ``config_hash`` must equal it.
        map_location: passed to ``torch.load``.

    Raises:
        CheckpointError: missing, truncated, corrupted (hash mismatch), not a weightgeom checkpoint, written by an
            older weightgeom (``WGCKPT1``), holding pickled Python objects (refused before any of them is built), or
            made with a different config (one line naming the file and the reason).
    """
    path = Path(path)
    data = _verified_payload_bytes(path)
    try:
        payload = safe_torch_load(io.BytesIO(data), map_location=map_location)
    except Exception as e:  # noqa: BLE001 - whatever a crafted payload makes the restricted unpickler raise: one line
        why = weights_only_refusal(e)
        hint = ("; weightgeom writes tensors and plain values only, so this file was not written by weightgeom (or "
                "was altered); nothing in it was run" if why.startswith("holds pickled") else "")
        raise CheckpointError(f"checkpoint {path}: {why}{hint}") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"checkpoint {path}: payload is a {type(payload).__name__}, not a dict")
    if expected_hash is not None and payload.get("config_hash") != expected_hash:
        raise CheckpointError(f"checkpoint {path}: made with a different config (hash {payload.get('config_hash')} "
                              f"!= {expected_hash}); resume with the run's config.resolved.toml")
    return payload


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of complete main checkpoint files in ``ckpt_dir``, oldest first (ignores tmp and shard files)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``ckpt_dir``, or None."""
    ck = list_checkpoints(ckpt_dir)
    return ck[-1][1] if ck else None


def _stale_tmp_files(d: Path, newest: Path | None, now: float) -> Iterable[Path]:
    """Checkpoint tmp files in ``d`` left by a killed writer.

    A file counts as stale only if its name is one :func:`atomic_write_bytes` gives a checkpoint being written, it
    was last modified more than :data:`STALE_TMP_AGE_S` seconds ago, and before the newest complete checkpoint
    ``newest`` was (a writer still at work keeps touching its file; with no complete checkpoint nothing is removed).
    """
    if newest is None:
        return []
    try:
        newest_mtime = newest.stat().st_mtime
    except OSError:
        return []
    out = []
    for p in d.iterdir():
        if not _TMP_NAME.match(p.name):
            continue
        try:
            mtime = p.stat().st_mtime
        except OSError:
            continue
        if mtime < newest_mtime and now - mtime > STALE_TMP_AGE_S:
            out.append(p)
    return out


def prune_checkpoints(ckpt_dir: str | os.PathLike, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints (with their rank shard files) and stale tmp files.

    Stale tmp files are those of :func:`_stale_tmp_files` (a killed writer's; never one a live writer may still be
    writing).
    """
    d = Path(ckpt_dir)
    ck = list_checkpoints(d)
    for step, p in ck[:-keep] if keep > 0 else []:
        p.unlink(missing_ok=True)
        for q in d.glob(f"ckpt_{step:08d}.rank*.pt"):
            q.unlink(missing_ok=True)
    for t in _stale_tmp_files(d, ck[-1][1] if ck else None, time.time()):
        t.unlink(missing_ok=True)
