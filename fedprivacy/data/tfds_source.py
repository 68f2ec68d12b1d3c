"""Read a TensorFlow Datasets (TFDS) dataset from a local ``data_dir``, without TensorFlow and never downloading.

The dataset is opened with ``tfds.core.read_only_builder.builder_from_files``: it rebuilds the dataset's
builder from the files ``tfds build`` (or ``download_and_prepare``) wrote under
``data_dir/<name>/[<config>/]<version>/`` (``dataset_info.json``, ``features.json``, the record files),
without the dataset's generation code, so no call here can download or prepare anything. Records are
read through TFDS's random-access data sources (``builder.as_data_source``), which need the record files
in ``array_record`` or ``parquet`` format; ``tfrecord`` (TFDS's default format) needs TensorFlow to read
and is refused with how to re-prepare.

Supported features (``features.json``): ``Tensor`` features (also ``Scalar`` and ``ClassLabel``; stored
plain or bytes/zlib-encoded) with a fully defined shape and a numeric dtype as inputs, a scalar integer one as the label, a scalar integer
or string one as the user id. Images, text, audio and variable-length sequences are refused (their
decoding needs TensorFlow, or they have no fixed size).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["TFDSError", "open_dataset", "check_features", "read_split", "split_records", "PREPARE_HINT"]

PREPARE_HINT = ("prepare it on a machine with internet access (`tfds build NAME --data_dir DIR "
                "--file_format=array_record`, or `tfds.builder(NAME, data_dir=DIR, file_format='array_record')"
                ".download_and_prepare()`), then copy DIR here; fedprivacy never downloads")
RANDOM_ACCESS_FORMATS = ("array_record", "parquet")
"""Record formats TFDS reads without TensorFlow (its random-access data sources)."""


class TFDSError(ValueError):
    """The dataset, a split or a feature is missing or unsupported; the message names it."""


def _tfds():
    """``tensorflow_datasets`` (the ``tfds`` extra), imported on first use; without it, how to install it."""
    try:
        import tensorflow_datasets as tfds
        from tensorflow_datasets.core import read_only_builder
    except ImportError as err:
        raise TFDSError(f"data.source=tfds needs tensorflow-datasets: pip install 'fedprivacy[tfds]' ({err})") from None
    return tfds, read_only_builder


def open_dataset(name: str, data_dir: Path) -> Any:
    """The read-only TFDS builder of ``name`` (``name[/config][:version]``) as prepared in ``data_dir``.

    Raises:
        TFDSError: ``data_dir`` is not a folder, the dataset (or that config or version) is not in it,
            or its records are in a format TFDS cannot read without TensorFlow.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise TFDSError(f"data.tfds.data_dir {str(data_dir)!r} is not a folder; {PREPARE_HINT}")
    tfds, read_only_builder = _tfds()
    try:
        builder = read_only_builder.builder_from_files(name, data_dir=os.fspath(data_dir))
    except tfds.core.registered.DatasetNotFoundError:
        present = sorted(p.name for p in data_dir.iterdir() if p.is_dir() and p.name != "downloads")
        raise TFDSError(f"data.tfds.name: dataset {name!r} is not prepared in data_dir {str(data_dir)!r} (it holds "
                        f"{present or 'no dataset'}); {PREPARE_HINT}") from None
    fmt = builder.info.file_format.value
    if fmt not in RANDOM_ACCESS_FORMATS:
        usable = [f.value for f in builder.info.alternative_file_formats if f.value in RANDOM_ACCESS_FORMATS]
        if not usable:
            raise TFDSError(f"data.tfds.name: dataset {builder.info.full_name!r} in {str(data_dir)!r} is stored as "
                            f"{fmt}, which needs TensorFlow to read; prepare it as one of {RANDOM_ACCESS_FORMATS} "
                            f"instead: {PREPARE_HINT}")
        builder = read_only_builder.builder_from_directory(builder.data_dir, file_format=usable[0])
    return builder


def _feature(builder: Any, path: str, field: str) -> Any:
    """The feature connector at ``path`` (``a/b``: feature ``b`` of the nested ``a``)."""
    node = builder.info.features
    for i, part in enumerate(path.split("/")):
        keys = list(node.keys()) if hasattr(node, "keys") else []
        if part not in keys:
            where = "/".join(path.split("/")[:i]) or "the dataset"
            raise TFDSError(f"{field}: feature {path!r} is not in dataset {builder.info.full_name!r} ({where} has "
                            f"{sorted(keys)})")
        node = node[part]
    return node


def _tensor_spec(builder: Any, path: str, field: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of a ``Tensor`` feature (``Scalar``, ``ClassLabel`` included) with a fixed shape."""
    tfds, _ = _tfds()
    feature = _feature(builder, path, field)
    kind = type(feature).__name__
    if type(feature) not in (tfds.features.Tensor, tfds.features.Scalar, tfds.features.ClassLabel):
        raise TFDSError(f"{field}: feature {path!r} of {builder.info.full_name!r} is a {kind}; supported: Tensor, "
                        "Scalar and ClassLabel features with a fixed shape (images, text, audio and sequences need "
                        "TensorFlow or have no fixed size)")
    shape = tuple(feature.shape)
    if any(d is None or d < 0 for d in shape):
        raise TFDSError(f"{field}: feature {path!r} of {builder.info.full_name!r} has shape {shape}, not a fixed size")
    return shape, np.dtype(feature.np_dtype)


def _string_scalar(builder: Any, path: str) -> bool:
    """Whether the feature at ``path`` is a scalar string (``Text``, or a string ``Tensor``)."""
    tfds, _ = _tfds()
    feature = _feature(builder, path, "data.tfds.client_feature")
    if isinstance(feature, tfds.features.Text):
        return True
    return isinstance(feature, tfds.features.Tensor) and feature.shape == () and np.dtype(feature.np_dtype).kind in "OSU"


def check_features(builder: Any, inputs: Sequence[str], label: str, client_feature: str | None,
                   num_classes: int | None) -> tuple[int, int]:
    """Check the features' types against what is supported; returns ``(input dimension, number of classes)``.

    Inputs: fixed-shape numeric (bool, integer, float) ``Tensor`` features. Label: a scalar integer feature;
    its classes are ``num_classes`` or, for a ``ClassLabel``, its own (they must agree when both are given).
    User id: a scalar integer or string feature.

    Raises:
        TFDSError: naming the field, the feature and what it is.
    """
    tfds, _ = _tfds()
    dim = 0
    for path in inputs:
        shape, dtype = _tensor_spec(builder, path, "data.tfds.inputs")
        if dtype.kind not in "biuf":
            raise TFDSError(f"data.tfds.inputs: feature {path!r} of {builder.info.full_name!r} has dtype {dtype}, "
                            "not a number")
        dim += int(np.prod(shape, dtype=np.int64))
    shape, dtype = _tensor_spec(builder, label, "data.tfds.label")
    if shape != () or dtype.kind not in "iu":
        raise TFDSError(f"data.tfds.label: feature {label!r} of {builder.info.full_name!r} is {dtype} of shape {shape}; "
                        "the label must be a scalar integer")
    feature = _feature(builder, label, "data.tfds.label")
    own = feature.num_classes if isinstance(feature, tfds.features.ClassLabel) else None
    if own is not None and num_classes is not None and own != num_classes:
        raise TFDSError(f"data.tfds.num_classes={num_classes} but label {label!r} of {builder.info.full_name!r} is a "
                        f"ClassLabel of {own} classes")
    classes = num_classes if num_classes is not None else own
    if classes is None:
        raise TFDSError(f"data.tfds.num_classes must be set: label {label!r} of {builder.info.full_name!r} is a plain "
                        "integer feature (a ClassLabel carries its own)")
    if client_feature is not None and not _string_scalar(builder, client_feature):
        shape, dtype = _tensor_spec(builder, client_feature, "data.tfds.client_feature")
        if shape != () or dtype.kind not in "iu":
            raise TFDSError(f"data.tfds.client_feature: feature {client_feature!r} of {builder.info.full_name!r} is "
                            f"{dtype} of shape {shape}; a user id must be a scalar integer or string")
    return dim, classes


def split_records(builder: Any, split: str, field: str) -> dict[str, set[int]]:
    """Which records of which record files ``split`` reads (file name -> record indices), from TFDS's own
    resolution of the split expression (``info.splits[split].file_instructions``).

    Raises:
        TFDSError: the split is not in the dataset, or the expression does not parse.
    """
    try:
        instructions = builder.info.splits[split].file_instructions
    except (ValueError, KeyError) as err:
        raise TFDSError(f"{field}: split {split!r} of {builder.info.full_name!r}: {err} (splits: "
                        f"{sorted(builder.info.splits.keys())})") from None
    records: dict[str, set[int]] = {}
    for fi in instructions:
        records.setdefault(Path(fi.filename).name, set()).update(range(fi.skip, fi.skip + fi.take))
    return records


@dataclass(frozen=True)
class SplitArrays:
    """One split as arrays, in the split's record order: ``inputs`` (n, d) float32, ``labels`` (n,) int64 and
    ``clients`` (n,) (integers, or bytes in an object array; None when not asked for)."""

    inputs: np.ndarray
    labels: np.ndarray
    clients: np.ndarray | None


def _get(record: dict[str, Any], path: str) -> Any:
    for part in path.split("/"):
        record = record[part]
    return record


def read_split(builder: Any, split: str, field: str, *, inputs: Sequence[str], label: str, num_classes: int,
               client_feature: str | None = None, input_scale: float = 1.0, batch: int = 4096) -> SplitArrays:
    """Every record of ``split``: inputs flattened and concatenated in the order of ``inputs``, times
    ``input_scale``, as float32; labels; user ids if ``client_feature`` is given.

    Raises:
        TFDSError: the split is missing or empty, a label is outside ``[0, num_classes)``, an input is not finite,
            naming the split, the feature and the first offending record.
    """
    split_records(builder, split, field)  # the split exists and parses
    source = builder.as_data_source(split=split)
    n = len(source)
    if n == 0:
        raise TFDSError(f"{field}: split {split!r} of {builder.info.full_name!r} has no records")
    parts: list[list[np.ndarray]] = [[] for _ in inputs]
    labels = np.empty(n, dtype=np.int64)
    clients: list[Any] = []
    for lo in range(0, n, batch):
        records = source.__getitems__(list(range(lo, min(n, lo + batch))))
        for part, path in zip(parts, inputs):
            part.append(np.stack([np.asarray(_get(r, path)) for r in records]).reshape(len(records), -1))
        labels[lo:lo + len(records)] = [_get(r, label) for r in records]
        if client_feature is not None:
            clients += [_get(r, client_feature) for r in records]
    x = np.concatenate([np.concatenate(p, axis=0) for p in parts], axis=1)
    x = (x.astype(np.float64) * input_scale).astype(np.float32) if input_scale != 1.0 else x.astype(np.float32)
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if bad.size:
        raise TFDSError(f"data.tfds.label: record {int(bad[0])} of split {split!r} of {builder.info.full_name!r} has "
                        f"label {int(labels[bad[0]])}, outside [0, {num_classes}) ({bad.size} such records)")
    rows = np.flatnonzero(~np.isfinite(x).all(axis=1))
    if rows.size:
        raise TFDSError(f"data.tfds.inputs: record {int(rows[0])} of split {split!r} of {builder.info.full_name!r} has "
                        f"a non-finite input ({rows.size} such records)")
    ids = None
    if client_feature is not None:  # strings as an object array of bytes: numpy's fixed-width ones drop trailing NULs
        ids = np.asarray(clients, dtype=object if isinstance(clients[0], (bytes, str)) else None)
    return SplitArrays(x, labels, ids)
