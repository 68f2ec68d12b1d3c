"""Translation between model vectors/updates and Flower's ``ArrayRecord`` (no math here).

- A model (the broadcast) travels as an ``ArrayRecord`` keyed by parameter name; it is
  flattened in ``model.parameters()`` order (``parameters_to_vector``).
- A client update travels as ``{"indices": int32[k], "values": float32[k]}``: a flat COO vector
  in that same order, or ``{"indices": int32[r], "values": float32[r, b]}``: block-sparse rows of
  the flat vector viewed as ``(d / b, b)`` (see :class:`~fedprivacy.privacy.aggregation.SparseUpdate`);
  int64 indices are accepted too (and sent when an index would not fit in int32).
  The server validates it before use; anything else decodes to ``None`` (rejected, contributes zero).
- Encoding writes the bytes ``np.save`` writes, with one copy; decoding on the CPU is a zero-copy
  read-only view (Flower's ``Array`` holds ``.npy`` bytes; its own helpers copy twice each way).
"""

from __future__ import annotations

import math
import struct
import warnings

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType
from torch import nn

from fedprivacy.privacy.aggregation import SparseUpdate


_NPY_MAGIC_1_0 = b"\x93NUMPY\x01\x00"
_NPY_ALIGN, _NPY_GROWTH_DIGITS = 64, 21  # numpy.lib.format's ARRAY_ALIGN and GROWTH_AXIS_MAX_DIGITS


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes | None:
    """The ``.npy`` (version 1.0) header ``np.save`` writes for a C-ordered array of a plain numeric
    ``dtype`` and ``shape``, formatted here (numpy's writer and reader go through ``repr`` and
    ``ast.literal_eval``, about 0.2 ms per array); ``None`` for anything else."""
    if dtype.kind not in "biuf" or dtype.hasobject or dtype.fields is not None:
        return None
    text = f"{{'descr': {dtype.str!r}, 'fortran_order': False, 'shape': {tuple(shape)!r}, }}"
    if shape:
        text += " " * (_NPY_GROWTH_DIGITS - len(repr(shape[0])))
    body = text.encode("latin1")
    pad = _NPY_ALIGN - ((len(_NPY_MAGIC_1_0) + 2 + len(body) + 1) % _NPY_ALIGN)
    if len(body) + 1 + pad > 0xFFFF:
        return None
    return _NPY_MAGIC_1_0 + struct.pack("<H", len(body) + 1 + pad) + body + b" " * pad + b"\n"


def _array(ndarray: np.ndarray) -> Array:
    """``Array(ndarray)`` with one copy instead of two: the same ``.npy`` bytes as ``np.save`` writes
    (Flower's ``Array.from_numpy_ndarray`` saves into a ``BytesIO`` and copies its value out)."""
    ndarray = ndarray if ndarray.flags.c_contiguous else np.ascontiguousarray(ndarray)
    header = _npy_header(ndarray.dtype, ndarray.shape)
    if header is None:
        return Array(ndarray)
    data = b"".join([header, memoryview(ndarray.reshape(-1).view(np.uint8))])
    return Array(dtype=str(ndarray.dtype), shape=tuple(ndarray.shape), stype=SType.NUMPY, data=data)


def _view(arr: Array) -> np.ndarray:
    """``arr.numpy()`` without the copy: a READ-ONLY view over the message's bytes. The header must
    be exactly the one ``np.save`` writes for the ``Array``'s own dtype and shape (and the data its
    size); anything else goes through ``np.load``."""
    if arr.stype != SType.NUMPY:
        return arr.numpy()  # raises Flower's TypeError
    try:
        dtype = np.dtype(arr.dtype)
    except TypeError:
        return arr.numpy()
    shape = tuple(int(n) for n in arr.shape)
    header = _npy_header(dtype, shape)
    count = math.prod(shape)
    if (header is None or len(arr.data) != len(header) + count * dtype.itemsize
            or arr.data[:len(header)] != header):
        return arr.numpy()
    return np.frombuffer(arr.data, dtype=dtype, count=count, offset=len(header)).reshape(shape)


with warnings.catch_warnings():  # torch warns ONCE per process that it cannot mark a read-only view
    warnings.simplefilter("ignore", UserWarning)  # read-only: spend that warning here, silently, so the
    torch.from_numpy(np.frombuffer(bytes(4), dtype=np.float32))  # per-reply path needs no catch_warnings


def _tensor(arr: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy`` of a read-only view (silent: its one warning was spent at import)."""
    return torch.from_numpy(arr)


def update_to_record(update: SparseUpdate) -> ArrayRecord:
    """Encode a client's update (values 1-D: flat COO or dense; 2-D: block-sparse rows). Indices
    travel as int32 when every one fits (half the bytes of a flat COO index), else int64."""
    values = update.values.detach().to("cpu", torch.float32).numpy()
    if update.indices is None:
        return ArrayRecord({"values": _array(values)})
    indices = update.indices.cpu().numpy()
    if update.dim // update.block <= np.iinfo(np.int32).max + 1:
        indices = indices.astype(np.int32)
    return ArrayRecord({"indices": _array(indices), "values": _array(values)})


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
    if indices.dtype not in ("int32", "int64") or len(indices.shape) != 1:
        return None
    return SparseUpdate(_tensor(_view(indices)).to(device, torch.int64), vals, dim)  # int32: widened (a copy)


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
    return arrays_to_record({name: p.detach().cpu().numpy() for name, p in model.named_parameters()})


def vector_to_record(vector: torch.Tensor, model: nn.Module) -> ArrayRecord:
    """The broadcast of a flat vector laid out like ``model``'s parameters (``parameters_to_vector``
    order): the same record as :func:`model_to_record` after ``vector_to_parameters(vector, ...)``,
    with one copy of the vector instead of two and the model left as it is."""
    flat = vector.detach().to("cpu", torch.float32)
    params = list(model.named_parameters())
    sizes = [p.numel() for _, p in params]
    if flat.numel() != sum(sizes):
        raise ValueError(f"a vector of {flat.numel()} values does not fill a model of {sum(sizes)} parameters")
    return arrays_to_record({name: part.view(p.shape).numpy() for (name, p), part in zip(params, flat.split(sizes))})


def arrays_to_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """Named numpy arrays as an ``ArrayRecord`` (one copy each)."""
    return ArrayRecord({name: _array(a) for name, a in arrays.items()})


def record_to_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """Inverse of :func:`arrays_to_record`: READ-ONLY views over the record's bytes."""
    return {name: _view(record[name]) for name in record.keys()}


def tensors_to_record(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    """Named float32 tensors (e.g. AdaDPS's ``A`` per parameter name) as an ``ArrayRecord``."""
    return arrays_to_record({name: t.detach().to("cpu", torch.float32).contiguous().numpy()
                             for name, t in tensors.items()})


def record_to_tensors(record: ArrayRecord, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Inverse of :func:`tensors_to_record` (read-only views on the CPU); raises ValueError on non-float32 arrays."""
    arrays = record_to_arrays(record)
    for name, a in arrays.items():
        if a.dtype != np.float32:
            raise ValueError(f"array {name!r} is {a.dtype}, expected float32")
    return {name: _tensor(a).to(device) for name, a in arrays.items()}


def record_nbytes(record: ArrayRecord) -> int:
    """Bytes of a record's arrays as they travel (``.npy`` payloads, headers included)."""
    return sum(len(record[name].data) for name in record.keys())
