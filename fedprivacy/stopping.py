"""Stopping a run between rounds, with nothing lost: SIGTERM (``kill <pid>``) asks, the round in progress
finishes, a checkpoint is written, and :class:`RunStopped` ends the run; ``--resume`` (or rerunning
``fedprivacy compare``) continues it as if it had never stopped.

A run killed mid-round (SIGKILL, a crash, Ctrl-C) also resumes, from its last checkpoint, but the releases it
made after that checkpoint stay spent (the write-ahead release log composes them into the ledger on resume:
never under-counted), so a run with a target epsilon ends with fewer rounds than planned. A session or a job
scheduler that ends work with SIGTERM therefore costs nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_requested = threading.Event()


class RunStopped(KeyboardInterrupt):
    """The run stopped between rounds on request, its checkpoint written: resuming loses nothing.
    A :class:`KeyboardInterrupt`, so code that handles an interruption handles this one."""


def request_stop(signum: int | None = None, frame: object = None) -> None:
    """Ask the run in this process to stop after its current round (a signal handler's signature)."""
    _requested.set()


def stop_requested() -> bool:
    """Whether :func:`request_stop` was called since the run began."""
    return _requested.is_set()


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While the body runs, SIGTERM asks for a stop (:func:`request_stop`) instead of ending the process; from the
    main thread only (elsewhere signals cannot be handled, and the body runs with the handler it has)."""
    _requested.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, request_stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
