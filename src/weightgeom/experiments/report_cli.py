"""``weightgeom report RUN_DIR…``: regenerate every table and plot from run directories (or sweep directories)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``weightgeom report``."""
    p.add_argument("paths", nargs="+", metavar="RUN_DIR", help="run directories or directories containing them")
    p.add_argument("--out", default=None,
                   help="output directory for report.md and PNGs (default: the sweep directory, else ./report)")
    p.add_argument("--title", default=None, help="report heading")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``weightgeom report``."""
    from weightgeom.experiments.report import make_report

    try:
        path = make_report(args.paths, out=args.out, title=args.title)
    except FileNotFoundError as e:
        print(f"weightgeom report: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. an unwritable or full output directory
        from weightgeom._cli_args import os_error_line

        print(f"weightgeom report: {os_error_line(e)}", file=sys.stderr)
        return 2
    pngs = sorted(p.name for p in path.parent.glob("*.png"))
    print(f"report: {path}" + (f" ({len(pngs)} plots: {', '.join(pngs)})" if pngs else ""))
    return 0
