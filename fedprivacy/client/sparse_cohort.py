"""Local SGD of many clients of the sparse logistic-regression model at once (the tag task's cohort path).

Every client of a round starts from the same point :math:`(b, W)` (the broadcast, or DiSK's lookahead) and
runs the closed-form SGD of :func:`fedprivacy.client.trainer.local_sgd` on its own rows (McMahan et al. 2017,
arXiv:1602.05629v4, Alg. 1). Client :math:`i` reads and changes only its support rows
:math:`S_i` (row 0 the bias, row :math:`1 + w` the weights of each word :math:`w` in its posts:
:meth:`~fedprivacy.models.logistic.SparseLogisticRegression.support_blocks`). Here the clients'
rows are laid one after another in ONE matrix :math:`X = [x_1; \\dots; x_C]`, client :math:`i`'s
rows at offset :math:`o_i` (:math:`x_i^{(0)} = (b, W)[S_i]`, gathered once), so step :math:`j` of
every client still training is one batched computation over the union of their batches:

.. math:: z_r = \\textstyle\\sum_{k} v_{rk}\\, X[o_{c(r)} + 1 + \\ell_{rk}] + X[o_{c(r)}], \\qquad
          G_r = g(z_r) / B_{c(r), j},

.. math:: X[o_i] \\leftarrow X[o_i] - \\eta \\textstyle\\sum_{r: c(r) = i} G_r, \\qquad
          X[o_i + 1 + \\ell] \\leftarrow X[o_i + 1 + \\ell] - \\eta \\textstyle\\sum_{(r,k): \\ell_{rk} = \\ell} v_{rk} G_r

for batch rows :math:`r` of client :math:`c(r)` with stored values :math:`v_{rk}` at local word
positions :math:`\\ell_{rk}`, the loss's logit gradient :math:`g` (:mod:`fedprivacy.models.logit_losses`:
:math:`\\operatorname{softmax}(z_r) - e_{y_r}` for single-label tags, :math:`(\\sigma(z_r) - t_r) / K` for the
multi-label BCE of Reddi et al. 2021, arXiv:2003.00295v5, App. C) and batch size :math:`B_{c(r), j}` (each
epoch's last batch may be short). AdaDPS (arXiv:2202.05963v2, Alg. 3) divides each row's update by
its public :math:`A` (a per-word :math:`A_w` scales the backward's values of row :math:`o_i + 1 + \\ell`,
a per-coordinate one multiplies the product). The clients' rows are disjoint, so these are exactly each client's own
steps: the one-at-a-time gradient of the batch mean cross-entropy, made of one ``embedding_bag``,
one softmax and one sparse-dense ``addmm`` for all of them instead of per client (the per-step
dispatch cost, which dominates a 10-post batch, is paid once per step); the bias is one more
stored value of every post (its row :math:`o_{c(r)}`, value 1), so both sums above are in the same
two calls. The
update is :math:`\\Delta_i = x_i^{(s_i)} - x_i^{(0)}`, block-sparse over :math:`S_i`, equal to the
one-at-a-time delta within float rounding (that path accumulates :math:`\\Delta` itself and reads
:math:`x_t` at every step; the sums run in another order). Each client's batch order comes from its
own generator (``rngs[i]``: one ``permutation`` per epoch, as ``local_sgd`` draws it), so the
batches are the same. A client with no step :math:`j` (it has fewer posts) has no rows in step
:math:`j` and is left as it is.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from fedprivacy.client.cohort_training import _batch_indices
from fedprivacy.client.trainer import LocalResult
from fedprivacy.models.logistic import LocalRows, SparseLogisticRegression
from fedprivacy.models.logit_losses import SOFTMAX_CROSS_ENTROPY, LogitLoss, closed_form_loss, logit_gradient_into
from fedprivacy.updates import SparseUpdate

log = logging.getLogger(__name__)


def train_sparse_cohort(model: SparseLogisticRegression, clients: Sequence[tuple[sp.csr_matrix, Any]], *,
                        epochs: int, batch_size: int, lr: float, rngs: Sequence[np.random.Generator],
                        loss: LogitLoss = SOFTMAX_CROSS_ENTROPY, start_from: torch.Tensor | None = None,
                        preconditioner: dict[str, torch.Tensor] | None = None) -> list[LocalResult]:
    """``local_sgd(model, *clients[i], rng=rngs[i], start_from=start_from, preconditioner=preconditioner, ...)``
    (the closed-form path of ``loss``) for every client, trained together (module docstring); one
    :class:`LocalResult` per client, in order, equal to the one-at-a-time result within float rounding.
    ``model`` is only read; ``start_from`` (a full flat vector, e.g. DiSK's lookahead) replaces its
    weights as the starting point; ``preconditioner``: AdaDPS's public ``A`` by parameter name."""
    if not clients:
        return []
    bias, weight = model.start_point(start_from)
    device = bias.device
    supports = [model.support_blocks(features) for features, _ in clients]
    sizes = np.array([len(blocks) for blocks, _ in supports])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # o_i: client i's bias row in X
    counts = np.array([labels.shape[0] for _, labels in clients])
    blocks = torch.cat([blocks for blocks, _ in supports])
    x = _start_rows(bias, weight, blocks, starts)
    start = x.clone()
    inverse = _inverse_rows(model, preconditioner, blocks, starts)
    plan = _Plan.build([local for _, local in supports], starts, counts, rngs, epochs, batch_size,
                       loss.concat([y for _, y in clients]), loss, device,
                       None if inverse is None or inverse.shape[1] > 1 else inverse[:, 0])
    losses = torch.empty(len(plan.owner), dtype=x.dtype, device=device)  # each row's loss statistic, in step order
    per_coordinate = None if inverse is None or inverse.shape[1] == 1 else inverse
    with torch.jit.optimized_execution(False):  # run the ops as written (no graph rewrites): the Python loop's result
        compiled_local_steps()(x, *map(list, plan.steps()), list(losses.split(plan.rows_per_step)), lr, loss.softmax,
                               per_coordinate)
    x.sub_(start)
    loss_sums = torch.zeros(len(clients), dtype=torch.float64, device=device).index_add_(
        0, plan.owner, loss.losses_(losses).double()).tolist()
    dim = sum(p.numel() for p in model.parameters())
    results = []
    for i, (client_blocks, _) in enumerate(supports):
        examples = int(counts[i]) * epochs
        results.append(LocalResult(update=SparseUpdate(client_blocks, x[starts[i]:starts[i] + sizes[i]], dim),
                                   train_loss=loss_sums[i] / examples if examples else 0.0,
                                   num_examples=int(counts[i])))
    return results


def local_steps(x: torch.Tensor, columns: list[torch.Tensor], offsets: list[torch.Tensor], values: list[torch.Tensor],
                targets: list[torch.Tensor], indices: list[torch.Tensor], scaled: list[torch.Tensor],
                statistics: list[torch.Tensor], lr: float, softmax: bool, per_coordinate: torch.Tensor | None) -> None:
    """Every step of a :class:`_Plan` (its :meth:`~_Plan.steps`, one list entry per step), in place on ``X``
    (``x``): the forward's ``embedding_bag`` sum, the loss's logit gradient (``softmax``:
    :func:`~fedprivacy.models.logit_losses.logit_gradient_into`, each row's statistic into ``statistics``; the
    ``1 / B`` is in the backward's ``scaled`` values) and the backward ``X <- X - lr X_j^T G`` (module docstring's
    two equations); ``per_coordinate``: AdaDPS's ``(R, K)`` ``1 / A``, multiplying the product.

    Plain tensor code: :func:`compiled_local_steps` compiles it with TorchScript, whose interpreter runs the
    loop without Python's global lock, so the cohort trainer's threads train their chunks on every core."""
    rows = x.shape[0]
    minus_one = torch.full([1, 1], -1.0, dtype=x.dtype, device=x.device)
    for j in range(len(columns)):
        logits = torch.embedding_bag(x, columns[j], offsets[j], False, 0, False, values[j])[0]  # mode 0: sum
        g = logit_gradient_into(logits, targets[j], statistics[j], softmax, minus_one)
        xt = torch.sparse_coo_tensor(indices[j], scaled[j], [rows, offsets[j].shape[0]])
        if per_coordinate is None:
            torch.addmm(x, xt, g, alpha=-lr, out=x)
        else:
            x.addcmul_(torch.sparse.mm(xt, g), per_coordinate, value=-lr)


@functools.cache
def compiled_local_steps() -> Callable[..., None]:
    """:func:`local_steps` compiled by TorchScript (once per process), or :func:`local_steps` itself where
    TorchScript cannot compile it (TorchScript is deprecated in recent torch; a warning then says so): the same loop, whose
    threads then share Python's lock between kernels (slower on several cores, the same result)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script's deprecation notice
            return torch.jit.script(local_steps)
    except Exception as exc:  # noqa: BLE001 - any failure to compile leaves the same loop in Python
        log.warning("TorchScript could not compile the cohort's step loop (%s); it runs in Python", exc)
        return local_steps


def _inverse_rows(model: SparseLogisticRegression, preconditioner: dict[str, torch.Tensor] | None,
                  blocks: torch.Tensor, bias_rows: np.ndarray) -> torch.Tensor | None:
    """AdaDPS's ``1 / A`` on every row of ``X`` (None: A = 1): ``(R, 1)`` when ``A`` is one number per word
    and the bias is not preconditioned (it then scales the backward's sparse values), else ``(R, K)``.
    The factors of :meth:`~SparseLogisticRegression.inverse_preconditioner` (``A_W``: ``(V, 1)`` or ``(V, K)``,
    ``A_b``: ``(K,)``), for all clients' rows at once (a bias row reads word 0's ``A_W``, then is overwritten)."""
    a_w, a_b = (None, None) if preconditioner is None else (preconditioner.get("embedding.weight"),
                                                            preconditioner.get("bias"))
    if a_w is None and a_b is None:
        return None
    inv_w = None if a_w is None else 1.0 / a_w.to(blocks.device).index_select(0, (blocks - 1).clamp_(min=0))
    inv_b = None if a_b is None else 1.0 / a_b.to(blocks.device)
    k = model.block_size
    width = 1 if inv_b is None and (inv_w is None or inv_w.shape[1] == 1) else k
    rows = torch.ones(len(blocks), width, dtype=torch.float32, device=blocks.device)
    if inv_w is not None:
        rows.copy_(inv_w.expand(len(blocks), width))
    at = torch.from_numpy(bias_rows).to(blocks.device)
    rows[at] = 1.0 if inv_b is None else inv_b.to(rows.dtype)
    return rows


class _Plan:
    """Every step's batches of every client, laid out before training (one pass in numpy).

    The batch rows of step ``j`` are ``row_at[j]:row_at[j + 1]`` (client by client); their stored
    values ``nnz_at[j]:nnz_at[j + 1]``. Each row carries its client's bias as one more stored value
    (column ``o_i``, value 1), so a row's logit is one ``embedding_bag`` sum over ``X``, and the bias
    gradient comes out of the same ``addmm`` as the weights'. ``indices`` = (row of X, the value's
    row within its step), ``values`` the forward's weights, ``scaled`` the backward's (divided by
    the row's batch size: the mean's ``1 / B``, and by AdaDPS's ``1 / A`` of its row of ``X`` where that is
    one number per row: ``inverse``), ``offsets`` each row's first value within its step, ``targets``
    (``loss.take`` of the rows, in step order) and ``owner`` (the client) per row.
    """

    def __init__(self, **arrays: torch.Tensor | np.ndarray) -> None:
        self.__dict__.update(arrays)
        self.rows_per_step = np.diff(self.row_at).tolist()
        self.nnz_per_step = np.diff(self.nnz_at).tolist()

    def steps(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """``(columns, offsets, values, targets, indices, scaled)``, each a sequence of one view per step (zipped:
        each step's inputs), cut by one ``split`` per array (not sliced step by step: the loop then pays only its
        kernels)."""
        rows, nnz = self.rows_per_step, self.nnz_per_step
        return (self.indices[0].split(nnz), self.offsets.split(rows), self.values.split(nnz),
                self.targets.split(rows), self.indices.split(nnz, dim=1), self.scaled.split(nnz))

    @classmethod
    def build(cls, locals_: Sequence[LocalRows], starts: np.ndarray, counts: np.ndarray,
              rngs: Sequence[np.random.Generator], epochs: int, batch_size: int, labels: Any, loss: LogitLoss,
              device: torch.device, inverse: torch.Tensor | None = None) -> _Plan:
        rows_base = np.concatenate([[0], np.cumsum(counts)[:-1]])
        steps = [_batch_indices(rng, int(n), epochs, batch_size) for rng, n in zip(rngs, counts)]
        total = max(len(s) for s in steps)
        table = np.full((total, len(counts), batch_size), -1, dtype=np.int64)  # (step, client, slot) -> joint row
        for i, (s, n) in enumerate(zip(steps, counts)):
            per_epoch = len(s) // epochs if epochs else 0
            valid = np.arange(batch_size)[None, :] < _step_sizes(int(n), per_epoch, epochs, batch_size)[:, None]
            table[:len(s), i] = np.where(valid, s + rows_base[i], -1)
        valid = table >= 0
        rows = table[valid]  # step-major, client by client
        row_at = np.concatenate([[0], np.cumsum(valid.sum((1, 2)))])
        batch = valid.sum(2)[valid.any(2)]  # each (step, client) batch's size, in the order of ``rows``
        per_row_batch = np.repeat(batch, batch)
        owner_of_joint = np.repeat(np.arange(len(counts)), counts)
        owner = owner_of_joint[rows]
        nnz = np.array([len(r.values) for r in locals_])
        value_base = np.concatenate([[0], np.cumsum(nnz)[:-1]])
        indptr = np.concatenate([[0]] + [r.indptr[1:] + b for r, b in zip(locals_, value_base)])
        columns = np.concatenate([r.columns + 1 + s for r, s in zip(locals_, starts)])  # rows of X
        values = np.concatenate([r.values for r in locals_])
        first, length = indptr[rows], indptr[rows + 1] - indptr[rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(length + 1, out=offsets[1:])  # + 1: the bias value leads each row
        row_of = np.repeat(np.arange(len(rows)), length + 1)
        position = np.arange(offsets[-1]) - offsets[row_of]  # 0: the bias; k: the row's k-th stored value
        source = first[row_of] + position - 1
        bias = position == 0
        col = np.where(bias, starts[owner][row_of], columns[np.where(bias, 0, source)])
        val = np.where(bias, np.float32(1.0), values[np.where(bias, 0, source)]).astype(np.float32)
        step_of_row = np.repeat(np.arange(total), np.diff(row_at))
        local_row = row_of - row_at[step_of_row][row_of]
        nnz_at = offsets[row_at]
        offsets = offsets[:-1] - nnz_at[step_of_row]  # each row's first value within its step
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        scaled = as_tensor(val / per_row_batch[row_of].astype(np.float32))
        indices = as_tensor(np.stack([col, local_row]))
        if inverse is not None:  # AdaDPS's per-row 1 / A, on the backward's values of that row of X
            scaled.mul_(inverse[indices[0]])
        return cls(row_at=row_at.tolist(), nnz_at=nnz_at.tolist(), offsets=as_tensor(offsets),
                   indices=indices, values=as_tensor(val), scaled=scaled,
                   targets=loss.take(labels, rows, device), owner=as_tensor(owner))


def _start_rows(bias: torch.Tensor, weight: torch.Tensor, blocks: torch.Tensor, bias_rows: np.ndarray) -> torch.Tensor:
    """The starting point's rows ``blocks`` of the ``(1 + V, K)`` layout (block 0 the bias, block ``1 + w``
    word ``w``), the clients' blocks one after another, their bias blocks at ``bias_rows``: one gather."""
    rows = weight.index_select(0, (blocks - 1).clamp_(min=0))  # a bias block reads word 0's row here ...
    rows[torch.from_numpy(bias_rows).to(rows.device)] = bias  # ... and is overwritten with the bias
    return rows


def _step_sizes(n: int, per_epoch: int, epochs: int, batch_size: int) -> np.ndarray:
    """Each of a client's steps' batch size: ``batch_size``, but each epoch's last is what is left of ``n``."""
    size = np.full(per_epoch, batch_size)
    if per_epoch:
        size[-1] = n - (per_epoch - 1) * batch_size
    return np.tile(size, epochs)


def trains_in_closed_form(task: object, model: torch.nn.Module) -> bool:
    """Whether ``task``'s clients train ``model`` with closed-form SGD on their support rows (the task
    names a closed-form loss: :func:`~fedprivacy.models.logit_losses.closed_form_loss`; the model has
    ``support_blocks``), which :func:`train_sparse_cohort` batches."""
    return closed_form_loss(task) is not None and hasattr(model, "support_blocks")
