"""Tests of TFF next-word preprocessing, its accuracy mask, and the LSTM."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fedprivacy.data.next_word import accuracy_mask, load_next_word, special_tokens, to_ids
from fedprivacy.data.sources import open_source
from fedprivacy.data.synthetic import SyntheticFiles
from fedprivacy.models.lstm import NextWordLSTM
from fedprivacy.models.metrics import masked_accuracy_counts

# V = 4: the=1, foo=2, bar=3, baz=4; OOV=5, BOS=6, EOS=7, pad=0.
VOCAB = pd.Index([b"the", b"foo", b"bar", b"baz"], dtype=object)


def test_special_tokens_are_tffs() -> None:
    special = special_tokens(10_000)
    assert (special.pad, special.oov, special.bos, special.eos) == (0, 10_001, 10_002, 10_003)
    assert special.num_classes == 10_004


def test_to_ids_by_hand() -> None:
    texts = [b"the foo qux", b"foo bar baz the foo", b"bar  the", b"", b"the foo bar baz the foo"]
    ids = to_ids(texts, VOCAB, seq_len=5, vocab_size=4)
    assert ids.dtype == np.int32 and ids.shape == (5, 6)
    assert ids.tolist() == [
        [6, 1, 2, 5, 7, 0],   # BOS the foo OOV EOS pad
        [6, 2, 3, 4, 1, 2],   # exactly 5 words: no EOS
        [6, 3, 5, 1, 7, 0],   # double space: an empty word, out of vocabulary
        [6, 5, 7, 0, 0, 0],   # "" splits into one empty word
        [6, 1, 2, 3, 4, 1],   # truncated to 5 words, no EOS
    ]


def test_accuracy_excludes_pad_oov_and_eos() -> None:
    targets = torch.tensor([[1, 5, 7, 0], [2, 3, 5, 7]])
    assert accuracy_mask(targets.numpy(), 4).tolist() == [[True, False, False, False],
                                                          [True, True, False, False]]
    predicted = torch.tensor([[1, 5, 7, 0], [3, 3, 0, 7]])
    logits = torch.nn.functional.one_hot(predicted, 8).float()
    # counted targets 1, 2, 3: right, wrong, right
    assert masked_accuracy_counts(logits, targets, (0, 5, 7)) == (2, 3)
    # pad only masked: 1 5 7 right; 2 wrong, 3 right, 5 wrong, 7 right
    assert masked_accuracy_counts(logits, targets, (0,)) == (5, 7)


def test_loads_both_formats_identically(so_files: SyntheticFiles,
                                        so_h5_files: SyntheticFiles) -> None:
    sqlite = load_next_word(open_source("tff-sqlite", so_files.sqlite), so_files.word_count,
                            "test", seq_len=20)
    h5 = load_next_word(open_source("tff-h5", so_h5_files.h5["test"].parent),
                        so_h5_files.word_count, "test", seq_len=20)
    assert sqlite.client_ids == h5.client_ids
    np.testing.assert_array_equal(sqlite.offsets, h5.offsets)
    np.testing.assert_array_equal(sqlite.tokens, h5.tokens)
    assert (sqlite.tokens[:, 0] == special_tokens(10_000).bos).all()
    x, y = sqlite.client(0)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])


def test_lstm_shapes_and_parameter_count() -> None:
    model = NextWordLSTM(special_tokens(10_000).num_classes)
    # TFF's Keras model: 4,050,748; PyTorch's second LSTM bias adds 4 * 670.
    assert sum(p.numel() for p in model.parameters()) == 4_050_748 + 4 * 670
    logits = model(np.zeros((3, 20), dtype=np.int32))
    assert logits.shape == (3, 20, 10_004)
    with pytest.raises(ValueError):
        load_next_word("unused.sqlite", "unused", "train", seq_len=0)
