"""Multinomial logistic regression on sparse bag-of-words inputs (10,000 words -> 500 tags).

.. math:: p(y \\mid x) = \\operatorname{softmax}(W^\\top x + b), \\quad W \\in \\mathbb R^{V \\times K}

Implemented as ``EmbeddingBag(mode="sum", per_sample_weights=x)``: a batch costs work only on the
rows of ``W`` for words present in it (~1% of the vocabulary), and with ``sparse=True`` the
gradient of ``W`` is a sparse tensor, so local SGD never touches the other ~99% of the 5,000,500
parameters. The math is exactly dense logistic regression (tests check it against ``x @ W + b``).

References: AdaDPS (Li et al. 2022, arXiv:2202.05963v2), App. B; TFF's StackOverflow LR baseline
(Reddi et al. 2021, arXiv:2003.00295v5, App. C).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn


class SparseLogisticRegression(nn.Module):
    """``logits = x @ W + b`` for CSR rows ``x``; parameters ``embedding.weight`` (V x K) and ``bias`` (K)."""

    def __init__(self, vocab_size: int = 10_000, num_classes: int = 500) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab_size, num_classes, mode="sum", sparse=True)
        self.bias = nn.Parameter(torch.zeros(num_classes))
        nn.init.zeros_(self.embedding.weight)

    def forward(self, x: sp.csr_matrix) -> torch.Tensor:
        """Logits for the rows of a SciPy CSR matrix (float32 values, int indices)."""
        device = self.bias.device
        indices = torch.from_numpy(x.indices.astype(np.int64, copy=False)).to(device)
        offsets = torch.from_numpy(x.indptr[:-1].astype(np.int64, copy=False)).to(device)
        weights = torch.from_numpy(x.data.astype(np.float32, copy=False)).to(device)
        return self.embedding(indices, offsets, per_sample_weights=weights) + self.bias

    def update_support(self, x: sp.csr_matrix) -> torch.Tensor:
        """Flat indices (``parameters_to_vector`` order) that training on rows ``x`` reads or changes.

        The logits of ``x`` read only the weight rows of words present in ``x`` and the bias, and
        plain SGD changes only those (the sparse gradient is exactly zero elsewhere). Sorted, unique.
        """
        offsets, at = {}, 0
        for name, p in self.named_parameters():  # own ``bias`` comes before ``embedding.weight``
            offsets[name] = at
            at += p.numel()
        num_classes = self.bias.numel()
        rows = torch.from_numpy(np.unique(x.indices).astype(np.int64))
        cols = torch.arange(num_classes)
        weight_idx = offsets["embedding.weight"] + (rows[:, None] * num_classes + cols[None, :]).reshape(-1)
        bias_idx = offsets["bias"] + cols
        parts = sorted([weight_idx, bias_idx], key=lambda t: int(t[0]) if len(t) else -1)
        return torch.cat(parts).to(self.bias.device)
