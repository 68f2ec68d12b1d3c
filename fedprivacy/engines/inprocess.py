"""In-process engine: a Flower ``Grid`` that calls the ClientApp directly, in this process.

No Ray, no SuperLink, no polling sleeps: ``send_and_receive`` returns a lazy iterator that runs
each destination's ClientApp when the ServerApp asks for the next reply, so the server's
streaming aggregator holds one client update at a time. Messages are the real Flower
``Message``/``RecordDict`` objects, handed over without serialization. Each node keeps its
``Context`` (and ``context.state``) across rounds, like a SuperNode; the server saves the nodes'
non-empty states with its checkpoint and restores them on resume (:meth:`InProcessGrid.node_state_dict`),
so client-side state (uplink residuals) survives a crash as it would on a device.

A ClientApp that raises produces an error reply, as Flower's runtimes do, so the ServerApp
treats it as a dropout (invariant 11).

With a ``cohort`` (:class:`fedprivacy.engines.cohorts.CohortTrainer`, chosen by the run's
``cohort_batching``), a batch of plain ``train`` messages is answered by training those clients
together, chunk by chunk, instead of calling the ClientApp once per client (the replies come in
the cohort's order, as they would from a real grid); if that fails, the clients not yet answered
run one at a time as usual.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING
from uuid import uuid4

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedprivacy.engines.processes import ProcessPool
from fedprivacy.fl.canary_client import CANARY_RECORD
from fedprivacy.fl.client_app import LEGACY_RESIDUAL, RESIDUAL, adopt_legacy_residual
from fedprivacy.fl.records import typed_record

if TYPE_CHECKING:
    from fedprivacy.engines.cohorts import CohortTrainer

log = logging.getLogger(__name__)

SERVER_NODE_ID = 1
CLIENT_APP_EXCEPTION = 1  # error code of a reply whose ClientApp raised


class InProcessGrid(Grid):
    """``num_nodes`` virtual SuperNodes with ``partition-id`` 0..num_nodes-1 and node id ``partition + 2``, or
    ``node_ids[partition]`` (SuperNodes that register under other ids after a restart)."""

    def __init__(self, client_app: ClientApp, num_nodes: int, run_id: int = 1,
                 prefetch: Callable[[list[int]], None] | None = None, processes: int = 1,
                 cohort: CohortTrainer | None = None, node_ids: Sequence[int] | None = None) -> None:
        """``prefetch(partitions)``, if given, is called with the partitions a batch of ``train``
        messages is addressed to when the batch is pushed, before any of them runs (the task's
        read-ahead of those clients' data: :meth:`fedprivacy.stackoverflow_tasks.TagPredictionTask.prefetch`).
        ``processes > 1`` forks ``processes - 1`` workers now (:mod:`.processes`) that run
        ClientApps alongside this process; :meth:`close` stops them. ``cohort`` answers the batches
        of ``train`` messages it handles (module docstring)."""
        self.client_app = client_app
        self.cohort = cohort
        self.num_nodes = num_nodes
        self._partitions: dict[int, int] | None = None  # node id -> partition, unless partition + 2
        if node_ids is not None:
            self._partitions = {node: partition for partition, node in enumerate(node_ids)}
            if not len(self._partitions) == len(node_ids) == num_nodes or SERVER_NODE_ID in self._partitions \
                    or min(node_ids) < 1 or cohort is not None:
                raise ValueError(f"node_ids must be {num_nodes} distinct positive ids other than the server's "
                                 f"({SERVER_NODE_ID}), without a cohort trainer (it addresses partition i as node "
                                 f"i + 2); got {list(node_ids)}")
        self.prefetch = prefetch
        self._run = Run.create_empty(run_id=run_id)
        self._states: dict[int, RecordDict] = {}
        self._pending: dict[str, Message] = {}
        self._pool = ProcessPool(self._run_client, processes) if processes > 1 else None

    def close(self) -> None:
        """Stop the worker processes, if any."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> InProcessGrid:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- Grid API ---------------------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return range(2, self.num_nodes + 2) if self._partitions is None else list(self._partitions)

    def partition_nodes(self) -> list[int]:
        """The node id of each partition ``0..num_nodes-1``: this grid gives every node its ``partition-id``, so it
        knows them without asking (:func:`~fedprivacy.fl.population.discover_nodes` then sends no identity query:
        at 342,477 nodes the query alone took 20-140 s)."""
        if self._partitions is None:
            return list(range(2, self.num_nodes + 2))
        node_of = {partition: node for node, partition in self._partitions.items()}
        return [node_of[p] for p in range(self.num_nodes)]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Queue messages; their ClientApps run when the replies are pulled (``prefetch`` reads the data of the
        ``train`` messages' clients ahead, a canary's none: :mod:`fedprivacy.fl.canaries`)."""
        messages = list(messages)
        if self.prefetch is not None and (cohort := [self._partition(m.metadata.dst_node_id) for m in messages
                                                     if m.metadata.message_type == "train"
                                                     and typed_record(m.content, CANARY_RECORD, ConfigRecord) is None]):
            self.prefetch(cohort)
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())  # as Flower's grids do on push
            self._pending[msg.metadata.message_id] = msg
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Run the ClientApps of the queued messages named (in this process) and return their replies."""
        return [self._deliver(self._pending.pop(i)) for i in list(message_ids) if i in self._pending]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterator[Message]:
        """Deliver each message to its node's ClientApp and yield the reply (lazily, in order).

        With worker processes, the batch's ClientApps run on all processes at once and the
        replies are still yielded in message order."""
        ids = list(self.push_messages(messages))
        if self.cohort is not None and self.cohort.handles([self._pending[i] for i in ids]):
            yield from self._cohort_replies([self._pending.pop(i) for i in ids])
            return
        if self._pool is None:
            for message_id in ids:
                yield from self.pull_messages([message_id])
            return
        batch = [self._pending.pop(i) for i in ids]
        nodes = [m.metadata.dst_node_id for m in batch]
        states = {n: self._states[n] for n in nodes if n in self._states}
        for (reply, state), node in zip(self._pool.run(batch, states), nodes):  # the pool's iterator runs to its end
            self._keep_state(node, state)
            yield reply

    def _cohort_replies(self, batch: list[Message]) -> Iterator[Message]:
        """The cohort's replies to ``batch`` (each node's state read and kept, as :meth:`_deliver` does);
        after a failure, the rest one at a time (a failing one a dropout)."""
        states = [self._states.get(m.metadata.dst_node_id, RecordDict()) for m in batch]
        answered, rest = set(), []
        try:
            for reply in self.cohort.replies(batch, states):
                answered.add(reply.metadata.reply_to_message_id)
                yield reply
        except Exception as exc:  # noqa: BLE001 - the clients still train, one at a time
            rest = [m for m in batch if m.metadata.message_id not in answered]
            log.warning("training the cohort together failed (%s); the remaining %d clients train one at a time",
                        exc, len(rest))
        finally:
            for msg, state in zip(batch, states):
                self._keep_state(msg.metadata.dst_node_id, state)
        for msg in rest:
            yield self._deliver(msg)

    # -- node state (kept with the server's checkpoint) ----------------------------------------
    def node_state_dict(self) -> dict[int, RecordDict]:
        """Each node's ``Context.state`` that is not empty (e.g. uplink residuals, AdaDPS's ``A``)."""
        return dict(self._states)

    def load_node_state_dict(self, states: dict[int, RecordDict]) -> None:
        """Restore :meth:`node_state_dict` (a resumed run's nodes continue with their state, as SuperNodes would);
        an uplink residual saved by an older fedprivacy under its ClientApp's former key moves to the key
        the ClientApp and the mods share (:func:`~fedprivacy.fl.client_app.adopt_legacy_residual`)."""
        moved = 0
        for node_id, state in states.items():
            self._partition(node_id)
            moved += adopt_legacy_residual(state)
            self._keep_state(node_id, state)
        if moved:
            log.info("%d node state(s) kept their uplink residual under the former key %r: now under %r",
                     moved, LEGACY_RESIDUAL, RESIDUAL)

    # -- delivery ---------------------------------------------------------------------------
    def _partition(self, node_id: int) -> int:
        """The partition of node ``node_id`` (ValueError: no such node)."""
        partition = node_id - 2 if self._partitions is None else self._partitions.get(node_id, -1)
        if not 0 <= partition < self.num_nodes:
            raise ValueError(f"no node with id {node_id}")
        return partition

    def _keep_state(self, node_id: int, state: RecordDict) -> None:
        """Keep a node's state once it is non-empty: a node whose state is still empty is
        indistinguishable from a fresh one, so a population of hundreds of thousands of nodes
        costs memory only for the nodes that store something."""
        if len(state) or node_id in self._states:
            self._states[node_id] = state

    def _run_client(self, msg: Message, state: RecordDict) -> tuple[Message, RecordDict]:
        """Run the destination's ClientApp on a ``Context`` holding ``state``; return the reply and
        the state it leaves (in whichever process runs it)."""
        node_id = msg.metadata.dst_node_id
        context = None
        try:
            context = Context(run_id=self._run.run_id, node_id=node_id,
                              node_config={"partition-id": self._partition(node_id), "num-partitions": self.num_nodes},
                              state=state, run_config=dict(self._run.override_config))
            return self.client_app(msg, context), context.state
        except Exception as exc:  # a failing client is a dropout, never a crashed run
            log.warning("ClientApp on node %s raised %s", node_id, exc)
            return Message(Error(code=CLIENT_APP_EXCEPTION, reason="".join(traceback.format_exception_only(exc)).strip()),
                           reply_to=msg), state if context is None else context.state

    def _deliver(self, msg: Message) -> Message:
        """Run the destination's ClientApp here and keep the state it leaves."""
        node_id = msg.metadata.dst_node_id
        reply, state = self._run_client(msg, self._states.get(node_id, RecordDict()))
        self._keep_state(node_id, state)
        return reply


def run_inprocess(server_app: ServerApp, client_app: ClientApp, num_nodes: int,
                  prefetch: Callable[[list[int]], None] | None = None, processes: int = 1,
                  cohort: CohortTrainer | None = None, node_ids: Sequence[int] | None = None) -> None:
    """Run ``server_app`` against ``num_nodes`` in-process SuperNodes running ``client_app`` on
    ``processes`` processes (this one and ``processes - 1`` forked workers), or, for the train
    batches ``cohort`` handles, trained together; ``node_ids``: their ids (:class:`InProcessGrid`)."""
    grid = InProcessGrid(client_app, num_nodes, prefetch=prefetch, processes=processes, cohort=cohort,
                         node_ids=node_ids)
    TaskIdentity.run_id = grid.run.run_id
    TaskIdentity.task_id = 1
    TaskIdentity.node_id = SERVER_NODE_ID
    context = Context(run_id=grid.run.run_id, node_id=SERVER_NODE_ID, node_config={}, state=RecordDict(),
                      run_config={})
    with grid:
        server_app(grid, context)
