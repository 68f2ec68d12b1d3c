"""AdaDPS side information over Flower messages: built by the server, sent to each node ONCE.

Server (:class:`SideInformationBroadcast`): builds the public ``A``
(:func:`build_side_information`, from the builders of :mod:`fedprivacy.optim.adadps`) before round 1 at the initial model and,
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import scipy.sparse as sp

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from torch import nn

from fedprivacy.config import AdaDPSConfig, RunConfig
from fedprivacy.data.sources import file_identity
from fedprivacy.data.stackoverflow import read_word_counts
from fedprivacy.fl.records import record_nbytes, record_to_tensors, tensors_to_record
from fedprivacy.optim.adadps import (ADADPS_STREAM, SideInformation, by_frequency, inverse_tfidf, public_batches,
                                     rmsprop_preconditioner, second_moments, two_level)
from fedprivacy.stackoverflow_tasks import word_count_file

log = logging.getLogger(__name__)

RECORD, VERSION = "adadps", "adadps-version"


def build_side_information(cfg: AdaDPSConfig, *, vocab_size: int | None, word_count_path: Path | None,
                           public: tuple[sp.csr_matrix, Any] | None, model: nn.Module,
                           loss_fn: Callable[[torch.Tensor, Any], torch.Tensor], seed: int,
                           released_round: int, public_split: str = "heldout") -> SideInformation:
    """``A`` for ``cfg.source`` from public inputs only (see the module docstring), scaled by ``cfg.scale``.

    Args:
        cfg: the ``client.adadps`` section.
        vocab_size: V (word ``j`` is vocabulary index ``j``, most frequent first); None for ``rmsprop``, the
            one source without word indices (any task with a public pool, e.g. a TFDS dataset's).
        word_count_path: TFF's ``stackoverflow.word_count`` (``frequency`` with ``statistics: word_count``).
        public: the public pool's ``(features, targets)`` (held-out users, or a TFDS public split), or None.
        public_split: the pool's split, for the provenance.
        model: the RELEASED model ``x_t`` (``rmsprop``); its weights are not changed.
        loss_fn: the task's batch-mean loss (``rmsprop``).
        seed: the run seed (the public batches' order).
        released_round: t of ``x_t`` (0: the initial model), recorded in the provenance.
    """
    provenance: dict[str, Any] = {
        "method": "AdaDPS side information (Li et al. 2022, arXiv:2202.05963v2, Alg. 3)",
        "source": cfg.source, "settings": cfg.model_dump(mode="json"), "public": True,
        "released_round": released_round}

    def pool() -> tuple[sp.csr_matrix, Any]:
        if public is None or public[0].shape[0] == 0:
            raise ValueError(f"client.adadps.source={cfg.source!r} needs a non-empty public pool (data.public_clients)")
        provenance["public_pool"] = {"split": public_split, "posts": int(public[0].shape[0])}
        return public

    if cfg.source == "ones":
        tensors = {"embedding.weight": torch.ones(vocab_size, 1)}
    elif cfg.source == "top_words":
        tensors = {"embedding.weight": two_level(vocab_size, cfg.top_words, cfg.multiplier)}
    elif cfg.source == "frequency":
        counts = _word_counts(cfg, vocab_size, word_count_path, pool, provenance)
        tensors = {"embedding.weight": by_frequency(counts, cfg.cap)}
    elif cfg.source == "tfidf":
        tensors = {"embedding.weight": inverse_tfidf(pool()[0], cfg.cap)}
    else:
        features, targets = pool()
        batches = public_batches(features, targets, cfg.public_batch_size,
                                 np.random.default_rng(np.random.SeedSequence([seed, ADADPS_STREAM, released_round])))
        v = second_moments(model, batches, loss_fn, estimator=cfg.estimator, beta=cfg.beta)
        tensors = {name: rmsprop_preconditioner(moment, cfg.eps, cfg.eps_inside_sqrt).detach().cpu()
                   for name, moment in v.items() if cfg.precondition_bias or name.rpartition(".")[2] != "bias"}
    return SideInformation({name: cfg.scale * t for name, t in tensors.items()}, provenance)


def _word_counts(cfg: AdaDPSConfig, vocab_size: int | None, word_count_path: Path | None,
                 pool: Callable[[], tuple[sp.csr_matrix, Any]], provenance: dict[str, Any]) -> np.ndarray:
    """Each of the ``vocab_size`` words' count for ``frequency``: TFF's word-count file (``statistics:
    word_count``; recorded in ``provenance``), else the public pool's posts per word."""
    if cfg.statistics == "word_count":
        counts = np.fromiter(read_word_counts(word_count_path, vocab_size).values(), dtype=np.float64)
        provenance["word_count_file"] = file_identity(word_count_path)
        return np.pad(counts, (0, vocab_size - len(counts)))  # words the file lacks count 0
    return np.bincount(pool()[0].indices, minlength=vocab_size).astype(np.float64)  # posts per word


class SideInformationBroadcast:
    """The server's current ``A``, its versions' provenance, and which nodes hold it (the
    :class:`~fedprivacy.fl.strategy.NodeContent` of a run with AdaDPS)."""

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
        words = a.source != "rmsprop"  # the rules with one A per vocabulary word (bag-of-words tasks only)
        side = build_side_information(a, vocab_size=self.task.train.vocab_size if words else None,
                                      word_count_path=word_count_file(self.cfg.data) if words else None,
                                      public=self.task.public_examples(), model=model, loss_fn=self.task.loss,
                                      seed=self.cfg.seed, released_round=completed_rounds,
                                      public_split=self.task.public_split)
        self._set(side, completed_rounds)
        self.builds.append(side.summary())
        log.info("AdaDPS side information (%s) estimated at round %d, sha256 %s", a.source, completed_rounds,
                 self.builds[-1]["sha256"][:12])
        return True

    def _set(self, side: SideInformation, version: int) -> None:
        self.side, self.version = side, version
        self.record = tensors_to_record(side.tensors)
        self.holders = set()

    def config(self) -> dict[str, int | float | str]:
        """The version of ``A`` this round's messages refer to (every train message's config)."""
        assert self.version is not None, "update() builds A before the first round"
        return {VERSION: self.version}

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
