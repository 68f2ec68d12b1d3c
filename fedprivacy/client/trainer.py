"""Local training on one client: plain mini-batch SGD, then the model delta.

.. math:: x^{(0)} = x_t,\\quad x^{(j+1)} = x^{(j)} - \\eta_l \\nabla f(x^{(j)}; B_j),
          \\quad \\Delta_i = x^{(s)} - x_t

(ARCHITECTURE "client: local training" and "client: update"; AdaDPS Alg. 3 with A = 1.)
The batch order is drawn from a generator seeded by ``(run seed, round, client)``, so the same
client in the same round trains identically on every engine.

The delta is returned as a :class:`~fedprivacy.updates.SparseUpdate` over the
coordinates that local SGD can change (``model.update_support(features)`` when the model
defines it; else all of them, as a dense update). It is the same vector as the dense delta: every
other coordinate is exactly zero. Afterwards the model is restored to ``x_t`` on those coordinates, so one working
model serves every client of a round without a full copy. A model that defines ``support_blocks``
(sparse logistic regression) instead accumulates the delta on just those rows and returns it
block-sparse; the shared model is never written.

The batch loops never wait for the device: batches go to it with ``non_blocking`` copies and
the losses stay there until the client is done (:func:`~fedprivacy.client.tensors.host_floats`), so on
a GPU the host queues work ahead instead of synchronising at every batch.

References: McMahan et al. 2017, arXiv:1602.05629v4, Alg. 1 (ClientUpdate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from fedprivacy.client.tensors import host_floats
from fedprivacy.models.logit_losses import SOFTMAX_CROSS_ENTROPY, LogitLoss
from fedprivacy.updates import SparseUpdate

CLIENT_STREAM = 0x636C69656E74  # "client"


@dataclass(frozen=True)
class LocalResult:
    """What a client sends back: its delta and non-private diagnostics."""

    update: SparseUpdate
    train_loss: float
    num_examples: int


def client_generator(seed: int, server_round: int, client_index: int) -> np.random.Generator:
    """The data-order generator of one client in one round (engine-independent)."""
    return np.random.default_rng(np.random.SeedSequence([seed, CLIENT_STREAM, server_round, client_index]))


class FlatView:
    """Gather/scatter flat (``parameters_to_vector``-order) coordinates of a model's parameters.

    ``indices`` None means every coordinate: then both are contiguous per-parameter copies (a
    4M-parameter LSTM's full gather by index costs ~20x as much, the index itself 32 MB).
    """

    def __init__(self, model: nn.Module) -> None:
        self.params = [p for p in model.parameters()]
        sizes = torch.tensor([p.numel() for p in self.params])
        self.bounds = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
        self.numel = int(self.bounds[-1])

    def _parts(self, indices: torch.Tensor | None):
        if indices is None:
            for k, p in enumerate(self.params):
                span = slice(int(self.bounds[k]), int(self.bounds[k + 1]))
                yield p, span, slice(None)
            return
        cut = torch.searchsorted(indices.cpu(), self.bounds).tolist()
        for k, p in enumerate(self.params):
            if cut[k] < cut[k + 1]:
                yield p, slice(cut[k], cut[k + 1]), indices[cut[k]:cut[k + 1]] - int(self.bounds[k])

    @torch.no_grad()
    def gather(self, indices: torch.Tensor | None) -> torch.Tensor:
        """A new flat tensor of the coordinates ``indices`` (None: all of them)."""
        out = torch.empty(self.numel if indices is None else len(indices), dtype=self.params[0].dtype,
                          device=self.params[0].device)
        for p, span, local in self._parts(indices):
            out[span] = p.view(-1)[local]
        return out

    @torch.no_grad()
    def scatter_(self, indices: torch.Tensor | None, values: torch.Tensor) -> None:
        """Write ``values`` into the coordinates ``indices`` (None: all of them)."""
        for p, span, local in self._parts(indices):
            p.view(-1)[local] = values[span]


def softmax_cross_entropy(logits: torch.Tensor, labels: np.ndarray) -> torch.Tensor:
    """Mean softmax cross-entropy over the batch (the default task's loss)."""
    y = torch.from_numpy(np.asarray(labels, dtype=np.int64)).to(logits.device, non_blocking=True)
    return nn.functional.cross_entropy(logits, y)


def local_sgd(model: nn.Module, features: sp.csr_matrix | np.ndarray, labels: np.ndarray | sp.csr_matrix, *,
              epochs: int, batch_size: int, lr: float, rng: np.random.Generator,
              start_from: torch.Tensor | None = None,
              loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
              preconditioner: dict[str, torch.Tensor] | None = None,
              closed_form: LogitLoss | None = None) -> LocalResult:
    """Train from the model's weights (or from ``start_from``); return ``x_local - x_start``.

    The model holds ``x_t`` before and after the call. ``start_from`` (a full flat vector, e.g.
    DiSK's lookahead ``x_t + gamma d``) replaces the starting point on the support; this is exact
    because ``update_support`` lists every coordinate the loss on these rows reads or changes.
    The loss is ``loss_fn(model(features[batch]), labels[batch])``, by default the mean softmax
    cross-entropy (then the sparse model trains in closed form on its weight rows); other tasks pass
    theirs and train by autograd, unless ``closed_form`` names the same loss in closed form
    (:mod:`fedprivacy.models.logit_losses`, e.g. the multi-label BCE) and the model trains on its
    support rows. With ``lr = 0`` the delta is exactly zero.

    AdaDPS (``preconditioner``: parameter name -> public ``A``, broadcastable to the parameter; an
    absent name is A = 1): every step is :math:`x \\leftarrow x - \\eta_l \\nabla f(x) \\oslash A`
    (arXiv:2202.05963v2, Alg. 3); the support is unchanged (A divides, it never spreads a gradient).
    """
    if closed_form is None and loss_fn is None:
        closed_form = SOFTMAX_CROSS_ENTROPY
    if closed_form is not None and hasattr(model, "support_blocks"):
        return _local_sgd_blocks(model, features, labels, epochs=epochs, batch_size=batch_size, lr=lr, rng=rng,
                                 start_from=start_from, preconditioner=preconditioner, loss=closed_form)
    view = FlatView(model)
    support = model.update_support(features) if hasattr(model, "update_support") else None  # None: all, dense
    origin = view.gather(support)
    start = origin if start_from is None else (start_from if support is None else start_from[support]).to(origin.dtype)
    if start_from is not None:
        view.scatter_(support, start)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    divide = [(p, preconditioner[name].to(p.device)) for name, p in model.named_parameters()
              if preconditioner and name in preconditioner]
    n = features.shape[0]
    loss_fn = loss_fn or softmax_cross_entropy
    losses, sizes = [], []
    model.train()
    try:
        for _ in range(epochs):
            order = rng.permutation(n)
            for lo in range(0, n, batch_size):
                idx = order[lo:lo + batch_size]
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(features[idx]), labels[idx])
                loss.backward()
                for p, a in divide:
                    _divide_grad_(p, a)
                optimizer.step()
                losses.append(loss.detach())
                sizes.append(len(idx))
        values = view.gather(support).sub_(start)
    finally:  # the working model is x_t again, even if training failed
        view.scatter_(support, origin)
    return LocalResult(update=SparseUpdate(support, values, view.numel),
                       train_loss=_mean_loss(losses, sizes, n * epochs), num_examples=n)


def _mean_loss(losses: list[torch.Tensor], sizes: list[int], examples: int) -> float:
    """Example-weighted mean of the batches' mean losses (read from the device once); 0 without examples."""
    return sum(loss * size for loss, size in zip(host_floats(losses), sizes)) / examples if examples else 0.0


def _divide_grad_(p: nn.Parameter, a: torch.Tensor) -> None:
    """``p.grad <- p.grad / A`` (a sparse row gradient, as ``EmbeddingBag(sparse=True)``'s, row by row)."""
    if p.grad.is_sparse:
        g = p.grad
        p.grad = torch.sparse_coo_tensor(g._indices(), g._values() / a.index_select(0, g._indices()[0]), g.shape)
    else:
        p.grad.div_(a)


def _local_sgd_blocks(model: nn.Module, features: sp.csr_matrix, labels: np.ndarray | sp.csr_matrix, *, epochs: int,
                      batch_size: int, lr: float, rng: np.random.Generator,
                      start_from: torch.Tensor | None,
                      preconditioner: dict[str, torch.Tensor] | None, loss: LogitLoss) -> LocalResult:
    """:func:`local_sgd` for a model that trains on its support rows alone (``support_blocks``).

    The same SGD on the same batches, accumulated as the delta itself on the ``(r, K)`` rows the
    client's data touches (:math:`\\Delta \\leftarrow \\Delta - \\eta_l \\nabla f(x_t + \\Delta; B_j)`,
    :math:`\\Delta = 0` at first) instead of on the shared model or a copy of its rows: the starting
    point is only read, nothing is restored, and the delta is block-sparse over those rows. The
    model supplies the batch gradient of ``loss`` in closed form (``local_sgd_step_``, in place); the
    values agree with autograd's up to float rounding.
    """
    blocks, local = model.support_blocks(features)
    start = model.start_point(start_from)
    delta = torch.zeros(len(blocks), model.block_size, dtype=start[0].dtype, device=start[0].device)
    inverse_a = model.inverse_preconditioner(preconditioner, blocks)
    n = features.shape[0]
    losses, sizes = [], []
    for _ in range(epochs):
        order = rng.permutation(n)
        for lo in range(0, n, batch_size):
            idx = order[lo:lo + batch_size]
            y = loss.take(labels, idx, delta.device)
            losses.append(model.local_sgd_step_(local, idx, start, delta, y, lr, inverse_a, delta_is_zero=not losses,
                                                loss=loss))
            sizes.append(len(idx))
    return LocalResult(update=SparseUpdate(blocks, delta, sum(p.numel() for p in model.parameters())),
                       train_loss=_mean_loss(losses, sizes, n * epochs), num_examples=n)


@torch.no_grad()
def evaluate(model: nn.Module, features: sp.csr_matrix, labels: np.ndarray, batch_size: int = 4096) -> dict[str, float]:
    """Example-weighted loss and accuracy of ``model`` over all rows (TFF/AdaDPS convention)."""
    model.eval()
    device = next(model.parameters()).device
    n = features.shape[0]
    if n == 0:
        return {"test_loss": float("nan"), "test_accuracy": float("nan")}
    loss_sums, correct = [], []
    for lo in range(0, n, batch_size):
        logits = model(features[lo:lo + batch_size])
        y = torch.from_numpy(np.asarray(labels[lo:lo + batch_size], dtype=np.int64)).to(device, non_blocking=True)
        loss_sums.append(nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct.append((logits.argmax(dim=1) == y).sum())
    return {"test_loss": sum(host_floats(loss_sums)) / n, "test_accuracy": sum(host_floats(correct)) / n}
