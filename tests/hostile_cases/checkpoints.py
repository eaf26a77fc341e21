"""Hostile inputs: checkpoints (rows of tests/test_hostile.py).

weightgeom's checkpoints load with ``torch.load(weights_only=True)``: a checkpoint whose SHA-256 header is valid (anyone
can compute one) but whose payload pickles code is refused with one line before any of it runs — on ``train
--resume``, on auto-resume (``train CONFIG --out RUN``) and in ``weightgeom analyze RUN`` (the loader rows); a
checkpoint of the older, fully pickled format is refused without being unpickled; every optimizer's state survives
the tensors-only loader; stale ``.tmp`` files of a killed writer are removed, a live writer's are not.

Every row drives the ``weightgeom train`` CLI in-process with a one-layer GPT on synthetic data (a few steps, about a
second each on a CPU).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shlex
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from hostile_cases import EvilPayload, Hostile, assert_one_line_error, cli, marker_path

__all__ = ["CASES", "TINY", "OsSystemPayload", "tiny_run", "write_evil_checkpoint", "write_old_format_checkpoint"]

TINY = {
    "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
    "data": {"kind": "synthetic", "block_size": 16, "batch_size": 4},
    "optim": {"name": "adamw", "adamw": {"lr": 1e-2}},
    "train": {"max_steps": 4, "eval_every": 4, "eval_iters": 1, "log_every": 1, "ckpt_every": 2},
}


def _config(tmp: Path, optim: dict | None = None) -> Path:
    p = tmp / "tiny.yaml"
    p.write_text(yaml.safe_dump({**TINY, "optim": {**TINY["optim"], **(optim or {})}}))
    return p


def tiny_run(tmp: Path, run: Path, optim: dict | None = None) -> Path:
    """Train the tiny config into ``run`` (4 steps, checkpoints at 2 and 4) through the CLI; returns the config file."""
    cfg = _config(tmp, optim)
    res = cli("train", cfg, "--out", run, "--no-progress")
    assert res.rc == 0, res.err
    return cfg


class OsSystemPayload:
    """Unpickling this object runs ``touch MARKER`` through ``os.system`` (pickled as ``posix.system`` on Linux), the
    classic malicious-pickle payload; PyTorch's weights-only unpickler refuses its module as blocked."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def _with_header(magic: bytes, data: bytes) -> bytes:
    return magic + b" " + hashlib.sha256(data).hexdigest().encode() + b" " + str(len(data)).encode() + b"\n" + data


def write_evil_checkpoint(path: Path, marker: Path, like: Path | None = None, payload_cls: type = EvilPayload) -> Path:
    """A checkpoint with a valid current-format header and hash whose payload also pickles code creating ``marker``.

    Args:
        path: file to write (e.g. the newest ``ckpt_*.pt`` of a real run, which it replaces).
        marker: file the payload would create when unpickled.
        like: a real checkpoint whose payload (same step, config and config hash) the evil one copies, so every
            check that runs after unpickling would pass; None: a minimal payload.
        payload_cls: the pickled object's class, built with ``marker`` (:class:`EvilPayload` calls ``exec``,
            :class:`OsSystemPayload` calls ``os.system``).
    """
    from weightgeom.train.checkpoint import MAGIC, load_checkpoint

    payload = load_checkpoint(like) if like is not None else {"step": 1, "config_hash": "x", "model": {}}
    payload["evil"] = payload_cls(marker)
    buf = io.BytesIO()
    torch.save(payload, buf)
    path.write_bytes(_with_header(MAGIC, buf.getvalue()))
    return path


def write_old_format_checkpoint(path: Path, marker: Path) -> Path:
    """A checkpoint as weightgeom wrote it before tensors-only loading (``WGCKPT1``: NumPy RNG state, fully pickled),
    with an extra object whose unpickling would create ``marker`` (proving it is refused without unpickling)."""
    payload = {"format": "weightgeom-ckpt-1", "step": 2, "config_hash": "x", "model": {"w": torch.zeros(2)},
               "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
               "evil": EvilPayload(marker)}
    buf = io.BytesIO()
    torch.save(payload, buf)
    path.write_bytes(_with_header(b"WGCKPT1", buf.getvalue()))
    return path


def _newest(run: Path) -> Path:
    from weightgeom.train.checkpoint import latest_checkpoint

    ck = latest_checkpoint(run / "checkpoints")
    assert ck is not None
    return ck


def _evil_run(tmp: Path) -> tuple[Path, Path, Path, bytes]:
    """A real tiny run whose newest checkpoint is replaced by an evil one with a valid header; returns (config, run,
    checkpoint, metrics bytes before)."""
    run = tmp / "run"
    cfg = tiny_run(tmp, run)
    ck = _newest(run)
    write_evil_checkpoint(ck, marker_path(tmp), like=ck)
    return cfg, run, ck, (run / "metrics.jsonl").read_bytes()


def _assert_refused_unrun(tmp: Path, res, ck: Path, run: Path, metrics: bytes) -> None:
    assert not marker_path(tmp).exists(), "the checkpoint's pickle ran code"
    assert_one_line_error(res, ck.name, "pickled Python objects")
    assert (run / "metrics.jsonl").read_bytes() == metrics, "the refused resume changed the run's metrics"


def _evil_on_resume(tmp: Path) -> None:
    _, run, ck, metrics = _evil_run(tmp)
    res = cli("train", "--resume", run, "--no-progress", "--set", "train.max_steps=6")
    _assert_refused_unrun(tmp, res, ck, run, metrics)


def _evil_on_auto_resume(tmp: Path) -> None:
    cfg, run, ck, metrics = _evil_run(tmp)
    res = cli("train", cfg, "--out", run, "--no-progress", "--set", "train.max_steps=6")
    _assert_refused_unrun(tmp, res, ck, run, metrics)


def _os_system_on_resume(tmp: Path) -> None:
    run = tmp / "run"
    tiny_run(tmp, run)
    ck = _newest(run)
    write_evil_checkpoint(ck, marker_path(tmp), like=ck, payload_cls=OsSystemPayload)
    metrics = (run / "metrics.jsonl").read_bytes()
    res = cli("train", "--resume", run, "--no-progress", "--set", "train.max_steps=6")
    _assert_refused_unrun(tmp, res, ck, run, metrics)
    line = assert_one_line_error(res, "posix.system", "os.system", "nothing in it was run")
    assert "weights_only" not in line, f"PyTorch's advice to turn weights_only off was repeated: {line!r}"


def _old_format_refused(tmp: Path) -> None:
    run = tmp / "run"
    tiny_run(tmp, run)
    ck = _newest(run)
    write_old_format_checkpoint(ck, marker_path(tmp))
    res = cli("train", "--resume", run, "--no-progress", "--set", "train.max_steps=6")
    assert not marker_path(tmp).exists(), "the old-format checkpoint was unpickled"
    assert_one_line_error(res, ck.name, "older weightgeom", "WGCKPT1")


def _stale_tmp_removed(tmp: Path) -> None:
    run = tmp / "run"
    tiny_run(tmp, run)
    ckdir = run / "checkpoints"
    old = time.time() - 3600
    stale = [ckdir / ".ckpt_00000006.pt.k1ll3d_x.tmp", ckdir / ".ckpt_00000004.rank1.pt.abc123.tmp"]
    live = ckdir / ".ckpt_00000008.pt.wr1t1ng.tmp"  # being written right now by a live writer: fresh mtime
    foreign = ckdir / "notes.tmp"  # not a name our writer uses
    for p in [*stale, live, foreign]:
        p.write_bytes(b"partial")
    for p in [*stale, foreign]:
        os.utime(p, (old, old))
    res = cli("train", "--resume", run, "--no-progress", "--set", "train.max_steps=6")
    assert res.rc == 0, res.err
    assert not any(p.exists() for p in stale), "a killed writer's tmp checkpoint was kept"
    assert live.exists(), "a tmp file a live writer may be writing was removed"
    assert foreign.exists(), "a file that is not one of our tmp checkpoints was removed"


_OPTIMS = ({"name": "adamw"}, {"name": "adamw-md"}, {"name": "muon"},
           {"name": "muon-md", "strategy": "hetero", "muon": {"dual": {"steps": 2}}})  # manifold state too


def _every_optimizer_safe(tmp: Path) -> None:
    for i, optim in enumerate(_OPTIMS):
        run = tmp / f"run{i}"
        tiny_run(tmp, run, optim)
        raw = _newest(run).read_bytes()
        payload = torch.load(io.BytesIO(raw[raw.index(b"\n") + 1:]), weights_only=True)  # PyTorch's safe loader
        assert payload["optimizer"] and payload["rng"]["numpy"], optim
        res = cli("train", "--resume", run, "--no-progress", "--set", "train.max_steps=5")
        assert res.rc == 0, f"{optim}: {res.err}"
        assert json.loads(res.out.strip().splitlines()[-1])["step"] == 5, optim


def _draws() -> tuple:
    return random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.randn()), torch.rand(3)


def _rng_roundtrip(tmp: Path) -> None:
    import pytest

    from weightgeom.train.checkpoint import CheckpointError, load_checkpoint, rng_state, save_checkpoint, set_rng_state

    random.gauss(0, 1)  # leave a cached Gaussian in Python's and NumPy's state: it must survive too
    np.random.randn()
    p = save_checkpoint(tmp / "ckpt_00000001.pt", {"step": 1, "config_hash": "h", "rng": rng_state()})
    want = _draws()
    raw = p.read_bytes()
    loaded = torch.load(io.BytesIO(raw[raw.index(b"\n") + 1:]), weights_only=True)  # PyTorch's safe loader
    set_rng_state(loaded["rng"])
    got = _draws()
    assert got[:4] == want[:4] and torch.equal(got[4], want[4])
    set_rng_state(load_checkpoint(p)["rng"])
    assert _draws()[:4] == want[:4]
    # a value the safe loader would refuse is refused when saving, naming its key; nothing is written
    with pytest.raises(CheckpointError, match=r"payload\['trainer'\]\['best'\] \(type numpy\.float64\)"):
        save_checkpoint(tmp / "ckpt_00000002.pt", {"step": 2, "trainer": {"best": np.float64(1.0)}})
    assert not (tmp / "ckpt_00000002.pt").exists() and not list(tmp.glob(".ckpt_*.tmp"))


CASES: list[Hostile] = [
    Hostile("evil-resume", "checkpoint",
            "a checkpoint with a valid SHA-256 header whose payload pickles code is refused on `train --resume` with "
            "one line naming it; no code runs and the run's files stay as they were", _evil_on_resume),
    Hostile("evil-auto-resume", "checkpoint",
            "the same crafted checkpoint met by auto-resume (`train CONFIG --out RUN`, as in every sweep) is refused "
            "the same way, before the config check", _evil_on_auto_resume),
    Hostile("evil-os-system", "checkpoint",
            "a checkpoint with a valid header whose payload pickles `os.system` (a module PyTorch blocks) is refused "
            "on `train --resume` with one line naming `posix.system`/`os.system` and saying nothing in it was run, "
            "never PyTorch's advice to switch its weights-only safety off; no code runs", _os_system_on_resume),
    Hostile("old-format", "checkpoint",
            "a checkpoint written by an older weightgeom (fully pickled WGCKPT1 format) is refused with one line "
            "saying so, without being unpickled", _old_format_refused),
    Hostile("stale-tmp", "checkpoint",
            "stale `.tmp` checkpoint files of a killed writer are removed when the run next saves; a fresh one (a live "
            "writer's) and files of other names are kept", _stale_tmp_removed),
    Hostile("optimizer-state-safe", "checkpoint",
            "every optimizer's checkpoint (AdamW, Muon, MD, manifold strategies) loads with PyTorch's weights-only "
            "unpickler and resumes", _every_optimizer_safe),
    Hostile("rng-roundtrip", "checkpoint",
            "the torch, Python and NumPy RNG states come back exactly through the tensors-only loader; a value it "
            "would refuse is refused at save time, naming its key, and nothing is written", _rng_roundtrip),
]
