"""Tests of client views, the preprocessing cache, multi-label tags and the task loader."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from fedprivacy.config import DataConfig
from fedprivacy.data.prepared import prepared_tags, prepared_tokens
from fedprivacy.data.sources import open_source
from fedprivacy.data.synthetic import SyntheticFiles
from fedprivacy.data.views import natural, sample_clients, split_by_position
from fedprivacy.models.metrics import recall_at_k_counts
from fedprivacy.stackoverflow_tasks import MultiLabelTagTask, NextWordTask, TagPredictionTask, load_task


def test_partitions_by_hand() -> None:
    offsets = np.array([0, 5, 5, 15, 16])
    train, test = split_by_position(offsets, 0.8)
    assert list(zip(train.starts, train.stops)) == [(0, 4), (5, 5), (5, 13), (15, 15)]
    assert list(zip(test.starts, test.stops)) == [(4, 5), (5, 5), (13, 15), (15, 16)]
    assert test.rows().tolist() == [4, 13, 14, 15]
    capped = natural(offsets).capped(3)
    assert capped.sizes.tolist() == [3, 0, 3, 1] and capped.rows().tolist() == [0, 1, 2, 5, 6, 7, 15]
    picked = sample_clients(10, 4, seed=1)
    assert len(set(picked)) == 4 and picked.tolist() == sorted(picked)
    assert picked.tolist() == sample_clients(10, 4, seed=1).tolist()
    assert sample_clients(3, 10, seed=0).tolist() == [0, 1, 2]


def test_recall_at_5_by_hand() -> None:
    scores = torch.tensor([[9., 8, 7, 6, 5, 4, 3], [1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 0, 0]])
    targets = torch.tensor([[1., 0, 0, 0, 0, 1, 0],     # tag 0 in top 5, tag 5 not
                            [1., 1, 1, 0, 0, 0, 0],     # top 5 = 6,5,4,3,2: only tag 2
                            [0., 0, 0, 0, 0, 0, 0]])    # no true tag: adds nothing
    assert recall_at_k_counts(scores, targets, k=5) == (2, 5)


def test_multi_hot_tags_match_the_single_label(so_files: SyntheticFiles, tmp_path: Path) -> None:
    source = open_source("tff-sqlite", so_files.sqlite)
    data, _ = prepared_tags(source, "test", vocab_size=10_000, num_tags=50, no_tag="label0")
    tags = data.tags.toarray()
    has_tag = tags.any(axis=1)
    assert set(np.unique(tags)) <= {0.0, 1.0}
    np.testing.assert_array_equal(data.labels[has_tag], tags[has_tag].argmax(axis=1))
    assert (data.labels[~has_tag] == 0).all() and data.num_dropped == 0
    dropped, _ = prepared_tags(source, "test", vocab_size=10_000, num_tags=50, no_tag="drop")
    assert dropped.num_dropped == int((~has_tag).sum()) > 0
    assert dropped.tags.shape[0] == int(has_tag.sum())


def _config(files: SyntheticFiles, tmp_path: Path, **kw) -> DataConfig:
    return DataConfig(path=files.word_count.parent, generate_if_missing=False,
                      cache_dir=tmp_path / "cache", **kw)


def test_cache_hit_is_memory_mapped_and_equal(so_files: SyntheticFiles, tmp_path: Path) -> None:
    source = open_source("tff-sqlite", so_files.sqlite)
    kw = dict(vocab_size=10_000, num_tags=500, no_tag="label0", first=20, cache_root=tmp_path)
    built, status = prepared_tags(source, "train", **kw)
    assert status == "built"
    hit, status = prepared_tags(source, "train", **kw)
    assert status == "hit"
    # read-only views of np.load(mmap_mode="r"), not copies
    assert not hit.features.data.flags.writeable and not hit.features.indices.flags.writeable
    assert not hit.labels.flags.writeable and built.labels.flags.writeable
    assert hit.client_ids == built.client_ids and len(hit.client_ids) == 20
    assert (hit.features != built.features).nnz == 0 and (hit.tags != built.tags).nnz == 0
    np.testing.assert_array_equal(hit.labels, built.labels)
    _, status = prepared_tags(source, "train", **{**kw, "first": 21})
    assert status == "built"                                   # another selection, another entry
    tokens, status = prepared_tokens(source, "train", vocab_size=10_000, seq_len=20, first=20,
                                     cache_root=tmp_path)
    assert status == "built"
    again, status = prepared_tokens(source, "train", vocab_size=10_000, seq_len=20, first=20,
                                    cache_root=tmp_path)
    assert status == "hit"
    np.testing.assert_array_equal(again.tokens, tokens.tokens)


def test_stale_cache_is_detected_and_rebuilt(so_files: SyntheticFiles, tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    for path in (so_files.sqlite, so_files.word_count, so_files.tag_count):
        (folder / path.name).write_bytes(path.read_bytes())
    source = open_source("tff-sqlite", folder)
    kw = dict(vocab_size=3, num_tags=500, no_tag="label0", first=5, cache_root=tmp_path / "c")
    before, _ = prepared_tags(source, "train", **kw)
    # Rewrite the word counts with another order: the vocabulary (and the features) change.
    lines = (folder / "stackoverflow.word_count").read_text().splitlines()
    (folder / "stackoverflow.word_count").write_text("\n".join(lines[3:] + lines[:3]) + "\n")
    with caplog.at_level(logging.WARNING, logger="fedprivacy.data.cache"):
        after, status = prepared_tags(source, "train", **kw)
    assert status == "rebuilt"
    assert re.search(r"stale data cache .*input 'word_count' .* changed: .*size|mtime|sha256",
                     caplog.text)
    assert (after.features != before.features).nnz > 0
    assert prepared_tags(source, "train", **kw)[1] == "hit"
    # A damaged array file and an unreadable meta.json are rebuilt too.
    entry = next(p for p in (tmp_path / "c").iterdir() if p.name.startswith("tag-train"))
    (entry / "labels.npy").write_bytes(b"\x93NUMPY garbage")
    assert prepared_tags(source, "train", **kw)[1] == "rebuilt"
    (entry / "meta.json").write_text("{")
    assert prepared_tags(source, "train", **kw)[1] == "rebuilt"
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["identities"]["examples"]["size"] == os.path.getsize(folder / "stackoverflow.sqlite")


def test_sqlite_and_h5_give_identical_tasks(so_files: SyntheticFiles, so_h5_files: SyntheticFiles,
                                            tmp_path: Path) -> None:
    for task in ("tag", "tag_multilabel", "next_word"):
        a = load_task(_config(so_files, tmp_path, task=task, max_clients=15))
        b = load_task(_config(so_h5_files, tmp_path, task=task, max_clients=15, source="tff-h5"))
        assert a.population == b.population == 15
        for i in (0, 7, 14):
            for x, y in zip(a.client_data(i), b.client_data(i)):
                if hasattr(x, "toarray"):
                    np.testing.assert_array_equal(x.toarray(), y.toarray())
                else:
                    np.testing.assert_array_equal(x, y)
        assert a.majority_baseline == b.majority_baseline


def test_adadps_view_public_pool_and_caps(so_files: SyntheticFiles, tmp_path: Path) -> None:
    task = load_task(_config(so_files, tmp_path, view="adadps", max_clients=10, public_clients=2))
    assert isinstance(task, TagPredictionTask) and task.population == 10
    sizes = np.diff(task.train.offsets)
    assert task.partition.sizes.tolist() == np.floor(0.8 * sizes + 1e-9).astype(int).tolist()
    assert len(task.test_labels) == sizes.sum() - task.partition.sizes.sum()
    features, labels = task.client_data(0)
    np.testing.assert_array_equal(labels, task.train.labels[:task.partition.sizes[0]])
    assert task.public is not None and task.public.num_clients == 2
    assert set(task.public.client_ids).isdisjoint(task.train.client_ids)
    capped = load_task(_config(so_files, tmp_path, max_examples_per_client=3, client_sample=7))
    assert capped.population == 7 and capped.partition.sizes.max() <= 3


def test_task_classes_losses_and_evaluation(so_files: SyntheticFiles, tmp_path: Path) -> None:
    multi = load_task(_config(so_files, tmp_path, task="tag_multilabel", max_clients=5))
    assert isinstance(multi, MultiLabelTagTask)
    model = multi.new_model()
    x, tags = multi.client_data(0)
    assert float(multi.loss(model(x), tags).detach()) == pytest.approx(np.log(2), rel=1e-6)  # zero model
    metrics = multi.evaluate(model)
    assert set(metrics) == {"test_loss", "test_recall_at_5"} and 0 <= metrics["test_recall_at_5"] <= 1
    words = load_task(_config(so_files, tmp_path, task="next_word", max_clients=3,
                              max_test_examples=50))
    assert isinstance(words, NextWordTask) and words.test_tokens.shape == (50, 21)
    model = words.new_model()
    x, y = words.client_data(1)
    loss = words.loss(model(x[:4]), y[:4])
    loss.backward()
    assert np.log(10_004) - 0.5 < float(loss.detach()) < np.log(10_004) + 0.5
    metrics = words.evaluate(model)
    assert set(metrics) == {"test_loss", "test_accuracy", "test_accuracy_with_oov_eos"}
    assert 0 <= words.majority_baseline <= 1


@pytest.mark.parametrize("no_tag", ["label0", "drop"])
def test_streamed_cache_equals_in_memory_build(so_files: SyntheticFiles, tmp_path: Path,
                                               no_tag: str) -> None:
    """A cache entry is written client by client (StreamWriter); it must hold exactly the
    arrays of the in-memory build (same dtypes, shapes, values) and load back as .npy files
    identical to np.save of those arrays."""
    from fedprivacy.data.cache import csr_arrays

    source = open_source("tff-sqlite", so_files.sqlite)
    for split in ("train", "test"):
        kw = dict(vocab_size=10_000, num_tags=50, no_tag=no_tag)
        memory, status = prepared_tags(source, split, **kw)
        assert status == "disabled"
        streamed, status = prepared_tags(source, split, cache_root=tmp_path / split, **kw)
        assert status == "built"
        assert isinstance(streamed.labels, np.memmap)
        assert streamed.client_ids == memory.client_ids
        assert streamed.num_dropped == memory.num_dropped
        expected = {**csr_arrays("features", memory.features), **csr_arrays("tags", memory.tags),
                    "labels": memory.labels, "offsets": memory.offsets,
                    "client_ids": np.array(memory.client_ids, dtype=str)}
        (entry,) = (tmp_path / split).glob(f"tag-{split}-*")
        meta = json.loads((entry / "meta.json").read_text())
        assert set(meta["arrays"]) == set(expected)
        for name, array in expected.items():
            on_disk = np.load(entry / f"{name}.npy", allow_pickle=False)
            assert on_disk.dtype == array.dtype and on_disk.shape == array.shape, name
            np.testing.assert_array_equal(on_disk, array, err_msg=name)
            assert meta["arrays"][name] == {"dtype": str(array.dtype),
                                            "shape": list(array.shape)}
        assert (streamed.features != memory.features).nnz == 0
        assert (streamed.tags != memory.tags).nnz == 0
        assert prepared_tags(source, split, cache_root=tmp_path / split, **kw)[1] == "hit"

    tokens, _ = prepared_tokens(source, "train", vocab_size=100, seq_len=7)
    streamed, status = prepared_tokens(source, "train", vocab_size=100, seq_len=7,
                                       cache_root=tmp_path / "nw")
    assert status == "built" and streamed.tokens.dtype == np.int32
    np.testing.assert_array_equal(streamed.tokens, tokens.tokens)
    np.testing.assert_array_equal(streamed.offsets, tokens.offsets)
    assert streamed.client_ids == tokens.client_ids


def test_stream_writer_empty_and_retyped_arrays(tmp_path: Path) -> None:
    from fedprivacy.data.cache import StreamWriter

    writer = StreamWriter(tmp_path)
    writer.append("empty", np.zeros((0, 3), np.int32))
    for start in range(0, 10, 4):
        writer.append("seq", np.arange(start, min(start + 4, 10), dtype=np.int64))
    writer.retype("seq", np.int32)
    writer.append("seq", np.array([10], np.int32))
    with pytest.raises(ValueError, match="do not match"):
        writer.append("seq", np.array([1.0]))
    specs = writer.finish()
    assert specs == {"empty": {"dtype": "int32", "shape": [0, 3]},
                     "seq": {"dtype": "int32", "shape": [11]}}
    assert np.load(tmp_path / "empty.npy").shape == (0, 3)
    seq = np.load(tmp_path / "seq.npy", mmap_mode="r")
    assert seq.dtype == np.int32 and seq.tolist() == list(range(11))


def test_take_cuts_csr_row_ranges_exactly_as_scipy_into_private_copies():
    import scipy.sparse as sp

    from fedprivacy.stackoverflow_tasks import _take

    m = sp.random(30, 12, density=0.3, format="csr", dtype=np.float32, random_state=0)
    for rows in (slice(0, 30), slice(3, 9), slice(7, 7), slice(29, 30), slice(10, None)):
        got, want = _take(m, rows), m[rows]
        assert got.shape == want.shape and (got != want).nnz == 0
        assert got.indptr.dtype == want.indptr.dtype and got.indices.dtype == want.indices.dtype
        assert not np.shares_memory(got.data, m.data) and not np.shares_memory(got.indices, m.indices)
