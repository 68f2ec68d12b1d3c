"""Translation between flat parameter vectors and Flower's ``ArrayRecord`` (no math here).

A model travels as an ``ArrayRecord`` keyed by parameter name (``model.named_parameters()``
order); the server and clients flatten in that same order with ``parameters_to_vector``.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import nn


def vector_to_record(vector: torch.Tensor, model: nn.Module) -> ArrayRecord:
    """Split a flat vector into ``model``'s parameter shapes, as an ``ArrayRecord``."""
    flat = vector.detach().to("cpu", torch.float32).numpy()
    arrays, offset = {}, 0
    for name, p in model.named_parameters():
        n = p.numel()
        arrays[name] = Array(np.ascontiguousarray(flat[offset:offset + n].reshape(tuple(p.shape))))
        offset += n
    if offset != flat.size:
        raise ValueError(f"vector has {flat.size} entries, the model {offset}")
    return ArrayRecord(arrays)


def record_to_vector(record: object, model: nn.Module, device: str | torch.device = "cpu") -> torch.Tensor | None:
    """Flatten an ``ArrayRecord`` laid out like ``model``; ``None`` if it is not laid out so."""
    if not isinstance(record, ArrayRecord):
        return None
    names = [name for name, _ in model.named_parameters()]
    if list(record.keys()) != names:
        return None
    parts = []
    for name, p in model.named_parameters():
        arr = record[name]
        if tuple(arr.shape) != tuple(p.shape) or arr.dtype != "float32":
            return None
        parts.append(torch.from_numpy(arr.numpy()).reshape(-1))
    return torch.cat(parts).to(device)
