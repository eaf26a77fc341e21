"""Names of the continuity metric families that :func:`weightgeom.analysis.analyze` computes (no torch import, so
``weightgeom analyze --help`` can list them cheaply).

``cv`` / ``cu``: cosine of adjacent layers' top right / left singular vectors; ``gram``: σ²-weighted Gram alignment
(input and output space); ``idx``: index-matched alignment of all singular vectors (full SVD: slow).
"""

METRICS: tuple[str, ...] = ("cv", "cu", "gram", "idx")
"""Every metric family ``analyze(metrics=...)`` accepts: ``cv``, ``cu``, ``gram``, ``idx`` (see above)."""
DEFAULT_METRICS: tuple[str, ...] = ("cv", "cu", "gram")
"""The metric families computed when none are named (all but the slow ``idx``)."""

__all__ = ["METRICS", "DEFAULT_METRICS"]
