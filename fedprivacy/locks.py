"""Exclusive folder locks that name their holder: one ``fedprivacy run`` per run folder, one
``fedprivacy compare`` per study folder.

A lock is an ``flock`` on the folder itself, which the kernel releases when its holder exits,
however it exits (``kill -9`` included). It is on the folder, not on the lock file: deleting the file
would let a second writer lock a new file of the same name while the first still writes (two runs
appending to one release log). The file only holds the holder's pid, host and start time, so that a
refused second writer can say who has the folder. One lock per folder. A ``reentrant`` lock that this process
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

LOCK_FILE = ".lock"
"""The lock file of a folder that one writer holds at a time: a run's ``output_dir``, a strategy's ``state_dir``."""

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
    folder = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if fcntl is not None:
            try:
                fcntl.flock(folder, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                holder = path.read_text().strip() if path.is_file() else ""
                raise error(f"another {what} ({holder or 'pid ?'}) is running on {path.parent}") from None
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        path.write_text(f"pid {os.getpid()}, host {socket.gethostname()}, started {started}")
        _held.add(path)
        try:
            yield
        finally:
            _held.discard(path)
    finally:
        os.close(folder)
