"""Read-ahead names exactly the bytes of the requested rows in the mapped file."""

import os

import numpy as np
import pytest

from fedprivacy.data import readahead


@pytest.mark.parametrize("shape", [(50,), (20, 7)])
def test_file_range_is_the_rows_bytes_in_the_file_through_slices_and_views(tmp_path, shape):
    path = tmp_path / "a.npy"
    np.save(path, np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape))
    root = np.load(path, mmap_mode="r")
    view = np.asarray(root[3:])  # a plain ndarray over a memmap slice (what a CSR matrix holds)
    name, offset, length = readahead.file_range(view, 2, 9)
    with open(name, "rb") as f:
        f.seek(offset)
        got = np.frombuffer(f.read(length), dtype=np.int32).reshape((7, *shape[1:]))
    assert np.array_equal(got, root[5:12])


def test_not_memory_mapped_or_empty_is_no_advice(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: calls.append(a), raising=False)
    readahead.advise_rows(np.arange(10), 0, 5)
    path = tmp_path / "b.npy"
    np.save(path, np.arange(10))
    readahead.advise_rows(np.load(path, mmap_mode="r"), 4, 4)
    assert calls == [] and readahead.file_range(np.arange(10), 0, 5) is None
