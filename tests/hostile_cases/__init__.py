"""Shared pieces of the hostile-input table (``tests/test_hostile.py``).

Each area module (``loaders``, ``checkpoints``, ``rundir``, ``sweeps``, ``optim``, ``data``) exports ``CASES``: a list
of :class:`Hostile` rows. A row names the hostile input and holds a ``check(tmp_path)`` that builds the input under
``tmp_path``, drives the user-facing entry point (the CLI in-process through :func:`cli`, or the Python API) and
asserts the promise (no code ran, one line and exit 2, nothing lost, nothing half-applied).
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Hostile", "CliResult", "cli", "assert_one_line_error", "EvilPayload", "evil_pickle_bytes",
           "write_evil_torch", "marker_path"]


@dataclass(frozen=True)
class Hostile:
    """One row of the hostile-input table.

    Attributes:
        id: short unique name (the pytest id is ``<area>-<id>``).
        area: ``loader`` | ``checkpoint`` | ``rundir`` | ``sweep`` | ``optim`` | ``data`` | ``analyze``.
        what: the hostile input and the promise, in words (shown in the README's guarantees section).
        check: builds the input under the given temporary directory (also the working directory), runs the entry
            point, asserts the promise.
    """

    id: str
    area: str
    what: str
    check: Callable[[Path], None]


@dataclass
class CliResult:
    """Exit code and captured output of one in-process ``weightgeom`` command."""

    rc: int
    out: str
    err: str


def cli(*args: str) -> CliResult:
    """Run ``weightgeom ARGS`` in this process (as the console script would) and capture its output."""
    from weightgeom.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:  # argparse errors
            rc = e.code if isinstance(e.code, int) else 1
    return CliResult(int(rc or 0), out.getvalue(), err.getvalue())


def assert_one_line_error(res: CliResult, *must_contain: str, rc: int = 2) -> str:
    """Assert exit code ``rc``, no traceback, and a last stderr line that contains every string in ``must_contain``.

    Returns:
        That line.
    """
    assert "Traceback" not in res.err, f"traceback instead of one line:\n{res.err}"
    lines = [ln for ln in res.err.splitlines() if ln.strip()]
    assert lines, f"no error message (rc={res.rc}, stdout={res.out[-500:]!r})"
    line = lines[-1]
    assert res.rc == rc, f"exit code {res.rc}, expected {rc}; stderr: {res.err[-1000:]}"
    for s in must_contain:
        assert s in line, f"{s!r} not in the error line {line!r}"
    return line


def marker_path(tmp_path: Path) -> Path:
    """Where an evil payload would create its marker file."""
    return tmp_path / "PWNED"


class EvilPayload:
    """Unpickling this object creates the file ``marker`` (what an attacker's pickle would do, harmlessly)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def evil_pickle_bytes(marker: Path) -> bytes:
    """A plain pickle that creates ``marker`` when loaded."""
    return pickle.dumps({"weights": EvilPayload(marker)})


def write_evil_torch(path: Path, marker: Path, with_tensor: bool = True) -> Path:
    """A ``torch.save`` file holding a real tensor and an object whose unpickling creates ``marker``."""
    obj = {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 4)} if with_tensor else {}
    obj["evil"] = EvilPayload(marker)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)
    return path


def no_traceback(text: str) -> bool:
    """True if ``text`` holds no Python traceback."""
    return re.search(r"Traceback \(most recent call last\)", text) is None
