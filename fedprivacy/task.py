"""What fedprivacy's apps need of a task: :class:`Task`.

The StackOverflow tasks (:mod:`fedprivacy.stackoverflow_tasks`) implement it, and so does a user's
task named ``data.task: package.module:factory``. No fedprivacy imports: every layer may name it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Task(Protocol):
    """What fedprivacy's ServerApp and ClientApp need of a task; the three StackOverflow tasks implement it,
    and a user's task named ``data.task: package.module:factory`` does too (``factory(data_config)``).

    ``client_data(i)`` returns ``(features, labels)`` of client ``i`` in ``0..population-1``, indexable by
    an index array (numpy arrays, tensors or scipy CSR); local SGD minimises
    ``loss(model(features[batch]), labels[batch])`` (a batch-mean scalar tensor). ``evaluate(model)``
    returns metrics for ``metrics.csv`` (``test_accuracy`` is the headline one by default). Optional:
    ``closed_form_softmax = True`` or ``closed_form_sigmoid = True`` (the sparse tag model's closed-form
    local SGD of that loss: :mod:`fedprivacy.models.logit_losses`), ``prefetch(clients)``, ``public``.
    """

    @property
    def population(self) -> int: ...

    @property
    def majority_baseline(self) -> float: ...

    def new_model(self, device: str = "cpu") -> nn.Module: ...

    def client_data(self, index: int) -> tuple[Any, Any]: ...

    def loss(self, logits: torch.Tensor, labels: Any) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module) -> dict[str, float]: ...
