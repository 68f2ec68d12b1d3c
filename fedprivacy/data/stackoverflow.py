"""Reader for TensorFlow Federated's StackOverflow files, without TensorFlow.

Reads the files TFF downloads (``stackoverflow.sqlite``, decompressed from
``stackoverflow.sqlite.lzma``; ``stackoverflow.word_count``;
``stackoverflow.tag_count``) and the synthetic ones written by
:mod:`fedprivacy.data.synthetic`, which share their layout:

* ``examples(split_name, client_id, serialized_example_proto)``: one
  serialized ``tf.train.Example`` per post, with the features
  ``creation_date``, ``score``, ``tags``, ``title``, ``tokens`` and ``type``.
* ``client_metadata(client_id, split_name, ...)``: the clients of each split.

The database is opened read-only and nothing is created in it. Clients are
streamed one at a time in sorted client-id order, so the table is never loaded
whole; with an index on ``examples(split_name, client_id)`` (the synthetic files
have one) no sorting is needed, otherwise SQLite sorts in its temporary store.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import TextIO

from fedprivacy.data.example_proto import decode_example

__all__ = [
    "DataFormatError",
    "read_word_counts",
    "read_tag_counts",
    "client_ids",
    "iter_client_examples",
    "split_counts",
]

_REQUIRED_COLUMNS = {
    "examples": ("split_name", "client_id", "serialized_example_proto"),
    "client_metadata": ("client_id", "split_name"),
}
# Chunk of client ids per query when a subset is requested; below SQLite's
# historical 999-variable limit.
_IDS_PER_QUERY = 900


class DataFormatError(ValueError):
    """A data file exists but does not have the expected format."""


def _existing(path: str | Path) -> Path:
    """Returns ``path`` as a Path, raising FileNotFoundError if it is missing."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    return path


@contextlib.contextmanager
def _text(path: Path) -> Iterator[TextIO]:
    """``path`` opened as UTF-8 text; bytes that are not UTF-8 raise a DataFormatError naming the file."""
    with open(path, encoding="utf-8") as f:
        try:
            yield f
        except UnicodeDecodeError as err:
            raise DataFormatError(f"{path}: not UTF-8 text (it holds byte {err.object[err.start]:#04x}, "
                                  f"{err.reason}); is it the right file?") from None


def read_word_counts(path: str | Path, vocab_size: int | None = None) -> dict[str, int]:
    """Reads a ``stackoverflow.word_count`` file (``word count`` per line).

    Args:
        path: The word count file.
        vocab_size: Read at most this many words (the most frequent ones);
            ``None`` reads all.

    Returns:
        Word to count, in file order (most frequent first).

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        DataFormatError: If a line is not ``word count``.
    """
    path = _existing(path)
    counts: dict[str, int] = {}
    with _text(path) as f:
        for line_number, line in enumerate(f, start=1):
            if vocab_size is not None and len(counts) >= vocab_size:
                break
            parts = line.split()
            if len(parts) != 2 or not parts[1].isdigit():
                raise DataFormatError(f"{path}, line {line_number}: expected 'word count', "
                                      f"got {line.rstrip()!r}")
            counts[parts[0]] = int(parts[1])
    return counts


def read_tag_counts(path: str | Path) -> dict[str, int]:
    """Reads a ``stackoverflow.tag_count`` file (a JSON object tag -> count).

    Args:
        path: The tag count file.

    Returns:
        Tag to count, sorted by count descending; ties keep file order (as
        TFF's ``load_tag_counts``).

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        DataFormatError: If the file is not a JSON object of integer counts.
    """
    path = _existing(path)
    with _text(path) as f:
        try:
            counts = json.load(f)
        except json.JSONDecodeError as err:
            raise DataFormatError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(counts, dict) or not all(
            isinstance(c, int) and not isinstance(c, bool) for c in counts.values()):
        raise DataFormatError(f"{path}: expected a JSON object mapping tags to integer counts")
    return dict(sorted(counts.items(), key=lambda item: item[1], reverse=True))


@contextlib.contextmanager
def _connect(sqlite_path: str | Path) -> Iterator[tuple[Path, sqlite3.Connection]]:
    """Opens the database read-only and checks its tables and columns."""
    path = _existing(sqlite_path)
    connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        try:
            tables = {row[0] for row in connection.execute(
                "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
        except sqlite3.DatabaseError as err:
            raise DataFormatError(f"{path}: not an SQLite database, or corrupt or "
                                  f"truncated ({err})") from err
        for table, required in _REQUIRED_COLUMNS.items():
            if table not in tables:
                raise DataFormatError(f"{path}: missing table {table!r} "
                                      f"(tables present: {sorted(tables)})")
            columns = {row[1] for row in connection.execute(f"PRAGMA table_info({table})")}
            missing = [c for c in required if c not in columns]
            if missing:
                raise DataFormatError(f"{path}: table {table!r} lacks column(s) {missing} "
                                      f"(columns present: {sorted(columns)})")
        yield path, connection
    finally:
        connection.close()


def _split_client_ids(path: Path, connection: sqlite3.Connection, split: str) -> list[str]:
    """Sorted client ids of ``split``; ValueError naming the splits if it is absent."""
    ids = sorted(row[0] for row in connection.execute(
        "SELECT DISTINCT client_id FROM client_metadata WHERE split_name = ?", (split,)))
    if not ids:
        splits = sorted(row[0] for row in connection.execute(
            "SELECT DISTINCT split_name FROM client_metadata"))
        raise ValueError(f"{path}: unknown split {split!r}; splits present: {splits}")
    return ids


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Turns SQLite errors met while reading (a corrupt or truncated file) into DataFormatError."""
    try:
        yield
    except sqlite3.DatabaseError as err:
        raise DataFormatError(f"{path}: corrupt or truncated SQLite file ({err})") from err


def client_ids(sqlite_path: str | Path, split: str) -> list[str]:
    """Lists the clients of a split, from ``client_metadata``.

    Args:
        sqlite_path: The StackOverflow SQLite file.
        split: ``"train"``, ``"heldout"`` or ``"test"``.

    Returns:
        The client ids, sorted.

    Raises:
        FileNotFoundError: If the file does not exist.
        DataFormatError: If it is not SQLite or lacks the expected tables/columns.
        ValueError: If ``split`` has no clients.
    """
    with _connect(sqlite_path) as (path, connection), _reading(path):
        return _split_client_ids(path, connection, split)


def split_counts(sqlite_path: str | Path) -> dict[str, dict[str, int]]:
    """Per split: clients listed in ``client_metadata``, clients with rows, rows.

    Returns:
        ``{split: {"clients": ..., "examples": ..., "empty_clients": ...}}`` where
        ``empty_clients`` counts listed clients without any row.

    Raises:
        FileNotFoundError, DataFormatError: As :func:`client_ids`.
    """
    with _connect(sqlite_path) as (path, connection), _reading(path):
        listed = dict(connection.execute(
            "SELECT split_name, COUNT(DISTINCT client_id) FROM client_metadata GROUP BY split_name"))
        rows = {split: (clients, examples) for split, clients, examples in connection.execute(
            "SELECT split_name, COUNT(DISTINCT client_id), COUNT(*) FROM examples "
            "GROUP BY split_name")}
    return {split: {"clients": listed.get(split, 0), "examples": rows.get(split, (0, 0))[1],
                    "empty_clients": listed.get(split, 0) - rows.get(split, (0, 0))[0]}
            for split in sorted(set(listed) | set(rows))}


def _chunks(ids: list[str]) -> Iterator[list[str]]:
    """Consecutive chunks of at most ``_IDS_PER_QUERY`` ids."""
    for start in range(0, len(ids), _IDS_PER_QUERY):
        yield ids[start:start + _IDS_PER_QUERY]


def _rows(connection: sqlite3.Connection, split: str, ids: list[str] | None
          ) -> Iterator[tuple[str, int, bytes]]:
    """(client_id, rowid, blob) of a split, ordered by client id then rowid."""
    base = ("SELECT client_id, rowid, serialized_example_proto FROM examples "
            "WHERE split_name = ?")
    if ids is None:
        yield from connection.execute(f"{base} ORDER BY client_id, rowid", (split,))
        return
    for chunk in _chunks(ids):
        marks = ", ".join("?" * len(chunk))
        yield from connection.execute(
            f"{base} AND client_id IN ({marks}) ORDER BY client_id, rowid", (split, *chunk))


def iter_client_examples(sqlite_path: str | Path, split: str,
                         client_ids: Iterable[str] | None = None, *, allow_empty: bool = False,
                         features: Collection[str] | None = None
                         ) -> Iterator[tuple[str, list[dict[str, list]]]]:
    """Streams clients and their decoded examples.

    Args:
        sqlite_path: The StackOverflow SQLite file.
        split: ``"train"``, ``"heldout"`` or ``"test"``.
        client_ids: Clients to read (any order, duplicates ignored); ``None``
            reads every client of the split.
        allow_empty: Yield ``[]`` for a client listed in ``client_metadata``
            without rows instead of raising.
        features: Keep only these features of each example (``None``: all); every row is
            still parsed and checked in full (:func:`~fedprivacy.data.example_proto.decode_example`).

    Yields:
        ``(client_id, examples)`` in sorted client-id order, one client at a
        time. ``examples`` are dicts as returned by
        :func:`~fedprivacy.data.example_proto.decode_example`, in rowid order.

    Raises:
        FileNotFoundError: If the file does not exist.
        DataFormatError: If it is not SQLite, lacks the expected tables or
            columns, is corrupt or truncated, holds a row that is not a
            ``tf.train.Example``, or (unless ``allow_empty``) a client listed
            in ``client_metadata`` has no rows.
        ValueError: If ``split`` has no clients, or a requested client is not
            in it.
    """
    with _connect(sqlite_path) as (path, connection), _reading(path):
        known = _split_client_ids(path, connection, split)
        if client_ids is None:
            wanted, query_ids = known, None
        else:
            wanted = query_ids = sorted(set(client_ids))
            unknown = sorted(set(wanted) - set(known))
            if unknown:
                raise ValueError(f"{path}: {len(unknown)} client id(s) not in split {split!r}, "
                                 f"e.g. {unknown[:5]}")
        with contextlib.closing(_rows(connection, split, query_ids)) as rows:
            pending = next(rows, None)
            for client in wanted:
                examples = []
                while pending is not None and pending[0] <= client:
                    if pending[0] == client:
                        try:
                            examples.append(decode_example(pending[2], features))
                        except ValueError as err:
                            raise DataFormatError(f"{path}: client {client!r}, row "
                                                  f"{pending[1]}: {err}") from err
                    pending = next(rows, None)
                if not examples and not allow_empty:
                    raise DataFormatError(f"{path}: client {client!r} of split {split!r} is "
                                          "listed in client_metadata but has no examples")
                yield client, examples
