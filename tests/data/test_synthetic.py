"""Defining properties of the synthetic StackOverflow generator."""

from __future__ import annotations

import collections
import json
import re
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from fedprivacy.data.example_proto import decode_example
from fedprivacy.data.stackoverflow import read_tag_counts, read_word_counts
from fedprivacy.data.synthetic import SyntheticFiles, generate

DATE = re.compile(rb"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC")


def _rows(files: SyntheticFiles) -> list[tuple[str, str, bytes]]:
    with sqlite3.connect(files.sqlite) as connection:
        return connection.execute(
            "SELECT split_name, client_id, serialized_example_proto FROM examples "
            "ORDER BY rowid").fetchall()


@pytest.fixture(scope="module")
def decoded(so_files: SyntheticFiles) -> list[tuple[str, str, dict]]:
    return [(split, client, decode_example(blob)) for split, client, blob in _rows(so_files)]


def _clients(so_files: SyntheticFiles) -> dict[str, set[str]]:
    with sqlite3.connect(so_files.sqlite) as connection:
        clients = collections.defaultdict(set)
        for client, split in connection.execute("SELECT client_id, split_name FROM client_metadata"):
            clients[split].add(client)
    return clients


def test_schema_is_tffs(so_files: SyntheticFiles) -> None:
    with sqlite3.connect(so_files.sqlite) as connection:
        tables = {r[0] for r in connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert tables == {"examples", "client_metadata"}
        columns = {table: [(r[1], r[2], r[3]) for r in connection.execute(
            f"PRAGMA table_info({table})")] for table in tables}
    assert columns["examples"] == [("split_name", "TEXT", 1), ("client_id", "TEXT", 1),
                                   ("serialized_example_proto", "BLOB", 1)]
    assert columns["client_metadata"] == [("client_id", "TEXT", 1), ("split_name", "TEXT", 1),
                                          ("num_examples", "INTEGER", 1)]


def test_split_names_and_metadata_counts(so_files: SyntheticFiles) -> None:
    with sqlite3.connect(so_files.sqlite) as connection:
        counted = dict(((c, s), n) for c, s, n in connection.execute(
            "SELECT client_id, split_name, COUNT(*) FROM examples GROUP BY 1, 2"))
        declared = {(c, s): n for c, s, n in connection.execute(
            "SELECT client_id, split_name, num_examples FROM client_metadata")}
    assert {s for _, s in declared} == {"train", "heldout", "test"}
    assert counted == declared
    assert min(declared.values()) >= 1


def test_every_row_has_the_six_typed_features(decoded: list) -> None:
    for split, _, example in decoded:
        assert set(example) == {"tokens", "title", "tags", "type", "score", "creation_date"}
        assert all(len(v) == 1 for v in example.values())
        for name in ("tokens", "title", "tags", "type", "creation_date"):
            assert isinstance(example[name][0], bytes), name
        assert isinstance(example["score"][0], int)
        assert example["type"][0] in (b"question", b"answer")
        assert DATE.fullmatch(example["creation_date"][0])
        tokens = example["tokens"][0]
        assert tokens and tokens == tokens.lower() and b"  " not in tokens
        tags = example["tags"][0].split(b"|")
        assert 1 <= len(tags) <= 5 and len(set(tags)) == len(tags) and all(tags)
        assert 5 <= len(example["title"][0].split()) <= 12   # answers carry a title too


def test_populations_follow_the_real_split_rules(so_files: SyntheticFiles, so_spec) -> None:
    num_clients = so_spec.num_clients
    clients = _clients(so_files)
    assert len(clients["train"]) == num_clients
    assert abs(len(clients["heldout"]) - num_clients / 9) <= 1
    assert not clients["heldout"] & (clients["train"] | clients["test"])
    assert clients["test"] <= clients["train"]
    assert 0.35 <= len(clients["test"]) / num_clients <= 0.85
    every = set().union(*clients.values())
    assert all(re.fullmatch(r"\d{8}", c) for c in every)
    assert all(int(c) % 10 == 0 for c in clients["heldout"])
    assert all(int(c) % 10 != 0 for c in clients["train"])


def test_train_dates_before_2018_and_test_dates_after(decoded: list) -> None:
    dates = collections.defaultdict(list)
    for split, _, example in decoded:
        dates[split].append(example["creation_date"][0])
    assert max(dates["train"]) < b"2018-01-01" <= min(dates["test"])
    assert min(dates["heldout"]) < b"2018-01-01" <= max(dates["heldout"])


def test_same_seed_same_bytes_other_seed_other_data(so_files: SyntheticFiles, so_spec,
                                                    tmp_path: Path) -> None:
    again = generate(tmp_path / "again", num_clients=so_spec.num_clients, seed=so_spec.seed)
    for name in ("sqlite", "word_count", "tag_count"):
        assert getattr(again, name).read_bytes() == getattr(so_files, name).read_bytes(), name
    other = generate(tmp_path / "other", num_clients=so_spec.num_clients, seed=so_spec.seed + 1)
    assert _rows(other) != _rows(so_files)
    assert other.word_count.read_bytes() != so_files.word_count.read_bytes()


def test_refuses_to_overwrite_unless_asked(tmp_path: Path) -> None:
    files = generate(tmp_path, num_clients=2, seed=3)
    with pytest.raises(FileExistsError, match=re.escape(str(files.sqlite))):
        generate(tmp_path, num_clients=2, seed=4)
    assert generate(tmp_path, num_clients=2, seed=4, overwrite=True) == files
    assert not list(tmp_path.glob("*.partial"))


def test_count_files_are_train_occurrences_most_frequent_first(so_files: SyntheticFiles,
                                                               decoded: list) -> None:
    words, tags = collections.Counter(), collections.Counter()
    for split, _, example in decoded:
        if split == "train":
            words.update(example["tokens"][0].decode().split())
            tags.update(example["tags"][0].decode().split("|"))
    word_counts = read_word_counts(so_files.word_count)
    assert word_counts == dict(words)
    counts = list(word_counts.values())
    assert counts == sorted(counts, reverse=True)
    lines = so_files.word_count.read_text().splitlines()
    assert all(re.fullmatch(r"\S+ \d+", line) for line in lines)

    raw = json.loads(so_files.tag_count.read_text())
    assert raw == dict(tags)
    assert list(raw.values()) == sorted(raw.values(), reverse=True)
    assert list(read_tag_counts(so_files.tag_count)) == list(raw)
    assert {"python", "java", "javascript", "c#"} <= set(list(raw)[:10])


def test_zipf_like_words_over_a_large_vocabulary(so_files: SyntheticFiles) -> None:
    counts = np.array(list(read_word_counts(so_files.word_count).values()), dtype=float)
    assert len(counts) > 8_000  # 60 users sample ~9.4k distinct words; the default 1,000 users ~20k
    assert counts[:10].sum() / counts.sum() > 0.12
    ranks = np.arange(10, 1001)
    slope = np.polyfit(np.log(ranks), np.log(counts[ranks - 1]), 1)[0]
    assert -1.3 < slope < -0.7
    assert list(read_word_counts(so_files.word_count, 3)) == ["the", ".", ","]


def test_heavy_tailed_examples_per_user(so_files: SyntheticFiles) -> None:
    with sqlite3.connect(so_files.sqlite) as connection:
        sizes = np.array([n for (n,) in connection.execute(
            "SELECT num_examples FROM client_metadata WHERE split_name = 'train'")])
    assert sizes.min() >= 1
    assert 8 <= np.median(sizes) <= 40
    assert sizes.max() >= 5 * np.median(sizes)


def test_users_are_non_iid(decoded: list) -> None:
    """A user's most used tag covers far more of their posts than of everyone's."""
    per_user = collections.defaultdict(collections.Counter)
    overall = collections.Counter()
    for split, client, example in decoded:
        if split == "train":
            tags = example["tags"][0].split(b"|")
            per_user[client].update(tags)
            overall.update(tags)
    total = sum(overall.values())
    lifts = [count / sum(c.values()) / (overall[tag] / total)
             for c in per_user.values() if sum(c.values()) >= 30
             for tag, count in c.most_common(1)]
    assert np.median(lifts) > 3
