"""Continuity analysis of weight stacks (SPEC §E): metrics, role recognition, loaders, reports, ``weightgeom analyze``.

Main entry points: :func:`analyze` (DataFrame, one row per (role, layer pair)), :func:`analyze_full` (plus per-layer
table and all-pairs cosine matrices), :func:`write_report` (CSV/JSON/PNG).
"""

from weightgeom.analysis.api import DEFAULT_METRICS, METRICS, AnalysisResult, analyze, analyze_full
from weightgeom.analysis.continuity import (
    dominance_ratio,
    gram_alignment,
    gram_alignment_svd,
    gram_random_level,
    index_matched_alignment,
    random_level_cos,
    stack_continuity,
    top_cos,
)
from weightgeom.analysis.loaders import Loaded, load, load_gguf
from weightgeom.analysis.roles import ROLES, assign_roles

__all__ = [
    "analyze", "analyze_full", "AnalysisResult", "METRICS", "DEFAULT_METRICS", "stack_continuity", "gram_alignment",
    "gram_alignment_svd", "gram_random_level", "index_matched_alignment", "random_level_cos", "top_cos",
    "dominance_ratio", "load", "load_gguf", "Loaded", "assign_roles", "ROLES", "write_report", "summary_table",
]


def __getattr__(name):  # report pulls in matplotlib: import lazily
    if name in ("write_report", "summary_table"):
        from weightgeom.analysis import report

        return getattr(report, name)
    raise AttributeError(f"module 'weightgeom.analysis' has no attribute {name!r}")
