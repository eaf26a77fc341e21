"""Continuity analysis of weight stacks: metrics, role recognition, loaders, reports, ``weightgeom analyze``.

Main entry points: :func:`analyze` (DataFrame, one row per (role, layer pair)), :func:`analyze_full` (plus per-layer
table and all-pairs cosine matrices), :func:`write_report` (CSV/JSON/PNG); :func:`compress` (cross-layer shared
bases, the ``--suggest`` advice applied) and :func:`perplexity` (a causal LM's perplexity, before and after).
"""

from weightgeom._lazy import lazy_exports

__all__ = [
    "analyze", "analyze_full", "AnalysisResult", "METRICS", "DEFAULT_METRICS", "stack_continuity", "gram_alignment",
    "gram_alignment_svd", "gram_random_level", "index_matched_alignment", "random_level_cos", "top_cos",
    "dominance_ratio", "load", "load_gguf", "Loaded", "assign_roles", "ROLES", "write_report", "summary_table",
    "open_lazy", "TensorRef", "powerlaw_alpha", "shared_basis_runs", "topk_spread", "gram_alignment_sketch",
    "compress", "CompressConfig", "CompressResult", "apply_compressed", "decompress", "choose_spaces", "perplexity",
    "load_causal_lm", "PerplexityResult",
]


# imported on first use, so `weightgeom analyze --help` (which imports weightgeom.analysis.cli) needs no torch; report
# pulls in matplotlib as well
lazy_exports(__name__, {
    **dict.fromkeys(["analyze", "analyze_full", "AnalysisResult", "METRICS", "DEFAULT_METRICS"], ".api"),
    **dict.fromkeys(["dominance_ratio", "gram_alignment", "gram_alignment_svd", "gram_random_level",
                     "index_matched_alignment", "random_level_cos", "stack_continuity", "top_cos", "powerlaw_alpha",
                     "topk_spread", "gram_alignment_sketch"],
                    ".continuity"),
    **dict.fromkeys(["Loaded", "load", "load_gguf", "open_lazy", "TensorRef"], ".loaders"),
    **dict.fromkeys(["ROLES", "assign_roles"], ".roles"),
    **dict.fromkeys(["write_report", "summary_table", "shared_basis_runs"], ".report"),
    **dict.fromkeys(["compress", "CompressConfig", "CompressResult", "apply_compressed", "decompress", "choose_spaces"],
                    ".compress"),
    **dict.fromkeys(["perplexity", "load_causal_lm", "PerplexityResult"], ".perplexity"),
})
