"""Read-ahead for memory-mapped client rows: ask the kernel for a cohort's rows before they are used.

A population of hundreds of thousands of users lives in memory-mapped arrays (:mod:`.cache`) far
larger than what one round reads (~100 users, a few MB). Rows not in the page cache cost a page
fault and a synchronous read each when a client touches them: 30-70 ms per round of 100 random
users with a warm-ish cache, 0.25-1 s right after the cache was dropped (BENCHMARKS.md, full
population). ``posix_fadvise(POSIX_FADV_WILLNEED)`` on each client's byte range starts the reads
for the whole cohort at once, asynchronously, so they overlap each other and the first clients'
training. Advice only: nothing is read into Python, and on systems without ``posix_fadvise`` (or
for arrays that are not memory-mapped) it does nothing.
"""

from __future__ import annotations

import functools
import os

import numpy as np

_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)


def _memmap_of(array: np.ndarray) -> np.memmap | None:
    """The root ``np.memmap`` that ``array`` views, or None. The root, because a slice of a memmap is
    a memmap too and inherits its parent's file ``offset`` while pointing elsewhere; only the root's
    first element sits at ``offset`` in the file."""
    base = array
    while isinstance(getattr(base, "base", None), np.ndarray):
        base = base.base
    return base if isinstance(base, np.memmap) and base.filename else None


@functools.lru_cache(maxsize=64)
def _fd(path: str) -> int:
    """One read-only descriptor per mapped file, kept for the process's life (advice needs an fd)."""
    return os.open(path, os.O_RDONLY)


def file_range(array: np.ndarray, lo: int, hi: int) -> tuple[str, int, int] | None:
    """``(file, byte offset, byte length)`` of rows ``[lo, hi)`` (axis 0) of a C-contiguous ``array``
    that views a memory-mapped file; None when it does not."""
    mm = _memmap_of(array)
    if mm is None or hi <= lo or not array.flags.c_contiguous:
        return None
    row_bytes = array.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
    start = mm.offset + (array.ctypes.data - mm.ctypes.data) + lo * row_bytes
    return mm.filename, start, (hi - lo) * row_bytes


def advise_rows(array: np.ndarray, lo: int, hi: int) -> None:
    """Start reading rows ``[lo, hi)`` of ``array`` into the page cache (no-op if not memory-mapped)."""
    if _WILLNEED is None:
        return
    where = file_range(array, lo, hi)
    if where is not None:
        path, offset, length = where
        os.posix_fadvise(_fd(path), offset, length, _WILLNEED)
