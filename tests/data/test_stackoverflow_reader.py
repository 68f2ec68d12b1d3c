"""Tests of the reader for TFF's StackOverflow files."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest

from fedprivacy.data import stackoverflow
from fedprivacy.data.example_proto import decode_example, encode_example
from fedprivacy.data.stackoverflow import (
    DataFormatError,
    client_ids,
    iter_client_examples,
    read_tag_counts,
    read_word_counts,
)
from fedprivacy.data.synthetic import SyntheticFiles

TFF_SCHEMA = (
    "CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL, "
    "serialized_example_proto BLOB NOT NULL);"
    "CREATE TABLE client_metadata (client_id TEXT NOT NULL, split_name TEXT NOT NULL, "
    "num_examples INTEGER NOT NULL);"
)


def _post(text: str) -> bytes:
    return encode_example({"tokens": text, "title": "t", "tags": "python", "type": "question",
                           "score": 0, "creation_date": "2015-01-01 00:00:00 UTC"})


def _make_db(path: Path, rows: list[tuple[str, str, bytes]],
             metadata: list[tuple[str, str, int]]) -> Path:
    """A TFF-layout database without any index, rows in the given (interleaved) order."""
    with sqlite3.connect(path) as connection:
        connection.executescript(TFF_SCHEMA)
        connection.executemany("INSERT INTO examples VALUES (?, ?, ?)", rows)
        connection.executemany("INSERT INTO client_metadata VALUES (?, ?, ?)", metadata)
    connection.close()
    return path


@pytest.fixture()
def interleaved_db(tmp_path: Path) -> Path:
    rows = [("train", "b", _post("b1")), ("train", "a", _post("a1")), ("test", "a", _post("x")),
            ("train", "b", _post("b2")), ("train", "a", _post("a2"))]
    metadata = [("b", "train", 2), ("a", "train", 2), ("a", "test", 1), ("c", "train", 0)]
    return _make_db(tmp_path / "so.sqlite", rows, metadata)


def _texts(examples: list[dict]) -> list[bytes]:
    return [e["tokens"][0] for e in examples]


def test_word_counts_keep_file_order_and_truncate(tmp_path: Path) -> None:
    path = tmp_path / "wc"
    path.write_text("the 50\nzebra 7\napple 7\nb 1\n")
    assert read_word_counts(path) == {"the": 50, "zebra": 7, "apple": 7, "b": 1}
    assert list(read_word_counts(path)) == ["the", "zebra", "apple", "b"]
    assert list(read_word_counts(path, vocab_size=2)) == ["the", "zebra"]


def test_word_count_errors_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "wc"
    path.write_text("the 50\nbroken\n")
    with pytest.raises(DataFormatError, match=rf"{re.escape(str(path))}, line 2"):
        read_word_counts(path)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "missing"))):
        read_word_counts(tmp_path / "missing")


def test_tag_counts_sorted_descending_with_stable_ties(tmp_path: Path) -> None:
    path = tmp_path / "tc"
    path.write_text(json.dumps({"a": 1, "b": 3, "c": 1, "d": 3, "e": 2}))
    assert list(read_tag_counts(path).items()) == [("b", 3), ("d", 3), ("e", 2), ("a", 1),
                                                   ("c", 1)]
    path.write_text("[1, 2]")
    with pytest.raises(DataFormatError, match=re.escape(str(path))):
        read_tag_counts(path)
    path.write_text("{not json")
    with pytest.raises(DataFormatError, match="not valid JSON"):
        read_tag_counts(path)


def test_client_ids_sorted_from_metadata(so_files: SyntheticFiles, so_spec) -> None:
    ids = client_ids(so_files.sqlite, "train")
    assert ids == sorted(ids) and len(ids) == so_spec.num_clients
    with sqlite3.connect(so_files.sqlite) as connection:
        expected = {c for (c,) in connection.execute(
            "SELECT client_id FROM client_metadata WHERE split_name = 'heldout'")}
    assert client_ids(so_files.sqlite, "heldout") == sorted(expected)


def test_streams_every_client_in_order_with_rowid_ordered_examples(
        so_files: SyntheticFiles) -> None:
    with sqlite3.connect(so_files.sqlite) as connection:
        expected = {}
        for client, blob in connection.execute(
                "SELECT client_id, serialized_example_proto FROM examples "
                "WHERE split_name = 'test' ORDER BY rowid"):
            expected.setdefault(client, []).append(decode_example(blob))
    streamed = list(iter_client_examples(so_files.sqlite, "test"))
    assert [c for c, _ in streamed] == sorted(expected)
    assert dict(streamed) == expected


def test_subset_in_sorted_order_across_query_chunks(so_files: SyntheticFiles,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    ids = client_ids(so_files.sqlite, "train")
    subset = ids[::3][::-1] + ids[:2]        # unordered, with a duplicate
    full = dict(iter_client_examples(so_files.sqlite, "train"))
    monkeypatch.setattr(stackoverflow, "_IDS_PER_QUERY", 4)
    streamed = list(iter_client_examples(so_files.sqlite, "train", subset))
    assert [c for c, _ in streamed] == sorted(set(subset))
    assert all(examples == full[c] for c, examples in streamed)
    with pytest.raises(ValueError, match="not in split 'train'.*nobody"):
        list(iter_client_examples(so_files.sqlite, "train", ["nobody"]))


def test_unindexed_interleaved_file_and_client_without_rows(interleaved_db: Path) -> None:
    streamed = [(c, _texts(e)) for c, e in iter_client_examples(interleaved_db, "train",
                                                                allow_empty=True)]
    assert streamed == [("a", [b"a1", b"a2"]), ("b", [b"b1", b"b2"]), ("c", [])]
    with pytest.raises(DataFormatError, match=rf"{re.escape(str(interleaved_db))}: client 'c' "
                                              "of split 'train'.*no examples"):
        list(iter_client_examples(interleaved_db, "train"))
    assert [(c, _texts(e)) for c, e in iter_client_examples(interleaved_db, "test")] == [
        ("a", [b"x"])]


def test_opens_read_only_and_creates_nothing(so_files: SyntheticFiles, tmp_path: Path) -> None:
    before = so_files.sqlite.read_bytes()
    neighbours = set(so_files.sqlite.parent.iterdir())
    list(iter_client_examples(so_files.sqlite, "heldout"))
    client_ids(so_files.sqlite, "train")
    assert so_files.sqlite.read_bytes() == before
    assert set(so_files.sqlite.parent.iterdir()) == neighbours


def test_unknown_split_lists_the_splits(interleaved_db: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown split 'validation'.*\['test', 'train'\]"):
        client_ids(interleaved_db, "validation")


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.sqlite"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        client_ids(missing, "train")
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        next(iter_client_examples(missing, "train"))
    assert not missing.exists()


def test_not_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "text.sqlite"
    path.write_text("this is not a database, it is plain text " * 20)
    with pytest.raises(DataFormatError, match=rf"{re.escape(str(path))}: not an SQLite"):
        client_ids(path, "train")


def test_missing_table_and_column_are_named(tmp_path: Path) -> None:
    path = tmp_path / "a.sqlite"
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE examples (split_name TEXT, client_id TEXT, "
                           "serialized_example_proto BLOB)")
    connection.close()
    with pytest.raises(DataFormatError, match=rf"{re.escape(str(path))}.*'client_metadata'"):
        client_ids(path, "train")
    path = tmp_path / "b.sqlite"
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE examples (split_name TEXT, client_id TEXT, blob BLOB)")
        connection.execute("CREATE TABLE client_metadata (client_id TEXT, split_name TEXT)")
    connection.close()
    with pytest.raises(DataFormatError,
                       match=rf"{re.escape(str(path))}.*'examples'.*'serialized_example_proto'"):
        next(iter_client_examples(path, "train"))


def test_undecodable_proto_names_file_client_and_row(tmp_path: Path) -> None:
    path = _make_db(tmp_path / "bad.sqlite",
                    [("train", "a", _post("ok")), ("train", "a", b"\xff\xfe garbage")],
                    [("a", "train", 2)])
    with pytest.raises(DataFormatError, match=rf"{re.escape(str(path))}: client 'a', row 2"):
        list(iter_client_examples(path, "train"))
