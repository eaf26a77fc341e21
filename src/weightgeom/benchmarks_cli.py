"""``weightgeom bench NAME [ARGS...]``: run a script from the repository's benchmarks/ directory by name.

``weightgeom bench`` alone lists the available benchmarks; ``weightgeom bench optimizer_step --quick`` runs
``benchmarks/optimizer_step.py --quick`` in this Python (arguments after the name are passed through).
The directory is found next to the installed source tree (editable install) or via ``$WEIGHTGEOM_BENCHMARKS``.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

__all__ = ["add_arguments", "run", "benchmarks_dir", "available"]


def benchmarks_dir() -> Path | None:
    """The benchmarks/ directory: ``$WEIGHTGEOM_BENCHMARKS``, else <repo>/benchmarks next to src/; None if absent."""
    env = os.environ.get("WEIGHTGEOM_BENCHMARKS")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2] / "benchmarks")
    candidates.append(Path.cwd() / "benchmarks")
    for c in candidates:
        if c.is_dir():
            return c
    return None


def available() -> list[str]:
    """Benchmark names (script stems, helpers starting with ``_`` excluded)."""
    d = benchmarks_dir()
    return sorted(p.stem for p in d.glob("*.py") if not p.name.startswith("_")) if d else []


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``name`` (optional: lists when missing) and the arguments passed through to the script."""
    p.add_argument("name", nargs="?", help="benchmark to run (script name in benchmarks/, without .py)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script (e.g. --quick)")


def run(args: argparse.Namespace) -> int:
    """Run the named benchmark as ``__main__`` with its arguments; returns its exit code."""
    d = benchmarks_dir()
    if d is None:
        print("weightgeom bench: no benchmarks/ directory found (set WEIGHTGEOM_BENCHMARKS=/path/to/benchmarks)",
              file=sys.stderr)
        return 2
    names = available()
    if not args.name:
        print("available benchmarks:", ", ".join(names) if names else "(none)")
        return 0
    name = args.name[:-3] if args.name.endswith(".py") else args.name
    if name not in names:
        print(f"weightgeom bench: unknown benchmark {args.name!r}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    script = d / f"{name}.py"
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *args.script_args]
    sys.path.insert(0, str(d))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
    return 0
