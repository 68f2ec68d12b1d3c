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
accumulates its delta on a small ``(r, K)`` matrix of those rows (reading the starting point only
where a batch's words are), and its update is block-sparse over them.

References: AdaDPS (Li et al. 2022, arXiv:2202.05963v2), App. B; TFF's StackOverflow LR baseline
(Reddi et al. 2021, arXiv:2003.00295v5, App. C).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from fedprivacy.models.logit_losses import SOFTMAX_CROSS_ENTROPY, LogitLoss


class SparseLogisticRegression(nn.Module):
    """``logits = x @ W + b`` for CSR rows ``x``; parameters ``embedding.weight`` (V x K) and ``bias`` (K)."""

    def __init__(self, vocab_size: int = 10_000, num_classes: int = 500) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab_size, num_classes, mode="sum", sparse=True)
        self.bias = nn.Parameter(torch.zeros(num_classes))
        nn.init.zeros_(self.embedding.weight)

    def forward(self, x: sp.csr_matrix) -> torch.Tensor:
        """Logits for the rows of a SciPy CSR matrix (float32 values, int indices)."""
        device = self.bias.device  # non_blocking: host-to-device copies need not wait for the device
        indices = torch.from_numpy(x.indices.astype(np.int64, copy=False)).to(device, non_blocking=True)
        offsets = torch.from_numpy(x.indptr[:-1].astype(np.int64, copy=False)).to(device, non_blocking=True)
        weights = torch.from_numpy(x.data.astype(np.float32, copy=False)).to(device, non_blocking=True)
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
        """The blocks training on ``x`` reads or changes, and the rows of ``x`` for :meth:`local_logits`.

        Returns ``blocks`` (sorted, unique int64: 0 for the bias, ``1 + w`` for word ``w`` present in
        ``x``) and the rows of ``x`` keeping both its word columns and their positions among the
        words (for :meth:`local_logits`). The same support as :meth:`update_support`, as whole rows.
        """
        words, local_cols = np.unique(x.indices, return_inverse=True)
        blocks = np.empty(len(words) + 1, dtype=np.int64)
        blocks[0] = 0
        blocks[1:] = words
        blocks[1:] += 1
        local = LocalRows(np.asarray(x.indptr, dtype=np.int64), x.indices.astype(np.int64, copy=False),
                          local_cols.astype(np.int64, copy=False), np.asarray(x.data, dtype=np.float32))
        return torch.from_numpy(blocks).to(self.bias.device), local

    def start_point(self, flat: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(bias, weight)`` of the point local training starts from, as read-only views: the model's
        own parameters, or ``flat`` (a full vector in ``parameters_to_vector`` order: the bias, then
        the weight rows)."""
        if flat is None:
            return self.bias.detach(), self.embedding.weight.detach()
        rows = flat.view(-1, self.block_size).to(self.bias.dtype)
        return rows[0], rows[1:]

    @staticmethod
    def local_logits(bag: Bag, start: tuple[torch.Tensor, torch.Tensor],
                     delta: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the rows of ``bag`` (from :meth:`LocalRows.bag`) under ``start + delta``: ``start``
        as from :meth:`start_point`, ``delta`` block rows (``(r, K)``: bias, then the weight rows of
        the client's words; None: zero). The same values as :meth:`forward` on those rows at that point.

        .. math:: z_i = (W_0 + \\Delta_W)^\\top x_i + b_0 + \\Delta_b
        """
        bias, weight = start
        logits = nn.functional.embedding_bag(bag.words, weight, bag.offsets, mode="sum",
                                             per_sample_weights=bag.values) + bias
        if delta is not None:
            logits += nn.functional.embedding_bag(bag.columns, delta[1:], bag.offsets, mode="sum",
                                                  per_sample_weights=bag.values) + delta[0]
        return logits

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
    def local_sgd_step_(local: LocalRows, rows: np.ndarray, start: tuple[torch.Tensor, torch.Tensor],
                        delta: torch.Tensor, labels: torch.Tensor, lr: float,
                        inverse_a: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None), *,
                        delta_is_zero: bool = False, loss: LogitLoss = SOFTMAX_CROSS_ENTROPY) -> torch.Tensor:
        """One SGD step of the batch-mean ``loss`` of rows ``rows`` (targets ``labels``, as from
        ``loss.take``) at ``start + delta``, in closed form, accumulated into ``delta`` in place; returns
        the batch's mean loss before the step (a 0-d tensor on ``delta``'s device: reading it would wait
        for the device).

        .. math:: \\Delta_b \\leftarrow \\Delta_b - \\tfrac{\\eta}{B} \\textstyle\\sum_i g_i \\oslash A_b,
                  \\quad \\Delta_W \\leftarrow \\Delta_W - \\tfrac{\\eta}{B} \\big(X^\\top G\\big) \\oslash A_W

        with :math:`g_i` row ``i``'s logit gradient (:mod:`fedprivacy.models.logit_losses`: ``p_i - e_{y_i}``
        for the softmax cross-entropy, ``(sigmoid(z_i) - t_i) / K`` for the multi-label BCE).
        The same step as autograd's gradient through :meth:`local_logits` (tested). Training keeps the
        delta, not the trained rows: the starting point is only read (the forward pass reads its
        rows of the batch's words), so nothing of size ``(r, K)`` is gathered, copied or subtracted;
        ``delta_is_zero`` (the first step) skips reading the delta. The weight update is one
        sparse-dense ``addmm`` into ``delta``: O(nnz K) work and no ``(r, K)`` temporary. AdaDPS
        (``inverse_a`` from :meth:`inverse_preconditioner`, A = 1 where None): a per-word ``A_W``
        (``(r-1, 1)``) scales the sparse values of word ``w`` by ``1 / A_w`` inside the same ``addmm``;
        a per-coordinate one (``(r-1, K)``) divides the product.
        """
        inv_w, inv_b = inverse_a
        batch = len(rows)
        bag = local.bag(rows, delta.device)
        logits = SparseLogisticRegression.local_logits(bag, start, None if delta_is_zero else delta)
        dlogits, losses = loss.gradient(logits, labels)
        dlogits.div_(batch)
        bias_grad = dlogits.sum(0)
        delta[0].sub_(bias_grad if inv_b is None else bias_grad.mul_(inv_b), alpha=lr)
        idx, w = bag.columns, bag.values
        if inv_w is not None and inv_w.shape[1] == 1:
            w = w * inv_w[idx, 0]
        xt = torch.sparse_coo_tensor(torch.stack([idx, bag.row_of]), w, (delta.shape[0] - 1, batch),
                                     check_invariants=False)  # in range by construction
        weight = delta[1:]
        if inv_w is None or inv_w.shape[1] == 1:
            torch.addmm(weight, xt, dlogits, alpha=-lr, out=weight)
        else:
            weight.addcmul_(torch.sparse.mm(xt, dlogits), inv_w, value=-lr)
        return losses.mean()


@dataclass(frozen=True)
class LocalRows:
    """A client's CSR rows: per stored value its word (``words``) and that word's position among the
    client's words (``columns``, ``0..r-2``)."""

    indptr: np.ndarray
    words: np.ndarray
    columns: np.ndarray
    values: np.ndarray

    def bag(self, rows: np.ndarray, device: str | torch.device = "cpu") -> Bag:
        """``EmbeddingBag`` inputs of ``rows``, in that order, as tensors on ``device`` (moved there once)."""
        starts = self.indptr[rows]
        lengths = self.indptr[rows + 1] - starts
        offsets = np.zeros(len(rows), dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        row_of = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
        positions = (starts - offsets)[row_of] + np.arange(len(row_of), dtype=np.int64)
        return Bag(*(torch.from_numpy(a).to(device, non_blocking=True) for a in (
            self.words[positions], self.columns[positions], self.values[positions], offsets, row_of)))


@dataclass(frozen=True)
class Bag:
    """The stored values of some rows, flattened, with their words, their positions among the
    client's words, where each row starts (``offsets``) and the row of each value (``row_of``)."""

    words: torch.Tensor
    columns: torch.Tensor
    values: torch.Tensor
    offsets: torch.Tensor
    row_of: torch.Tensor
