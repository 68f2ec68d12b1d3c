"""Write-ahead log of the server's releases: every release is accounted, whatever crashes when.

The checkpoint holds the privacy ledger only as of its own round. With ``checkpoint_every: 5`` a
crash in round 7 loses the ledger entries of rounds 6 and 7, yet those releases were computed and,
in a deployment, broadcast: resuming from round 5 and accounting only the re-run rounds would
under-count the spend, and re-running round 6 with the restored generator state would release a
second average under the SAME noise draw with possibly different replies (the difference of the
two releases is one client's clipped update, noise-free).

So, before a round's noise is added (and so before its release can leave the server), one JSON
line is appended to ``releases.jsonl`` and fsynced:

``{"release": k, "round": t, "epoch": e, "draw": <id of the noise draw>, "event": <the accounted event>}``

(the event as :func:`~fedprivacy.privacy.events.event_to_dict` writes it; a line written before events
carried their ``type`` is a :class:`~fedprivacy.privacy.accounting.GaussianRound`)

- ``release`` is the release's position in the privacy ledger (1, 2, ...), re-runs included;
- ``draw`` identifies the generator state the noise is drawn from (``None`` when the server draws
  nothing), so a reused draw is detectable and refused (:meth:`ReleaseLog.record`);
- ``epoch`` counts resumes that began a new noise stream: every resume that found releases beyond its
  checkpoint and, with noise from the OS (nothing persisted rebuilds a stream), every resume after a
  release. Such a resume composes the lost releases' events into the ledger (:meth:`ReleaseLog.lost_since`)
  and re-keys the noise generator and the cohort sampler with the next epoch (:func:`rekeyed_seed`), so
  no re-run round reuses a draw or a cohort. A seeded resume from the last release's checkpoint changes
  nothing (bit-identical). Where the epoch changes, the log shows where a stream began, so a later resume
  checks each lost release against the stream that made it (its position in a correlated strategy).

A last line cut short by a crash during its own write (not even JSON) is ignored, and cut off the
file before the next record is appended: its release had not happened yet (the line is complete, fsynced, before the
noise is added). Any other unreadable line is an error that names the file and the line.

Damage is refused, never read as fewer releases (:meth:`ReleaseLog.check`, before a resumed run
releases anything): a log that is missing, emptied, or cut below the releases the checkpoint's
ledger holds; a release numbered out of sequence; a logged event other than the ledger's at its
position or, beyond the ledger, other than the run's own. What no file can show is a log whose
lines past the checkpoint were deleted: those releases are then unaccounted. Against that, with
noise from the OS (the default of :class:`~fedprivacy.privacy.mechanism.GaussianMechanism` and
``privacy.secure_noise``), nothing persisted rebuilds a draw, so a resume never reuses one; a
seeded simulation's noise is rebuildable from its seed by design, and the epoch, kept in the
checkpoint too, never goes back below the checkpoint's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedprivacy.privacy.accounting import PrivacyLedger
from fedprivacy.privacy.events import AccountedEvent, event_from_dict, event_to_dict

RELEASES = "releases.jsonl"
REKEY_STREAM = 0x72656B6579  # "rekey"


def rekeyed_seed(seed: int, epoch: int) -> int:
    """The seed a run's generators use in ``epoch`` (0: the run seed itself, as before any re-run)."""
    if epoch == 0:
        return seed
    return int(np.random.SeedSequence([seed, REKEY_STREAM, epoch]).generate_state(1, np.uint64)[0] >> 1)


def _parse_entry(line: bytes) -> dict[str, Any]:
    """One record, every field of its type (``release`` and ``round`` integers >= 1, ``epoch`` >= 0, ``draw``
    a string or null, ``event`` a valid registered event); ValueError, KeyError or TypeError otherwise."""
    entry = json.loads(line)
    record = {k: entry[k] for k in ("release", "round", "epoch", "draw", "event")}
    for name, minimum in (("release", 1), ("round", 1), ("epoch", 0)):
        value = record[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if not (record["draw"] is None or isinstance(record["draw"], str)):
        raise ValueError(f"draw must be a string or null, got {record['draw']!r}")
    record["event"] = logged_event(record["event"])
    return record


def logged_event(item: Any) -> AccountedEvent:
    """A logged event (:func:`~fedprivacy.privacy.events.event_from_dict`; no ``type``: a ``GaussianRound``,
    as every line was before events carried their type)."""
    if isinstance(item, dict) and "type" not in item:
        item = {"type": "GaussianRound", **item}
    return event_from_dict(item)


class ReleaseLog:
    """The run folder's ``releases.jsonl``: appended and fsynced once per release."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / RELEASES
        self._torn: int | None = None  # where a line cut by a crash starts: cut off before appending
        self._unterminated = False  # the last whole record lost its newline in a crash: end it before appending
        self.entries: list[dict[str, Any]] = self._read()
        self.epoch = max((e["epoch"] for e in self.entries), default=0)
        self._draws = {e["draw"] for e in self.entries if e["draw"] is not None}

    def _read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        entries = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entries.append(_parse_entry(line))
            except json.JSONDecodeError as err:
                if number == len(lines):  # the last line, cut short by a crash during its own write
                    self._torn = len(data) - len(line)
                    break
                raise ValueError(f"{self.path}: line {number} is not a release record ({err})") from None
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{self.path}: line {number} is not a release record ({err})") from None
        self._unterminated = self._torn is None and bool(data) and not data.endswith(b"\n")
        for before, entry in zip(entries, entries[1:]):
            if entry["release"] != before["release"] + 1:
                raise ValueError(f"{self.path}: release {entry['release']} follows release {before['release']}")
        return entries

    def check(self, ledger: PrivacyLedger, accepts: Callable[[int, AccountedEvent], bool]) -> None:
        """Refuse a log that cannot be the record of the run whose checkpointed ``ledger`` it extends and which
        could have made release ``k`` as the logged event ``e`` when ``accepts(k, e)`` (module docstring: damage
        is refused, never read as fewer releases).

        Raises:
            ValueError: naming the file and what is wrong.
        """
        logged = [e["release"] for e in self.entries]
        if len(logged) < ledger.rounds or (logged and logged[0] != 1):
            raise ValueError(f"{self.path} holds releases {logged[:1] + logged[-1:] or 'none'} but the checkpoint's "
                             f"ledger holds {ledger.rounds}: the release log was deleted, emptied or cut; refusing to "
                             "resume (it could reuse noise draws and under-count the privacy spent)")
        expected = [rnd for rnd, count in ledger.entries for _ in range(count)]
        for entry in self.entries:
            position = entry["release"]
            if position <= len(expected):
                ok, want = entry["event"] == expected[position - 1], f"the checkpoint holds {event_to_dict(expected[position - 1])}"
            else:
                ok, want = accepts(position, entry["event"]), "this run cannot have made it there"
            if not ok:
                raise ValueError(f"{self.path}: release {position} logs the event {event_to_dict(entry['event'])}, "
                                 f"but {want}; refusing a log of other releases")

    def new_epochs_since(self, ledger: PrivacyLedger) -> list[int]:
        """The releases after ``ledger`` that a resume made first in its new epoch (:meth:`start_epoch`), where it
        began a new noise stream: each whose epoch differs from the record before it."""
        return [entry["release"] for before, entry in zip(self.entries, self.entries[1:])
                if entry["release"] > ledger.rounds and entry["epoch"] != before["epoch"]]

    def lost_since(self, ledger: PrivacyLedger) -> list[AccountedEvent]:
        """The events of releases made after ``ledger`` was checkpointed (it holds releases 1..``ledger.rounds``)."""
        return [e["event"] for e in self.entries if e["release"] > ledger.rounds]

    def start_epoch(self, checkpointed: int = 0) -> int:
        """Begin a new epoch (a resume that re-runs released rounds), after every epoch this log or the
        checkpoint (``checkpointed``) has seen; returns it."""
        self.epoch = max(self.epoch, checkpointed) + 1
        return self.epoch

    def record(self, ledger: PrivacyLedger, round_: int, event: AccountedEvent, draw: str | None) -> None:
        """Durably log one release BEFORE its noise is added, as release ``ledger.rounds + 1`` (the
        ledger holds every earlier one); refuses a draw already released."""
        if draw is not None and draw in self._draws:
            raise RuntimeError(f"round {round_}: the noise draw {draw} was already used by an earlier release "
                               f"({self.path}); refusing to release it again")
        entry = {"release": ledger.rounds + 1, "round": round_, "epoch": self.epoch, "draw": draw, "event": event}
        if self._torn is not None:
            os.truncate(self.path, self._torn)
        with open(self.path, "ab") as f:
            line = json.dumps({**entry, "event": event_to_dict(event)})
            f.write((b"\n" if self._unterminated else b"") + (line + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        self._torn, self._unterminated = None, False
        self.entries.append(entry)
        if draw is not None:
            self._draws.add(draw)
