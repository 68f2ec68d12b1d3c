"""The two losses the sparse logistic regression trains in closed form: their value and logit gradient.

Local SGD of :class:`~fedprivacy.models.logistic.SparseLogisticRegression` needs of its loss only,
per batch row :math:`r` with logits :math:`z_r \\in \\mathbb R^K`, the row's loss :math:`\\ell_r` and
its gradient :math:`g_r = \\partial \\ell_r / \\partial z_r`; the batch loss is the mean
:math:`\\tfrac1B \\sum_r \\ell_r`, so the step's logit gradient is :math:`g_r / B` and the weight
gradient :math:`X^\\top G / B` (:meth:`~fedprivacy.models.logistic.SparseLogisticRegression.local_sgd_step_`,
:func:`~fedprivacy.client.sparse_cohort.train_sparse_cohort`: one code path for both losses).

* :data:`SOFTMAX_CROSS_ENTROPY` (single-label tags, AdaDPS arXiv:2202.05963v2 App. B):
  :math:`\\ell_r = -\\log \\operatorname{softmax}(z_r)_{y_r}`, :math:`g_r = \\operatorname{softmax}(z_r) - e_{y_r}`;
  targets: the labels, int64 ``(n,)``.
* :data:`SIGMOID_BINARY_CROSS_ENTROPY` (multi-hot tags, Reddi et al. 2021, arXiv:2003.00295v5, App. C):
  :math:`\\ell_r = \\tfrac1K \\sum_k \\operatorname{BCE}(\\sigma(z_{rk}), t_{rk})`,
  :math:`g_r = (\\sigma(z_r) - t_r) / K`; targets: multi-hot CSR ``(n, K)``, taken dense per batch.
  (The batch loss is the mean over the batch and the K tags, ``binary_cross_entropy_with_logits``.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn


_MINUS_ONE = torch.tensor([[-1.0]])  # e_y's coefficient in softmax(z) - e_y, expanded to each step's rows


class SoftmaxCrossEntropy:
    """Softmax cross-entropy with integer labels (module docstring)."""

    @staticmethod
    def concat(labels: Sequence[Any]) -> np.ndarray:
        """Several clients' labels, one after another."""
        return np.concatenate([np.asarray(y, dtype=np.int64) for y in labels])

    @staticmethod
    def take(labels: Any, rows: np.ndarray, device: str | torch.device) -> torch.Tensor:
        """The targets of ``rows`` of ``labels``, as a tensor on ``device``."""
        return torch.from_numpy(np.asarray(labels, dtype=np.int64)[rows]).to(device, non_blocking=True)

    @staticmethod
    def gradient(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g, l)``: each row's logit gradient ``softmax(z) - e_y`` (a new tensor) and loss ``-log softmax(z)_y``."""
        g = torch.softmax(logits, dim=1)
        at = targets[:, None]
        losses = g.gather(1, at).log_().neg_().squeeze(1)
        g.scatter_add_(1, at, torch.full_like(at, -1.0, dtype=g.dtype))
        return g, losses

    softmax = True  # which branch of :func:`logit_gradient_into` computes this loss

    @staticmethod
    def gradient_into(logits: torch.Tensor, targets: torch.Tensor, statistic: torch.Tensor) -> torch.Tensor:
        """:meth:`gradient`'s ``g``, writing into ``statistic`` (``(n,)``) each row's ``softmax(z)_y``, which
        :meth:`losses_` turns into the row's loss ``-log softmax(z)_y`` later, for all steps at once (the same
        values: elementwise ops; a step then pays 3 kernels, not 8)."""
        return logit_gradient_into(logits, targets, statistic, True, _MINUS_ONE)

    @staticmethod
    def losses_(statistic: torch.Tensor) -> torch.Tensor:
        """The rows' losses from :meth:`gradient_into`'s statistic, in place: ``-log softmax(z)_y``."""
        return statistic.log_().neg_()


class SigmoidBinaryCrossEntropy:
    """Per-tag sigmoid binary cross-entropy, averaged over the K tags, with multi-hot CSR targets."""

    @staticmethod
    def concat(labels: Sequence[Any]) -> sp.csr_matrix:
        """Several clients' multi-hot rows, one after another."""
        return sp.vstack(labels, format="csr")

    @staticmethod
    def take(labels: sp.csr_matrix, rows: np.ndarray, device: str | torch.device) -> torch.Tensor:
        """The dense multi-hot targets ``(len(rows), K)`` of ``rows``, float32 on ``device``."""
        return torch.from_numpy(labels[rows].toarray().astype(np.float32, copy=False)).to(device, non_blocking=True)

    softmax = False  # which branch of :func:`logit_gradient_into` computes this loss

    @staticmethod
    def gradient(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g, l)``: each row's logit gradient ``(sigmoid(z) - t) / K`` and loss ``mean_k BCE(sigmoid(z_k), t_k)``."""
        losses = nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction="none").mean(1)
        g = torch.sigmoid(logits).sub_(targets).div_(logits.shape[1])
        return g, losses

    @staticmethod
    def gradient_into(logits: torch.Tensor, targets: torch.Tensor, statistic: torch.Tensor) -> torch.Tensor:
        """:meth:`gradient`'s ``g``, writing each row's loss into ``statistic`` (``(n,)``)."""
        return logit_gradient_into(logits, targets, statistic, False, _MINUS_ONE)

    @staticmethod
    def losses_(statistic: torch.Tensor) -> torch.Tensor:
        """The rows' losses from :meth:`gradient_into`'s statistic: the statistic itself."""
        return statistic


def logit_gradient_into(logits: torch.Tensor, targets: torch.Tensor, statistic: torch.Tensor, softmax: bool,
                        minus_one: torch.Tensor) -> torch.Tensor:
    """The logit gradient ``g`` of either loss (``softmax``: :class:`SoftmaxCrossEntropy`, else
    :class:`SigmoidBinaryCrossEntropy`), each row's statistic written into ``statistic``: ``softmax(z)_y``,
    or the row's loss ``mean_k BCE``. ``minus_one``: a one-element tensor holding -1 (e_y's coefficient).

    Plain tensor code that TorchScript compiles as it is: the cohort trainer's compiled step loop
    (:func:`fedprivacy.client.sparse_cohort.local_steps`) calls this same function, so the two paths
    compute the same ops in the same order."""
    if softmax:
        g = torch.softmax(logits, dim=1)
        at = targets.unsqueeze(1)
        torch.gather(g, 1, at, out=statistic.unsqueeze(1))
        return g.scatter_add_(1, at, minus_one.expand(at.shape))
    statistic.copy_(nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction="none").mean(1))
    return torch.sigmoid(logits).sub_(targets).div_(logits.shape[1])


LogitLoss = SoftmaxCrossEntropy | SigmoidBinaryCrossEntropy
SOFTMAX_CROSS_ENTROPY = SoftmaxCrossEntropy()
SIGMOID_BINARY_CROSS_ENTROPY = SigmoidBinaryCrossEntropy()


def closed_form_loss(task: object) -> LogitLoss | None:
    """The loss ``task``'s clients train the sparse model with in closed form: the task's
    ``closed_form_softmax`` or ``closed_form_sigmoid`` attribute (True), else None (autograd on ``task.loss``)."""
    if getattr(task, "closed_form_softmax", False):
        return SOFTMAX_CROSS_ENTROPY
    if getattr(task, "closed_form_sigmoid", False):
        return SIGMOID_BINARY_CROSS_ENTROPY
    return None
