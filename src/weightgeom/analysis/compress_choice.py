"""``share="auto"`` with calibration: per role, the space (input-shared, output-shared or per layer) whose
activation-aware fit has the lowest calibration loss at the requested savings (or rank).

Each role is fitted in all three spaces (:func:`~weightgeom.analysis.compress.compress_roles` with the calibration
Grams, one group in memory at a time) and its relative layer-output error Σ_l tr(D_l G_l D_lᵀ) / Σ_l tr(W_l G_l W_lᵀ)
(D_l = W_l − Ŵ_l) compared; a space no rank ≥ 1 reaches the savings in is skipped. The continuity ratios
(:func:`~weightgeom.analysis.compress.choose_spaces`) are reported beside the choice, not obeyed.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from weightgeom.analysis.api import _as_loaded
from weightgeom.analysis.calibration import source_grams
from weightgeom.analysis.compress import (
    SPACES,
    CompressConfig,
    CompressResult,
    _plan,
    _select,
    check_out,
    choose_spaces,
    compress,
    compress_roles,
)
from weightgeom.analysis.loaders import Loaded
from weightgeom.analysis.roles import RoleWeight, assign_roles

__all__ = ["role_losses", "choose_by_loss", "format_choice_table", "compress_calibrated"]


def role_losses(items: list[RoleWeight], role: str, cfg: CompressConfig, grams, space: str,
                keep: list | None = None) -> float:
    """The role's relative calibration loss when fitted in ``space`` at ``cfg``'s savings or rank (NaN when no rank
    reaches it there).

    Args:
        keep: a list the fitted :class:`~weightgeom.analysis.compress.GroupResult` s are appended to (None: dropped).
    """
    ccfg = replace(cfg, share=space, basis="svd", roles=(role,))
    try:
        _plan({role: items}, ccfg, {role: space})
    except ValueError:
        return math.nan
    err = en = 0.0
    for g in compress_roles(None, ccfg, by_role={role: items}, spaces={role: space}, grams=grams):
        err += (g.calib_loss or 0.0) * g.calib_energy
        en += g.calib_energy
        if keep is not None:
            keep.append(g)
    return err / en if en > 0 else 0.0


def choose_by_loss(by_role: Mapping[str, list[RoleWeight]], cfg: CompressConfig, grams,
                   ratios: Mapping[str, dict] | None = None, progress: bool = False,
                   keep: dict | None = None) -> dict[str, dict]:
    """Per role, the space with the lowest calibration loss.

    Args:
        by_role: role → its matrices (lazy or dense).
        cfg: the settings (its savings or rank is used for every space).
        grams: :class:`~weightgeom.analysis.calibration.Grams`.
        ratios: role → continuity ratios ``{"input": C_v/random, "output": C_u/random}`` to report beside it.
        keep: a dict that gets role → the chosen space's fitted groups (so they need not be fitted again).

    Returns:
        role → ``{"space": ..., "loss": {space: relative loss}, "input": ratio, "output": ratio, "by": "loss"}``.
    """
    out: dict[str, dict] = {}
    t0 = time.perf_counter()
    for j, (role, items) in enumerate(by_role.items()):
        fitted: dict[str, list] = {s: [] for s in SPACES}
        losses = {s: role_losses(items, role, cfg, grams, s, fitted[s] if keep is not None else None)
                  for s in SPACES}
        ok = {s: v for s, v in losses.items() if not math.isnan(v)}
        best = min(ok, key=lambda s: ok[s]) if ok else "none"
        if keep is not None:
            keep[role] = fitted[best]
        del fitted
        r = dict((ratios or {}).get(role) or {})
        out[role] = {"space": best, "loss": losses, "input": r.get("input", math.nan),
                     "output": r.get("output", math.nan), "by": "loss"}
        if progress:
            print(f"  [{j + 1}/{len(by_role)} roles] auto: {role} " + ", ".join(
                f"{s} {v:.4g}" for s, v in losses.items()) + f" → {best}  {time.perf_counter() - t0:.1f} s elapsed",
                file=sys.stderr, flush=True)
    return out


def _num(x) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def format_choice_table(spaces: Mapping[str, dict]) -> str:
    """The per-role table ``compress`` ends with: the choice, the calibration loss of each option (relative
    layer-output error on the calibration text) and the continuity ratios (C_v, C_u over their random levels)."""
    head = ("role", "choice", "loss input", "loss output", "loss per-layer", "C_v/rand", "C_u/rand")
    rows = [head]
    for role, v in spaces.items():
        loss = v.get("loss") or {}
        rows.append((role, "per-layer" if v.get("space") == "none" else str(v.get("space")),
                     _num(loss.get("input")), _num(loss.get("output")), _num(loss.get("none")),
                     _num(v.get("input")), _num(v.get("output"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def compress_calibrated(source, out: str | Path | None = None, cfg: CompressConfig | None = None, *,
                        role_map: Mapping[str, str] | str | None = None, progress: bool = False,
                        allow_growth: bool = False, grams=None, **kwargs) -> CompressResult:
    """:func:`~weightgeom.analysis.compress.compress` with activation-aware fits: collects the calibration Grams of
    ``source`` (:func:`~weightgeom.analysis.calibration.source_grams` on ``cfg.calibration``, unless ``grams`` is
    given), picks ``auto``'s spaces by calibration loss (:func:`choose_by_loss`, continuity ratios beside), then
    compresses.

    Raises:
        ValueError: as :func:`~weightgeom.analysis.compress.compress`, and a source that cannot be run for
            calibration (one line saying to use weight-only fits).
    """
    cfg = cfg or CompressConfig(**kwargs)
    if cfg.calibration is None and grams is None:
        cfg = replace(cfg, calibration="shakespeare")
    cfg.check()
    if out is not None:
        check_out(out, source, cfg, role_map)  # refused before the calibration pass
    src = _as_loaded(source)
    by_role = _select(assign_roles(src.tensors, role_map), cfg.roles)
    if cfg.share != "auto":
        _plan(by_role, cfg, dict.fromkeys(by_role, cfg.share), allow_growth)
    if grams is None:
        runnable = source.meta.get("path") if isinstance(source, Loaded) else source
        grams = source_grams(runnable, list(by_role), text=cfg.calibration, role_map=role_map,
                             tokens=cfg.calibration_tokens, progress=progress)
    spaces_info = None
    if cfg.share == "auto":
        if progress:
            print("continuity analysis (its ratios are reported beside auto's choice) ...", file=sys.stderr, flush=True)
        ratios = choose_spaces(src, role_map, list(by_role))
        if progress:
            print("measuring each role's calibration loss in the input, output and per-layer spaces ...",
                  file=sys.stderr, flush=True)
        spaces_info = choose_by_loss(by_role, cfg, grams, ratios, progress)
    return compress(source, out, cfg, role_map=role_map, progress=progress, allow_growth=allow_growth, grams=grams,
                    spaces_info=spaces_info)
