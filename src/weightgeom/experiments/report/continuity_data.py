"""What the continuity report and the claims read from a run's ``continuity.jsonl``: per-step means of the
continuity metrics, their curves, and the top-k spread of the final weights (one definition for both)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from weightgeom.analysis.recorder import ROW_METRICS
from weightgeom.experiments.report.common import RunData

SPREAD_COLUMNS = ("v1_share", "cv_rest", "topk_overlap", "topk_overlap_rand")
# The continuity paper: expected continuity space per Llama projection
EXPECTED_SPACE = {"q": "v1", "k": "v1", "gate": "v1", "up": "v1", "o": "u1", "down": "u1", "v": "low"}


# -------------------------------------------------------------------------------------------------- continuity
CONT_METRICS = ROW_METRICS


def cont_summary(run: RunData, kind: str, step: str | int = "last") -> dict[str, float]:
    """Mean over layers (and roles) of each continuity metric at a step of ``continuity.jsonl``."""
    c = run.continuity
    if c is None or "kind" not in c:
        return {}
    sub = c[c["kind"] == kind]
    if sub.empty:
        return {}
    s = int(sub["step"].max()) if step == "last" else (int(sub["step"].min()) if step == "first" else int(step))
    sub = sub[sub["step"] == s]
    return {m: float(sub[m].mean()) for m in CONT_METRICS + ("dominance",) if m in sub and sub[m].notna().any()}


def cont_curve(run: RunData, kind: str, metric: str, role: str | None = None) -> pd.Series:
    """One continuity metric over training (mean over layers, of one role when given), indexed by step."""
    c = run.continuity
    if c is None or "kind" not in c or metric not in c:
        return pd.Series(dtype=float)
    sub = c[c["kind"] == kind]
    if role is not None and "role" in sub:
        sub = sub[sub["role"] == role]
    if sub.empty:
        return pd.Series(dtype=float)
    return sub.groupby("step")[metric].mean().sort_index()


def spread_summary(run: RunData) -> dict[str, float]:
    """Means over layer pairs of the top-k spread columns of the last weight record (empty when not recorded)."""
    c = run.continuity
    if c is None or "kind" not in c or "v1_share" not in c:
        return {}
    sub = c[(c["kind"] == "weight") & c["v1_share"].notna()]
    if sub.empty:
        return {}
    sub = sub[sub["step"] == sub["step"].max()]
    cols = [k for k in sub.columns if k in SPREAD_COLUMNS or (k.startswith("cv_dir") and k[6:].isdigit())]
    return {k: float(sub[k].mean()) for k in cols if sub[k].notna().any()}


def spread_mean(rs: Sequence[RunData], key: str) -> float:
    """Mean over the finished runs of one top-k spread column (NaN when none recorded it)."""
    v = [x for x in (spread_summary(r).get(key, float("nan")) for r in rs if not r.diverged) if math.isfinite(x)]
    return float(np.mean(v)) if v else float("nan")
