"""Ownership of a run or sweep directory: one writer at a time, and earlier runs moved aside, never mixed or deleted.

A directory is owned through a lock file (:data:`LOCK_NAME`) holding the owner's pid, host, process start time and
command as JSON. It is created with ``O_CREAT | O_EXCL``, so exactly one process wins. A lock whose owner is gone is
*stale*: on the same host that is decided for certain (the pid no longer exists, or it was reused by a process that
started later than the recorded start time); a lock written on another host cannot be checked from here and is refused
with a line that says how to remove it. Breaking a stale lock and taking a new one happen under ``flock`` on a guard
file, so two processes that both see the same stale lock cannot both take it over.

A process killed with ``kill -9`` leaves its lock file behind; the next writer finds it stale and takes over. Release
removes the lock only if it still names this process.

:func:`archive_previous` moves the files of an earlier run (metrics, checkpoints, status, config, logs) into
``previous/<UTC time>/`` inside the same directory, so a fresh run never shares a directory listing with an old one's
checkpoints and nothing is deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from weightgeom._files import open_append, read_json

__all__ = ["read_status", "LOCK_NAME", "PREVIOUS_DIR", "DirLock", "LockError", "read_lock", "lock_is_stale",
           "archive_previous", "safe_child", "check_relative_name", "remove_if_unused", "RUN_MARKERS", "TRAINER_FILES",
           "check_run_dir_contents", "proc_state"]

LOCK_NAME = ".weightgeom.lock"
"""File name of the lock inside the owned directory."""

PREVIOUS_DIR = "previous"
"""Sub-directory that earlier runs' files are moved into (one ``<UTC time>`` folder per earlier run)."""

_GUARD_NAME = ".weightgeom.lock.guard"

TRAINER_FILES = ("status.json", "meta.json", "metrics.jsonl", "config.resolved.toml", "checkpoints", "tb")
"""What the trainer writes into a run directory."""

RUN_MARKERS = ("config.resolved.toml", "status.json", "meta.json", "experiment.json")
"""Files whose presence shows a directory is a weightgeom run directory (the trainer writes the first three first
thing; a sweep writes ``experiment.json`` just before a run starts)."""


class LockError(ValueError):
    """The directory is owned by another live process (or by one on another host that cannot be checked)."""


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3… of Linux ``/proc/<pid>/stat`` (state first), or None where there is no such process or no ``/proc``.

    The command name (field 2) is in parentheses and may contain spaces, so the split starts after the last ')'.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split()


def _proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None where unknown."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19])  # field 22 overall: starttime
    except (TypeError, IndexError, ValueError):
        return None


def proc_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (``R``, ``S``, ``Z`` for a zombie ...), or None where unknown or gone."""
    fields = _stat_fields(pid)
    return fields[0].decode() if fields else None


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process. A killed process not yet reaped by its parent (a zombie, ``Z``) still
    answers ``kill(pid, 0)`` but will never write again, so it counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    return proc_state(pid) not in ("Z", "X")


def read_lock(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The owner record of ``directory``'s lock (pid, host, start, time, command), or None if there is no lock.

    An unreadable or partly written lock file reads as ``{"pid": None, ...}`` (owner unknown).
    """
    p = Path(directory) / LOCK_NAME
    try:
        rec = read_json(p, what="lock")
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"pid": None, "host": None}
    return rec if isinstance(rec, dict) else {"pid": None, "host": None}


def lock_is_stale(rec: dict[str, Any]) -> bool | None:
    """Whether the lock ``rec`` belongs to a process that no longer runs: True/False, or None if it cannot be told
    from this host (written on another host)."""
    pid = rec.get("pid")
    if rec.get("host") not in (None, platform.node()):
        return None
    if not isinstance(pid, int):
        # unknown owner: stale only if the file is old (a writer crashed between create and write)
        return time.time() - float(rec.get("_mtime", time.time())) > 60
    if not _pid_alive(pid):
        return True
    start = rec.get("start")
    now_start = _proc_start_time(pid)
    return start is not None and now_start is not None and now_start != start


def _describe(rec: dict[str, Any]) -> str:
    cmd = rec.get("command")
    cmd = " ".join(cmd) if isinstance(cmd, list) else (cmd or "?")
    if len(cmd) > 80:
        cmd = cmd[:77] + "..."
    return f"pid {rec.get('pid')} on host {rec.get('host')} since {rec.get('time', '?')} ({cmd})"


class DirLock:
    """Exclusive ownership of a directory by this process (a context manager).

    Args:
        directory: the run or sweep directory (created if missing).
        what: how error messages name it (``"run directory"``, ``"sweep directory"``).

    Raises:
        LockError: from :meth:`acquire`, when a live process (or one on another host) owns the directory.
    """

    def __init__(self, directory: str | os.PathLike, what: str = "run directory") -> None:
        self.directory = Path(directory)
        self.what = what
        self.path = self.directory / LOCK_NAME
        self.held = False
        self.took_over: dict[str, Any] | None = None  # the stale owner this lock replaced, if any

    def _refusal(self, rec: dict[str, Any]) -> str:
        """Why the lock held by ``rec`` refuses this process ("" when it is stale and may be replaced)."""
        with contextlib.suppress(OSError):
            rec.setdefault("_mtime", self.path.stat().st_mtime)
        if rec.get("pid") == os.getpid() and rec.get("host") == platform.node():
            return f"{self.what} {self.directory} is already in use by this process"
        stale = lock_is_stale(rec)
        if stale:
            return ""
        if stale is None:  # on another host, which cannot be checked
            return (f"{self.what} {self.directory} is in use by {_describe(rec)}; that host cannot be checked from "
                    f"here: if that process is gone, delete {self.path}")
        return (f"{self.what} {self.directory} is in use by {_describe(rec)}; wait for it to finish or choose "
                "another directory")

    def in_use_reason(self) -> str:
        """Why :meth:`acquire` would refuse now ("" when it would not), read without taking or changing anything —
        for a dry run that must predict the command's refusals."""
        if self.held:
            return ""
        rec = read_lock(self.directory)
        return "" if rec is None else self._refusal(rec)

    def _record(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": platform.node(), "start": _proc_start_time(os.getpid()),
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": sys.argv}

    def acquire(self) -> DirLock:
        """Take the lock, replacing a stale one. Re-entrant within this object."""
        if self.held:
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
        with open_append(self.directory / _GUARD_NAME, text=False) as guard:
            fcntl.flock(guard.fileno(), fcntl.LOCK_EX)
            try:
                for _ in range(3):
                    try:
                        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    except FileExistsError:
                        rec = read_lock(self.directory)
                        if rec is None:
                            continue  # released between our open and read: try again
                        refusal = self._refusal(rec)
                        if refusal:
                            raise LockError(refusal) from None
                        self.took_over = rec
                        self.path.unlink(missing_ok=True)
                        continue
                    with os.fdopen(fd, "w") as f:
                        json.dump(self._record(), f)
                        f.flush()
                        os.fsync(f.fileno())
                    self.held = True
                    return self
            finally:
                fcntl.flock(guard.fileno(), fcntl.LOCK_UN)
        raise LockError(f"{self.what} {self.directory}: could not take the lock {self.path}")

    def release(self) -> None:
        """Remove the lock if it still names this process (never another owner's)."""
        if not self.held:
            return
        self.held = False
        rec = read_lock(self.directory)
        if rec is not None and rec.get("pid") == os.getpid() and rec.get("host") == platform.node():
            with contextlib.suppress(OSError):
                self.path.unlink()

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def archive_previous(directory: str | os.PathLike, keep: tuple[str, ...] = ()) -> Path | None:
    """Move every entry of ``directory`` except the lock, ``previous/`` and ``keep`` into ``previous/<UTC time>/``.

    Used when a run starts fresh in a directory an earlier run used (``--fresh``, a sweep's ``--no-resume``), so the
    new run's checkpoints are never mixed with, pruned against or mistaken for the old run's, and nothing is deleted.

    Args:
        directory: the run directory (the caller must hold its :class:`DirLock`).
        keep: names to leave in place (e.g. ``experiment.json`` written by a sweep just before the run).

    Returns:
        The folder the old files went to, or None if there was nothing to move.
    """
    d = Path(directory)
    if not d.is_dir():
        return None
    skip = {LOCK_NAME, _GUARD_NAME, PREVIOUS_DIR, *keep}
    entries = [p for p in d.iterdir() if p.name not in skip]
    if not entries:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = d / PREVIOUS_DIR / stamp
    k = 1
    while dest.exists():
        k += 1
        dest = d / PREVIOUS_DIR / f"{stamp}-{k}"
    dest.mkdir(parents=True)
    for p in entries:
        os.replace(p, dest / p.name)
    return dest


def remove_if_unused(directory: str | os.PathLike) -> bool:
    """Remove ``directory`` if it holds nothing but the lock's guard file (a writer that took the lock on a directory
    it created and then wrote nothing, e.g. because its input was refused). Call only after releasing the lock.

    Returns:
        True if the directory was removed.
    """
    d = Path(directory)
    try:
        names = {p.name for p in d.iterdir()}
    except OSError:
        return False
    if not names <= {_GUARD_NAME}:
        return False
    with contextlib.suppress(OSError):
        (d / _GUARD_NAME).unlink(missing_ok=True)
        d.rmdir()
        return True
    return False


def check_run_dir_contents(directory: str | os.PathLike, what: str = "run directory") -> None:
    """Refuse to train into a directory that holds anything but weightgeom runs' files.

    A run directory is either new, empty (but for a lock), or an earlier weightgeom run (it holds one of
    :data:`RUN_MARKERS`; a fresh start then moves that run to ``previous/``). Anything else — a project folder, a
    sweep directory, a folder of other runs — is refused, so a fresh start never moves a user's files or a live run's
    directory aside. A run directory may not contain another run (a sub-folder with a lock or a run marker).

    Raises:
        ValueError: one line naming the directory and what is in it; nothing was written or moved.
    """
    d = Path(directory)
    if not d.is_dir():
        return
    entries = list(d.iterdir())
    names = {p.name for p in entries}
    if names & set(RUN_MARKERS):
        nested = sorted(p.name for p in entries if p.name != PREVIOUS_DIR and p.is_dir()
                        and any((p / m).exists() for m in (LOCK_NAME, *RUN_MARKERS)))
        if nested:
            raise ValueError(f"{what} {d} contains another run ({nested[0]}/); a run directory cannot hold other "
                             "runs: choose another --out (nothing was written or moved)")
        return
    foreign = sorted(names - {LOCK_NAME, _GUARD_NAME, PREVIOUS_DIR})
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise ValueError(f"{what} {d} is not empty and holds no weightgeom run ({', '.join(foreign[:3])}{more}); "
                         "choose a new or empty directory with --out (nothing was written or moved)")


def check_relative_name(name: str, what: str = "run.name", parent: str = "run.out_dir") -> str:
    """Refuse a directory name that would not be a proper sub-directory of ``parent``; returns ``name``.

    The name is a path relative to ``parent`` (``"x"`` or ``"sweep/x"``): it may not be empty, absolute, start with
    ``~``, contain control characters or a ``..`` component, or name ``parent`` itself (``"."``). Symbolic links that
    lead out are caught by :func:`safe_child`, which resolves the path.

    Raises:
        ValueError: one line naming ``what``, the value and what is wrong with it.
    """
    key = f"config key {what}={name!r}"
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{key}: must be a non-empty name (the run directory under {parent})")
    if os.path.isabs(name) or name.startswith("~"):
        raise ValueError(f"{key}: must be relative to {parent}, not an absolute path (set {parent} or use --out to "
                         "choose where the run goes)")
    if any(ord(c) < 32 for c in name):
        raise ValueError(f"{key}: must not contain control characters (newline, tab, ...)")
    parts = Path(name).parts
    if not [part for part in parts if part != "."]:
        raise ValueError(f"{key}: names {parent} itself; give the run its own sub-directory name")
    if ".." in parts:
        raise ValueError(f"{key}: must not contain '..' (the run directory would be outside {parent})")
    return name


def safe_child(parent: str | os.PathLike, name: str, what: str = "run.name") -> Path:
    """``parent / name``, refusing a ``name`` that :func:`check_relative_name` refuses or that resolves outside
    ``parent`` (through a symbolic link).

    Raises:
        ValueError: one line naming ``what`` and the bad value.
    """
    check_relative_name(name, what)
    base = Path(parent).resolve()
    child = (base / name).resolve()
    if child == base:
        raise ValueError(f"config key {what}={name!r}: resolves to the output directory {base} itself; give the run "
                         "its own sub-directory name")
    if base not in child.parents:
        raise ValueError(f"config key {what}={name!r}: resolves to {child}, outside {base}")
    return Path(parent) / name


def read_status(run_dir: str | os.PathLike) -> dict[str, Any]:
    """A run directory's ``status.json`` (``{"state": "running" | "done" | "diverged" | "failed", "step", "reason"}``),
    or ``{}`` when it is absent or unreadable (a run that never started, or one killed while writing it)."""
    try:
        st = read_json(Path(run_dir) / "status.json", what="run status")
    except (OSError, ValueError):
        return {}
    return st if isinstance(st, dict) else {}
