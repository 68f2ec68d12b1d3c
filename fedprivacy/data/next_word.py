"""StackOverflow next-word prediction, preprocessed exactly as TFF's baseline.

Per post (TFF ``simulation/baselines/stackoverflow/word_prediction_preprocessing.py``,
``build_to_ids_fn`` with one OOV bucket; Reddi et al. 2021, arXiv:2003.00295, App. C):

* words = ``tokens`` split on the single byte ``b" "`` (``tf.strings.split(sep=" ")``, so a
  run of spaces gives empty words, which are out of vocabulary), truncated to the first
  ``seq_len`` words; the title is not used;
* ids: pad = 0; the j-th most frequent word of the word count file (j = 0..V-1) = j + 1;
  OOV = V + 1; BOS = V + 2; EOS = V + 3; so the model sees ``V + 4`` classes;
* sequence = ``[BOS] + ids`` followed by ``EOS`` only if fewer than ``seq_len`` words were
  kept, right-padded with 0 to ``seq_len + 1``; input ``x = seq[:-1]``, target ``y = seq[1:]``.

Each post is one row of ``tokens`` (``seq_len + 1`` int32 ids); ``x`` and ``y`` are views.

Accuracy as TFF reports it (``accuracy_without_out_of_vocab_or_end_of_sentence`` in
``word_prediction_tasks.py``): the argmax over all ``V + 4`` logits is compared with the
target at every position whose target is not pad, OOV or EOS (BOS never is a target).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from fedprivacy.data.sources import ExampleSource, offsets_partition, open_source
from fedprivacy.data.stackoverflow import DataFormatError, read_word_counts

__all__ = ["SpecialTokens", "special_tokens", "FederatedTokenData", "load_next_word",
           "to_ids", "accuracy_mask"]


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the special tokens for a vocabulary of ``V`` words (TFF, one OOV bucket)."""

    pad: int
    oov: int
    bos: int
    eos: int

    @property
    def num_classes(self) -> int:
        """``V + 4``: pad, the ``V`` words, OOV, BOS, EOS."""
        return self.eos + 1


def special_tokens(vocab_size: int) -> SpecialTokens:
    """pad 0, OOV ``V+1``, BOS ``V+2``, EOS ``V+3`` (TFF ``get_special_tokens``)."""
    return SpecialTokens(pad=0, oov=vocab_size + 1, bos=vocab_size + 2, eos=vocab_size + 3)


def to_ids(texts: Sequence[bytes], word_index: pd.Index, seq_len: int,
           vocab_size: int) -> np.ndarray:
    """Token sequences of posts: int32 array ``(len(texts), seq_len + 1)`` (see module doc).

    Args:
        texts: The posts' ``tokens`` byte strings.
        word_index: The vocabulary, most frequent word first (at most ``vocab_size`` words).
        seq_len: Number of words kept per post.
        vocab_size: ``V``, which fixes the special ids.
    """
    special = special_tokens(vocab_size)
    words = [text.split(b" ")[:seq_len] for text in texts]
    lengths = np.fromiter(map(len, words), np.int64, len(words))
    flat = [w for ws in words for w in ws]
    ids = word_index.get_indexer(flat) if flat else np.empty(0, np.int64)
    ids = np.where(ids >= 0, ids + 1, special.oov)
    out = np.zeros((len(texts), seq_len + 1), dtype=np.int32)
    out[:, 0] = special.bos
    rows = np.repeat(np.arange(len(texts)), lengths)
    starts = np.cumsum(lengths) - lengths
    out[rows, 1 + np.arange(len(flat)) - np.repeat(starts, lengths)] = ids
    short = np.flatnonzero(lengths < seq_len)
    out[short, lengths[short] + 1] = special.eos
    return out


def accuracy_mask(targets: np.ndarray, vocab_size: int) -> np.ndarray:
    """Positions TFF counts in accuracy: target not pad, OOV or EOS."""
    special = special_tokens(vocab_size)
    return (targets != special.pad) & (targets != special.oov) & (targets != special.eos)


@dataclass(frozen=True)
class FederatedTokenData:
    """Next-word sequences of a population of clients.

    Attributes:
        tokens: int32 array ``(num_examples, seq_len + 1)``, one post per row.
        offsets: int64 ``(num_clients + 1,)``: client ``i`` owns rows
            ``offsets[i]:offsets[i + 1]``.
        client_ids: The clients, in row order (sorted).
        vocab_size: ``V``, the number of vocabulary words (the model has ``V + 4`` classes).
        seq_len: Words per sequence.
    """

    tokens: np.ndarray
    offsets: np.ndarray
    client_ids: tuple[str, ...]
    vocab_size: int
    seq_len: int

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if (self.tokens.shape != (n, self.seq_len + 1)
                or not offsets_partition(self.offsets, n, len(self.client_ids))):
            raise ValueError("inconsistent FederatedTokenData shapes or offsets")

    @property
    def num_clients(self) -> int:
        return len(self.client_ids)

    def client(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Inputs ``x`` and targets ``y`` (views, ``(n_i, seq_len)`` each) of client ``i``."""
        rows = self.tokens[self.offsets[i]:self.offsets[i + 1]]
        return rows[:, :-1], rows[:, 1:]


def _text(example: Mapping[str, list], where: str) -> bytes:
    value = example.get("tokens")
    if not value or not isinstance(value[0], bytes):
        raise DataFormatError(f"{where}: missing or non-bytes feature 'tokens'")
    return value[0]


def iter_token_rows(source: ExampleSource, word_count_path: str | Path, split: str, *,
                    vocab_size: int, seq_len: int, clients: Sequence[str] | None = None
                    ) -> Iterator[tuple[str, np.ndarray]]:
    """Streams ``(client_id, token rows)`` per client (see :func:`load_next_word`).

    One client is in memory at a time (the streaming cache writer relies on it).
    """
    words = [w.encode("utf-8") for w in read_word_counts(word_count_path, vocab_size)]
    word_index = pd.Index(words, dtype=object)
    where = source.split_file(split)
    for client, examples in source.iter_client_examples(split, clients):
        texts = [_text(e, f"{where}: client {client!r}, example {j}")
                 for j, e in enumerate(examples)]
        yield client, to_ids(texts, word_index, seq_len, vocab_size)


def load_next_word(source: ExampleSource | str | Path, word_count_path: str | Path,
                   split: str, *, vocab_size: int = 10_000, seq_len: int = 20,
                   clients: Sequence[str] | None = None) -> FederatedTokenData:
    """Loads a split of StackOverflow as federated next-word sequences.

    Args:
        source: The examples, or the path of a ``stackoverflow.sqlite``.
        word_count_path: ``stackoverflow.word_count`` (the vocabulary is its first
            ``vocab_size`` words; if it lists fewer, the remaining ids are never used).
        split: ``"train"``, ``"heldout"`` or ``"test"``.
        vocab_size: ``V``.
        seq_len: Words kept per post (TFF's default 20).
        clients: Clients to read; ``None`` reads all of the split.

    Raises:
        DataFormatError: If a file is malformed or a post lacks ``tokens``.
        ValueError: On an invalid argument or unknown split/client.
    """
    if vocab_size < 1 or seq_len < 1:
        raise ValueError(f"vocab_size and seq_len must be >= 1, got {vocab_size}, {seq_len}")
    if not isinstance(source, ExampleSource):
        source = open_source("tff-sqlite", source)
    ids: list[str] = []
    parts: list[np.ndarray] = []
    for client, rows in iter_token_rows(source, word_count_path, split, vocab_size=vocab_size,
                                        seq_len=seq_len, clients=clients):
        ids.append(client)
        parts.append(rows)
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    tokens = (np.concatenate(parts) if parts
              else np.zeros((0, seq_len + 1), dtype=np.int32))
    return FederatedTokenData(tokens=tokens, offsets=offsets, client_ids=tuple(ids),
                              vocab_size=vocab_size, seq_len=seq_len)
