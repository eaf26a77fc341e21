"""Where weightgeom keeps per-machine caches (compiled kernels, msign micro-benchmark results)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """``$WEIGHTGEOM_CACHE_DIR``, else ``$XDG_CACHE_HOME/weightgeom`` (``~/.cache/weightgeom``)."""
    root = os.environ.get("WEIGHTGEOM_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "weightgeom")
    return Path(root)
