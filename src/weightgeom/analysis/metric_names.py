"""Names of the continuity metric families that :func:`weightgeom.analysis.analyze` computes (no torch import, so
``weightgeom analyze --help`` can list them cheaply).

``cv`` / ``cu``: cosine of adjacent layers' top right / left singular vectors; ``gram``: σ²-weighted Gram alignment
(input and output space); ``idx``: index-matched alignment of all singular vectors (full SVD: slow).
"""

METRICS: tuple[str, ...] = ("cv", "cu", "gram", "idx")
DEFAULT_METRICS: tuple[str, ...] = ("cv", "cu", "gram")

__all__ = ["METRICS", "DEFAULT_METRICS"]
