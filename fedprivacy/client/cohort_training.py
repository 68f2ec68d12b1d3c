"""Cohorts trained together: the local SGD of many clients as one batched computation.

Every client of a round starts from the same broadcast :math:`x_t` and runs plain local SGD
(:func:`fedprivacy.client.trainer.local_sgd`, McMahan et al. 2017, arXiv:1602.05629v4, Alg. 1):

.. math:: x_i^{(0)} = x_t,\\quad x_i^{(j+1)} = x_i^{(j)} - \\eta_l \\nabla f(x_i^{(j)}; B_{i,j}),
          \\quad \\Delta_i = x_i^{(s_i)} - x_t .

Here the :math:`C` clients' parameters are stacked along a new leading axis, the model's forward
is vectorised over that axis with :func:`torch.func.vmap` (one ``bmm`` where each client would run
its own ``mm``), and step :math:`j` of all clients is one forward, one backward and one in-place
update of the stack. The clients' losses are independent, so the gradient of their sum with
respect to client :math:`i`'s slice is :math:`\\nabla f(x_i^{(j)}; B_{i,j})` exactly.

Same math, same batches: each client draws its batch order from its own
:func:`~fedprivacy.client.trainer.client_generator`, exactly as on its own. Clients differ in their
number of steps :math:`s_i` and in the size of each epoch's last batch; the clients are sorted by
``(s_i, last batch size)`` descending, so at step ``j`` the clients still training are a prefix
of the stack and those with an equal batch size are (for one epoch) contiguous slices of it. A
client with no step ``j`` is simply not in any slice: its parameters are left exactly as they are
(the "mask" is the slice bound). The updates equal the one-at-a-time path's within float
rounding (batched ``bmm`` kernels sum in another order).

Supported (:func:`unsupported_reason` says why not otherwise): dense models without buffers,
dropout or tied parameters, trained with plain SGD (no momentum, no per-client optimizer state, no AdaDPS
preconditioner), on features and labels that are numpy arrays or tensors. The forward is
the model's own ``vmap_forward(params, features)`` when it offers one, else ``torch.func.functional_call``
of the model: ``aten::lstm`` has no ``vmap`` batching rule, so :class:`~fedprivacy.models.lstm.NextWordLSTM`
offers its forward with the LSTM cell written out in matmuls and its own backpropagation through time
(:meth:`~fedprivacy.models.lstm.NextWordLSTM.vmap_forward`).
The loss is ``vmap``-ed with the forward when the task's loss allows it (tensor ops only), else
called once per client on the stacked logits (e.g. :meth:`fedprivacy.stackoverflow_tasks.NextWordTask.loss`,
which reads its targets through numpy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap

from fedprivacy.client.trainer import LocalResult
from fedprivacy.updates import SparseUpdate

Forward = Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]
"""One client's forward: ``forward(parameters by name, features batch) -> logits``."""


def batched_forward(model: nn.Module) -> Forward:
    """The per-client forward that :func:`train_cohort` vectorises: the model's ``vmap_forward`` if it
    offers one (e.g. :meth:`~fedprivacy.models.lstm.NextWordLSTM.vmap_forward`), else
    ``functional_call(model, params, (x,))``."""
    own: Forward | None = getattr(model, "vmap_forward", None)
    if own is not None:
        return own
    return lambda params, x: functional_call(model, params, (x,), tie_weights=False)  # none tied: checked


def unsupported_reason(model: nn.Module, features: Any = None, labels: Any = None) -> str | None:
    """Why :func:`train_cohort` cannot train clients of ``model`` on such data exactly, or ``None``."""
    if hasattr(model, "update_support") or hasattr(model, "support_blocks"):
        return f"{type(model).__name__} trains sparsely on its support (its own fast path)"
    if len(list(model.named_parameters(remove_duplicate=False))) != len(list(model.parameters())):
        return f"{type(model).__name__} ties parameters (one tensor under two names)"
    if any(True for _ in model.buffers()):
        return f"{type(model).__name__} has buffers (per-client state such as batch-norm statistics)"
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return f"{type(model).__name__} has dropout (random per client)"
    if not hasattr(model, "vmap_forward") and any(isinstance(m, nn.RNNBase) for m in model.modules()):
        return "torch's recurrent layers have no vmap batching rule (and the model offers no vmap_forward)"
    for name, values in (("features", features), ("labels", labels)):
        if values is not None and not isinstance(values, (np.ndarray, torch.Tensor)):
            return f"client {name} are {type(values).__name__}, not numpy arrays or tensors"
    return None


def _padded_batches(values: np.ndarray | torch.Tensor, index: np.ndarray, batch_size: int,
                    device: torch.device | str) -> torch.Tensor:
    """``values[index]`` as ``(steps, batch_size, ...)`` on ``device`` (pad rows are never read)."""
    rows = torch.as_tensor(values[index.ravel()])
    return rows.reshape(len(index), batch_size, *rows.shape[1:]).to(device)


def _batch_indices(rng: np.random.Generator, n: int, epochs: int, batch_size: int) -> np.ndarray:
    """Rows of each of a client's steps, ``(epochs * ceil(n / B), B)``: the orders that ``local_sgd``
    draws (one ``rng.permutation(n)`` per epoch), cut into batches; a short last batch is padded with 0."""
    per_epoch = -(-n // batch_size)
    out = np.zeros((epochs * per_epoch, batch_size), dtype=np.int64)
    for e in range(epochs):
        order = rng.permutation(n)
        padded = np.zeros(per_epoch * batch_size, dtype=np.int64)
        padded[:n] = order
        out[e * per_epoch:(e + 1) * per_epoch] = padded.reshape(per_epoch, batch_size)
    return out


def _groups(sizes: np.ndarray) -> list[tuple[int, np.ndarray | slice]]:
    """Positions of the clients with each nonzero batch size: a slice when contiguous, else an index array."""
    out = []
    for size in np.unique(sizes[sizes > 0])[::-1]:
        where = np.flatnonzero(sizes == size)
        contiguous = where[-1] - where[0] + 1 == len(where)
        out.append((int(size), slice(int(where[0]), int(where[-1]) + 1) if contiguous else where))
    return out


def train_cohort(model: nn.Module, clients: Sequence[tuple[Any, Any]], *, epochs: int, batch_size: int, lr: float,
                 rngs: Sequence[np.random.Generator], loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
                 vmap_loss: bool | None = None) -> list[LocalResult]:
    """:func:`~fedprivacy.client.trainer.local_sgd` of every ``(features, labels)`` in ``clients``
    from ``model``'s weights, trained together (module docstring); one :class:`LocalResult` per
    client, in order, equal to ``local_sgd(model, *clients[i], rng=rngs[i], loss_fn=loss_fn, ...)``
    within float rounding. ``model`` is only read. ``vmap_loss``: whether ``loss_fn`` is
    vectorised too (``None``: if it runs under ``vmap``, else once per client).
    """
    reason = unsupported_reason(model, *(clients[0] if clients else (None, None)))
    if reason is not None:
        raise ValueError(f"cohort training does not support this: {reason}")
    if not clients:
        return []
    names = [name for name, _ in model.named_parameters()]
    start = [p.detach() for p in model.parameters()]
    device = start[0].device
    counts = np.array([len(labels) for _, labels in clients])
    indices = [_batch_indices(rng, n, epochs, batch_size) for rng, n in zip(rngs, counts)]
    steps = np.array([len(ix) for ix in indices])
    last = counts - (-(-counts // batch_size) - 1) * batch_size  # size of each epoch's last batch
    order = np.lexsort((-last, -steps))  # most steps first, then the larger last batch
    total = int(steps.max())
    xs, ys = [], []
    for i in order:
        features, labels = clients[i]
        xs.append(_pad_steps(_padded_batches(features, indices[i], batch_size, device), total))
        ys.append(_pad_steps(_padded_batches(labels, indices[i], batch_size, "cpu"), total))
    x, y_host = torch.stack(xs), torch.stack(ys)  # labels: on the host for a per-client numpy loss
    y = y_host.to(device)
    label_is_numpy = isinstance(clients[0][1], np.ndarray)
    stack = [p.unsqueeze(0).repeat(len(clients), *([1] * p.dim())) for p in start]
    loss_sum = torch.zeros(len(clients), dtype=torch.float64, device=device)
    per_client = batched_forward(model)
    forward = vmap(per_client, randomness="error")
    forward_loss = vmap(lambda p, xs, ys: loss_fn(per_client(p, xs), ys), randomness="error")
    per_epoch = steps // epochs
    for j in range(total):
        position = np.where(j < steps, np.where(j % np.maximum(per_epoch, 1) == per_epoch - 1, last, batch_size), 0)
        for size, where in _groups(position[order]):
            index = where if isinstance(where, slice) else torch.as_tensor(where, device=device)
            params = dict(zip(names, [s[index].requires_grad_() for s in stack]))  # views, or gathered copies
            inputs, targets = x[index, j, :size], y[index, j, :size]
            if vmap_loss is None:
                vmap_loss = _loss_vmaps(loss_fn, forward(params, inputs), targets)
            if vmap_loss:
                losses = forward_loss(params, inputs, targets)
            else:  # numpy targets come from the host copy: no wait for the device
                host = y_host[where, j, :size].numpy() if label_is_numpy else targets
                losses = torch.stack([loss_fn(logit, target) for logit, target in zip(forward(params, inputs), host)])
            grads = torch.autograd.grad(losses.sum(), list(params.values()))
            with torch.no_grad():
                for s, p, g in zip(stack, params.values(), grads):
                    if isinstance(where, slice):
                        s[where].add_(g, alpha=-lr)  # torch.optim.SGD's update, in place
                    else:
                        s.index_copy_(0, index, p.detach().add_(g, alpha=-lr))
                loss_sum[index] += losses.detach().double() * size
    results = [None] * len(clients)
    loss_sums = loss_sum.tolist()  # one read from the device
    for row, i in enumerate(order):
        delta = torch.cat([(s[row] - p).reshape(-1) for s, p in zip(stack, start)])
        examples = int(counts[i]) * epochs
        results[i] = LocalResult(update=SparseUpdate.dense(delta),
                                 train_loss=loss_sums[row] / examples if examples else 0.0,
                                 num_examples=int(counts[i]))
    return results


def _pad_steps(batches: torch.Tensor, total: int) -> torch.Tensor:
    """``(steps, B, ...)`` padded with zeros to ``(total, B, ...)`` (steps a client does not take)."""
    return torch.cat([batches, batches.new_zeros(total - len(batches), *batches.shape[1:])])


def _loss_vmaps(loss_fn: Callable[[torch.Tensor, Any], torch.Tensor], logits: torch.Tensor,
                targets: torch.Tensor) -> bool:
    """Whether ``loss_fn`` runs under ``vmap`` on these stacked logits and targets (tensor ops only)."""
    try:
        vmap(loss_fn, randomness="error")(logits.detach(), targets)
    except Exception:  # noqa: BLE001 - any failure means: call it once per client instead
        return False
    return True
