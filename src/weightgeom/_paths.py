"""Whether an output directory could be created and written, checked before any work and without leaving a trace."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["unwritable_reason"]


def unwritable_reason(out: Path, flag: str = "--out") -> str:
    """Why ``out`` cannot become an output directory ("" when it can): a file in the way, or a nearest existing
    ancestor that is not a directory or cannot be written. A real write test (a temporary directory created and
    removed at once: permissions alone say nothing for root, /proc or a read-only mount); nothing else is created."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        return f"{flag} {out}: exists and is not a directory"
    probe = out.absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{flag} {out}: {probe} exists and is not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".wg-out-check-", dir=probe))
    except OSError as e:
        return f"{flag} {out}: cannot create anything in {probe} ({e.strerror or e})"
    return ""
