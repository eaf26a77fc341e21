"""``Muon.summary()``'s text: one line per parameter group and, per device, the msign choice and the numerics.

``describe(opt)`` (``optim/param_groups.py``) gives the per-parameter table; this is the per-group view, kept beside
``Muon`` (``param_groups`` imports ``Muon``, so the text cannot live there without an import cycle).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from weightgeom.linalg.numerics import NOT_RESOLVED, Numerics
from weightgeom.optim.state_compat import TORCH_MUON

__all__ = ["summary"]


def summary(param_groups: Sequence[Mapping[str, Any]], numerics: Mapping[str, Numerics],
            msign_auto: Mapping[str, Mapping[str, Any]]) -> str:
    """One line per parameter group (algorithm, size, manifold, msign settings) plus, per device of ``numerics``, the
    msign choice (``msign_auto``) and the numerics (``Numerics.describe``).

    Args:
        param_groups: a ``Muon``'s groups.
        numerics: its ``numerics`` ({device: ``Numerics``}).
        msign_auto: its ``msign_auto`` ({device: ``MsignChoice.as_dict()``}).

    Returns:
        The lines joined by newlines (no trailing newline).
    """
    lines = []
    for gi, group in enumerate(param_groups):
        n = sum(p.numel() for p in group["params"])
        if group["algorithm"] == "adamw":
            lines.append(f"group {gi}: adamw, {len(group['params'])} params ({n:,} weights), lr {group['lr']:g}")
            continue
        dt = group["msign_dtype"]
        ms = (f"msign {group['msign_method']}, steps {group['ns_steps'] or 'auto'}, dtype "
              f"{str(dt).replace('torch.', '') if dt is not None else 'auto'}")
        if group["ns_coefficients"] is not None:
            ms = (f"Newton–Schulz {tuple(group['ns_coefficients'])}, steps "
                  f"{group['ns_steps'] or TORCH_MUON['ns_steps']}, dtype "
                  f"{str(dt or torch.bfloat16).replace('torch.', '')}, eps {group['eps']:g}")
        where = f", manifold {group['manifold']}" if group["manifold"] is not None else ""
        lines.append(f"group {gi}: muon, {len(group['params'])} matrices ({n:,} weights), lr {group['lr']:g}"
                     f"{where}, {ms}")
    for dev, n in numerics.items():
        c = msign_auto.get(dev)
        kind = None if n.products_source == NOT_RESOLVED else n.products
        if c is not None:
            products = "" if kind is None else f"; manifold constraint products {kind}"
            lines.append(f"msign auto on {dev}: {c['dtype']}, {c['steps']} Polar Express steps ({c['source']})"
                         f"{products}")
        elif kind is not None:  # manifold groups with their msign set explicitly
            lines.append(f"manifold constraint products on {dev}: {kind}")
        lines.append(n.describe())
    return "\n".join(lines)
