"""Translation between model vectors/updates and Flower's ``ArrayRecord`` (no math here).

- A model (the broadcast) travels as an ``ArrayRecord`` keyed by parameter name; it is
  flattened in ``model.parameters()`` order (``parameters_to_vector``).
- A client update travels as ``{"indices": int32[k], "values": float32[k]}``: a flat COO vector
  in that same order, or ``{"indices": int32[r], "values": float32[r, b]}``: block-sparse rows of
  the flat vector viewed as ``(d / b, b)`` (see :class:`~fedprivacy.updates.SparseUpdate`);
  int64 indices are accepted too (and sent when an index would not fit in int32).
  The server validates it before use; anything else decodes to ``None`` (rejected, contributes zero).
- Encoding writes the bytes ``np.save`` writes, with one copy; decoding on the CPU is a zero-copy
  read-only view (Flower's ``Array`` holds ``.npy`` bytes; its own helpers copy twice each way).
"""

from __future__ import annotations

import functools
import math
import struct
import warnings
from collections.abc import Mapping
from typing import TypeVar

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SType
from torch import nn

from fedprivacy.updates import RejectedUpdate, SparseUpdate


_NPY_MAGIC_1_0 = b"\x93NUMPY\x01\x00"
_NPY_ALIGN, _NPY_GROWTH_DIGITS = 64, 21  # numpy.lib.format's ARRAY_ALIGN and GROWTH_AXIS_MAX_DIGITS


@functools.lru_cache(maxsize=1024)
def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes | None:
    """The ``.npy`` (version 1.0) header ``np.save`` writes for a C-ordered array of a plain numeric
    ``dtype`` and ``shape``, formatted here (numpy's writer and reader go through ``repr`` and
    ``ast.literal_eval``, about 0.2 ms per array); ``None`` for anything else. Cached: a reply's
    header is formatted once, when it is encoded, and looked up when the server reads it."""
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


def _array_record(arrays: Mapping[str, Array]) -> ArrayRecord:
    """``ArrayRecord(arrays)`` holding these very ``Array`` objects (Flower's constructor builds a second
    ``Array`` of each, about 30 us per array)."""
    record = ArrayRecord()
    for name, arr in arrays.items():
        record[name] = arr
    return record


RecordT = TypeVar("RecordT", ArrayRecord, ConfigRecord, MetricRecord)


def typed_record(content: RecordDict, key: str, kind: type[RecordT]) -> RecordT | None:
    """``content``'s record ``key`` if it is a ``kind``, else ``None``: the same as Flower's
    ``content.array_records.get(key)`` (``config_records``, ``metric_records``), without those properties'
    new type-checked dict of every record of the kind at each access (three records: about 40 us)."""
    record = content.get(key)
    return record if isinstance(record, kind) else None


def _view(arr: Array) -> np.ndarray:
    """``arr.numpy()`` without the copy: a READ-ONLY view over the message's bytes.

    The payload must be what the ``Array``'s own metadata says: its real dtype (byte order
    included) and shape are checked against ``arr.dtype`` and ``arr.shape``, and anything else
    raises ``ValueError`` naming the mismatch (a float16 or big-endian payload behind float32
    metadata would otherwise be read as something else). When the header is exactly the one
    ``np.save`` writes, the array is a view; any other valid header goes through ``np.load``.
    """
    if arr.stype != SType.NUMPY:
        raise ValueError(f"array stype is {arr.stype!r}, expected {SType.NUMPY!r}")
    try:
        dtype = np.dtype(arr.dtype)
        shape = tuple(int(n) for n in arr.shape)
    except (TypeError, ValueError) as err:
        raise ValueError(f"array metadata is not a numpy dtype and shape ({err})") from None
    header = _npy_header(dtype, shape) if all(n >= 0 for n in shape) else None
    count = math.prod(shape)
    if (header is not None and len(arr.data) == len(header) + count * dtype.itemsize
            and arr.data[:len(header)] == header):
        return np.frombuffer(arr.data, dtype=dtype, count=count, offset=len(header)).reshape(shape)
    try:
        real = arr.numpy()
    except Exception as err:  # noqa: BLE001 -- the bytes are untrusted: any failure to parse them is a rejection
        raise ValueError(f"array bytes are not a .npy payload ({type(err).__name__}: {err})") from None
    if real.dtype != dtype or real.shape != shape:
        raise ValueError(f"array payload is {real.dtype.str}{real.shape} but its metadata says {dtype.str}{shape}")
    return real


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
        return _array_record({"values": _array(values)})
    indices = update.indices.cpu().numpy()
    if update.dim // update.block <= np.iinfo(np.int32).max + 1:
        indices = indices.astype(np.int32)
    return _array_record({"indices": _array(indices), "values": _array(values)})


def record_to_update(record: object, dim: int, device: str | torch.device = "cpu") -> SparseUpdate:
    """Decode a client's update of dimension ``dim`` (validated further by ``PrivateSum.add_``).

    The contract: ``{"values": float32[dim]}`` (dense), ``{"indices": int[k], "values": float32[k]}``
    (flat COO) or ``{"indices": int[r], "values": float32[r, b]}`` (block rows), native-byte-order
    ``.npy`` payloads, int32 or int64 indices. Raises :class:`RejectedUpdate` with reason
    ``"malformed"`` (not such a record) or ``"dtype"`` (a payload whose real or declared dtype or
    byte order is not the contract's). The tensors are read-only views over the message's bytes
    when ``device`` is the CPU (no copy): consumers must not modify them in place.
    """
    if not isinstance(record, ArrayRecord):
        raise RejectedUpdate("malformed", f"'arrays' is {type(record).__name__}, not an ArrayRecord")
    if set(record.keys()) not in ({"values"}, {"indices", "values"}):
        raise RejectedUpdate("malformed", f"array keys {sorted(record.keys())}, expected 'values' (+ 'indices')")
    values = _contract_view(record, "values", ("float32",))
    if values.ndim not in (1, 2) or (values.ndim == 2 and "indices" not in record):
        raise RejectedUpdate("malformed", f"values of shape {values.shape}")
    vals = _tensor(values).to(device)
    if "indices" not in record:
        return SparseUpdate(None, vals, dim)
    indices = _contract_view(record, "indices", ("int32", "int64"))
    if indices.ndim != 1:
        raise RejectedUpdate("malformed", f"indices of shape {indices.shape}")
    return SparseUpdate(_tensor(indices).to(device, torch.int64), vals, dim)  # int32: widened (a copy)


def reply_content(reply: Message) -> RecordDict:
    """A reply's content, or :class:`RejectedUpdate` ``"failed"`` with its error's reason."""
    if reply.has_error():
        raise RejectedUpdate("failed", reply.error.reason)
    return reply.content


def reply_to_update(content: RecordDict, x: torch.Tensor, layout: Mapping[str, tuple[int, ...]]) -> SparseUpdate:
    """The update ``u`` in a reply's ``"arrays"`` against the broadcast ``x`` (flat, laid out as ``layout``:
    parameter name -> shape, in the broadcast's order); the one triage of the server and the strategy.

    - keyed exactly as the broadcast: the client's full weights ``w`` (Flower's convention), so
      ``u = w - x``, concatenated in ``layout``'s order; each array must be float32 (else ``"dtype"``)
      of the broadcast's shape (else ``"malformed"``); one copy of ``w`` (and ``u`` is on ``x``'s device);
    - anything else: fedprivacy's delta contract (:func:`record_to_update`; zero-copy views on the CPU).

    A model whose parameters are named exactly ``values`` (and ``indices``) would read as full weights.
    """
    record = typed_record(content, "arrays", ArrayRecord)
    if record is not None and record.keys() == layout.keys():
        parts = []
        for name, shape in layout.items():
            w = _contract_view(record, name, ("float32",))
            if w.shape != tuple(shape):
                raise RejectedUpdate("malformed", f"{name}: float32{w.shape}, sent float32{tuple(shape)}")
            parts.append(_tensor(w).reshape(-1))
        return SparseUpdate.dense(torch.cat(parts).to(x.device).sub_(x))
    return record_to_update(record, x.numel(), x.device)


def _contract_view(record: ArrayRecord, key: str, dtypes: tuple[str, ...]) -> np.ndarray:
    """``record[key]`` as a view whose declared AND real dtype is one of ``dtypes``, in the native byte order."""
    arr = record[key]
    if arr.dtype not in dtypes:
        raise RejectedUpdate("dtype", f"{key} declared {arr.dtype!r}, expected one of {list(dtypes)}")
    try:
        return _view(arr)  # its real dtype is then exactly the declared native one
    except ValueError as err:
        raise RejectedUpdate("dtype", f"{key}: {err}") from None


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
    return layout_to_record(vector, {name: tuple(p.shape) for name, p in model.named_parameters()})


def layout_to_record(vector: torch.Tensor, layout: Mapping[str, tuple[int, ...]]) -> ArrayRecord:
    """A flat vector cut into the named arrays of ``layout`` (name -> shape, in order), one copy."""
    flat = vector.detach().to("cpu", torch.float32)
    sizes = [math.prod(shape) for shape in layout.values()]
    if flat.numel() != sum(sizes):
        raise ValueError(f"a vector of {flat.numel()} values does not fill a layout of {sum(sizes)} values")
    return arrays_to_record({name: part.view(shape).numpy()
                             for (name, shape), part in zip(layout.items(), flat.split(sizes))})


def record_to_layout(record: ArrayRecord, device: str | torch.device = "cpu") -> tuple[torch.Tensor,
                                                                                      dict[str, tuple[int, ...]]]:
    """A model record as one flat float32 vector (in the record's order, one copy) and its layout; every
    array must be float32 (a DP update covers all of them)."""
    arrays = record_to_arrays(record)
    wrong = [f"{name} ({a.dtype})" for name, a in arrays.items() if a.dtype != np.float32]
    if wrong:
        raise ValueError(f"DP training covers float32 arrays only; convert or leave out: {', '.join(wrong)}")
    flat = torch.cat([_tensor(a).reshape(-1) for a in arrays.values()]) if arrays else torch.zeros(0)
    return flat.to(device, copy=True), {name: tuple(a.shape) for name, a in arrays.items()}


def arrays_to_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """Named numpy arrays as an ``ArrayRecord`` (one copy each)."""
    return _array_record({name: _array(a) for name, a in arrays.items()})


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


def float32_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """A model record's arrays (copies); every one must be float32 (a DP update covers all of them)."""
    out = {name: np.array(a) for name, a in record_to_arrays(record).items()}
    wrong = [f"{name} ({a.dtype})" for name, a in out.items() if a.dtype != np.float32]
    if wrong:
        raise ValueError(f"DP training covers float32 arrays only; convert or leave out: {', '.join(wrong)}")
    return out


def arrays_to_vector(arrays: dict[str, np.ndarray]) -> torch.Tensor:
    """Named arrays as one flat float32 vector, in the record's order."""
    return torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays.values()]).astype(np.float32))


def vector_to_arrays(vector: torch.Tensor, like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inverse of :func:`arrays_to_vector`: a flat vector cut into arrays shaped as ``like``."""
    flat, out, start = vector.detach().cpu().numpy(), {}, 0
    for name, a in like.items():
        out[name] = flat[start:start + a.size].reshape(a.shape).copy()
        start += a.size
    return out
