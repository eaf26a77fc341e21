"""What every command module shares: argparse integer types, a parser whose errors are one line, the one formatter
of an ``OSError`` into a line naming the path. Standard library only (building a parser must import no torch)."""

from __future__ import annotations

import argparse
import errno

__all__ = ["os_error_line", "positive_int", "nonneg_int", "OneLineParser"]


def os_error_line(e: OSError) -> str:
    """One line for an ``OSError``: the path(s) it names and the system's reason, e.g.
    ``cannot use runs/x/checkpoints/ckpt_00000008.pt: No space left on device (ENOSPC)``. The one formatter every
    command uses."""
    reason = e.strerror or str(e) or type(e).__name__
    code = errno.errorcode.get(e.errno) if isinstance(e.errno, int) else None
    if code:
        reason += f" ({code})"
    if e.filename is None:
        return reason
    where = str(e.filename) + (f" -> {e.filename2}" if e.filename2 is not None else "")
    if isinstance(e, FileExistsError):  # os.makedirs on a path that is a regular file
        reason = "exists and is not a directory"
    return f"cannot use {where}: {reason}"


def _int_at_least(text: str, low: int, expected: str) -> int:
    """``int(text)`` if it is ≥ ``low``, else an argparse error saying ``expected``."""
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (``--steps``, ``--jobs``, ``--threads`` of sweep, demo and analyze)."""
    return _int_at_least(text, 1, "a positive integer")


def nonneg_int(text: str) -> int:
    """argparse type: an integer >= 0 (``--gpus-per-run``, ``--max-retries``)."""
    return _int_at_least(text, 0, "an integer >= 0")


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``weightgeom sweep: error: argument --steps: ... (see weightgeom
    sweep --help)``) with exit code 2, instead of the usage block followed by the error; subparsers inherit it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
