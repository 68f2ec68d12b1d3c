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
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterable, Iterator
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

log = logging.getLogger(__name__)

SERVER_NODE_ID = 1
CLIENT_APP_EXCEPTION = 1  # error code of a reply whose ClientApp raised


class InProcessGrid(Grid):
    """``num_nodes`` virtual SuperNodes with ``partition-id`` 0..num_nodes-1 and node id ``partition + 2``."""

    def __init__(self, client_app: ClientApp, num_nodes: int, run_id: int = 1,
                 prefetch: Callable[[list[int]], None] | None = None) -> None:
        """``prefetch(partitions)``, if given, is called with the partitions a batch of ``train``
        messages is addressed to when the batch is pushed, before any of them runs (the task's
        read-ahead of those clients' data: :meth:`fedprivacy.task.TagPredictionTask.prefetch`)."""
        self.client_app = client_app
        self.num_nodes = num_nodes
        self.prefetch = prefetch
        self._run = Run.create_empty(run_id=run_id)
        self._contexts: dict[int, Context] = {}
        self._pending: dict[str, Message] = {}

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
        return range(2, self.num_nodes + 2)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Queue messages; their ClientApps run when the replies are pulled."""
        messages = list(messages)
        if self.prefetch is not None and (cohort := [m.metadata.dst_node_id - 2 for m in messages
                                                     if m.metadata.message_type == "train"]):
            self.prefetch(cohort)
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())  # as Flower's grids do on push
            self._pending[msg.metadata.message_id] = msg
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Run the ClientApps of the queued messages named and return their replies."""
        return [self._deliver(self._pending.pop(i)) for i in list(message_ids) if i in self._pending]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterator[Message]:
        """Deliver each message to its node's ClientApp and yield the reply (lazily, in order)."""
        for message_id in self.push_messages(messages):
            yield from self.pull_messages([message_id])

    # -- node state (kept with the server's checkpoint) ----------------------------------------
    def node_state_dict(self) -> dict[int, RecordDict]:
        """Each node's ``Context.state`` that is not empty (e.g. uplink residuals, AdaDPS's ``A``)."""
        return {node_id: context.state for node_id, context in self._contexts.items()}

    def load_node_state_dict(self, states: dict[int, RecordDict]) -> None:
        """Restore :meth:`node_state_dict` (a resumed run's nodes continue with their state, as SuperNodes would)."""
        for node_id, state in states.items():
            context = self._context(node_id)
            context.state = state
            self._contexts[node_id] = context

    # -- delivery ---------------------------------------------------------------------------
    def _context(self, node_id: int) -> Context:
        """The node's kept ``Context``, or a fresh one (empty state) if it has none."""
        if node_id in self._contexts:
            return self._contexts[node_id]
        partition = node_id - 2
        if not 0 <= partition < self.num_nodes:
            raise ValueError(f"no node with id {node_id}")
        return Context(run_id=self._run.run_id, node_id=node_id,
                       node_config={"partition-id": partition, "num-partitions": self.num_nodes},
                       state=RecordDict(), run_config=dict(self._run.override_config))

    def _deliver(self, msg: Message) -> Message:
        """Run the destination's ClientApp. Its ``Context`` is kept once its state is non-empty: a
        node whose state is still empty is indistinguishable from a fresh one, so a population of
        hundreds of thousands of nodes costs memory only for the nodes that store something."""
        node_id = msg.metadata.dst_node_id
        try:
            context = self._context(node_id)
            reply = self.client_app(msg, context)
        except Exception as exc:  # a failing client is a dropout, never a crashed run
            log.warning("ClientApp on node %s raised %s", node_id, exc)
            return Message(Error(code=CLIENT_APP_EXCEPTION, reason="".join(traceback.format_exception_only(exc)).strip()),
                           reply_to=msg)
        if len(context.state):
            self._contexts[node_id] = context
        return reply


def run_inprocess(server_app: ServerApp, client_app: ClientApp, num_nodes: int,
                  prefetch: Callable[[list[int]], None] | None = None) -> None:
    """Run ``server_app`` against ``num_nodes`` in-process SuperNodes running ``client_app``."""
    grid = InProcessGrid(client_app, num_nodes, prefetch=prefetch)
    TaskIdentity.run_id = grid.run.run_id
    TaskIdentity.task_id = 1
    TaskIdentity.node_id = SERVER_NODE_ID
    context = Context(run_id=grid.run.run_id, node_id=SERVER_NODE_ID, node_config={}, state=RecordDict(),
                      run_config={})
    server_app(grid, context)
