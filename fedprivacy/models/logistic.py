"""Multinomial logistic regression on sparse bag-of-words inputs (10,000 words -> 500 tags).

.. math:: p(y \\mid x) = \\operatorname{softmax}(W^\\top x + b), \\quad W \\in \\mathbb R^{V \\times K}

Implemented as ``EmbeddingBag(mode="sum", per_sample_weights=x)``: a batch costs work only on the
rows of ``W`` for words present in it (~1% of the vocabulary), and with ``sparse=True`` the
gradient of ``W`` is a sparse tensor, so local SGD never touches the other ~99% of the 5,000,500
parameters. The math is exactly dense logistic regression (tests check it against ``x @ W + b``).

Local training can also run on the client's rows alone (:meth:`SparseLogisticRegression.support_blocks`,
:meth:`~SparseLogisticRegression.local_logits`): the flat parameter vector (``bias`` then
``embedding.weight``) is a ``(1 + V, K)`` matrix whose row 0 is the bias and row ``1 + w`` the
weights of word ``w``; a client reads and changes only the rows of its words and the bias, so it
trains a small ``(r, K)`` copy of those rows, and its update is block-sparse over them.

References: AdaDPS (Li et al. 2022, arXiv:2202.05963v2), App. B; TFF's StackOverflow LR baseline
(Reddi et al. 2021, arXiv:2003.00295v5, App. C).
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def block_size(self) -> int:
        """Coordinates per block of the flat vector: the number of classes ``K``."""
        return self.bias.numel()

    def support_blocks(self, x: sp.csr_matrix) -> tuple[torch.Tensor, LocalRows]:
        """The blocks training on ``x`` reads or changes, and ``x`` renumbered onto them.

        Returns ``blocks`` (sorted, unique int64: 0 for the bias, ``1 + w`` for word ``w`` present in
        ``x``) and the rows of ``x`` with column ``w`` renumbered to its position among the words,
        for :meth:`local_logits`. The same support as :meth:`update_support`, as whole rows.
        """
        words, local_cols = np.unique(x.indices, return_inverse=True)
        blocks = np.empty(len(words) + 1, dtype=np.int64)
        blocks[0] = 0
        blocks[1:] = words
        blocks[1:] += 1
        local = LocalRows(np.asarray(x.indptr, dtype=np.int64), local_cols.astype(np.int64, copy=False),
                          np.asarray(x.data, dtype=np.float32))
        return torch.from_numpy(blocks).to(self.bias.device), local

    @torch.no_grad()
    def gather_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """A fresh ``(r, K)`` tensor holding the model's rows ``blocks`` (``blocks[0]`` must be 0, the bias)."""
        out = torch.empty(len(blocks), self.block_size, dtype=self.bias.dtype, device=self.bias.device)
        out[0] = self.bias
        torch.index_select(self.embedding.weight, 0, blocks[1:] - 1, out=out[1:])
        return out

    @staticmethod
    def local_logits(local: LocalRows, rows: np.ndarray, theta: torch.Tensor) -> torch.Tensor:
        """Logits of rows ``rows`` of ``local`` under block parameters ``theta`` (``(r, K)``: bias,
        then the weight rows of the client's words): the same values as :meth:`forward` on those rows."""
        indices, offsets, weights = local.bag(rows)
        device = theta.device
        return nn.functional.embedding_bag(
            torch.from_numpy(indices).to(device), theta[1:], torch.from_numpy(offsets).to(device), mode="sum",
            per_sample_weights=torch.from_numpy(weights).to(device)) + theta[0]

    def inverse_preconditioner(self, preconditioner: dict[str, torch.Tensor] | None,
                               blocks: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """AdaDPS's ``1 / A`` on the client's rows: ``(1 / A_W[words], 1 / A_b)`` for :meth:`local_sgd_step_`.

        ``preconditioner`` maps parameter names to ``A`` (``embedding.weight``: ``(V, 1)`` or ``(V, K)``;
        ``bias``: ``(K,)``; an absent name is A = 1). ``blocks`` as from :meth:`support_blocks`.
        """
        a_w = None if preconditioner is None else preconditioner.get("embedding.weight")
        a_b = None if preconditioner is None else preconditioner.get("bias")
        device = self.bias.device
        inv_w = None if a_w is None else 1.0 / a_w.to(device).index_select(0, blocks[1:] - 1)
        return inv_w, None if a_b is None else 1.0 / a_b.to(device)

    @staticmethod
    @torch.no_grad()
    def local_sgd_step_(local: LocalRows, rows: np.ndarray, theta: torch.Tensor, labels: torch.Tensor,
                        lr: float, inverse_a: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> float:
        """One SGD step of the mean cross-entropy of rows ``rows`` on ``theta`` in place, in closed form;
        returns the batch's mean loss before the step.

        .. math:: b \\leftarrow b - \\tfrac{\\eta}{B} \\textstyle\\sum_i (p_i - e_{y_i}) \\oslash A_b,\\quad
                  W \\leftarrow W - \\tfrac{\\eta}{B} \\big(X^\\top (P - E_y)\\big) \\oslash A_W

        The same step as autograd's gradient through :meth:`local_logits` (tested). The weight update
        is one sparse-dense ``addmm`` accumulated into ``theta`` itself: O(nnz K) work and no ``(r, K)``
        temporary (a gradient the size of the client's rows, allocated and zeroed every batch, cost
        more than the arithmetic). AdaDPS (``inverse_a`` from :meth:`inverse_preconditioner`, A = 1
        where None): a per-word ``A_W`` (``(r-1, 1)``) scales the sparse values of word ``w`` by
        ``1 / A_w`` inside the same ``addmm``; a per-coordinate one (``(r-1, K)``) divides the product.
        """
        inv_w, inv_b = inverse_a
        indices, offsets, weights = local.bag(rows)
        device, batch = theta.device, len(rows)
        idx, w = torch.from_numpy(indices).to(device), torch.from_numpy(weights).to(device)
        logits = nn.functional.embedding_bag(idx, theta[1:], torch.from_numpy(offsets).to(device), mode="sum",
                                             per_sample_weights=w) + theta[0]
        loss = float(nn.functional.cross_entropy(logits, labels))
        dlogits = torch.softmax(logits, dim=1)
        dlogits[torch.arange(batch, device=device), labels] -= 1.0
        dlogits.div_(batch)
        bias_grad = dlogits.sum(0)
        theta[0].sub_(bias_grad if inv_b is None else bias_grad.mul_(inv_b), alpha=lr)
        if inv_w is not None and inv_w.shape[1] == 1:
            w = w * inv_w[idx, 0]
        bag_of = torch.from_numpy(np.repeat(np.arange(batch, dtype=np.int64), np.diff(offsets, append=len(indices))))
        xt = torch.sparse_coo_tensor(torch.stack([idx, bag_of.to(device)]), w, (theta.shape[0] - 1, batch),
                                     check_invariants=False)  # in range by construction
        weight = theta[1:]
        if inv_w is None or inv_w.shape[1] == 1:
            torch.addmm(weight, xt, dlogits, alpha=-lr, out=weight)
        else:
            weight.addcmul_(torch.sparse.mm(xt, dlogits), inv_w, value=-lr)
        return loss


@dataclass(frozen=True)
class LocalRows:
    """A client's CSR rows with columns renumbered to its own words (``0..r-2``)."""

    indptr: np.ndarray
    columns: np.ndarray
    values: np.ndarray

    def bag(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``EmbeddingBag`` inputs (indices, offsets, per-sample weights) of ``rows``, in that order."""
        starts = self.indptr[rows]
        lengths = self.indptr[rows + 1] - starts
        offsets = np.zeros(len(rows), dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        positions = np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)
        return self.columns[positions], offsets, self.values[positions]
