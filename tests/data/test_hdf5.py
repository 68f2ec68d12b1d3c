"""Tests of the HDF5 (TFF legacy) reader/writer and of the format-independent source."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from fedprivacy.data.hdf5 import SPLIT_FILES, h5_client_ids, iter_h5_client_examples
from fedprivacy.data.sources import SPLITS, file_identity, open_source
from fedprivacy.data.stackoverflow import DataFormatError, iter_client_examples
from fedprivacy.data.synthetic import SyntheticFiles


def test_h5_layout_is_tffs(so_h5_files: SyntheticFiles) -> None:
    assert so_h5_files.sqlite is None
    assert {s: p.name for s, p in so_h5_files.h5.items()} == SPLIT_FILES
    with h5py.File(so_h5_files.h5["train"], "r") as f:
        assert list(f.keys()) == ["examples"]
        client = f["examples"][sorted(f["examples"].keys())[0]]
        assert sorted(client.keys()) == ["creation_date", "score", "tags", "title", "tokens",
                                         "type"]
        assert client["score"].dtype == np.int64
        assert h5py.check_string_dtype(client["tokens"].dtype) is not None
        assert isinstance(client["tokens"][0], bytes)
        assert len({len(d) for d in client.values()}) == 1


def test_sqlite_and_h5_hold_identical_clients_and_examples(so_files: SyntheticFiles,
                                                           so_h5_files: SyntheticFiles) -> None:
    sqlite = open_source("tff-sqlite", so_files.sqlite)
    h5 = open_source("tff-h5", so_h5_files.h5["train"].parent)
    assert so_files.word_count.read_bytes() == so_h5_files.word_count.read_bytes()
    assert so_files.tag_count.read_bytes() == so_h5_files.tag_count.read_bytes()
    for split in SPLITS:
        assert sqlite.client_ids(split) == h5.client_ids(split)
        assert list(sqlite.iter_client_examples(split)) == list(h5.iter_client_examples(split))


def test_both_formats_stream_exactly_the_named_features(so_files: SyntheticFiles,
                                                        so_h5_files: SyntheticFiles) -> None:
    """``features=`` keeps the full stream's values of those features and drops the others, in both formats."""
    names = ("tags", "tokens", "absent")
    for source in (open_source("tff-sqlite", so_files.sqlite), open_source("tff-h5", so_h5_files.h5["train"].parent)):
        full = list(source.iter_client_examples("test"))
        assert list(source.iter_client_examples("test", features=names)) == [
            (client, [{k: e[k] for k in names if k in e} for e in examples]) for client, examples in full]
        assert {k for _, examples in full for e in examples for k in e} > {"tags", "tokens"}


def test_h5_subset_and_unknown_client(so_h5_files: SyntheticFiles) -> None:
    path = so_h5_files.h5["test"]
    ids = h5_client_ids(path)
    full = dict(iter_h5_client_examples(path))
    streamed = list(iter_h5_client_examples(path, [ids[3], ids[1], ids[3]]))
    assert [c for c, _ in streamed] == [ids[1], ids[3]]
    assert all(full[c] == examples for c, examples in streamed)
    with pytest.raises(ValueError, match="not in the file.*nobody"):
        list(iter_h5_client_examples(path, ["nobody"]))


def _h5(path: Path, clients: dict) -> Path:
    with h5py.File(path, "w") as f:
        group = f.create_group("examples")
        for client, columns in clients.items():
            g = group.create_group(client)
            for name, data in columns.items():
                g.create_dataset(name, data=data)
    return path


def test_h5_format_errors_name_file_client_and_problem(tmp_path: Path) -> None:
    strings = np.array([b"a b", b"c"], dtype=object)
    ragged = _h5(tmp_path / "ragged.h5", {"u1": {"tokens": strings, "score": np.arange(3)}})
    with pytest.raises(DataFormatError, match=rf"{re.escape(str(ragged))}: client 'u1': "
                                              "feature datasets differ in length"):
        list(iter_h5_client_examples(ragged))
    typed = _h5(tmp_path / "typed.h5", {"u1": {"tokens": np.zeros((2, 2))}})
    with pytest.raises(DataFormatError, match=r"client 'u1', feature 'tokens': expected a 1-D"):
        list(iter_h5_client_examples(typed))
    boolean = _h5(tmp_path / "bool.h5", {"u1": {"tokens": np.array([True, False])}})
    with pytest.raises(DataFormatError, match=r"feature 'tokens': unsupported type bool"):
        list(iter_h5_client_examples(boolean))
    empty = _h5(tmp_path / "empty.h5", {"u1": {"tokens": strings}, "u2": {}})
    with pytest.raises(DataFormatError, match=rf"{re.escape(str(empty))}: client 'u2' has no "
                                              "examples"):
        list(iter_h5_client_examples(empty))
    assert [c for c, e in iter_h5_client_examples(empty, allow_empty=True)] == ["u1", "u2"]
    with h5py.File(tmp_path / "nogroup.h5", "w") as f:
        f.create_group("data")
    with pytest.raises(DataFormatError, match=r"nogroup.h5: missing group '/examples'.*data"):
        h5_client_ids(tmp_path / "nogroup.h5")
    text = tmp_path / "text.h5"
    text.write_text("not hdf5 " * 100)
    with pytest.raises(DataFormatError, match=rf"{re.escape(str(text))}: not a readable HDF5"):
        h5_client_ids(text)
    with pytest.raises(FileNotFoundError, match="missing.h5"):
        h5_client_ids(tmp_path / "missing.h5")


def test_truncated_files_are_format_errors(so_files: SyntheticFiles,
                                           so_h5_files: SyntheticFiles, tmp_path: Path) -> None:
    h5 = tmp_path / "cut.h5"
    data = so_h5_files.h5["train"].read_bytes()
    h5.write_bytes(data[:len(data) // 2])
    with pytest.raises(DataFormatError, match=rf"{re.escape(str(h5))}: not a readable HDF5"):
        list(iter_h5_client_examples(h5))
    db = tmp_path / "cut.sqlite"
    data = so_files.sqlite.read_bytes()
    db.write_bytes(data[:len(data) // 2])
    with pytest.raises(DataFormatError, match=rf"{re.escape(str(db))}: .*corrupt or truncated"):
        list(iter_client_examples(db, "train"))


def test_open_source_and_file_identity(so_files: SyntheticFiles, tmp_path: Path) -> None:
    folder = open_source("tff-sqlite", so_files.sqlite.parent)
    assert folder == open_source("tff-sqlite", so_files.sqlite)
    assert folder.word_count == so_files.word_count and folder.tag_count == so_files.tag_count
    with pytest.raises(ValueError, match="unknown source format 'csv'"):
        open_source("csv", so_files.sqlite)
    with pytest.raises(ValueError, match="unknown split 'valid'"):
        folder.split_file("valid")
    copy = tmp_path / "copy.sqlite"
    shutil.copy2(so_files.sqlite, copy)
    identity = file_identity(copy)
    assert identity["size"] == so_files.sqlite.stat().st_size
    assert file_identity(copy) == identity
    with open(copy, "r+b") as f:
        f.seek(100)
        f.write(b"\x00")
    assert file_identity(copy)["sha256_head_tail"] != identity["sha256_head_tail"]
