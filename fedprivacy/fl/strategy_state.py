"""A :class:`~fedprivacy.fl.strategy.DPFedAvg` strategy's state folder: what lets a ServerApp that dies be
started again without under-counting the privacy it spent.

``state_dir`` holds::

    strategy.pt      after every round: the round, the model x_{t+1}, the server optimizer and filter
                     state, the mechanism (ledger, noise epoch, adaptive clip; for a seeded simulation
                     the sampler's and the noise generator's states, from the OS nothing that rebuilds a
                     draw), the clients' ledgers and the settings it ran with (written atomically)
    releases.jsonl   the write-ahead release log (:mod:`fedprivacy.privacy.release_log`): every
                     release, fsynced BEFORE its noise is added
    .lock            the folder lock (:mod:`fedprivacy.locks`): one strategy at a time

A crash at any moment of a round leaves either the round's release unlogged (nothing was released),
or logged but not checkpointed: the restart composes it into the ledger and runs the round again with
a fresh cohort and draw (:meth:`~fedprivacy.privacy.mechanism.GaussianMechanism.attach_release_log`).
A damaged log is refused, a changed setting is refused naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from fedprivacy.checkpoints import ResumeError, atomic_save, load_checkpoint
from fedprivacy.locks import LOCK_FILE, FolderBusyError, locked

STATE = "strategy.pt"
_VERSION = 2  # 2: the model as a flat vector ("params") in the broadcast's layout


class StrategyState:
    """The state folder of one strategy (module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.path = self.dir / STATE

    def lock(self) -> AbstractContextManager[None]:
        """Hold the folder for the duration of a ``start()`` (another holder: ``FolderBusyError``)."""
        return locked(self.dir / LOCK_FILE, blocking=False, error=FolderBusyError, what="DPFedAvg strategy")

    def load(self, settings: Mapping[str, Any]) -> dict[str, Any] | None:
        """The saved state (None: a fresh folder), refused unless saved with exactly ``settings``.

        Raises:
            ResumeError: the file is unreadable (naming it), or a setting changed (naming every one, old and new).
        """
        if not self.path.is_file():
            return None
        state = load_checkpoint(self.path)
        if not isinstance(state, dict) or state.get("version") != _VERSION:
            raise ResumeError(f"{self.path} is not a DPFedAvg state (version {_VERSION})")
        saved = state["settings"]
        # over both sides' keys: a setting written only when not its default (groups, secure_aggregation) that
        # one side lacks changed too
        changed = {k: (saved.get(k), settings.get(k)) for k in {**saved, **settings} if saved.get(k) != settings.get(k)}
        if changed:
            raise ResumeError(f"DPFedAvg(state_dir={str(self.dir)!r}) holds a run started with other settings: "
                              + "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
                              + " (restore them, or use another state_dir)")
        return state

    def save(self, settings: Mapping[str, Any], state: Mapping[str, Any]) -> None:
        """Write the state after a round, atomically."""
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_save({"version": _VERSION, "settings": dict(settings), **state}, self.path)
