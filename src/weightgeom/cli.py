"""``weightgeom`` command line: train | sweep | analyze | compress | eval | report | claims | bench | data | demo.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; this file only
dispatches. An ``OSError`` a subcommand lets through (a path that cannot be written or read: not a directory, no
permission, disk full) ends the command with one line naming the path and the system's reason, and exit code 2, like
any other bad input. ``weightgeom --version`` prints the installed versions of weightgeom and torch.

Building the parser imports no torch, NumPy or pandas, so ``weightgeom --help``, ``weightgeom COMMAND --help`` and
``--version`` answer in a fraction of a second: the subcommand modules and the packages above them (whose public
names are lazy, see ``weightgeom._lazy``) import only the standard library at module level, and each ``run(args)``
imports the heavy modules it needs inside the function. Those command functions are the one place in weightgeom
where function-level imports are the rule; ``tests/test_cli.py`` checks that no torch is imported for help.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from weightgeom._cli_args import OneLineParser, nonneg_int, os_error_line, positive_int
from weightgeom._signals import Terminated, sigterm_unwinds

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("weightgeom.experiments.demo", "the main CPU job: small versions of the paper experiments + report"),
    "train": ("weightgeom.train.cli", "train a model from a TOML/YAML config (torchrun for DDP/FSDP2)"),
    "sweep": ("weightgeom.experiments.cli", "run an experiment recipe: manifolds | continuity | md"),
    "report": ("weightgeom.experiments.report_cli", "regenerate tables and plots from run directories"),
    "claims": ("weightgeom.experiments.claims_cli", "the papers' claims table from reports (README, results page)"),
    "analyze": ("weightgeom.analysis.cli", "continuity analysis of a checkpoint (HF dir, torch .pt, GGUF)"),
    "compress": ("weightgeom.analysis.compress_cli", "share low-rank bases across layers (input/output space)"),
    "eval": ("weightgeom.analysis.eval_cli", "perplexity of a causal LM (HF dir, GGUF, ours, compressed)"),
    "bench": ("weightgeom.benchmarks_cli", "run a benchmark shipped in weightgeom.benchmarks (none: list them)"),
    "data": ("weightgeom.data.cli", "prepare token datasets (train.bin/val.bin) from text, JSONL, parquet"),
}

__all__ = ["main", "build_parser", "version_line", "SUBCOMMANDS", "OneLineParser", "os_error_line", "positive_int",
           "nonneg_int", "Terminated"]


def version_line() -> str:
    """``weightgeom X.Y.Z (torch A.B.C, Python D.E.F)``: the installed distributions' versions, read from their
    metadata (nothing is imported; ``weightgeom.__version__`` where weightgeom runs from a source tree without being
    installed)."""
    import platform
    from importlib import metadata

    from weightgeom import __version__

    def installed(dist: str, fallback: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return fallback

    return (f"weightgeom {installed('weightgeom', __version__)} (torch {installed('torch', 'not installed')}, "
            f"Python {platform.python_version()})")


class _VersionAction(argparse.Action):
    """``--version``: print :func:`version_line` and exit 0 (computed only when asked for)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per available subcommand."""
    parser = OneLineParser(prog="weightgeom", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action=_VersionAction, help="print the versions of weightgeom and torch and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name):
                continue  # subcommand not built yet
            raise
        p = sub.add_parser(name, help=help_, description=help_)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _show_deprecations(command: str) -> None:
    """Inside ``catch_warnings``: weightgeom's own DeprecationWarnings (an old config key or keyword, named with its
    new spelling) are shown once each as one line, ``weightgeom COMMAND: deprecated: ...`` — Python hides them by
    default outside ``__main__``; every other warning keeps its own filter and format."""
    shown = warnings.showwarning
    warnings.filterwarnings("default", category=DeprecationWarning, module=r"weightgeom(\.|$)")

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 (warnings' signature)
        if issubclass(category, DeprecationWarning) and "weightgeom" in str(filename):
            print(f"weightgeom {command}: deprecated: {message}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``weightgeom`` script. Returns the process exit code (130 after Ctrl-C, 143 after
    SIGTERM)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        with sigterm_unwinds(), warnings.catch_warnings():
            _show_deprecations(args.command)
            return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("weightgeom: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("weightgeom: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except OSError as e:
        print(f"weightgeom {args.command}: error: {os_error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
