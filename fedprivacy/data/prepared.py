"""Preprocessed StackOverflow splits through the cache: select users, preprocess once, map.

:func:`prepared_tags` and :func:`prepared_tokens` return the tag-prediction and next-word
arrays of one split for a user selection: the first ``first`` users in sorted client-id order
(AdaDPS: 400), then optionally a seeded uniform ``sample`` of them. The cache key
(:mod:`fedprivacy.data.cache`) holds the selection *spec*, the preprocessing options and the
source format and path; the identities of the example, word-count and tag-count files decide
whether an entry is fresh. A fresh entry is memory-mapped: no file is parsed.

With a cache folder, a missing or stale entry is built **streaming**: each client's rows are
appended to the entry's files as soon as they are preprocessed (:class:`~fedprivacy.data.cache.StreamWriter`),
so peak memory stays bounded by the largest client as the split grows; the arrays are
identical to those of the in-memory build (``cache_root=None``), which returns plain arrays.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np

from fedprivacy.data.cache import (StreamWriter, csr_arrays, csr_from_arrays, csr_index_dtype,
                                   load_or_build)
from fedprivacy.data.next_word import FederatedTokenData, iter_token_rows, load_next_word
from fedprivacy.data.on_demand import generated_population, generated_tag_rows
from fedprivacy.data.progress import with_progress
from fedprivacy.data.sources import ExampleSource, file_identity
from fedprivacy.data.tag_prediction import (FederatedTagData, NoTag, _ClientRows, assemble, iter_tag_rows,
                                            load_tag_prediction)
from fedprivacy.data.views import sample_clients

T = TypeVar("T")

__all__ = ["prepared_tags", "prepared_tokens"]


def _selection(first: int | None, sample: int | None, seed: int) -> dict:
    return {"first": first, "sample": sample, "seed": seed if sample is not None else None}


def _select_ids(source: ExampleSource, split: str, first: int | None, sample: int | None,
                seed: int) -> list[str] | None:
    """The selected client ids (``None``: every client of the split)."""
    if first is None and sample is None:
        return None
    ids = source.client_ids(split)[:first]
    if sample is not None:
        ids = [ids[i] for i in sample_clients(len(ids), sample, seed)]
    return ids


def _common(source: ExampleSource, split: str, first: int | None, sample: int | None,
            seed: int) -> tuple[dict, dict]:
    config = {"split": split, "source": source.format,
              "examples": str(source.split_file(split).resolve()),
              "clients": _selection(first, sample, seed)}
    identities = {"examples": source.identity(split),
                  "word_count": file_identity(source.word_count)}
    return config, identities


def _cache_progress(rows: Iterator[T], source: ExampleSource, split: str, clients: list[str] | None,
                    task: str) -> Iterator[T]:
    """A cache build's ``rows`` (one per user of ``clients``, None: the split's), with a bar on a terminal."""
    total = len(clients) if clients is not None else len(source.client_ids(split))
    return with_progress(rows, total, f"data cache: {task} {split}", "users")


def _client_ids(arrays: dict) -> tuple[str, ...]:
    return tuple(arrays["client_ids"].tolist())


def prepared_tags(source: ExampleSource, split: str, *, vocab_size: int, num_tags: int,
                  no_tag: NoTag, first: int | None = None, sample: int | None = None,
                  seed: int = 0, cache_root: Path | None = None
                  ) -> tuple[FederatedTagData, str]:
    """Tag-prediction data of a split (see :func:`~fedprivacy.data.tag_prediction.load_tag_prediction`).

    Returns:
        The data and the cache status (``hit``, ``built``, ``rebuilt`` or ``disabled``).
    """
    config, identities = _common(source, split, first, sample, seed)
    config.update(task="tag", vocab_size=vocab_size, num_tags=num_tags, no_tag=no_tag)
    identities["tag_count"] = file_identity(source.tag_count)

    def rows(clients: list[str] | None) -> Iterator[tuple[str, _ClientRows]]:
        """The rows of the split's ``clients`` (None: all): decoded from the files, or drawn when the files are
        exactly what the generator wrote (:func:`~fedprivacy.data.on_demand.generated_population`: the same rows
        without decoding)."""
        population = generated_population(source)
        if population is None:
            return iter_tag_rows(source, source.word_count, source.tag_count, split, vocab_size=vocab_size,
                                 num_tags=num_tags, no_tag=no_tag, clients=clients)
        return generated_tag_rows(population, source, split, source.client_ids(split) if clients is None else clients,
                                  vocab_size=vocab_size, num_tags=num_tags, no_tag=no_tag)

    def build() -> tuple[dict, dict]:
        load_tag_prediction(source, source.word_count, source.tag_count, split, vocab_size=vocab_size,
                            num_tags=num_tags, no_tag=no_tag, clients=[])  # the argument checks
        data = assemble(list(rows(_select_ids(source, split, first, sample, seed))), vocab_size, num_tags)
        arrays = {**csr_arrays("features", data.features), **csr_arrays("tags", data.tags),
                  "labels": data.labels, "offsets": data.offsets,
                  "client_ids": np.array(data.client_ids, dtype=str)}
        return arrays, {"num_dropped": data.num_dropped}

    def stream(writer: StreamWriter) -> dict:
        if vocab_size < 1 or num_tags < 1 or no_tag not in ("label0", "drop"):
            load_tag_prediction(source, source.word_count, source.tag_count, split,
                                vocab_size=vocab_size, num_tags=num_tags, no_tag=no_tag,
                                clients=[])  # raises the same ValueError as the build
        ids: list[str] = []
        sizes: list[int] = []
        dropped = 0
        for prefix in ("features", "tags"):
            writer.append(f"{prefix}_data", np.empty(0, np.float32))
            writer.append(f"{prefix}_indices", np.empty(0, np.int32))
            writer.append(f"{prefix}_indptr", np.zeros(1, np.int64))
        writer.append("labels", np.empty(0, np.int64))
        nnz = {"features": 0, "tags": 0}
        clients = _select_ids(source, split, first, sample, seed)
        for client, part in _cache_progress(rows(clients), source, split, clients, "tag"):
            ids.append(client)
            sizes.append(len(part.labels))
            dropped += part.dropped
            for prefix, row_nnz, columns, values in (
                    ("features", part.row_nnz, part.columns, part.values),
                    ("tags", part.tag_nnz, part.tag_columns,
                     np.ones(len(part.tag_columns), np.float32))):
                writer.append(f"{prefix}_data", values.astype(np.float32, copy=False))
                writer.append(f"{prefix}_indices", columns.astype(np.int32, copy=False))
                writer.append(f"{prefix}_indptr", nnz[prefix] + np.cumsum(row_nnz,
                                                                          dtype=np.int64))
                nnz[prefix] += int(row_nnz.sum())
            writer.append("labels", part.labels.astype(np.int64, copy=False))
        for prefix in ("features", "tags"):  # the in-memory build's index dtype rule
            writer.retype(f"{prefix}_indices", csr_index_dtype(nnz[prefix]))
            writer.retype(f"{prefix}_indptr", csr_index_dtype(nnz[prefix]))
        writer.put("offsets", np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
                   .astype(np.int64))
        writer.put("client_ids", np.array(ids, dtype=str))
        return {"num_dropped": dropped}

    arrays, meta, status = load_or_build(cache_root, f"tag-{split}", config, identities, build,
                                         stream)
    data = FederatedTagData(
        features=csr_from_arrays(arrays, "features", vocab_size), labels=arrays["labels"],
        tags=csr_from_arrays(arrays, "tags", num_tags), offsets=arrays["offsets"],
        client_ids=_client_ids(arrays), vocab_size=vocab_size, num_tags=num_tags,
        num_dropped=meta["num_dropped"])
    return data, status


def prepared_tokens(source: ExampleSource, split: str, *, vocab_size: int, seq_len: int,
                    first: int | None = None, sample: int | None = None, seed: int = 0,
                    cache_root: Path | None = None) -> tuple[FederatedTokenData, str]:
    """Next-word data of a split (see :func:`~fedprivacy.data.next_word.load_next_word`).

    Returns:
        The data and the cache status.
    """
    config, identities = _common(source, split, first, sample, seed)
    config.update(task="next_word", vocab_size=vocab_size, seq_len=seq_len)

    def build() -> tuple[dict, dict]:
        data = load_next_word(source, source.word_count, split, vocab_size=vocab_size,
                              seq_len=seq_len,
                              clients=_select_ids(source, split, first, sample, seed))
        return {"tokens": data.tokens, "offsets": data.offsets,
                "client_ids": np.array(data.client_ids, dtype=str)}, {}

    def stream(writer: StreamWriter) -> dict:
        if vocab_size < 1 or seq_len < 1:
            load_next_word(source, source.word_count, split, vocab_size=vocab_size,
                           seq_len=seq_len, clients=[])  # raises the build's ValueError
        ids: list[str] = []
        sizes: list[int] = []
        writer.append("tokens", np.zeros((0, seq_len + 1), np.int32))
        clients = _select_ids(source, split, first, sample, seed)
        for client, rows in _cache_progress(iter_token_rows(source, source.word_count, split, vocab_size=vocab_size,
                                                            seq_len=seq_len, clients=clients),
                                            source, split, clients, "next_word"):
            ids.append(client)
            sizes.append(len(rows))
            writer.append("tokens", rows)
        writer.put("offsets", np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
                   .astype(np.int64))
        writer.put("client_ids", np.array(ids, dtype=str))
        return {}

    arrays, _, status = load_or_build(cache_root, f"next_word-{split}", config, identities,
                                      build, stream)
    data = FederatedTokenData(tokens=arrays["tokens"], offsets=arrays["offsets"],
                              client_ids=_client_ids(arrays), vocab_size=vocab_size,
                              seq_len=seq_len)
    return data, status
