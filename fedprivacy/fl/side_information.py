"""AdaDPS side information over Flower messages: built by the server, sent to each node ONCE.

Server (:class:`SideInformationBroadcast`): builds the public ``A``
(:func:`~fedprivacy.optim.adadps.build_side_information`) before round 1 at the initial model and,
for ``rmsprop`` with ``refresh_every``, again at the released model every that many rounds. Each
build is a version (the number of completed rounds it was estimated at). Every ``train`` message
carries ``config["adadps-version"]``; only a node not known to hold that version also gets
``content["adadps"]`` (an ``ArrayRecord`` of ``A`` by parameter name). A node is known to hold it
once it replies without error; a failed reply forgets it, so it is sent again next time. After a
resume nothing is assumed and every node gets it again.

Client (:func:`node_side_information`): keeps the received ``A`` and its version in its
``Context.state`` (a SuperNode's state survives between rounds) and trains with the version the
server names. A node asked to use a version it does not hold raises, which the server counts as a
dropout (zero update) and answers by sending ``A`` again the next time that node is sampled.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message

from fedprivacy.config import RunConfig
from fedprivacy.fl.records import record_nbytes, record_to_tensors, tensors_to_record
from fedprivacy.optim.adadps import SideInformation, build_side_information
from fedprivacy.task import WORD_COUNT

log = logging.getLogger(__name__)

RECORD, VERSION = "adadps", "adadps-version"


class SideInformationBroadcast:
    """The server's current ``A``, its versions' provenance, and which nodes hold it."""

    def __init__(self, cfg: RunConfig, task: Any) -> None:
        self.cfg = cfg
        self.task = task
        self.version: int | None = None
        self.side: SideInformation | None = None
        self.record: ArrayRecord | None = None
        self.builds: list[dict[str, Any]] = []
        self.holders: set[int] = set()

    def update(self, completed_rounds: int, model: torch.nn.Module) -> bool:
        """Build ``A`` if there is none yet, or re-estimate it when a refresh is due; True if built."""
        a = self.cfg.client.adadps
        due = (self.version is None or (a.refresh_every is not None and completed_rounds > self.version
                                        and completed_rounds % a.refresh_every == 0))
        if not due:
            return False
        side = build_side_information(a, vocab_size=self.task.train.vocab_size,
                                      word_count_path=self.cfg.data.path / WORD_COUNT,
                                      public=self.task.public_examples(), model=model, loss_fn=self.task.loss,
                                      seed=self.cfg.seed, released_round=completed_rounds)
        self._set(side, completed_rounds)
        self.builds.append(side.summary())
        log.info("AdaDPS side information (%s) estimated at round %d, sha256 %s", a.source, completed_rounds,
                 self.builds[-1]["sha256"][:12])
        return True

    def _set(self, side: SideInformation, version: int) -> None:
        self.side, self.version = side, version
        self.record = tensors_to_record(side.tensors)
        self.holders = set()

    def content_for(self, node: int) -> dict[str, ArrayRecord]:
        """What node ``node``'s message needs besides the shared content: ``A`` unless it holds it."""
        return {} if node in self.holders else {RECORD: self.record}

    def bytes_for(self, node: int) -> int:
        """Bytes of ``A`` in node ``node``'s message (0 when it holds the current version)."""
        return 0 if node in self.holders else record_nbytes(self.record)

    def acknowledge(self, node: int, ok: bool) -> None:
        """A reply from ``node``: without error it holds the current version; with one, send again."""
        if ok:
            self.holders.add(node)
        else:
            self.holders.discard(node)

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "tensors": self.side.tensors, "provenance": self.side.provenance,
                "builds": self.builds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._set(SideInformation(state["tensors"], state["provenance"]), int(state["version"]))
        self.builds = list(state["builds"])


class _Decoded:
    """One decoded ``A`` per process, for the record every node of an in-process run shares."""

    record: ArrayRecord | None = None
    tensors: dict[str, torch.Tensor] | None = None


def node_side_information(msg: Message, context: Context, device: str) -> dict[str, torch.Tensor] | None:
    """The ``A`` this ``train`` message asks the node to use (storing a newly sent one), or None without AdaDPS.

    Raises:
        ValueError: the message names a version the node does not hold (and did not send it).
    """
    version = msg.content["config"].get(VERSION)
    if version is None:
        return None
    if RECORD in msg.content.array_records:
        context.state[RECORD] = msg.content[RECORD]
        context.state[VERSION] = ConfigRecord({"version": int(version)})
    held = context.state.config_records.get(VERSION)
    if held is None or int(held["version"]) != int(version):
        raise ValueError(f"this node does not hold AdaDPS side information version {version}")
    record = context.state[RECORD]
    if _Decoded.record is not record:
        _Decoded.tensors, _Decoded.record = record_to_tensors(record, device), record
    return _Decoded.tensors
