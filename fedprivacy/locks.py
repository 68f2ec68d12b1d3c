"""Exclusive folder locks that name their holder: one ``fedprivacy run`` per run folder, one
``fedprivacy compare`` per study folder.

A lock is an ``flock`` on a file in the folder, which the kernel releases when its holder exits,
however it exits (``kill -9`` included); the file holds the holder's pid, host and start time so
that a refused second writer can say who has the folder. A ``reentrant`` lock that this process
holds is granted again at once (a sweep worker holds its run's folder while
:func:`fedprivacy.run.run` locks it again).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Linux/macOS: no locks, the rest works
    fcntl = None  # type: ignore[assignment]

_held: set[Path] = set()  # lock files this process holds


class FolderBusyError(RuntimeError):
    """The lock is held by another process (or, not re-entrant, by this one); the message names the holder."""


@contextmanager
def locked(path: Path, blocking: bool, error: type[Exception] = FolderBusyError, what: str = "a run",
           reentrant: bool = False) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` for the duration (created with its folder if needed).

    Raises:
        error: ``blocking`` is false and the lock is held ("another ``what`` (pid ..., host
            ..., started ...) is running on <folder>").
    """
    path = Path(path).absolute()
    if reentrant and path in _held:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                f.seek(0)
                raise error(f"another {what} ({f.read().strip() or 'pid ?'}) is running on {path.parent}") from None
        f.seek(0)
        f.truncate()
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        f.write(f"pid {os.getpid()}, host {socket.gethostname()}, started {started}")
        f.flush()
        _held.add(path)
        try:
            yield
        finally:
            _held.discard(path)
