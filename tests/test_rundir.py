"""Run/sweep directory ownership (weightgeom.train.rundir): the lock, stale-lock takeover, archiving, safe names."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weightgeom.train.rundir import (
    LOCK_NAME,
    DirLock,
    LockError,
    archive_previous,
    lock_is_stale,
    read_lock,
    safe_child,
)

HOLDER = """
import sys, time
from weightgeom.train.rundir import DirLock
lock = DirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def _start_holder(d: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(d)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_lock_records_owner_and_releases(tmp_path):
    with DirLock(tmp_path / "run") as lock:
        rec = read_lock(tmp_path / "run")
        assert rec["pid"] == os.getpid() and rec["host"] == platform.node()
        assert lock.held
    assert read_lock(tmp_path / "run") is None


def test_second_writer_refused_then_stale_after_sigkill(tmp_path):
    d = tmp_path / "run"
    p = _start_holder(d)
    try:
        with pytest.raises(LockError, match=rf"in use by pid {p.pid} on host"):
            DirLock(d).acquire()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert read_lock(d)["pid"] == p.pid  # kill -9 leaves the file behind ...
    lock = DirLock(d).acquire()  # ... and the next writer takes over
    assert lock.took_over["pid"] == p.pid
    assert read_lock(d)["pid"] == os.getpid()
    lock.release()


def test_reused_pid_is_stale(tmp_path):
    # a lock naming a live pid (ours) but another process start time: the pid was reused, the owner is gone
    d = tmp_path / "run"
    d.mkdir()
    (d / LOCK_NAME).write_text(json.dumps({"pid": os.getpid(), "host": platform.node(), "start": 1}))
    assert lock_is_stale(read_lock(d)) is True


def test_other_host_is_refused_with_a_way_out(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "some-other-node", "start": 5}))
    with pytest.raises(LockError, match="cannot be checked from here: if that process is gone, delete"):
        DirLock(d).acquire()


def test_release_never_removes_another_owner(tmp_path):
    d = tmp_path / "run"
    lock = DirLock(d).acquire()
    (d / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere"}))  # someone broke and retook it
    lock.release()
    assert read_lock(d)["host"] == "elsewhere"


def test_garbage_lock_file_young_is_respected_old_is_stale(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / LOCK_NAME).write_text("{half-writ")
    with pytest.raises(LockError):
        DirLock(d).acquire()
    old = time.time() - 3600
    os.utime(d / LOCK_NAME, (old, old))
    DirLock(d).acquire().release()


def test_archive_previous_moves_everything_but_keep(tmp_path):
    d = tmp_path / "run"
    (d / "checkpoints").mkdir(parents=True)
    (d / "checkpoints" / "ckpt_00000008.pt").write_bytes(b"x")
    (d / "metrics.jsonl").write_text("{}\n")
    (d / "experiment.json").write_text("{}")
    with DirLock(d):
        dest = archive_previous(d, keep=("experiment.json",))
        assert dest is not None and dest.parent == d / "previous"
        assert sorted(p.name for p in d.iterdir()) == sorted([LOCK_NAME, ".weightgeom.lock.guard", "experiment.json",
                                                              "previous"])
        assert (dest / "checkpoints" / "ckpt_00000008.pt").read_bytes() == b"x"
        (d / "metrics.jsonl").write_text("{}\n")
        dest2 = archive_previous(d)  # a second archive never overwrites the first
        assert dest2 != dest and (dest / "metrics.jsonl").exists() and (dest2 / "metrics.jsonl").exists()
    assert archive_previous(tmp_path / "empty") is None


@pytest.mark.parametrize("name", ["../x", "../../x", "a/../../x", "/abs/x", "~/x", "", "  "])
def test_safe_child_refuses_escapes(tmp_path, name):
    with pytest.raises(ValueError, match="run.name"):
        safe_child(tmp_path, name)


def test_safe_child_refuses_symlink_escape(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "link").symlink_to(tmp_path.parent)
    with pytest.raises(ValueError, match="outside"):
        safe_child(tmp_path / "out", "link/x")
    assert safe_child(tmp_path / "out", "a/b") == tmp_path / "out" / "a" / "b"


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_run_files_follow_the_umask_not_0600(tmp_path, mask):
    # files of a run (config, status, checkpoints) are written through a temporary file; they must still get the
    # mode an ordinary open() gives, so collaborators on a shared filesystem can read the run
    from weightgeom.train.checkpoint import atomic_write_bytes

    old = os.umask(mask)
    try:
        atomic_write_bytes(tmp_path / "status.json", b"{}")
    finally:
        os.umask(old)
    assert (tmp_path / "status.json").stat().st_mode & 0o777 == 0o666 & ~mask


def test_killed_but_unreaped_owner_is_stale(tmp_path):
    # a worker killed with kill -9 stays a zombie until its parent reaps it; it will never write again, so the next
    # writer must not be refused because kill(pid, 0) still answers
    d = tmp_path / "run"
    p = _start_holder(d)
    p.send_signal(signal.SIGKILL)
    for _ in range(100):  # wait until it is a zombie (not reaped: no p.wait() yet)
        with open(f"/proc/{p.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.02)
    try:
        lock = DirLock(d).acquire()
        assert lock.took_over["pid"] == p.pid
        lock.release()
    finally:
        p.wait()


def test_report_ignores_runs_moved_to_previous(tmp_path):
    from weightgeom.experiments.report.common import discover

    for rel in ("sweep/a", "sweep/a/previous/20260101T000000Z", "sweep/b"):
        (tmp_path / rel).mkdir(parents=True, exist_ok=True)
        (tmp_path / rel / "status.json").write_text('{"state": "done"}')
    found = discover([tmp_path / "sweep"])
    assert [p.name for p in found] == ["a", "b"]


def test_train_cli_refuses_a_run_inside_a_directory_a_live_sweep_owns(tmp_path, capsys):
    """Hostile trial: `weightgeom train --out SWEEP/run --fresh` while the sweep ran moved the sweep's finished run
    aside. A directory whose lock a live process holds (a sweep, a demo) takes no `weightgeom train` run."""
    from weightgeom.cli import main
    from weightgeom.train.rundir import DirLock

    sweep = tmp_path / "sw"
    cfg = tmp_path / "c.toml"
    cfg.write_text('[data]\nkind = "shakespeare"\n[train]\nmax_steps = 1\n')
    with DirLock(sweep, what="sweep directory"):
        assert main(["train", str(cfg), "--out", str(sweep / "run"), "--fresh", "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "a running sweep or demo owns" in err[0], err
        assert not (sweep / "run").exists()
