"""Atomic, verified checkpoints.

File layout (``ckpt_00001000.pt``): one header line ``WGCKPT1 <sha256 hex> <payload bytes>\\n`` followed by the
``torch.save`` payload. Writing goes to a temporary file in the same directory, is flushed and fsync'd, then
``os.replace``-d onto the final name (atomic on POSIX) and the directory is fsync'd: a process killed mid-write leaves
only a stray ``.tmp`` file, never a truncated checkpoint under a final name, and the previous checkpoint stays
loadable. Loading checks the header, the length and the hash before unpickling, so a truncated or corrupted file is
refused with one clear line instead of an unpickling traceback.

A payload holds ``step``, ``config_hash``, ``config``, ``model``, ``optimizer``, ``rng`` (torch CPU/CUDA, Python,
NumPy) and ``trainer`` (smoothed loss, best loss, ...). Under torchrun with a sharded optimizer each rank r > 0 also
writes ``ckpt_XXXXXXXX.rank{r}.pt`` (its optimizer shard and RNG), and rank 0 writes the main file last, after a
barrier, so the main file's presence means the whole checkpoint is complete.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints",
           "prune_checkpoints", "rng_state", "set_rng_state", "atomic_write_bytes", "checkpoint_name"]

MAGIC = b"WGCKPT1"
_NAME = re.compile(r"^ckpt_(\d{8})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: truncated, corrupted, wrong format, or from a different config."""


def checkpoint_name(step: int, rank: int = 0) -> str:
    """File name of the checkpoint at ``step`` (``rank > 0``: that rank's shard file)."""
    return f"ckpt_{step:08d}.pt" if rank == 0 else f"ckpt_{step:08d}.rank{rank}.pt"


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, chunks) -> None:
    """Write byte ``chunks`` (bytes or an iterable of bytes) to ``path`` atomically (tmp + fsync + os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(chunks, (bytes, bytearray, memoryview)):
        chunks = [chunks]
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def rng_state() -> dict[str, Any]:
    """Snapshot of the torch (CPU and CUDA), Python and NumPy RNG states."""
    st = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    """Restore a snapshot from :func:`rng_state` (CUDA states only when CUDA is available)."""
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save_checkpoint(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Serialise ``payload`` with ``torch.save`` and write it atomically with a hash header.

    Args:
        path: final file path.
        payload: dict of tensors / plain Python objects (see module docstring for the trainer's keys).

    Returns:
        The path written.
    """
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getbuffer()
    header = MAGIC + b" " + hashlib.sha256(data).hexdigest().encode() + b" " + str(len(data)).encode() + b"\n"
    atomic_write_bytes(path, [header, data])
    return Path(path)


def load_checkpoint(path: str | os.PathLike, *, expected_hash: str | None = None,
                    map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read and verify a checkpoint.

    Args:
        path: checkpoint file.
        expected_hash: if given, the payload's ``config_hash`` must equal it.
        map_location: passed to ``torch.load``.

    Raises:
        CheckpointError: missing, truncated, corrupted (hash mismatch), not a weightgeom checkpoint, or made with a
            different config (one line naming the file and the reason).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    raw = path.read_bytes()
    nl = raw.find(b"\n", 0, 200)
    head = raw[:nl].split(b" ") if nl > 0 else []
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
    try:
        payload = torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: cannot unpickle: {e}".replace("\n", " ")) from e
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


def prune_checkpoints(ckpt_dir: str | os.PathLike, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints (with their rank shard files) and stale tmp files."""
    d = Path(ckpt_dir)
    ck = list_checkpoints(d)
    for step, p in ck[:-keep] if keep > 0 else []:
        p.unlink(missing_ok=True)
        for q in d.glob(f"ckpt_{step:08d}.rank*.pt"):
            q.unlink(missing_ok=True)
