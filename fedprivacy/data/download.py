"""``fedprivacy data download``: fetch TFF's federated StackOverflow files into a ``data.path`` folder.

TFF hosts the files at ``https://storage.googleapis.com/tff-datasets-public/`` (:data:`BASE_URL`);
:data:`MANIFEST` lists, per source format, the archives, the SHA-256 TFF checks for each and the
files each leaves in the folder (TFF ``tensorflow_federated/python/simulation/datasets/stackoverflow.py``:
``load_data``, ``load_word_counts``, ``load_tag_counts``; the HDF5 archive from the same file before
commit 7bb20162f, February 2021). TFF checks no hash for ``stackoverflow.sqlite.lzma``
(``download.get_compressed_file`` takes none), so that entry's ``sha256`` is ``None``: its
download prints the SHA-256 it got and warns that it could not be verified.

Each archive is streamed to ``<out>/.partial/<archive>``. A cut connection or a timeout resumes
with an HTTP ``Range`` request (a few times within one command; a rerun resumes too); a server
that ignores ``Range`` (status 200, not 206) restarts the file from byte 0. The finished archive's
SHA-256 is checked before it is decompressed (a mismatch deletes it and fails, naming the file,
the expected and the computed sum); its files are written under ``.partial/`` and moved into
``<out>`` with :func:`os.replace`, so a file in ``<out>`` is always complete; then the archive is
deleted. ``<out>/download.json`` records each archive's SHA-256 and its files' sizes: a rerun
skips an archive whose files are all there with those sizes.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import io
import json
import lzma
import re
import shutil
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Literal

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

from fedprivacy.data.hdf5 import SPLIT_FILES
from fedprivacy.data.progress import progress_bar
from fedprivacy.data.sources import SQLITE_NAME, TAG_COUNT_NAME, WORD_COUNT_NAME
from fedprivacy.data.synthetic import SYNTHETIC_MARKER

__all__ = ["Archive", "BASE_URL", "MANIFEST", "DownloadError", "download"]

BASE_URL = "https://storage.googleapis.com/tff-datasets-public/"
PARTIAL_DIR = ".partial"
RECORD = "download.json"
CHUNK = 1 << 20
TIMEOUT = 60.0
"""Seconds a connection or a read may stall before it counts as interrupted (and is resumed)."""
PLAIN_PROGRESS_SECONDS = 10.0
"""Without a terminal, one progress line per archive every this many seconds."""


@dataclass(frozen=True)
class Archive:
    """One file on TFF's server.

    Attributes:
        name: The file name on the server (appended to the base URL).
        sha256: The SHA-256 TFF checks for it, or ``None`` where TFF publishes none.
        compression: ``"lzma"`` (one compressed file) or ``"tar.bz2"``.
        files: The files it leaves in the folder (for ``lzma``, the one decompressed file).
    """

    name: str
    sha256: str | None
    compression: Literal["lzma", "tar.bz2"]
    files: tuple[str, ...]


_WORD_COUNT = Archive("stackoverflow.word_count.tar.bz2",
                      "1dc00256d6e527c54b9756d968118378ae14e6692c0b3b6cad470cdd3f0c519c",
                      "tar.bz2", (WORD_COUNT_NAME,))
_TAG_COUNT = Archive("stackoverflow.tag_count.tar.bz2",
                     "6fe281cec490d9384a290d560072438e7e2b377bbb823876ce7bd6f82696772d",
                     "tar.bz2", (TAG_COUNT_NAME,))
MANIFEST: dict[str, tuple[Archive, ...]] = {
    "tff-sqlite": (Archive("stackoverflow.sqlite.lzma", None, "lzma", (SQLITE_NAME,)),
                   _WORD_COUNT, _TAG_COUNT),
    "tff-h5": (Archive("stackoverflow.tar.bz2",
                       "99eca2f8b8327a09e5fc123979df2d237acbc5e52322f6d86bf523ee47b961a2",
                       "tar.bz2", tuple(SPLIT_FILES.values())),
               _WORD_COUNT, _TAG_COUNT),
}
"""Per ``data.source`` format, the archives that fill a ``data.path`` folder."""


class DownloadError(Exception):
    """A download that cannot finish: network or HTTP error, wrong checksum, bad archive, local I/O."""


class _Interrupted(Exception):
    """The connection broke off before the whole file arrived (worth resuming)."""


@contextlib.contextmanager
def _local(path: Path) -> Iterator[None]:
    """Turns a local file-system error (full disk, permissions) into a :class:`DownloadError` naming ``path``."""
    try:
        yield
    except OSError as err:
        raise DownloadError(f"{err.filename or path}: {err.strerror or err}") from err


def _say(console: Console, text: str) -> None:
    """One line on ``console``, as written (no markup, no wrapping)."""
    console.print(text, highlight=False, markup=False, soft_wrap=True)


class _Meter:
    """Bytes received of one archive: a rich bar on a terminal, else a line every few seconds."""

    def __init__(self, name: str, total: int | None, done: int, console: Console) -> None:
        self.name, self.total, self.done, self.console = name, total, done, console
        self.progress = None
        if console.is_terminal:
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                     TransferSpeedColumn(), TimeRemainingColumn(), console=console)
            self.task = self.progress.add_task(name, total=total, completed=done)
            self.progress.start()
        self.last_line = time.monotonic()

    def advance(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress.update(self.task, completed=self.done)
        elif time.monotonic() - self.last_line >= PLAIN_PROGRESS_SECONDS:
            self.last_line = time.monotonic()
            _say(self.console, self._line())

    def _line(self) -> str:
        if self.total:
            return f"{self.name}: {self.done:,} of {self.total:,} bytes ({100 * self.done / self.total:.0f}%)"
        return f"{self.name}: {self.done:,} bytes"

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        else:
            _say(self.console, self._line())


def _content_range_total(header: str | None) -> int | None:
    """The full size in a ``Content-Range`` header (``bytes a-b/N`` or ``bytes */N``), if given."""
    match = re.fullmatch(r"bytes [^/]+/(\d+)", (header or "").strip())
    return int(match.group(1)) if match else None


def _fetch_once(url: str, partial: Path, console: Console) -> None:
    """Continues ``partial`` from its current size (a ``Range`` request), to the end of ``url``.

    Raises:
        _Interrupted: The connection broke off (or timed out) before the end.
        DownloadError: An HTTP error status (other than 5xx), an unreachable server, or a local I/O error.
    """
    with _local(partial):
        offset = partial.stat().st_size if partial.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={offset}-"} if offset else {})
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT)
    except urllib.error.HTTPError as err:
        if err.code == 416 and _content_range_total(err.headers.get("Content-Range")) == offset:
            return  # the partial file already holds the whole file
        if err.code == 416:
            with _local(partial):
                partial.unlink()
            raise _Interrupted(f"{url}: the partial file does not fit the server's; starting again") from err
        if err.code >= 500:
            raise _Interrupted(f"{url}: HTTP {err.code} {err.reason}") from err
        raise DownloadError(f"{url}: HTTP {err.code} {err.reason}") from err
    except urllib.error.URLError as err:
        if isinstance(err.reason, (TimeoutError, ConnectionResetError)):
            raise _Interrupted(f"{url}: {err.reason}") from err
        raise DownloadError(f"{url}: {err.reason}") from err
    except (OSError, http.client.HTTPException) as err:  # a reset or timeout before the response's headers
        raise _Interrupted(f"{url}: {str(err) or type(err).__name__}") from err
    with response:
        if offset and response.status != 206:
            _say(console, f"{url}: the server ignored the Range request; downloading from the start")
            offset = 0
        length = response.headers.get("Content-Length")
        expected = offset + int(length) if length is not None else None
        meter = _Meter(partial.name, expected, offset, console)
        try:
            with _local(partial), open(partial, "ab" if offset else "wb") as out:
                while True:
                    try:
                        chunk = response.read(CHUNK)
                    except (OSError, http.client.HTTPException) as err:
                        raise _Interrupted(f"{url}: {str(err) or type(err).__name__}") from err
                    if not chunk:
                        break
                    out.write(chunk)
                    meter.advance(len(chunk))
        finally:
            meter.close()
    if expected is not None and meter.done < expected:
        raise _Interrupted(f"{url}: connection closed after {meter.done:,} of {expected:,} bytes")


def _fetch(url: str, partial: Path, *, retries: int, console: Console) -> None:
    """:func:`_fetch_once`, resumed up to ``retries`` times after an interruption (at once, then 2, 4, 8, ...
    at most 30 s later)."""
    for attempt in range(retries + 1):
        try:
            return _fetch_once(url, partial, console)
        except _Interrupted as err:
            if attempt == retries:
                raise DownloadError(f"{err} (rerun the same command to resume)") from err
            _say(console, f"{err}; resuming")
            time.sleep(min(2.0 ** attempt, 30.0) if attempt else 0.0)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with _local(path), open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _copy_to(source: BinaryIO, target: Path) -> None:
    with _local(target), open(target, "wb") as out:
        shutil.copyfileobj(source, out, CHUNK)


class _Reading(io.RawIOBase):
    """A binary file read through (not seekable), each read's bytes counted by ``advance``."""

    def __init__(self, file: BinaryIO, advance: Callable[[int], None]) -> None:
        super().__init__()
        self.file, self.advance = file, advance

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self.file.readinto(buffer)  # type: ignore[attr-defined]
        self.advance(n or 0)
        return n


def _decompress(archive: Archive, source: Path, staging: Path, console: Console) -> list[Path]:
    """Writes ``archive.files`` from the compressed ``source`` into ``staging``; returns their paths. A bar of
    the compressed bytes read shows on a terminal (:func:`~fedprivacy.data.progress.progress_bar`).

    Only the listed files are taken from a tar archive (by base name, regular files only), so a
    member's path never decides where anything is written.
    """
    written = [staging / name for name in archive.files]
    for path in written:  # left over from an earlier, failed run
        with _local(path):
            path.unlink(missing_ok=True)
    try:
        with progress_bar(f"{archive.name}: decompressing", source.stat().st_size, "bytes", console) as advance, \
                open(source, "rb") as raw:
            _extract(archive, io.BufferedReader(_Reading(raw, advance)), staging)
    except (lzma.LZMAError, tarfile.TarError, EOFError, OSError) as err:
        raise DownloadError(f"{source}: cannot decompress {archive.name} ({err})") from err
    missing = [p.name for p in written if not p.is_file()]
    if missing:
        raise DownloadError(f"{source}: {archive.name} does not hold {', '.join(missing)}")
    return written


def _extract(archive: Archive, compressed: BinaryIO, staging: Path) -> None:
    if archive.compression == "lzma":
        with lzma.open(compressed) as stream:
            _copy_to(stream, staging / archive.files[0])
    else:
        with tarfile.open(fileobj=compressed, mode="r|bz2") as tar:  # a stream: each member read as it comes
            for member in tar:
                name = PurePosixPath(member.name).name
                if member.isfile() and name in archive.files:
                    _copy_to(tar.extractfile(member), staging / name)


def _read_record(path: Path) -> dict:
    """The download record, or an empty one if it is missing or unreadable (everything is then fetched)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _is_done(archive: Archive, out: Path, record: dict) -> bool:
    """Whether ``record`` lists ``archive`` (with the manifest's SHA-256, where it has one) and all its
    files are in ``out`` with the recorded sizes."""
    entry = record.get(archive.name, {})
    if archive.sha256 is not None and entry.get("sha256") != archive.sha256:
        return False
    sizes = entry.get("files", {})
    return all(sizes.get(name) is not None and (out / name).is_file()
               and (out / name).stat().st_size == sizes[name] for name in archive.files)


def _install(archive: Archive, url: str, out: Path, *, retries: int, console: Console) -> dict:
    """Fetches ``archive`` from ``url`` into ``<out>/.partial``, checks its SHA-256, moves its files
    into ``out`` and deletes it; returns its entry of the download record."""
    partial = out / PARTIAL_DIR / archive.name
    _fetch(url, partial, retries=retries, console=console)
    got = _sha256(partial)
    if archive.sha256 is None:
        _say(console, f"warning: {archive.name}: TFF publishes no SHA-256 for it, so it could not be "
                      f"verified; its SHA-256 is {got}")
    elif got != archive.sha256:
        with _local(partial):
            partial.unlink()
        raise DownloadError(f"{url}: SHA-256 mismatch: expected {archive.sha256}, got {got} "
                            "(the download was deleted; rerun to fetch it again)")
    _say(console, f"{archive.name}: decompressing")
    for file in _decompress(archive, partial, partial.parent, console):
        with _local(out / file.name):
            file.replace(out / file.name)
    with _local(partial):
        partial.unlink()
    return {"url": url, "sha256": got, "verified": archive.sha256 is not None,
            "files": {name: (out / name).stat().st_size for name in archive.files}}


def download(out: Path, source: str = "tff-sqlite", *, base_url: str | None = None, retries: int = 5,
             console: Console | None = None) -> dict[str, Path]:
    """Downloads, verifies and decompresses the StackOverflow files of ``source`` into ``out``.

    Args:
        out: The folder to fill (created if missing); afterwards ``data.path`` for ``fedprivacy run``.
        source: ``"tff-sqlite"`` or ``"tff-h5"`` (a key of :data:`MANIFEST`).
        base_url: Where the archives are: a mirror holding the same names (default: :data:`BASE_URL`).
        retries: Resumptions of an interrupted archive within this call.
        console: Where progress, warnings and notes go (default: stderr).

    Returns:
        Each file of ``source`` -> its path in ``out``.

    Raises:
        DownloadError: One line naming the URL or path: network or HTTP error, a SHA-256 that is
            not TFF's, a bad archive, a local I/O error, or ``out`` holding synthetic data.
        ValueError: If ``source`` is unknown.
    """
    if source not in MANIFEST:
        raise ValueError(f"unknown source format {source!r}; expected one of {list(MANIFEST)}")
    console = console or Console(stderr=True)
    out = Path(out)
    if (out / SYNTHETIC_MARKER).exists():
        raise DownloadError(f"{out} holds generated synthetic data ({SYNTHETIC_MARKER}); "
                            "download the real files into another folder")
    staging = out / PARTIAL_DIR
    with _local(staging):
        staging.mkdir(parents=True, exist_ok=True)
    record_path = out / RECORD
    record = _read_record(record_path)
    for archive in MANIFEST[source]:
        if _is_done(archive, out, record):
            verified = record[archive.name].get("verified")
            _say(console, f"{archive.name}: already downloaded"
                          + (" and verified" if verified else " (its SHA-256 could not be verified)"))
            continue
        url = (base_url or BASE_URL).rstrip("/") + "/" + archive.name
        record[archive.name] = _install(archive, url, out, retries=retries, console=console)
        with _local(record_path):
            (staging / RECORD).write_text(json.dumps(record, indent=2))
            (staging / RECORD).replace(record_path)
    with contextlib.suppress(OSError):
        staging.rmdir()
    return {name: out / name for archive in MANIFEST[source] for name in archive.files}
