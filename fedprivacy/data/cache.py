"""On-disk cache of preprocessed StackOverflow splits: memory-mapped NumPy arrays.

Layout: ``<cache root>/<kind>-<h>/`` where ``h`` is a SHA-256 prefix of the preprocessing
config (task, split, vocabulary sizes, options, client selection, source format and path).
The folder holds one ``.npy`` per array and ``meta.json`` with the full config, the identity
(:func:`~fedprivacy.data.sources.file_identity`: size, mtime, head/tail hash) of every input
file, and each array's dtype and shape.

* tag prediction: the bag-of-words CSR matrix (``data``, ``indices``, ``indptr``), the
  multi-hot tag CSR matrix, the single labels, per-client ``offsets`` and ``client_ids``;
* next word: the ``(n, seq_len + 1)`` int32 token array, ``offsets`` and ``client_ids``.

A hit loads every array with ``np.load(mmap_mode="r")``: nothing is parsed or tokenized and
pages are read on demand. CSR indices are stored as int32 when the matrix has fewer than
2**31 nonzeros, so SciPy wraps the mapped arrays without copying them.

A cache is **stale** when an input file's identity differs from the one recorded (the file
was replaced or rewritten), when ``meta.json`` or an array is missing or unreadable, or when
:data:`CACHE_FORMAT` changed; it is then rebuilt in place (logged with the reason). Entries
are written to a temporary folder and renamed into place, so a crash never leaves a
half-written entry that looks valid, and concurrent builders do not corrupt each other.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
from scipy import sparse

log = logging.getLogger(__name__)

__all__ = ["CACHE_FORMAT", "load_or_build", "csr_arrays", "csr_from_arrays"]

CACHE_FORMAT = 1
"""Bump when the preprocessing or the layout changes meaning: older entries become stale."""

Arrays = dict[str, np.ndarray]


def _digest(config: Mapping) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:20]


def _stale_reason(folder: Path, config: Mapping, identities: Mapping) -> str | None:
    """Why the entry in ``folder`` cannot be used, or None if it can."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as err:
        return f"unreadable meta.json ({err})"
    if meta.get("format") != CACHE_FORMAT:
        return f"cache format {meta.get('format')} != {CACHE_FORMAT}"
    if meta.get("config") != json.loads(json.dumps(config)):
        return "different preprocessing config"
    recorded = meta.get("identities", {})
    for name, identity in identities.items():
        if recorded.get(name) != identity:
            before = recorded.get(name) or {}
            changed = [k for k in ("path", "size", "mtime_ns", "sha256_head_tail")
                       if before.get(k) != identity.get(k)]
            return f"input {name!r} ({identity['path']}) changed: {', '.join(changed)}"
    return None


def _load(folder: Path) -> tuple[Arrays, dict] | None:
    """The entry's arrays (memory-mapped) and user meta, or None if an array is damaged."""
    meta = json.loads((folder / "meta.json").read_text())
    arrays = {}
    for name, spec in meta["arrays"].items():
        try:
            array = np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError):
            return None
        if str(array.dtype) != spec["dtype"] or list(array.shape) != spec["shape"]:
            return None
        arrays[name] = array
    return arrays, meta["meta"]


def _write(root: Path, folder: Path, config: Mapping, identities: Mapping, arrays: Arrays,
           meta: Mapping) -> None:
    """Writes an entry atomically (temporary folder, then rename)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
    try:
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(array), allow_pickle=False)
        (tmp / "meta.json").write_text(json.dumps({
            "format": CACHE_FORMAT, "config": config, "identities": identities,
            "arrays": {n: {"dtype": str(a.dtype), "shape": list(a.shape)}
                       for n, a in arrays.items()},
            "meta": meta}, indent=1, sort_keys=True))
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except OSError as err:  # e.g. another process renamed its entry first
        log.debug("cache entry %s not written (%s)", folder, err)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_or_build(root: Path | None, kind: str, config: Mapping, identities: Mapping,
                  build: Callable[[], tuple[Arrays, dict]]) -> tuple[Arrays, dict, str]:
    """Returns cached arrays for ``config`` if fresh, else builds (and caches) them.

    Args:
        root: Cache folder; ``None`` disables caching.
        kind: Name prefix of the entry (e.g. ``"tag-train"``).
        config: Everything the arrays depend on besides the input files (JSON-serializable).
        identities: Input name -> :func:`~fedprivacy.data.sources.file_identity`.
        build: Computes ``(arrays, meta)``; ``meta`` is a small JSON-serializable dict.

    Returns:
        ``(arrays, meta, status)`` with status ``"hit"`` (arrays memory-mapped), ``"built"``,
        ``"rebuilt"`` (a stale entry was replaced) or ``"disabled"``.
    """
    if root is None:
        arrays, meta = build()
        return arrays, meta, "disabled"
    root = Path(root)
    folder = root / f"{kind}-{_digest(config)}"
    status = "built"
    if folder.exists():
        reason = _stale_reason(folder, config, identities)
        loaded = _load(folder) if reason is None else None
        if loaded is not None:
            return (*loaded, "hit")
        reason = reason or "damaged array file"
        log.warning("stale data cache %s: %s; rebuilding", folder, reason)
        status = "rebuilt"
    arrays, meta = build()
    _write(root, folder, config, identities, arrays, meta)
    return arrays, meta, status


def csr_arrays(prefix: str, matrix: sparse.csr_matrix) -> Arrays:
    """The three arrays of a CSR matrix, indices as int32 when they fit (see module doc)."""
    index_dtype = np.int32 if matrix.nnz < 2**31 - 1 else np.int64
    return {f"{prefix}_data": matrix.data, f"{prefix}_indices": matrix.indices.astype(index_dtype),
            f"{prefix}_indptr": matrix.indptr.astype(index_dtype)}


def csr_from_arrays(arrays: Mapping[str, np.ndarray], prefix: str,
                    width: int) -> sparse.csr_matrix:
    """Wraps stored CSR arrays (memory-mapped or not) without copying them."""
    indptr = arrays[f"{prefix}_indptr"]
    return sparse.csr_matrix((arrays[f"{prefix}_data"], arrays[f"{prefix}_indices"], indptr),
                             shape=(len(indptr) - 1, width), copy=False)
