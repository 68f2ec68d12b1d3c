"""The in-process engine's cohort batching: which runs train a round's clients together, and how.

A round's ``train`` messages all carry the same broadcast :math:`x_t`; where the run's local
training is plain SGD on a dense model (:func:`fedprivacy.client.cohort_training.unsupported_reason`
and :func:`config_obstacle`), :class:`CohortTrainer` trains them in chunks with
:func:`~fedprivacy.client.cohort_training.train_cohort`, the same data order per ``(seed, round,
client)`` as the ClientApp, the same values within float rounding, and builds each client's reply
with the ClientApp's own :func:`fedprivacy.fl.client_app.client_reply` (``{"arrays": Delta_i,
"metrics": {"train_loss", "num-examples"}}``): one reply path, so nothing on the privacy path
differs. Each client's node state is the grid's own (``Context.state``): AdaDPS's ``A`` is read from
and stored in it as the ClientApp does (:func:`~fedprivacy.fl.side_information.node_side_information`)
and the uplink compression's residual is read and written by :func:`client_reply`; only record-level
DP (``client.sample_dp``: per-client noise inside local training) trains one at a time. Before the run, one
batched step of one client at lr 0 checks that the task's model and loss run under ``vmap`` (a
user's forward that reads its input through numpy cannot).

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

The tag task's sparse logistic regression (5,000,500 parameters, but each client reads and changes
only the rows of its own words) has its own batched path,
:func:`~fedprivacy.client.sparse_cohort.train_sparse_cohort`: the clients' support rows laid one
after another in one matrix, one ``embedding_bag`` and one sparse ``addmm`` per local step for all
of them, for the softmax cross-entropy of ``tag`` and the sigmoid BCE of ``tag_multilabel`` alike
(:mod:`fedprivacy.models.logit_losses`), with AdaDPS's ``1 / A`` on its rows and, for DiSK, both passes
(from the lookahead and from :math:`x_t`, the same data order) combined per client as the ClientApp does
(:func:`~fedprivacy.fl.client_app.combine_disk_passes`). ``auto`` always takes it
(benchmarks/quickstart_round.py, BENCHMARKS.md "The quickstart's round"; benchmarks/so_multilabel_round.py).
Its chunks only read the model, so they train on ``processes`` threads at once
(:func:`~fedprivacy.engines.processes.run_processes`), and the replies still come in chunk order.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedprivacy.client.cohort_training import train_cohort, unsupported_reason
from fedprivacy.client.sparse_cohort import train_sparse_cohort, trains_in_closed_form
from fedprivacy.client.trainer import LocalResult, client_generator
from fedprivacy.config import ConfigError, RunConfig
from fedprivacy.engines.heap import keep_freed_memory
from fedprivacy.engines.processes import run_processes
from fedprivacy.fl.canary_client import CANARY_RECORD
from fedprivacy.fl.client_app import ClientJob, LastDecoded, client_reply, combine_disk_passes
from fedprivacy.fl.records import load_record_, typed_record
from fedprivacy.fl.side_information import node_side_information
from fedprivacy.models.logit_losses import closed_form_loss
from fedprivacy.stackoverflow_tasks import load_task
from fedprivacy.task import Task

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
SPARSE_CHUNK_EXAMPLES = 2000
"""The sparse tag model's chunk: clients holding about this many examples together (about five
StackOverflow-shaped users). Its working set is the chunk's support rows (about 3 MB per user at
500 tags): smaller chunks pay the per-step dispatch more often, larger ones leave the L3 cache.
Not tuned by a recorded measurement (the shared machine's noise exceeded the differences; see
BENCHMARKS.md); ``benchmarks/quickstart_round.py --chunks N ...`` measures other sizes."""


def config_obstacle(cfg: RunConfig, task: Task) -> str | None:
    """Why ``cfg``'s clients (of ``task``) cannot be trained together, naming the setting, or ``None``;
    read from the config and the task alone (the model's own obstacles: :func:`unsupported_reason`).
    Record-level DP trains one client at a time; AdaDPS (the config allows it for the tag tasks only,
    whose sparse model trains in closed form) and the uplink compression (part of each reply:
    :func:`client_reply`, on the node's own state) train together."""
    if cfg.engine != "inprocess":
        return f"engine {cfg.engine!r} (needs 'inprocess')"
    if cfg.client.sample_dp is not None:
        return "client.sample_dp is set (per-client record-level noise)"
    if cfg.privacy.placement != "central":
        return f"privacy.placement={cfg.privacy.placement!r} (clients add their own noise)"
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


def chunks_by_examples(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Positions ``0..len(sizes)-1``, the most examples first (as :func:`chunks_by_size`), in chunks
    closed as soon as their clients hold at least ``budget`` examples (so one large client is a chunk
    of its own, and many small ones share one)."""
    chunks, held = [[]], 0
    for i in chunks_by_size(sizes, max(len(sizes), 1))[0] if sizes else []:
        if held >= budget:
            chunks, held = [*chunks, []], 0
        chunks[-1].append(i)
        held += sizes[i]
    return [c for c in chunks if c]


class CohortTrainer:
    """Replies to a round's ``train`` messages, their local SGD trained together in chunks.

    The tag task's sparse model (:func:`~fedprivacy.client.sparse_cohort.trains_in_closed_form`)
    trains with :func:`~fedprivacy.client.sparse_cohort.train_sparse_cohort` in chunks of about
    :data:`SPARSE_CHUNK_EXAMPLES` examples, on ``threads`` threads (its chunks only read the model;
    their step loops run compiled, without the GIL:
    :func:`~fedprivacy.client.sparse_cohort.compiled_local_steps`); the replies still come in chunk
    order, so the result does not depend on the threads. Dense models train with :func:`train_cohort` in chunks of
    :func:`chunk_size` clients, one after another (``functional_call`` swaps the model's parameters
    while it runs, so two chunks cannot share the model).
    """

    def __init__(self, cfg: RunConfig, task: Task, model: torch.nn.Module, threads: int = 1) -> None:
        """``model``: the task's model, a working copy that each round's broadcast is loaded into."""
        self.cfg, self.task, self.model = cfg, task, model
        self.sparse = trains_in_closed_form(task, model)
        self.loss = closed_form_loss(task)
        self._lookaheads = LastDecoded()
        self.chunk = SPARSE_CHUNK_EXAMPLES if self.sparse else chunk_size(self.model)
        self.threads = threads if self.sparse else 1
        self._loaded = None  # the broadcast record the model holds
        if self.sparse:
            keep_freed_memory()  # each chunk's fresh rows reuse the last chunk's memory (fedprivacy.engines.heap)

    def handles(self, messages: Sequence[Message]) -> bool:
        """Whether these are ``train`` messages (no SecAgg+ stage, no canary: :mod:`fedprivacy.fl.canaries`; a DiSK
        lookahead only for the sparse model) that :meth:`replies` answers."""
        return bool(messages) and all(
            m.metadata.message_type == "train" and typed_record(m.content, "secagg", ConfigRecord) is None
            and typed_record(m.content, CANARY_RECORD, ConfigRecord) is None
            and (self.sparse or typed_record(m.content, "lookahead", ArrayRecord) is None) for m in messages)

    def replies(self, messages: Sequence[Message], states: Sequence[RecordDict]) -> Iterator[Message]:
        """The ClientApp's reply to each message, trained in chunks (the class docstring), chunk by chunk.

        ``states``: each message's node ``Context.state``, read and written as the ClientApp does (AdaDPS's
        ``A``, sent to a node once: :func:`~fedprivacy.fl.side_information.node_side_information`), and
        handed to :func:`client_reply`."""
        record = messages[0].content["arrays"]
        if any(m.content["arrays"] is not record for m in messages):
            raise ValueError("a cohort's train messages carry different broadcasts")
        if record is not self._loaded:
            if not load_record_(self.model, record):
                raise ValueError("broadcast arrays do not match the model's parameters")
            self._loaded = record
        round_ = _RoundInputs.of(messages, states, self.model, self.cfg.device, self._lookaheads)
        data = [self.task.client_data(m.metadata.dst_node_id - 2) for m in messages]
        sizes = [labels.shape[0] for _, labels in data]
        parts = chunks_by_examples(sizes, self.chunk) if self.sparse else chunks_by_size(sizes, self.chunk)
        jobs = [functools.partial(self._train, [messages[i] for i in part], [data[i] for i in part],
                                  [states[i] for i in part], round_) for part in parts]
        if self.threads == 1:
            for job in jobs:
                yield from job()
            return
        with ThreadPoolExecutor(self.threads, thread_name_prefix="fedprivacy-cohort") as pool:
            try:
                ahead: deque[Future[list[Message]]] = deque()
                for job in jobs:  # at most 2 chunks per thread trained and not yet replied: bounded memory
                    ahead.append(pool.submit(job))
                    if len(ahead) > 2 * self.threads:
                        yield from ahead.popleft().result()
                while ahead:
                    yield from ahead.popleft().result()
            finally:
                pool.shutdown(wait=True, cancel_futures=True)

    def _train(self, messages: Sequence[Message], data: Sequence[tuple[Any, Any]], states: Sequence[RecordDict],
               round_: _RoundInputs) -> list[Message]:
        """The replies to ``messages`` (one chunk), each :func:`client_reply` of its client's training
        (DiSK: both passes with the same data order, combined by :func:`combine_disk_passes`)."""
        c = self.cfg
        jobs = [ClientJob.of(m, m.metadata.dst_node_id - 2, c, simulated=True) for m in messages]

        def train_from(start: torch.Tensor | None) -> list[LocalResult]:  # each pass: a fresh data order, as the app
            rngs = [client_generator(c.seed, job.round, job.partition) for job in jobs]
            if self.sparse:
                return train_sparse_cohort(self.model, data, epochs=c.client.epochs, batch_size=c.client.batch_size,
                                           lr=c.client.lr, rngs=rngs, loss=self.loss, start_from=start,
                                           preconditioner=round_.preconditioner)
            return train_cohort(self.model, data, epochs=c.client.epochs, batch_size=c.client.batch_size,
                                lr=c.client.lr, rngs=rngs, loss_fn=self.task.loss)

        if round_.lookahead is None:
            results = train_from(None)
        else:
            ahead = train_from(round_.lookahead)
            current = [None] * len(ahead) if round_.disk_c == 1.0 else train_from(None)
            results = [combine_disk_passes(a, r, round_.disk_c) for a, r in zip(ahead, current)]
        return [client_reply(m, state, c, job, self.model, r)
                for m, state, job, r in zip(messages, states, jobs, results)]


class _RoundInputs:
    """What a round's messages share besides the broadcast: AdaDPS's ``A`` (each node's, stored in its
    state as the ClientApp does), DiSK's decoded lookahead and ``disk-c``; one value for the whole cohort."""

    def __init__(self, preconditioner: dict[str, torch.Tensor] | None, lookahead: torch.Tensor | None,
                 disk_c: float | None) -> None:
        self.preconditioner, self.lookahead, self.disk_c = preconditioner, lookahead, disk_c

    @classmethod
    def of(cls, messages: Sequence[Message], states: Sequence[RecordDict], model: torch.nn.Module, device: str,
           lookaheads: LastDecoded) -> _RoundInputs:
        """Read them from ``messages`` (ValueError: they differ between messages, or a node lacks ``A``)."""
        sides = [node_side_information(m, Context(run_id=0, node_id=m.metadata.dst_node_id, node_config={},
                                                  state=state, run_config={}), device)
                 for m, state in zip(messages, states)]
        records = [typed_record(m.content, "lookahead", ArrayRecord) for m in messages]
        coefficients = {float(m.content["config"]["disk-c"]) for m in messages if "disk-c" in m.content["config"]}
        if any(side is not sides[0] for side in sides) or any(r is not records[0] for r in records) \
                or len(coefficients) > 1:
            raise ValueError("a cohort's train messages carry different AdaDPS or DiSK inputs")
        if records[0] is not None and not coefficients:
            raise ValueError("a train message carries a DiSK lookahead without its 'disk-c'")
        lookahead = None if records[0] is None else lookaheads.vector(records[0], model, device)
        return cls(sides[0], lookahead, coefficients.pop() if coefficients else None)


def cohort_trainer(cfg: RunConfig) -> CohortTrainer | None:
    """The run's :class:`CohortTrainer`, or ``None`` to train one client at a time.

    ``cohort_batching``: ``off``, ``None``; ``on``, a trainer, or :class:`ConfigError` naming what
    prevents it; ``auto``, a trainer when supported and either the task trains the sparse model in
    closed form (the tag task: faster at every cohort measured, module docstring) or the model has
    at most :data:`AUTO_MAX_PARAMETERS` parameters, has no ``vmap_forward`` of its own (not the next-word LSTM) and
    ``privacy.expected_cohort`` is at least :data:`AUTO_MIN_COHORT`, else ``None``. The trainer's
    threads: :func:`~fedprivacy.engines.processes.run_processes`.
    """
    if cfg.cohort_batching == "off":
        return None
    task = load_task(cfg.data)
    reason = config_obstacle(cfg, task)  # before building a model
    if reason is None:
        model = task.new_model(cfg.device)
        if trains_in_closed_form(task, model):
            return _announce(CohortTrainer(cfg, task, model, threads=run_processes(cfg)))
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
    return _announce(CohortTrainer(cfg, task, model))


def _announce(trainer: CohortTrainer) -> CohortTrainer:
    """Log how the run's cohorts train; return ``trainer``."""
    size = (f"chunks of about {trainer.chunk} examples" if trainer.sparse
            else f"{trainer.chunk} clients per batched step")
    log.info("training cohorts together, %s, on %d thread(s) (cohort_batching=%s)", size, trainer.threads,
             trainer.cfg.cohort_batching)
    return trainer


def _auto_chooses(cfg: RunConfig, model: torch.nn.Module) -> bool:
    """``auto``'s rule (never a timing): a model without its own ``vmap_forward`` (a model that has one, as the
    next-word LSTM's recurrence unrolled step by step, ran about 2x slower batched), at most
    :data:`AUTO_MAX_PARAMETERS` parameters, an expected cohort of at least :data:`AUTO_MIN_COHORT`."""
    return (getattr(model, "vmap_forward", None) is None
            and sum(p.numel() for p in model.parameters()) <= AUTO_MAX_PARAMETERS
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
