"""A stop request (SIGTERM, SIGUSR2, a sweep worker's SIGINT) turned into an exception in the main thread, so a run
unwinds: ``status.json`` says failed with the reason, locks are released, logs are closed. Used by the ``weightgeom``
command (:func:`sigterm_unwinds`), the sweep runner and the launchers' training processes. Standard library only."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

__all__ = ["Terminated", "SYNC_MODULES", "STOP_DEFER_S", "stop_request_handler", "sigterm_unwinds"]


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
def sigterm_unwinds():
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
