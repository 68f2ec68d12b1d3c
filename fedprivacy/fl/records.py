"""Translation between model vectors/updates and Flower's ``ArrayRecord`` (no math here).

- A model (the broadcast) travels as an ``ArrayRecord`` keyed by parameter name; it is
  flattened in ``model.parameters()`` order (``parameters_to_vector``).
- A client update travels as ``{"indices": int64[k], "values": float32[k]}``: a flat COO vector
  in that same order, or ``{"indices": int64[r], "values": float32[r, b]}``: block-sparse rows of
  the flat vector viewed as ``(d / b, b)`` (see :class:`~fedprivacy.privacy.aggregation.SparseUpdate`).
  The server validates it before use; anything else decodes to ``None`` (rejected, contributes zero).
- Encoding writes the bytes ``np.save`` writes, with one copy; decoding on the CPU is a zero-copy
  read-only view (Flower's ``Array`` holds ``.npy`` bytes; its own helpers copy twice each way).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType
from torch import nn

from fedprivacy.privacy.aggregation import SparseUpdate


def _array(ndarray: np.ndarray) -> Array:
    """``Array(ndarray)`` with one copy instead of two: the same ``.npy`` bytes as ``np.save`` writes
    (Flower's ``Array.from_numpy_ndarray`` saves into a ``BytesIO`` and copies its value out)."""
    ndarray = ndarray if ndarray.flags.c_contiguous else np.ascontiguousarray(ndarray)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(ndarray))
    data = b"".join([header.getvalue(), memoryview(ndarray.reshape(-1).view(np.uint8))])
    return Array(dtype=str(ndarray.dtype), shape=tuple(ndarray.shape), stype=SType.NUMPY, data=data)


def _view(arr: Array) -> np.ndarray:
    """``arr.numpy()`` without the copy: a READ-ONLY view over the message's bytes (``.npy`` header
    parsed as ``np.load`` does; anything unusual goes through ``np.load``)."""
    if arr.stype != SType.NUMPY:
        return arr.numpy()  # raises Flower's TypeError
    f = io.BytesIO(arr.data)
    try:
        version = np.lib.format.read_magic(f)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}[version]
        shape, fortran, dtype = read_header(f)
    except (KeyError, ValueError):
        return arr.numpy()
    if fortran or dtype.hasobject:
        return arr.numpy()
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(arr.data, dtype=dtype, count=count, offset=f.tell()).reshape(shape)


def _tensor(arr: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy`` of a read-only view (torch warns once that it cannot mark it read-only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def update_to_record(update: SparseUpdate) -> ArrayRecord:
    """Encode a client's update (values 1-D: flat COO or dense; 2-D: block-sparse rows)."""
    values = update.values.detach().to("cpu", torch.float32).numpy()
    if update.indices is None:
        return ArrayRecord({"values": _array(values)})
    return ArrayRecord({"indices": _array(update.indices.cpu().numpy()), "values": _array(values)})


def record_to_update(record: object, dim: int, device: str | torch.device = "cpu") -> SparseUpdate | None:
    """Decode a client's update; ``None`` if the record is not an update of dimension ``dim``.

    The tensors are read-only views over the message's bytes when ``device`` is the CPU (no copy):
    consumers must not modify them in place (``PrivateSum.add_`` does not).
    """
    if not isinstance(record, ArrayRecord) or set(record.keys()) not in ({"values"}, {"indices", "values"}):
        return None
    values = record["values"]
    if values.dtype != "float32" or len(values.shape) not in (1, 2) or (len(values.shape) == 2 and "indices" not in record):
        return None
    vals = _tensor(_view(values)).to(device)
    if "indices" not in record:
        return SparseUpdate(None, vals, dim)
    indices = record["indices"]
    if indices.dtype != "int64" or len(indices.shape) != 1:
        return None
    return SparseUpdate(_tensor(_view(indices)).to(device), vals, dim)


def record_to_vector(record: object, model: nn.Module, device: str | torch.device = "cpu") -> torch.Tensor | None:
    """Flatten a broadcast ``ArrayRecord`` laid out like ``model``; ``None`` if it is not."""
    parts = _record_parts(record, model)
    return None if parts is None else torch.cat([_tensor(a).reshape(-1) for a in parts]).to(device)


def load_record_(model: nn.Module, record: object) -> bool:
    """Copy a broadcast ``ArrayRecord`` into ``model``'s parameters (one copy per parameter, no
    intermediate flat vector); ``False`` (model untouched) if the record is not laid out like ``model``."""
    parts = _record_parts(record, model)
    if parts is None:
        return False
    with torch.no_grad():
        for p, arr in zip(model.parameters(), parts):
            p.copy_(_tensor(arr).reshape(p.shape))
    return True


def _record_parts(record: object, model: nn.Module) -> list[np.ndarray] | None:
    if not isinstance(record, ArrayRecord):
        return None
    if list(record.keys()) != [name for name, _ in model.named_parameters()]:
        return None
    parts = []
    for name, p in model.named_parameters():
        arr = record[name]
        if tuple(arr.shape) != tuple(p.shape) or arr.dtype != "float32":
            return None
        parts.append(_view(arr))
    return parts


def model_to_record(model: nn.Module) -> ArrayRecord:
    """The broadcast: the model's parameters by name."""
    return ArrayRecord({name: _array(p.detach().cpu().numpy()) for name, p in model.named_parameters()})
