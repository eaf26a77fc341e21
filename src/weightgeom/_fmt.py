"""Human-readable figures printed by every command: one definition of how a duration reads."""

from __future__ import annotations

import math

__all__ = ["duration"]


def duration(seconds: float) -> str:
    """A duration as people read it: ``"45 s"`` under 90 s, ``"12 min"`` under 90 minutes, else ``"3.4 h"``.

    Args:
        seconds: wall time in seconds; negative values read as 0, and a value that is not finite as ``"?"``.

    Returns:
        The text, rounded to what a progress line or an estimate can promise (whole seconds, whole minutes, or
        tenths of an hour).
    """
    if not math.isfinite(seconds):
        return "?"
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
