"""The in-process engine's cohort batching: which runs train a round's clients together, and how.

A round's ``train`` messages all carry the same broadcast :math:`x_t`; where the run's local
training is plain SGD on a dense model (:func:`fedprivacy.client.cohort_training.unsupported_reason`
and :func:`config_obstacle`), :class:`CohortTrainer` trains them in chunks with
:func:`~fedprivacy.client.cohort_training.train_cohort` and builds each client's reply exactly as
the ClientApp (:func:`fedprivacy.fl.client_app.build_client_app`) would: ``{"arrays": Delta_i,
"metrics": {"train_loss", "num-examples"}}``, the same data order per ``(seed, round, client)``, the
same values within float rounding. The server clips and noises each reply as before; nothing on
the privacy path changes. Before the run, one batched step of one client at lr 0 checks that the
task's model and loss run under ``vmap`` (a user's forward that reads its input through numpy
cannot).

How ``cohort_batching: auto`` chooses (:func:`cohort_trainer`), from the CPU measurements of
``benchmarks/cohort_training.py`` (BENCHMARKS.md, "Cohorts trained together"): batching removes
the per-step Python and dispatch cost of each client, but adds a fixed cost per step and batch
size (a ``vmap``-ed forward and backward) and its working set is the whole chunk's stacked
parameters instead of one model that stays in cache. It paid for small models (at most
:data:`AUTO_MAX_PARAMETERS` parameters, e.g. the MLPs of user tasks: 2.4x and 7.4x for 2,410
parameters at cohorts 100 and 1,000, 1.8x and 2.2x for 19,210) in cohorts of at least
:data:`AUTO_MIN_COHORT` expected clients (at 10 it was at par or slower), and lost for larger
models (0.5-0.6x at 76,810 parameters); TFF's 4M-parameter next-word LSTM ran about 2x slower
batched on the CPU (0.52x: its matmul-written cell cannot use the fused ``aten::lstm`` kernel,
which has no ``vmap`` rule, and CPU ``bmm`` is slower than ``mm`` at its shapes), so ``auto``
leaves it one at a time; ``on`` still batches it (e.g. on a GPU, unmeasured here). The rule depends only on the
config and the model, never on timings, so a run is reproducible bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from flwr.app import Message, MetricRecord, RecordDict

from fedprivacy.client.cohort_training import train_cohort, unsupported_reason
from fedprivacy.client.trainer import client_generator
from fedprivacy.config import ConfigError, RunConfig
from fedprivacy.engines.processes import run_processes
from fedprivacy.fl.records import load_record_, update_to_record
from fedprivacy.models.lstm import NextWordLSTM
from fedprivacy.task import Task, load_task

log = logging.getLogger(__name__)

AUTO_MAX_PARAMETERS = 20_000
"""``auto`` batches models of at most this many parameters (measured crossover on the CPU)."""
AUTO_MIN_COHORT = 50
"""``auto`` batches runs whose ``privacy.expected_cohort`` is at least this."""
CHUNK_BYTES = 4 << 20
"""Clients per batched computation: as many as keep about this many bytes of stacked parameters
(at least :data:`MIN_CHUNK`, at most :data:`MAX_CHUNK`), so a round of any cohort streams its
replies chunk by chunk and the working set stays near the cache."""
MIN_CHUNK, MAX_CHUNK = 8, 256


def config_obstacle(cfg: RunConfig, task: Task) -> str | None:
    """Why ``cfg``'s clients (of ``task``) cannot be trained together, naming the setting, or ``None``;
    read from the config and the task alone (the model's own obstacles: :func:`unsupported_reason`)."""
    if cfg.engine != "inprocess" or run_processes(cfg) > 1:
        return f"engine {cfg.engine!r} with processes={run_processes(cfg)} (needs 'inprocess' with processes: 1)"
    for name, value in (("client.sample_dp", cfg.client.sample_dp), ("client.adadps", cfg.client.adadps),
                        ("client.compression", cfg.client.compression)):
        if value is not None:
            return f"{name} is set (per-client noise, preconditioner or residual state)"
    if cfg.privacy.placement != "central":
        return f"privacy.placement={cfg.privacy.placement!r} (clients add their own noise)"
    if getattr(task, "closed_form_softmax", False):
        return f"data.task={cfg.data.task!r} trains in closed form (its own fast path)"
    if task.population == 0:
        return "the task has no clients"
    return None


def chunk_size(model: torch.nn.Module) -> int:
    """Clients per :func:`train_cohort` call for ``model`` (:data:`CHUNK_BYTES`)."""
    per_client = 4 * sum(p.numel() for p in model.parameters())
    return max(MIN_CHUNK, min(MAX_CHUNK, CHUNK_BYTES // per_client))


def chunks_by_size(sizes: Sequence[int], chunk: int) -> list[list[int]]:
    """Positions ``0..len(sizes)-1`` in chunks of at most ``chunk``, the most examples first: a
    chunk then holds clients of similar step counts, so its padded batches stay small and few
    steps need more than one batch size (ties keep their order)."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    return [order[lo:lo + chunk] for lo in range(0, len(order), chunk)]


class CohortTrainer:
    """Replies to a round's ``train`` messages, their local SGD trained together in chunks."""

    def __init__(self, cfg: RunConfig, task: Task, model: torch.nn.Module) -> None:
        """``model``: the task's model, a working copy that each round's broadcast is loaded into."""
        self.cfg, self.task, self.model = cfg, task, model
        self.chunk = chunk_size(self.model)
        self._loaded = None  # the broadcast record the model holds

    @staticmethod
    def handles(messages: Sequence[Message]) -> bool:
        """Whether these are plain ``train`` messages (no DiSK lookahead) that :meth:`replies` answers."""
        return bool(messages) and all(m.metadata.message_type == "train"
                                      and "lookahead" not in m.content.array_records for m in messages)

    def replies(self, messages: Sequence[Message]) -> Iterator[Message]:
        """The ClientApp's reply to each message, trained in :func:`chunks_by_size` of ``self.chunk``."""
        data = [self.task.client_data(m.metadata.dst_node_id - 2) for m in messages]
        for part in chunks_by_size([len(labels) for _, labels in data], self.chunk):
            yield from self._train([messages[i] for i in part], [data[i] for i in part])

    def _train(self, messages: Sequence[Message], data: Sequence[tuple[Any, Any]]) -> list[Message]:
        c = self.cfg
        record = messages[0].content["arrays"]
        if any(m.content["arrays"] is not record for m in messages):
            raise ValueError("a cohort's train messages carry different broadcasts")
        if record is not self._loaded:
            if not load_record_(self.model, record):
                raise ValueError("broadcast arrays do not match the model's parameters")
            self._loaded = record
        partitions = [m.metadata.dst_node_id - 2 for m in messages]
        rounds = [int(m.content["config"]["server-round"]) for m in messages]
        results = train_cohort(self.model, data, epochs=c.client.epochs,
                               batch_size=c.client.batch_size, lr=c.client.lr,
                               rngs=[client_generator(c.seed, r, p) for r, p in zip(rounds, partitions)],
                               loss_fn=self.task.loss)
        return [Message(RecordDict({"arrays": update_to_record(r.update),
                                    "metrics": MetricRecord({"train_loss": r.train_loss,
                                                             "num-examples": r.num_examples})}), reply_to=m)
                for m, r in zip(messages, results)]


def cohort_trainer(cfg: RunConfig) -> CohortTrainer | None:
    """The run's :class:`CohortTrainer`, or ``None`` to train one client at a time.

    ``cohort_batching``: ``off``, ``None``; ``on``, a trainer, or :class:`ConfigError` naming what
    prevents it; ``auto``, a trainer when supported, the model has at most :data:`AUTO_MAX_PARAMETERS`
    parameters, it is not the next-word LSTM and ``privacy.expected_cohort`` is at least
    :data:`AUTO_MIN_COHORT` (module docstring), else ``None``.
    """
    if cfg.cohort_batching == "off":
        return None
    task = load_task(cfg.data)
    reason = config_obstacle(cfg, task)  # before building a model: the default tag run stops here
    if reason is None:
        model = task.new_model(cfg.device)
        reason = unsupported_reason(model, *task.client_data(0))
        if reason is None:
            if cfg.cohort_batching == "auto" and not _auto_chooses(cfg, model):
                return None
            reason = _trial_step(cfg, task, model)
    if reason is not None:
        if cfg.cohort_batching == "on":
            raise ConfigError(f"cohort_batching='on' is not possible here: {reason}")
        log.info("training clients one at a time: %s", reason)
        return None
    trainer = CohortTrainer(cfg, task, model)
    log.info("training cohorts together, %d clients per batched step (cohort_batching=%s)", trainer.chunk,
             cfg.cohort_batching)
    return trainer


def _auto_chooses(cfg: RunConfig, model: torch.nn.Module) -> bool:
    """``auto``'s rule (never a timing): not the LSTM, at most :data:`AUTO_MAX_PARAMETERS` parameters,
    an expected cohort of at least :data:`AUTO_MIN_COHORT`."""
    return (type(model) is not NextWordLSTM and sum(p.numel() for p in model.parameters()) <= AUTO_MAX_PARAMETERS
            and cfg.privacy.expected_cohort >= AUTO_MIN_COHORT)


def _trial_step(cfg: RunConfig, task: Task, model: torch.nn.Module) -> str | None:
    """Why one batched step fails (e.g. a forward or loss that ``vmap`` cannot run), or ``None``;
    tried on the first client with examples among the first ten."""
    for client in range(min(10, task.population)):
        data = task.client_data(client)
        if len(data[1]):
            break
    try:
        train_cohort(model, [data], epochs=1, batch_size=cfg.client.batch_size, lr=0.0,
                     rngs=[client_generator(cfg.seed, 0, client)], loss_fn=task.loss)
    except Exception as err:  # noqa: BLE001 - whatever the user's model or loss raises under vmap
        return f"a batched step of client {client} failed ({type(err).__name__}: {err})"
    return None
