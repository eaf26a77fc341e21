"""Whether an output directory could be created and written, checked before any work and without leaving a trace."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["unwritable_reason"]


def unwritable_reason(out: Path, flag: str = "--out") -> str:
    """Why ``out`` cannot become an output directory ("" when it can): a file, a dangling or looping symbolic link in
    the way (at ``out`` or above it), or a nearest existing ancestor that is not a directory or cannot be written.
    A real write test (a temporary directory created and removed at once in that ancestor — which changes its
    modification time — since permissions alone say nothing for root, /proc or a read-only mount); nothing is left."""
    out = Path(out)
    probe = out.absolute()
    while not os.path.lexists(probe):  # the nearest ancestor that is there in any form
        probe = probe.parent
    if not probe.is_dir():  # a file, or a symbolic link that leads nowhere (dangling, or a loop)
        what = "is a symbolic link that leads nowhere (dangling, or a loop)" if probe.is_symlink() and not \
            probe.exists() else "exists and is not a directory"
        return f"{flag} {out}: {probe} {what}" if probe != out.absolute() else f"{flag} {out}: {what}"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".wg-out-check-", dir=probe))
    except OSError as e:
        return f"{flag} {out}: cannot create anything in {probe} ({e.strerror or e})"
    return ""
