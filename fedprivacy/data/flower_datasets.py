"""Flower Datasets partitions as a user-level DP population: local files, column checks, the user audit.

User-level DP (McMahan et al. 2018, arXiv:1710.06963, Sec. 2) calls two data sets adjacent when they differ in
ALL the records of one user; DP-FedAvg bounds a client's update, so it protects whatever one client (one
partition) holds. A partitioner therefore gives user-level DP exactly when no user's records are spread over
two partitions. :func:`check_user_level` checks that on the data:

- ``NaturalIdPartitioner(partition_by=u)`` with user column ``u``: one user per partition by construction;
- any other partitioner with a user column: every partition's users are read, a user found in two partitions
  is refused (naming the user and the partitions), and partitions holding several users draw a warning. If
  the mechanism is (eps, delta)-DP for adding or removing one partition, a user sharing a partition is
  (2 eps, (1 + e^eps) delta)-DP alone: removing it is at most two partition steps away (remove the
  partition, add it back without the user; group privacy, Dwork & Roth 2014, Thm 2.2);
- no user column (``IidPartitioner``, ``DirichletPartitioner``, ...): a warning that the DP unit is then
  the partition, which is user-level only if the records of each person sit in one partition.

No Flower and no fedprivacy imports (``flwr_datasets`` imports only Hugging Face ``datasets``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeAlias

import datasets
import numpy as np
import pyarrow as pa
from flwr_datasets.partitioner import NaturalIdPartitioner, Partitioner

READERS = {".parquet": ("Parquet", datasets.Dataset.from_parquet), ".csv": ("CSV", datasets.Dataset.from_csv),
           ".json": ("JSON", datasets.Dataset.from_json), ".jsonl": ("JSON lines", datasets.Dataset.from_json)}
"""File suffix -> (format, Hugging Face reader) of :func:`read_local`."""

Source: TypeAlias = datasets.Dataset | str | os.PathLike
"""A Hugging Face ``Dataset``, or the path of a local Parquet, CSV or JSON (lines) file."""


def read_local(path: str | os.PathLike) -> datasets.Dataset:
    """The records of a local Parquet, CSV or JSON (lines) file, by its suffix, read by Hugging Face ``datasets``
    (no network). A missing, unreadable or empty file is an error naming it."""
    path = Path(path)
    if path.suffix.lower() not in READERS:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; give a .parquet, .csv, .json or .jsonl file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    kind, reader = READERS[path.suffix.lower()]
    try:
        return reader(str(path))
    except Exception as e:  # Arrow's, pandas' and datasets' own errors (an empty file among them): name the file
        raise ValueError(f"{path}: cannot read it as {kind}: {type(e).__name__}: {e}") from e


def as_dataset(source: Source) -> tuple[datasets.Dataset, str]:
    """``(dataset, name)``: ``source`` itself, or the file it names read by :func:`read_local`; the name says
    where the records came from in error messages."""
    if isinstance(source, datasets.Dataset):
        return source, "the dataset"
    if isinstance(source, str | os.PathLike):
        return read_local(source), str(source)
    raise TypeError(f"expected a datasets.Dataset or a file path, got {type(source).__name__}")


def _numeric(kind: pa.DataType) -> bool:
    """Numbers, or (nested, fixed- or variable-size) lists of numbers; extension types by their storage."""
    if isinstance(kind, pa.ExtensionType):
        return _numeric(kind.storage_type)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _numeric(kind.value_type)
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)


def check_columns(dataset: datasets.Dataset, name: str, features: Sequence[str], label: str,
                  user_column: str | None = None) -> None:
    """Refuse, naming the column and ``name``, a missing column, a feature that is not numbers (or lists of
    numbers), a label that is not integer class ids, and a user column with missing values."""
    wanted = [*features, label] + ([user_column] if user_column is not None else [])
    missing = [c for c in wanted if c not in dataset.column_names]
    if missing:
        raise ValueError(f"{name}: no column {missing[0]!r} (its columns: {', '.join(dataset.column_names)})")
    schema = dataset.features.arrow_schema
    for column in features:
        if not _numeric(schema.field(column).type):
            raise ValueError(f"{name}: feature column {column!r} has type {schema.field(column).type}; a feature "
                             "must be numbers or fixed-length lists of numbers")
    if not pa.types.is_integer(schema.field(label).type):
        raise ValueError(f"{name}: label column {label!r} has type {schema.field(label).type}, not integer class "
                         f"ids (cast it, e.g. dataset.class_encode_column({label!r}) for strings)")
    if user_column is not None and _nulls(dataset, user_column):
        raise ValueError(f"{name}: user column {user_column!r} has {_nulls(dataset, user_column)} records without "
                         "a user; user-level DP needs every record's user")


def _nulls(dataset: datasets.Dataset, column: str) -> int:
    return dataset.with_format("arrow", columns=[column])[:].column(column).null_count


def arrays(dataset: datasets.Dataset, name: str, features: Sequence[str], label: str) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``: the features of every record flattened and concatenated in ``features`` order, float32
    ``(n, d)``, and the int64 labels ``(n,)``. Refused, naming ``name`` and the column: no records, missing
    values, lists of different lengths, NaN or infinity, negative labels."""
    if len(dataset) == 0:
        raise ValueError(f"{name} has no records")
    columns = dataset.with_format("numpy", columns=list(features))[:]
    for column in features:
        _refuse_objects(dataset, name, column, columns[column])
    x = np.concatenate([columns[c].reshape(len(dataset), -1).astype(np.float32) for c in features], axis=1)
    if not np.isfinite(x).all():
        bad = next(c for c in features if not np.isfinite(columns[c].astype(np.float32)).all())
        raise ValueError(f"{name}: feature column {bad!r} holds NaN or infinity")
    return x, class_ids(dataset, name, label)


def class_ids(dataset: datasets.Dataset, name: str, label: str) -> np.ndarray:
    """The int64 labels of every record; missing and negative ones are refused, naming ``name`` and the column."""
    y = dataset.with_format("numpy", columns=[label])[:][label]
    _refuse_objects(dataset, name, label, y)
    if len(y) and y.min() < 0:
        raise ValueError(f"{name}: label column {label!r} holds {y.min()}; class ids are 0, 1, 2, ...")
    return y.astype(np.int64)


def _refuse_objects(dataset: datasets.Dataset, name: str, column: str, values: np.ndarray) -> None:
    """Hugging Face's numpy format gives an object array for missing values and for lists of different lengths."""
    if values.dtype == object:
        nulls = _nulls(dataset, column)
        raise ValueError(f"{name}: column {column!r} holds " + (f"{nulls} missing values" if nulls else
                         "lists of different lengths; a feature must have one shape in every record"))


def partitioner_name(partitioner: Partitioner) -> str:
    """The partitioner's class, with the column a natural-id one partitions by."""
    if isinstance(partitioner, NaturalIdPartitioner):
        return f"NaturalIdPartitioner(partition_by={natural_column(partitioner)!r})"
    return type(partitioner).__name__


def natural_column(partitioner: NaturalIdPartitioner) -> str:
    """The column a ``NaturalIdPartitioner`` partitions by (flwr-datasets 0.6 keeps it, unexposed, as
    ``_partition_by``)."""
    return partitioner._partition_by


def user_column_of(partitioner: Partitioner, user_column: str | None) -> str | None:
    """The user column: ``user_column`` when given, else the column of a ``NaturalIdPartitioner``, else None."""
    if user_column is None and isinstance(partitioner, NaturalIdPartitioner):
        return natural_column(partitioner)
    return user_column


def check_user_level(partitioner: Partitioner, user_column: str | None) -> None:
    """Check that ``partitioner`` (its dataset assigned) never spreads a user's records over two partitions
    (module docstring): a ``ValueError`` names a split user and its partitions, and an empty partition; a
    ``UserWarning`` says when the DP unit is a partition holding several users, or an unchecked partition.
    No partitions at all is refused too."""
    name = partitioner_name(partitioner)
    if partitioner.num_partitions == 0:
        raise ValueError(f"{name} has no partitions: its dataset has no records")
    user_column = user_column_of(partitioner, user_column)
    if user_column is None:
        warnings.warn(f"{name} with no user column: the DP unit is the partition, so the reported epsilon is "
                      "user-level only if each person's records sit in one partition (name the user column to "
                      "have that checked, or partition with NaturalIdPartitioner(partition_by=<user column>))",
                      UserWarning, stacklevel=3)
        _refuse_empty(name, [i for i in range(partitioner.num_partitions) if len(partitioner.load_partition(i)) == 0])
        return
    if isinstance(partitioner, NaturalIdPartitioner) and natural_column(partitioner) == user_column:
        return
    home: dict[Any, int] = {}
    split: dict[Any, list[int]] = {}
    shared: dict[int, int] = {}
    empty: list[int] = []
    for i in range(partitioner.num_partitions):
        users = partitioner.load_partition(i).with_format("arrow", columns=[user_column])[:].column(user_column)
        distinct = users.unique().to_pylist()
        if not distinct:
            empty.append(i)
        if len(distinct) > 1:
            shared[i] = len(distinct)
        for user in distinct:
            if home.setdefault(user, i) != i:
                split.setdefault(user, [home[user]]).append(i)
    if split:
        user, where = next(iter(split.items()))
        more = f" (and {len(split) - 1} more users are split)" if len(split) > 1 else ""
        raise ValueError(f"user {user!r} of column {user_column!r} has records in partitions "
                         f"{', '.join(map(str, where))} of {name}{more}: user-level DP needs all of a user's records "
                         f"in one partition; use NaturalIdPartitioner(partition_by={user_column!r})")
    _refuse_empty(name, empty)
    if shared:
        first = next(iter(shared))
        warnings.warn(f"{len(shared)} partitions of {name} hold several users (partition {first}: "
                      f"{shared[first]}): the reported epsilon is for a whole partition; a user sharing one is "
                      "(2 eps, (1 + e^eps) delta)-DP alone", UserWarning, stacklevel=3)


def _refuse_empty(name: str, empty: list[int]) -> None:
    if empty:
        raise ValueError(f"partition{'s' * (len(empty) > 1)} {', '.join(map(str, empty[:10]))} of {name} "
                         f"{'are' if len(empty) > 1 else 'is'} empty ({len(empty)} in all): every partition is a "
                         "client and needs records")
