"""Defining properties of the synthetic StackOverflow generator."""

from __future__ import annotations

import collections
import json
import re
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedprivacy.data.example_proto import decode_example, encode_example
from fedprivacy.data.stackoverflow import read_tag_counts, read_word_counts
from fedprivacy.data.synthetic import (DEFAULT_MAX_EXAMPLES, SYNTHETIC_MARKER, TFF_MEAN_EXAMPLES,
                                       TFF_MIN_EXAMPLES, SyntheticFiles, _bytes_entry, _length, _sizes,
                                       _user_splits, _world, generate)

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


def _train_sizes(files: SyntheticFiles) -> np.ndarray:
    with sqlite3.connect(files.sqlite) as connection:
        return np.array([n for (n,) in connection.execute(
            "SELECT num_examples FROM client_metadata WHERE split_name = 'train'")])


def test_users_have_tffs_heavy_tailed_sizes(so_files: SyntheticFiles) -> None:
    """TFF keeps users with >= 100 sentences; 397 train examples per user on average."""
    sizes = _train_sizes(so_files)
    assert sizes.min() >= TFF_MIN_EXAMPLES
    assert 150 <= np.median(sizes) <= 350
    assert sizes.max() >= 3 * np.median(sizes)
    with sqlite3.connect(so_files.sqlite) as connection:
        heldout, test = ([n for (n,) in connection.execute(
            "SELECT num_examples FROM client_metadata WHERE split_name = ?", (split,))]
            for split in ("heldout", "test"))
    assert min(heldout) >= TFF_MIN_EXAMPLES
    assert 0.05 <= np.mean(test) / sizes.mean() <= 0.5   # TFF: 81 test vs 397 train examples


def test_size_distribution_hits_the_mean_with_a_heavy_tail() -> None:
    sizes = _sizes(TFF_MIN_EXAMPLES, TFF_MEAN_EXAMPLES, DEFAULT_MAX_EXAMPLES)
    rng = np.random.default_rng(0)
    draws = np.array([sizes.draw(rng) for _ in range(400)])
    assert draws.min() >= TFF_MIN_EXAMPLES
    assert abs(draws.mean() / TFF_MEAN_EXAMPLES - 1) < 0.1
    assert draws.max() / np.median(draws) > 5
    many = np.array([sizes.draw(rng) for _ in range(20_000)])
    assert abs(many.mean() / TFF_MEAN_EXAMPLES - 1) < 0.03
    capped = _sizes(100, 397, 1_000)        # the cap is solved for: the mean stays
    draws = np.array([capped.draw(rng) for _ in range(20_000)])
    assert draws.max() == 1_000 and abs(draws.mean() / 397 - 1) < 0.03
    assert {_sizes(5, 5, 9).draw(rng), _sizes(2, 9, 9).draw(rng)} == {5, 9}


@pytest.mark.parametrize("sizes", [(0, 5, 10), (10, 5, 20), (1, 30, 20)])
def test_refuses_inconsistent_sizes(tmp_path: Path, sizes) -> None:
    low, mean, high = sizes
    with pytest.raises(ValueError, match="min_examples <= mean_examples <= max_examples"):
        generate(tmp_path, num_clients=2, min_examples=low, mean_examples=mean,
                 max_examples=high)


def test_small_sizes_for_fast_fixtures(tmp_path: Path) -> None:
    files = generate(tmp_path, num_clients=30, seed=2, min_examples=1, mean_examples=6,
                     max_examples=40)
    sizes = _train_sizes(files)
    assert sizes.min() >= 1 and sizes.max() <= 40 and 3 <= sizes.mean() <= 12
    marker = json.loads((tmp_path / SYNTHETIC_MARKER).read_text())
    assert (marker["min_examples"], marker["mean_examples"], marker["max_examples"]) == (1, 6, 40)


def _posts(decoded: list) -> dict[tuple, list[dict]]:
    """Examples grouped by post: same user, split and creation date."""
    posts = collections.defaultdict(list)
    for split, client, example in decoded:
        posts[split, client, example["creation_date"][0]].append(example)
    return posts


def test_examples_are_sentences_sharing_their_posts_title_and_tags(decoded: list) -> None:
    posts = _posts(decoded)
    for examples in posts.values():
        for name in ("title", "tags", "score", "type"):
            assert len({example[name][0] for example in examples}) == 1, name
    sentences = np.array([len(examples) for examples in posts.values()])
    assert 3.5 <= sentences.mean() <= 6.5 and sentences.max() >= 8
    lengths = np.array([len(example["tokens"][0].split()) for _, _, example in decoded])
    assert 9 <= lengths.mean() <= 18            # a sentence, not a whole post
    assert len({example["tokens"][0] for _, _, example in decoded}) > 0.95 * len(decoded)


def test_one_to_five_tags_per_post(decoded: list) -> None:
    counts = np.array([len(examples[0]["tags"][0].split(b"|"))
                       for examples in _posts(decoded).values()])
    share = np.bincount(counts, minlength=6)[1:] / len(counts)
    assert counts.min() >= 1 and counts.max() <= 5 and share.min() > 0.03
    assert 2.3 <= counts.mean() <= 3.1


def test_a_tenth_of_the_tokens_lie_outside_the_top_10000_words(so_files: SyntheticFiles) -> None:
    counts = np.array(list(read_word_counts(so_files.word_count).values()), dtype=float)
    assert 0.06 <= counts[10_000:].sum() / counts.sum() <= 0.16


def test_tag_specificity_rises_into_the_vocabulary_tail(so_files: SyntheticFiles,
                                                       decoded: list) -> None:
    """Share of a word's occurrences in posts carrying its commonest co-occurring tag, by the
    word's frequency rank: stop words are spread over all tags, API names tied to one or two."""
    rank = {w: i for i, w in enumerate(read_word_counts(so_files.word_count))}
    per_word = collections.defaultdict(collections.Counter)
    occurrences = collections.Counter()
    for split, _, example in decoded:
        if split == "train":
            tags = example["tags"][0].split(b"|")
            for word in example["tokens"][0].decode().split():
                per_word[rank[word]].update(tags)
                occurrences[rank[word]] += 1
    share = {}
    for low, high in ((0, 100), (100, 1_000), (1_000, 10_000)):
        ranks = [r for r in range(low, high) if occurrences[r]]
        share[low] = (sum(per_word[r].most_common(1)[0][1] for r in ranks)
                      / sum(occurrences[r] for r in ranks))
    assert share[0] < 0.2 and share[0] < share[100] < share[1_000]


def test_fast_encoder_is_byte_identical_to_encode_example() -> None:
    """Also for sentences long enough (repeated 1,500 times: 15-90 kB) that the lengths need three varint bytes,
    past the table of short lengths."""
    world = _world(0)
    for _, block in _user_splits(0, 7, world, _sizes(2, 5, 9)):
        for score, repeat in ((-1, 1), (0, 1), (1, 1), (2 ** 40, 1), (2, 1_500)):
            columns = dict(block.post_columns, score=[score] * len(block.post_columns["score"]))
            again = type(block)(columns, [s * repeat for s in block.sentences], block.post_of, block.token_ids,
                                block.tag_ids)
            rows = again.columns()
            expected = [encode_example({name: rows[name][i] for name in rows})
                        for i in range(len(again))]
            assert again.blobs() == expected


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from([b"creation_date", b"tags", b"title", b"tokens", b"type"]),
       value=st.one_of(st.text(max_size=40), st.text(min_size=100, max_size=400),
                       st.builds(str.__mul__, st.text(alphabet="ab\u00e9\u4e2d", min_size=1, max_size=4),
                                 st.integers(1_000, 6_000))))
def test_a_bytes_entry_is_byte_identical_to_encode_example(name: bytes, value: str) -> None:
    """Crafted values whose lengths need 1, 2 or 3 varint bytes at each nesting level (value, list, feature, entry;
    multi-byte UTF-8 included): the generator's one-join entry is the entry of ``encode_example``."""
    assert encode_example({name.decode(): value}) == b"\x0a" + _length(len(entry := _bytes_entry(name, value))) + entry


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


def test_every_split_exists_at_any_population_size(tmp_path):
    from fedprivacy.data.stackoverflow import client_ids

    for users, seed in [(u, s) for u in (1, 2, 3) for s in range(4)]:  # 40% of users have no 2018 posts
        files = generate(tmp_path / f"{users}_{seed}", num_clients=users, seed=seed, min_examples=1,
                         mean_examples=5, max_examples=20)
        for split in ("train", "heldout", "test"):
            assert client_ids(files.sqlite, split), (users, seed, split)
