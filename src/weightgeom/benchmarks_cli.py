"""``weightgeom bench NAME [ARGS...]``: run one of the benchmarks shipped in :mod:`weightgeom.benchmarks` by name.

``weightgeom bench`` alone lists them; ``weightgeom bench optimizer_step --quick`` runs the module
``weightgeom.benchmarks.optimizer_step`` as a script in this Python, with the arguments after the name passed through
(``weightgeom bench optimizer_step --help`` shows the benchmark's own options). The benchmarks are part of the
installed package, so this works from any directory after a plain ``pip install``; in a source checkout
``python -m weightgeom.benchmarks.optimizer_step --quick`` is the same.
"""

from __future__ import annotations

import argparse
import pkgutil
import runpy
import sys

__all__ = ["PACKAGE", "add_arguments", "run", "available"]

PACKAGE = "weightgeom.benchmarks"


def available() -> list[str]:
    """Names of the benchmark modules in :mod:`weightgeom.benchmarks` (helpers starting with ``_`` excluded), found
    without importing them (so without importing torch)."""
    import weightgeom.benchmarks as pkg

    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.ispkg and not m.name.startswith("_"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``name`` (optional: lists the benchmarks when missing) and the arguments passed through to the benchmark."""
    p.add_argument("name", nargs="?", help=f"benchmark to run: {', '.join(available())} (none: list them)")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="arguments passed to the benchmark (e.g. --quick; --help shows its options)")


def run(args: argparse.Namespace) -> int:
    """Run the named benchmark as ``__main__`` with its arguments; returns its exit code (2: unknown name)."""
    names = available()
    if not args.name:
        print("available benchmarks:", ", ".join(names) if names else "(none)")
        return 0
    name = args.name[:-3] if args.name.endswith(".py") else args.name
    if name not in names:
        print(f"weightgeom bench: unknown benchmark {args.name!r}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    old_argv = sys.argv
    sys.argv = [f"weightgeom bench {name}", *args.script_args]  # the benchmark's argparse prog and arguments
    try:
        runpy.run_module(f"{PACKAGE}.{name}", run_name="__main__", alter_sys=False)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            return e.code or 0
        print(e.code, file=sys.stderr)  # sys.exit("message"): shown, exit code 1, as Python does for a script
        return 1
    finally:
        sys.argv = old_argv
    return 0
