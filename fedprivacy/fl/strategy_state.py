"""A :class:`~fedprivacy.fl.strategy.DPFedAvg` strategy's state folder: what lets a ServerApp that dies be
started again without under-counting the privacy it spent. ``fedprivacy run``'s ``output_dir`` is such a folder
(its run is the strategy's loop plus the run's hooks: :mod:`fedprivacy.fl.run_hooks`).

The folder holds::

    checkpoint.pt    every ``checkpoint_every`` rounds, at a graceful stop and at the end (written atomically):
                     the round, the model x_{t+1}, the server optimizer and filter state, the mechanism (ledger,
                     noise epoch, adaptive clip; for a seeded simulation the sampler's and the noise generator's
                     states, from the OS nothing that rebuilds a draw), the clients' ledgers, each hook's state
                     (``fedprivacy run``: the metrics rows, the config, the side information, the canaries, the
                     in-process nodes' states) and the settings a resume may not change (the strategy's
                     ``settings`` plus the hooks' ``fixed_settings``)
    releases.jsonl   the write-ahead release log (:mod:`fedprivacy.privacy.release_log`): every
                     release, fsynced BEFORE its noise is added
    .lock            the folder lock (:mod:`fedprivacy.locks`): one strategy at a time

A crash at any moment of a round leaves either the round's release unlogged (nothing was released),
or logged but not checkpointed: the restart composes it into the ledger and runs the round again with
a fresh cohort and draw (:meth:`~fedprivacy.privacy.mechanism.GaussianMechanism.attach_release_log`).
A damaged log is refused, a changed setting is refused naming the field.

Folders written before this format are read as it (:func:`migrate`): a ``fedprivacy run`` ``checkpoint.pt``
without a version (the same flat keys; its fixed settings are the ones its stored config states:
:meth:`fedprivacy.fl.hooks.RunHook.former_settings`) and a user strategy's ``strategy.pt`` (version 2).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from fedprivacy.checkpoints import STATE_FILE, ResumeError, atomic_save, load_checkpoint
from fedprivacy.locks import LOCK_FILE, FolderBusyError, locked

STATE = STATE_FILE
LEGACY_STATE = "strategy.pt"  # a user strategy's state file before version 3
_VERSION = 3  # 3: one file for the strategy and its hooks (checkpoint.pt); 2: the model as a flat vector


def migrate(state: Any, path: Path, settings: Mapping[str, Any],
            former: Callable[[Mapping[str, Any]], dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """``state`` as read from ``path``, in the current format. A state without a version (``fedprivacy run``'s
    ``checkpoint.pt`` before this format: the same flat keys) holds no settings: ``former(state)`` gives those it
    determines (``fedprivacy run``'s: its stored config's fixed fields,
    :meth:`~fedprivacy.fl.strategy.DPFedAvg.former_settings`), and the strategy's (which that config determined and
    a resume then did not check) are taken as ``settings`` states them. Version 2 differs only in name and number.

    Raises:
        ResumeError: ``state`` is none of these (naming ``path``).
    """
    if isinstance(state, dict) and "version" not in state and former is not None:
        derived = former(state)
        if derived is not None:
            return {**state, "version": _VERSION, "settings": derived}
    if isinstance(state, dict) and state.get("version") in (2, _VERSION):
        return {**state, "version": _VERSION}
    raise ResumeError(f"{path} is not a DPFedAvg state (version {_VERSION})")


class StrategyState:
    """The state folder of one strategy (module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.path = self.dir / STATE

    def lock(self) -> AbstractContextManager[None]:
        """Hold the folder for the duration of a ``start()`` (another holder: ``FolderBusyError``); re-entrant in
        the process, so a ``fedprivacy run`` that holds its folder's lock runs its strategy in it."""
        return locked(self.dir / LOCK_FILE, blocking=False, error=FolderBusyError, what="DPFedAvg strategy",
                      reentrant=True)

    def exists(self) -> bool:
        """Whether the folder holds a state (in the current format or an earlier one)."""
        return self.path.is_file() or (self.dir / LEGACY_STATE).is_file()

    def load(self, settings: Mapping[str, Any],
             former: Callable[[Mapping[str, Any]], dict[str, Any] | None] | None = None) -> dict[str, Any] | None:
        """The saved state (None: a fresh folder), refused unless saved with exactly ``settings`` (a setting one side
        lacks reads as None there: a section added to the config since reads as off); a state of an earlier format
        is read as this one (:func:`migrate`, ``former``).

        Raises:
            ResumeError: the file is unreadable (naming it), or a setting changed (naming every one, old and new).
        """
        path = self.path if self.path.is_file() else self.dir / LEGACY_STATE
        if not path.is_file():
            return None
        state = migrate(load_checkpoint(path), path, settings, former)
        saved = state["settings"]
        changed = {k: (saved.get(k), settings.get(k)) for k in {**saved, **settings} if saved.get(k) != settings.get(k)}
        if changed:
            raise ResumeError(f"resume refused: {self.dir} holds a run started with other settings: "
                              + "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items()))
                              + " (restore them, or use another folder)")
        return state

    def save(self, settings: Mapping[str, Any], state: Mapping[str, Any]) -> None:
        """Write the state, atomically."""
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_save({"version": _VERSION, "settings": dict(settings), **state}, self.path)
