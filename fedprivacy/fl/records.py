"""Translation between model vectors/updates and Flower's ``ArrayRecord`` (no math here).

- A model (the broadcast) travels as an ``ArrayRecord`` keyed by parameter name; it is
  flattened in ``model.parameters()`` order (``parameters_to_vector``).
- A client update travels as ``{"indices": int64[k], "values": float32[k]}``: a flat COO vector
  in that same order (see :class:`~fedprivacy.privacy.aggregation.SparseUpdate`). The server
  validates it before use; anything else decodes to ``None`` (rejected, contributes zero).
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import nn

from fedprivacy.privacy.aggregation import SparseUpdate


def update_to_record(update: SparseUpdate) -> ArrayRecord:
    """Encode a client's flat update."""
    values = update.values.detach().to("cpu", torch.float32).numpy()
    if update.indices is None:
        return ArrayRecord({"values": Array(values)})
    return ArrayRecord({"indices": Array(update.indices.cpu().numpy()), "values": Array(values)})


def record_to_update(record: object, dim: int, device: str | torch.device = "cpu") -> SparseUpdate | None:
    """Decode a client's update; ``None`` if the record is not an update of dimension ``dim``."""
    if not isinstance(record, ArrayRecord) or set(record.keys()) not in ({"values"}, {"indices", "values"}):
        return None
    values = record["values"]
    if values.dtype != "float32" or len(values.shape) != 1:
        return None
    vals = torch.from_numpy(values.numpy()).to(device)
    if "indices" not in record:
        return SparseUpdate(None, vals, dim)
    indices = record["indices"]
    if indices.dtype != "int64" or len(indices.shape) != 1:
        return None
    return SparseUpdate(torch.from_numpy(indices.numpy()).to(device), vals, dim)


def record_to_vector(record: object, model: nn.Module, device: str | torch.device = "cpu") -> torch.Tensor | None:
    """Flatten a broadcast ``ArrayRecord`` laid out like ``model``; ``None`` if it is not."""
    if not isinstance(record, ArrayRecord):
        return None
    if list(record.keys()) != [name for name, _ in model.named_parameters()]:
        return None
    parts = []
    for name, p in model.named_parameters():
        arr = record[name]
        if tuple(arr.shape) != tuple(p.shape) or arr.dtype != "float32":
            return None
        parts.append(torch.from_numpy(arr.numpy()).reshape(-1))
    return torch.cat(parts).to(device)


def model_to_record(model: nn.Module) -> ArrayRecord:
    """The broadcast: the model's parameters by name."""
    return ArrayRecord({name: Array(np.ascontiguousarray(p.detach().cpu().numpy())) for name, p in model.named_parameters()})
