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

Entries are written **streaming** when the caller gives ``load_or_build`` a ``stream``
function: it appends each client's rows to growing raw files (:class:`StreamWriter`) whose
first bytes are reserved for the ``.npy`` header, written once the final shape is known. Peak
memory is then bounded by the largest client, not by the split (the per-client ``offsets`` and
``client_ids`` stay in memory: a few bytes per user). The files are the same ``.npy`` arrays an
in-memory build writes, so both builds give identical entries.
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

__all__ = ["CACHE_FORMAT", "StreamWriter", "load_or_build", "csr_arrays", "csr_from_arrays",
           "csr_index_dtype"]

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


def _load(folder: Path, mmap_mode: str = "r") -> tuple[Arrays, dict] | None:
    """The entry's arrays (memory-mapped) and user meta, or None if an array is damaged."""
    meta = json.loads((folder / "meta.json").read_text())
    arrays = {}
    for name, spec in meta["arrays"].items():
        try:
            array = np.load(folder / f"{name}.npy", mmap_mode=mmap_mode, allow_pickle=False)
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
        _write_meta(tmp, config, identities,
                    {n: {"dtype": str(a.dtype), "shape": list(a.shape)}
                     for n, a in arrays.items()}, meta)
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except OSError as err:  # e.g. another process renamed its entry first
        log.debug("cache entry %s not written (%s)", folder, err)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_HEADER_BYTES = 128
"""Bytes reserved at the start of a streamed file for its ``.npy`` (version 1.0) header."""

_COPY_ROWS_BYTES = 1 << 24
"""Bytes per chunk when a streamed array is converted to another dtype."""


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """A ``.npy`` version 1.0 header of exactly :data:`_HEADER_BYTES` bytes."""
    text = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                 "shape": tuple(shape)})
    body_len = _HEADER_BYTES - 10  # magic (6) + version (2) + header length (2)
    if len(text) + 1 > body_len:
        raise ValueError(f"npy header for {dtype} {shape} exceeds {_HEADER_BYTES} bytes")
    body = text.ljust(body_len - 1).encode("latin1") + b"\n"
    return np.lib.format.magic(1, 0) + body_len.to_bytes(2, "little") + body


class StreamWriter:
    """Writes the arrays of a cache entry into ``folder``, appending rows chunk by chunk.

    :meth:`append` adds rows (along axis 0) to a growing array; :meth:`put` writes a small
    array whole; :meth:`retype` converts a streamed array's dtype chunk by chunk;
    :meth:`finish` writes the headers and returns each array's dtype and shape. Memory use is
    that of one chunk, whatever the total size.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._files: dict[str, object] = {}
        self._specs: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        self._put: dict[str, dict] = {}

    def _path(self, name: str) -> Path:
        return self.folder / f"{name}.npy"

    def append(self, name: str, rows: np.ndarray) -> None:
        """Appends ``rows`` to array ``name`` (created by the first call, even with no rows)."""
        rows = np.ascontiguousarray(rows)
        if name not in self._files:
            f = open(self._path(name), "wb", buffering=1 << 20)  # noqa: SIM115 (closed in finish)
            f.write(bytes(_HEADER_BYTES))
            self._files[name] = f
            self._specs[name] = (rows.dtype, rows.shape[1:], 0)
        dtype, tail, count = self._specs[name]
        if rows.dtype != dtype or rows.shape[1:] != tail:
            raise ValueError(f"array {name!r}: rows {rows.dtype} {rows.shape} do not match "
                             f"{dtype} (n, {tail})")
        if len(rows):
            self._files[name].write(rows.data.cast("B") if rows.ndim else rows.tobytes())
        self._specs[name] = (dtype, tail, count + len(rows))

    def put(self, name: str, array: np.ndarray) -> None:
        """Writes a whole (small) array."""
        array = np.ascontiguousarray(array)
        np.save(self._path(name), array, allow_pickle=False)
        self._put[name] = {"dtype": str(array.dtype), "shape": list(array.shape)}

    def length(self, name: str) -> int:
        """Rows appended so far to ``name``."""
        return self._specs[name][2]

    def retype(self, name: str, dtype: np.dtype) -> None:
        """Converts streamed array ``name`` to ``dtype`` (values must fit), chunk by chunk."""
        old_dtype, tail, count = self._specs[name]
        dtype = np.dtype(dtype)
        if dtype == old_dtype:
            return
        self._files.pop(name).close()
        source = self._path(name)
        target = source.with_suffix(".retype")
        row_items = int(np.prod(tail, dtype=np.int64))
        chunk = max(1, _COPY_ROWS_BYTES // max(1, old_dtype.itemsize * row_items))
        with open(source, "rb") as src, open(target, "wb") as dst:
            dst.write(bytes(_HEADER_BYTES))
            src.seek(_HEADER_BYTES)
            for start in range(0, count, chunk):
                n = min(chunk, count - start)
                part = np.fromfile(src, dtype=old_dtype, count=n * row_items)
                dst.write(part.astype(dtype).tobytes())
        os.replace(target, source)
        self._files[name] = open(source, "r+b")  # noqa: SIM115 (closed in finish)
        self._files[name].seek(0, os.SEEK_END)
        self._specs[name] = (dtype, tail, count)

    def finish(self) -> dict[str, dict]:
        """Writes the headers, closes the files; returns name -> ``{"dtype", "shape"}``."""
        specs = dict(self._put)
        for name, f in self._files.items():
            dtype, tail, count = self._specs[name]
            f.flush()
            f.seek(0)
            f.write(_npy_header(dtype, (count, *tail)))
            f.close()
            specs[name] = {"dtype": str(dtype), "shape": [count, *tail]}
        self._files.clear()
        return specs

    def close(self) -> None:
        """Closes open files without finishing (on error)."""
        for f in self._files.values():
            f.close()
        self._files.clear()


def _write_meta(folder: Path, config: Mapping, identities: Mapping, specs: Mapping,
                meta: Mapping) -> None:
    (folder / "meta.json").write_text(json.dumps({
        "format": CACHE_FORMAT, "config": config, "identities": identities,
        "arrays": specs, "meta": meta}, indent=1, sort_keys=True))


def _stream(root: Path, folder: Path, config: Mapping, identities: Mapping,
            stream: Callable[[StreamWriter], dict]) -> tuple[Arrays, dict]:
    """Builds an entry streaming into a temporary folder, renames it in place, maps it."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
    try:
        writer = StreamWriter(tmp)
        try:
            meta = stream(writer)
            specs = writer.finish()
        finally:
            writer.close()
        _write_meta(tmp, config, identities, specs, meta)
        try:
            if folder.exists():
                shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        except OSError as err:  # another process renamed its entry first: use ours
            log.debug("cache entry %s not renamed (%s)", folder, err)
            loaded = _load(tmp, "c")
            if loaded is None:
                raise
            # Mapped files stay readable after the folder is removed (POSIX).
            return loaded
        # Copy-on-write mapping: writeable like an in-memory build, pages read on demand,
        # and writes stay private to this process (the entry on disk is never modified).
        loaded = _load(folder, "c")
        if loaded is None:
            raise OSError(f"cache entry {folder} unreadable right after it was written")
        return loaded
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_or_build(root: Path | None, kind: str, config: Mapping, identities: Mapping,
                  build: Callable[[], tuple[Arrays, dict]],
                  stream: Callable[[StreamWriter], dict] | None = None
                  ) -> tuple[Arrays, dict, str]:
    """Returns cached arrays for ``config`` if fresh, else builds (and caches) them.

    Args:
        root: Cache folder; ``None`` disables caching.
        kind: Name prefix of the entry (e.g. ``"tag-train"``).
        config: Everything the arrays depend on besides the input files (JSON-serializable).
        identities: Input name -> :func:`~fedprivacy.data.sources.file_identity`.
        build: Computes ``(arrays, meta)``; ``meta`` is a small JSON-serializable dict.
        stream: Optional; writes the same arrays through a :class:`StreamWriter` and returns
            ``meta``. Used instead of ``build`` when caching is enabled, so that peak memory
            does not grow with the entry; the result is then memory-mapped copy-on-write
            (writeable, private to the process).

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
    if stream is not None:
        arrays, meta = _stream(root, folder, config, identities, stream)
        return arrays, meta, status
    arrays, meta = build()
    _write(root, folder, config, identities, arrays, meta)
    return arrays, meta, status


def csr_arrays(prefix: str, matrix: sparse.csr_matrix) -> Arrays:
    """The three arrays of a CSR matrix, indices as int32 when they fit (see module doc)."""
    index_dtype = csr_index_dtype(matrix.nnz)
    return {f"{prefix}_data": matrix.data, f"{prefix}_indices": matrix.indices.astype(index_dtype),
            f"{prefix}_indptr": matrix.indptr.astype(index_dtype)}


def csr_from_arrays(arrays: Mapping[str, np.ndarray], prefix: str,
                    width: int) -> sparse.csr_matrix:
    """Wraps stored CSR arrays (memory-mapped or not) without copying them."""
    indptr = arrays[f"{prefix}_indptr"]
    return sparse.csr_matrix((arrays[f"{prefix}_data"], arrays[f"{prefix}_indices"], indptr),
                             shape=(len(indptr) - 1, width), copy=False)


def csr_index_dtype(nnz: int) -> type:
    """int32 when a CSR matrix of ``nnz`` nonzeros can use it, else int64."""
    return np.int32 if nnz < 2**31 - 1 else np.int64
