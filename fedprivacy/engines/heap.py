"""Keep the memory that a round's cohort chunks free in the process's heap, for the next chunks to reuse.

Each chunk of :func:`~fedprivacy.client.sparse_cohort.train_sparse_cohort` allocates its rows :math:`X` and their
copy afresh (about 15 MB each at 500 tags). glibc's ``malloc`` serves blocks of that size with a fresh ``mmap``
(above its dynamic threshold, which stops at 32 MB) or returns a freed heap top to the OS (above its trim
threshold), so every chunk page-faults and zeroes its buffers again: about 100,000 minor faults (400 MB) per
quickstart round. :func:`keep_freed_memory` fixes the first at 32 MB, raises the second and pads the heap's growth,
so the freed blocks stay mapped and are reused; the process's resident size then stays at its peak instead of
shrinking between rounds. Only the allocator's bookkeeping changes: no value computed differs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20
"""Blocks below this come from the heap (glibc's largest dynamic threshold: a 15 MB chunk buffer qualifies)."""
TRIM_THRESHOLD = 1 << 30
"""Freed heap top kept up to this size instead of returned to the OS."""
TOP_PAD = 64 << 20
"""The heap grows by this much more than asked, so a few chunks' buffers fit in what it already holds."""


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (module docstring); ``False`` where the C library is not glibc (then
    nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD))
    return all([bool(libc.mallopt(option, value)) for option, value in settings])
