"""TFF's legacy StackOverflow HDF5 files: streaming reader and writer (h5py, no TensorFlow).

Until February 2021 TFF shipped StackOverflow as ``stackoverflow.tar.bz2`` holding
``stackoverflow_train.h5``, ``stackoverflow_held_out.h5`` and ``stackoverflow_test.h5``, read by
``tff.simulation.HDF5ClientData``. Layout (``HDF5ClientData._EXAMPLES_GROUP = "examples"``):

* ``/examples/<client_id>/<feature>``: one 1-D dataset per feature, one entry per post, all of a
  client's datasets of equal length; entry ``i`` of every dataset is post ``i`` (TFF zips the
  datasets in sorted feature-name order, ``tf.data.Dataset.from_tensor_slices``);
* features ``creation_date``, ``tags``, ``title``, ``tokens``, ``type`` are byte strings
  (variable-length HDF5 strings; fixed-length ``S`` arrays are accepted too) and ``score`` is an
  integer.

The reader yields each post as the same ``{feature: [value]}`` dict that
:func:`~fedprivacy.data.example_proto.decode_example` gives for the SQLite rows, so both sources
feed one preprocessing path. Clients are read one at a time, in sorted client-id order (TFF's
``client_ids``), so memory is bounded by the largest client.

References: TFF ``tensorflow_federated/python/simulation/hdf5_client_data.py`` and
``simulation/datasets/stackoverflow.py`` (``load_data``, before commit 7bb20162f).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import h5py
import numpy as np

from fedprivacy.data.stackoverflow import DataFormatError

__all__ = ["EXAMPLES_GROUP", "SPLIT_FILES", "h5_client_ids", "iter_h5_client_examples",
           "h5_counts", "H5Writer"]

EXAMPLES_GROUP = "examples"
SPLIT_FILES = {"train": "stackoverflow_train.h5", "heldout": "stackoverflow_held_out.h5",
               "test": "stackoverflow_test.h5"}
"""File of each split, keyed by the split names of TFF's SQLite file."""


@contextlib.contextmanager
def _open(path: str | Path) -> Iterator[tuple[Path, h5py.Group]]:
    """Opens an HDF5 file read-only and yields its ``examples`` group."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    try:
        handle = h5py.File(path, "r")
    except OSError as err:
        raise DataFormatError(f"{path}: not a readable HDF5 file ({err})") from err
    with handle:
        group = handle.get(EXAMPLES_GROUP)
        if not isinstance(group, h5py.Group):
            raise DataFormatError(f"{path}: missing group '/{EXAMPLES_GROUP}' (top level holds "
                                  f"{sorted(handle.keys())})")
        yield path, group


def h5_client_ids(path: str | Path) -> list[str]:
    """Sorted client ids of one split file (the members of ``/examples``).

    Raises:
        FileNotFoundError: If the file does not exist.
        DataFormatError: If it is not HDF5 or has no ``examples`` group.
    """
    with _open(path) as (_, group):
        return sorted(group.keys())


def h5_counts(path: str | Path) -> dict[str, int]:
    """Clients, examples and clients without examples of one split file.

    A client's example count is the length of its datasets, read from the metadata only.

    Raises:
        FileNotFoundError, DataFormatError: As :func:`iter_h5_client_examples` (lengths differ,
            a member is not a dataset or group).
    """
    with _open(path) as (path, group):
        clients, examples, empty = 0, 0, 0
        for client, member in group.items():
            if not isinstance(member, h5py.Group):
                raise DataFormatError(f"{path}: '/{EXAMPLES_GROUP}/{client}' is not a group")
            lengths = {len(d) if isinstance(d, h5py.Dataset) and d.ndim == 1 else None
                       for d in member.values()}
            if None in lengths or len(lengths) > 1:
                raise DataFormatError(f"{path}: client {client!r}: members are not 1-D datasets "
                                      "of one length")
            n = lengths.pop() if lengths else 0
            clients, examples, empty = clients + 1, examples + n, empty + (n == 0)
    return {"clients": clients, "examples": examples, "empty_clients": empty}


def _column(path: Path, client: str, name: str, member: object) -> list:
    """The values of one feature dataset as Python bytes / int / float."""
    where = f"{path}: client {client!r}, feature {name!r}"
    if not isinstance(member, h5py.Dataset):
        raise DataFormatError(f"{where}: expected a dataset, found {type(member).__name__}")
    if member.ndim != 1:
        raise DataFormatError(f"{where}: expected a 1-D dataset, got shape {member.shape}")
    try:
        values = member[()]
    except OSError as err:
        raise DataFormatError(f"{where}: unreadable (corrupt or truncated file: {err})") from err
    kind = values.dtype.kind
    if kind == "O" and h5py.check_string_dtype(member.dtype) is not None:
        return values.tolist()
    if kind == "S":
        return values.tolist()
    if kind in "iu":
        return values.astype(np.int64).tolist()
    if kind == "f":
        return values.astype(np.float64).tolist()
    raise DataFormatError(f"{where}: unsupported type {member.dtype} (expected byte strings, "
                          "integers or floats)")


def _client_examples(path: Path, client: str, group: object,
                     features: Collection[str] | None = None) -> list[dict[str, list]]:
    """All posts of one client group, as ``{feature: [value]}`` dicts of ``features`` (``None``: all;
    every dataset is read and checked either way)."""
    if not isinstance(group, h5py.Group):
        raise DataFormatError(f"{path}: '/{EXAMPLES_GROUP}/{client}' is not a group")
    columns = {name: _column(path, client, name, member)
               for name, member in sorted(group.items())}
    lengths = {name: len(values) for name, values in columns.items()}
    if len(set(lengths.values())) > 1:
        raise DataFormatError(f"{path}: client {client!r}: feature datasets differ in length "
                              f"{lengths}")
    n = next(iter(lengths.values()), 0)
    kept = {name: values for name, values in columns.items() if features is None or name in features}
    return [{name: [values[i]] for name, values in kept.items()} for i in range(n)]


def iter_h5_client_examples(path: str | Path, client_ids: Iterable[str] | None = None,
                            *, allow_empty: bool = False, features: Collection[str] | None = None
                            ) -> Iterator[tuple[str, list[dict[str, list]]]]:
    """Streams the clients of one split file and their posts.

    Args:
        path: ``stackoverflow_{train,held_out,test}.h5`` (TFF's or synthetic).
        client_ids: Clients to read (any order, duplicates ignored); ``None`` reads all.
        allow_empty: Yield ``[]`` for a client without posts instead of raising.
        features: Keep only these features of each post (``None``: all); every dataset is
            still read and checked.

    Yields:
        ``(client_id, examples)`` in sorted client-id order; examples in dataset order, each
        ``{feature: [value]}`` with ``bytes``, ``int`` or ``float`` values.

    Raises:
        FileNotFoundError: If the file does not exist.
        DataFormatError: If the file is not HDF5, lacks ``/examples``, or a client's member is
            not a 1-D dataset of strings/numbers, its datasets differ in length, its data cannot
            be read, or (unless ``allow_empty``) it has no posts.
        ValueError: If a requested client is not in the file.
    """
    with _open(path) as (path, group):
        known = sorted(group.keys())
        wanted = known if client_ids is None else sorted(set(client_ids))
        unknown = sorted(set(wanted) - set(known))
        if unknown:
            raise ValueError(f"{path}: {len(unknown)} client id(s) not in the file, "
                             f"e.g. {unknown[:5]}")
        for client in wanted:
            examples = _client_examples(path, client, group[client], features)
            if not examples and not allow_empty:
                raise DataFormatError(f"{path}: client {client!r} has no examples")
            yield client, examples


class H5Writer:
    """Writes clients into TFF-layout HDF5 split files (one group per client).

    Strings are stored as variable-length UTF-8 HDF5 strings (read back as ``bytes``),
    integers as int64, one dataset per feature. Use as a context manager.
    """

    def __init__(self, paths: Mapping[str, Path]) -> None:
        self._files = {split: h5py.File(path, "w") for split, path in paths.items()}
        self._groups = {split: f.create_group(EXAMPLES_GROUP) for split, f in self._files.items()}

    def add(self, split: str, client_id: str, columns: Mapping[str, Sequence]) -> None:
        """Writes one client's posts given as feature columns of equal length."""
        group = self._groups[split].create_group(client_id)
        for name, values in columns.items():
            if values and isinstance(values[0], (str, bytes)):
                group.create_dataset(name, data=np.array(values, dtype=object),
                                     dtype=h5py.string_dtype("utf-8"))
            else:
                group.create_dataset(name, data=np.asarray(values, dtype=np.int64))

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> H5Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
