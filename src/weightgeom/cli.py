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
import contextlib
import errno
import importlib
import signal
import sys
import threading

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


def os_error_line(e: OSError) -> str:
    """One line for an ``OSError``: the path(s) it names and the system's reason, e.g.
    ``cannot use runs/x/checkpoints/ckpt_00000008.pt: No space left on device (ENOSPC)``. The one formatter every
    command uses."""
    reason = e.strerror or str(e) or type(e).__name__
    code = errno.errorcode.get(e.errno) if isinstance(e.errno, int) else None
    if code:
        reason += f" ({code})"
    if e.filename is None:
        return reason
    where = str(e.filename) + (f" -> {e.filename2}" if e.filename2 is not None else "")
    if isinstance(e, FileExistsError):  # os.makedirs on a path that is a regular file
        reason = "exists and is not a directory"
    return f"cannot use {where}: {reason}"


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


def _int_at_least(text: str, low: int, expected: str) -> int:
    """``int(text)`` if it is ≥ ``low``, else an argparse error saying ``expected``."""
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (``--steps``, ``--jobs``, ``--threads`` of sweep, demo and analyze)."""
    return _int_at_least(text, 1, "a positive integer")


def nonneg_int(text: str) -> int:
    """argparse type: an integer >= 0 (``--gpus-per-run``, ``--max-retries``)."""
    return _int_at_least(text, 0, "an integer >= 0")


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``weightgeom sweep: error: argument --steps: ... (see weightgeom
    sweep --help)``) with exit code 2, instead of the usage block followed by the error; subparsers inherit it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


class Terminated(BaseException):
    """Raised in the main thread when the process gets SIGTERM (a scheduler's or ``kill``'s stop request), so a run
    unwinds like on Ctrl-C: ``status.json`` says failed with the reason, locks are released, logs are closed."""


SYNC_MODULES = frozenset({"threading", "queue", "logging"})
"""Modules whose code a stop request never interrupts: an exception raised inside their lock and condition
bookkeeping can leave a lock released under its owner or a waiter never woken, so the unwinding then hangs
(seen: TensorBoard's writer thread never woken in ``SummaryWriter.close``, 3 of 26 preempted jobs on a loaded 2-core
machine) until something kills the process, with the run's lock left behind and no reason logged."""

STOP_DEFER_S = 5.0
"""Longest a stop request waits for the main thread to leave :data:`SYNC_MODULES` before it is raised regardless."""

_STOP_RETRY_S = 0.02
_STOP: dict = {}  # the pending stop request: {"reason": str, "since": monotonic seconds}


def _in_sync_code(frame) -> bool:
    """Whether the interrupted main thread is inside :data:`SYNC_MODULES` (anywhere on its stack)."""
    while frame is not None:
        if frame.f_globals.get("__name__") in SYNC_MODULES:
            return True
        frame = frame.f_back
    return False


def stop_request_handler(reason: str, exc_type: type[BaseException] = Terminated, once: bool = False):
    """A signal handler that raises :class:`Terminated` (``reason``, with ``{signal}`` replaced by the signal's name)
    in the main thread, so a run unwinds: status failed with the reason, lock released, logs closed.

    Never while the main thread is inside ``threading``/``queue``/``logging`` code (e.g. handing TensorBoard's writer
    thread a batch of scalars, or waiting for it in a flush): there the request is kept and retried every
    ``_STOP_RETRY_S`` seconds through SIGALRM (``setitimer``: no lock is taken here), for at most
    :data:`STOP_DEFER_S` seconds. Install the returned handler for SIGALRM too. ``exc_type`` is what is raised
    (``KeyboardInterrupt`` for a sweep worker's SIGINT); with ``once``, signals after the first raise are ignored, so
    a second Ctrl-C (the terminal's and the sweep's own) cannot interrupt the unwinding that writes the run's status.
    """
    import time

    raised: list[bool] = []

    def handler(signum, frame) -> None:
        if once and raised and signum != signal.SIGALRM:
            return
        if signum != signal.SIGALRM:
            _STOP.setdefault("reason", reason.format(signal=signal.Signals(signum).name))
            _STOP.setdefault("since", time.monotonic())
        elif "reason" not in _STOP:
            return  # a retry of a request already raised
        if _in_sync_code(frame) and time.monotonic() - _STOP["since"] < STOP_DEFER_S:
            signal.setitimer(signal.ITIMER_REAL, _STOP_RETRY_S)
            return
        why = _STOP.pop("reason")
        _STOP.clear()
        raised.append(True)
        raise exc_type(why)

    return handler


@contextlib.contextmanager
def _sigterm_unwinds():
    """Turn SIGTERM into :class:`Terminated` while a command runs (main thread only; restored afterwards)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = stop_request_handler("terminated by {signal}")
    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGALRM)}
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, h in old.items():
            signal.signal(sig, h)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``weightgeom`` script. Returns the process exit code (130 after Ctrl-C, 143 after
    SIGTERM)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        with _sigterm_unwinds():
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
