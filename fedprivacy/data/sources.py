"""One interface over TFF's two StackOverflow example formats, and file identities for caching.

* ``tff-sqlite``: ``stackoverflow.sqlite`` (:mod:`fedprivacy.data.stackoverflow`), splits
  ``train``, ``heldout``, ``test`` in one file;
* ``tff-h5``: TFF's legacy ``stackoverflow_{train,held_out,test}.h5``
  (:mod:`fedprivacy.data.hdf5`), one file per split.

Both yield the same ``(client_id, [{feature: [value]}, ...])`` stream, in sorted client-id
order, so preprocessing and caching do not depend on the format. The word and tag count files
(``stackoverflow.word_count``, ``stackoverflow.tag_count``) sit beside the example files.

:func:`file_identity` is what the cache compares to tell whether a source file changed: its
size, modification time (ns) and a SHA-256 of its first and last MiB. Changing any byte in the
middle without changing size or mtime goes unnoticed; every ordinary rewrite changes the mtime.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import numpy as np

from fedprivacy.data import hdf5, stackoverflow

__all__ = ["SourceFormat", "ExampleSource", "open_source", "file_identity", "SPLITS",
           "SQLITE_NAME", "WORD_COUNT_NAME", "TAG_COUNT_NAME"]

SourceFormat = Literal["tff-sqlite", "tff-h5"]
SPLITS = ("train", "heldout", "test")
SQLITE_NAME = "stackoverflow.sqlite"
WORD_COUNT_NAME = "stackoverflow.word_count"
TAG_COUNT_NAME = "stackoverflow.tag_count"
_IDENTITY_BYTES = 1 << 20


def file_identity(path: str | Path) -> dict[str, object]:
    """Size, mtime (ns) and SHA-256 of the first and last MiB of a file (cheap, O(1) reads).

    Raises:
        FileNotFoundError: If the file does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    stat = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(_IDENTITY_BYTES))
        if stat.st_size > 2 * _IDENTITY_BYTES:
            f.seek(-_IDENTITY_BYTES, 2)
            digest.update(f.read(_IDENTITY_BYTES))
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "sha256_head_tail": digest.hexdigest()}


@dataclass(frozen=True)
class ExampleSource:
    """StackOverflow examples in one of TFF's formats.

    Attributes:
        format: ``"tff-sqlite"`` or ``"tff-h5"``.
        folder: The folder holding the example files and the count files.
        sqlite: The SQLite file (``tff-sqlite`` only).
    """

    format: SourceFormat
    folder: Path
    sqlite: Path | None = None

    @property
    def word_count(self) -> Path:
        return self.folder / WORD_COUNT_NAME

    @property
    def tag_count(self) -> Path:
        return self.folder / TAG_COUNT_NAME

    def split_file(self, split: str) -> Path:
        """The file holding ``split``.

        Raises:
            ValueError: If ``split`` is not train, heldout or test.
        """
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; splits are {list(SPLITS)}")
        return self.sqlite if self.sqlite is not None else self.folder / hdf5.SPLIT_FILES[split]

    def client_ids(self, split: str) -> list[str]:
        """Sorted client ids of ``split``."""
        if self.sqlite is not None:
            return stackoverflow.client_ids(self.sqlite, split)
        return hdf5.h5_client_ids(self.split_file(split))

    def iter_client_examples(self, split: str, client_ids: Iterable[str] | None = None, *,
                             allow_empty: bool = False, features: Collection[str] | None = None
                             ) -> Iterator[tuple[str, list[dict[str, list]]]]:
        """Streams ``(client_id, examples)`` of ``split`` in sorted client-id order, each example
        holding only ``features`` (``None``: all; every example is still read and checked in full)."""
        if self.sqlite is not None:
            return stackoverflow.iter_client_examples(self.sqlite, split, client_ids,
                                                      allow_empty=allow_empty, features=features)
        return hdf5.iter_h5_client_examples(self.split_file(split), client_ids,
                                            allow_empty=allow_empty, features=features)

    def stats(self) -> dict[str, dict[str, object]]:
        """Per split: its file, number of clients, examples, and clients without examples."""
        if self.sqlite is not None:
            counts = stackoverflow.split_counts(self.sqlite)
            return {split: {"file": str(self.sqlite), **counts.get(split, {
                "clients": 0, "examples": 0, "empty_clients": 0})} for split in SPLITS}
        return {split: {"file": str(self.split_file(split)),
                        **hdf5.h5_counts(self.split_file(split))} for split in SPLITS}

    def identity(self, split: str) -> dict[str, object]:
        """:func:`file_identity` of the file holding ``split``."""
        return file_identity(self.split_file(split))


def open_source(format: str, path: str | Path) -> ExampleSource:
    """Resolves a format and a path (a folder, or for SQLite the file itself) to a source.

    Raises:
        ValueError: If ``format`` is unknown.
        FileNotFoundError: If ``path`` does not exist.
    """
    if format not in get_args(SourceFormat):
        raise ValueError(f"unknown source format {format!r}; expected one of "
                         f"{list(get_args(SourceFormat))}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such file or folder: {path}")
    if format == "tff-sqlite":
        sqlite = path / SQLITE_NAME if path.is_dir() else path
        return ExampleSource(format, sqlite.parent, sqlite)
    return ExampleSource(format, path if path.is_dir() else path.parent)


def offsets_partition(offsets: np.ndarray, num_rows: int, num_clients: int) -> bool:
    """Whether ``offsets`` splits ``num_rows`` rows into ``num_clients`` consecutive, possibly
    empty, client ranges: shape ``(num_clients + 1,)``, from 0 to ``num_rows``, non-decreasing."""
    return (offsets.shape == (num_clients + 1,) and offsets[0] == 0 and offsets[-1] == num_rows
            and not np.any(np.diff(offsets) < 0))
