"""``weightgeom eval MODEL``: perplexity of a causal LM (defined in :mod:`weightgeom.analysis.compress_cli`)."""

from weightgeom.analysis.compress_cli import add_eval_arguments as add_arguments
from weightgeom.analysis.compress_cli import run_eval as run

__all__ = ["add_arguments", "run"]
