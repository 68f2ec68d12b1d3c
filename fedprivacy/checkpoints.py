"""Checkpoint files: written atomically, read back or refused naming the file.

A strategy's ``checkpoint.pt`` (:class:`fedprivacy.fl.strategy_state.StrategyState`, ``fedprivacy run``'s too) and
a run's model files (:class:`fedprivacy.outputs.RunOutputs`) are written by :func:`atomic_save` (a crash or a
full disk mid-write leaves the last complete version) and read by :func:`load_checkpoint` (a damaged file is a
:class:`ResumeError` naming it). Imports nothing of fedprivacy, so the strategy imports it without the run
folder's config, CSV and YAML layers.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "checkpoint.pt"
"""A state folder's checkpoint (a strategy's, ``fedprivacy run``'s: :mod:`fedprivacy.fl.strategy_state`)."""


class ResumeError(ValueError):
    """``--resume`` (or a strategy's ``state_dir``) cannot continue this folder: no checkpoint, an unreadable one,
    or a changed fixed field."""


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """File-system errors while writing ``path`` name it (a write's ``OSError``, e.g. a full disk, names
    no file; torch reports a failed write as a RuntimeError, ``enforce fail at inline_container.cc``)."""
    try:
        yield
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror or str(err), str(path)) from None
    except RuntimeError as err:
        if "inline_container" not in str(err):
            raise
        raise OSError(errno.EIO, f"write failed ({str(err).splitlines()[-1].strip()})", str(path)) from None


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` through a temporary file and a rename: ``path`` holds the old or the new
    version, never a torn one (a crash or a full disk mid-write leaves the old)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with writing(path):
        try:
            torch.save(obj, tmp)
        except BaseException:  # a full disk: free what was written; ``path`` keeps its last complete version
            tmp.unlink(missing_ok=True)
            raise
    os.replace(tmp, path)


def load_checkpoint(path: Path, **options: Any) -> dict:
    """A run's checkpoint (``options``: more arguments of ``torch.load``, e.g. ``mmap=True``).

    Raises:
        ResumeError: the file is not a readable checkpoint (corrupt or truncated), naming it.
    """
    try:
        return torch.load(path, weights_only=False, **options)
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 - torch and pickle raise many kinds on a damaged file
        raise ResumeError(f"{path} is not a readable checkpoint (corrupt or truncated: {type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}); move it away to start the run over") \
            from None
