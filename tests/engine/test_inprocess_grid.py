"""The in-process grid keeps each node's ``Context.state`` across messages, like a SuperNode,
and holds memory only for nodes that store something."""

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

from fedprivacy.engines.inprocess import InProcessGrid


def _counting_app() -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:  # counts this node's rounds in its own state
        seen = int(context.state["count"]["n"]) if "count" in context.state else 0
        context.state["count"] = ConfigRecord({"n": seen + 1})
        return Message(RecordDict({"seen": ConfigRecord({"n": seen + 1})}), reply_to=msg)

    @app.query()
    def query(msg: Message, context) -> Message:  # stores nothing
        return Message(RecordDict({"node": ConfigRecord({"partition-id": int(context.node_config["partition-id"])})}),
                       reply_to=msg)

    return app


def _send(grid: InProcessGrid, node: int, kind: str) -> Message:
    return next(iter(grid.send_and_receive([Message(RecordDict(), dst_node_id=node, message_type=kind)])))


def test_state_survives_across_messages_and_absences():
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    grid = InProcessGrid(_counting_app(), num_nodes=5)
    assert _send(grid, 2, "train").content["seen"]["n"] == 1
    assert _send(grid, 3, "train").content["seen"]["n"] == 1  # another node: its own state
    assert _send(grid, 2, "train").content["seen"]["n"] == 2


def test_nodes_with_empty_state_are_not_kept():
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    grid = InProcessGrid(_counting_app(), num_nodes=1000)
    for node in grid.get_node_ids():
        assert _send(grid, node, "query").content["node"]["partition-id"] == node - 2
    assert grid._states == {}  # discovery of every node holds no per-node memory
    _send(grid, 7, "train")
    assert list(grid._states) == [7]


def test_prefetch_sees_the_whole_cohort_before_any_client_runs():
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    events: list = []
    inner = _counting_app()

    class Recording(ClientApp):
        def __call__(self, message, context):
            events.append(("run", message.metadata.dst_node_id - 2))
            return inner(message, context)

    grid = InProcessGrid(Recording(), num_nodes=10, prefetch=lambda parts: events.append(("prefetch", parts)))
    cohort = [Message(RecordDict(), dst_node_id=n, message_type="train") for n in (4, 9, 2)]
    replies = list(grid.send_and_receive(cohort))
    assert len(replies) == 3
    assert events == [("prefetch", [2, 7, 0]), ("run", 2), ("run", 7), ("run", 0)]
    _send(grid, 3, "query")  # discovery queries need no data
    assert events[-1] == ("run", 1) and len(events) == 5


def test_the_in_process_grid_names_its_nodes_partitions_so_discovery_asks_nothing():
    """It gives each node its partition-id, so ``discover_nodes`` takes them from it: no identity query is sent
    (an app without the identity answer still runs), and other node ids come back in partition order."""
    import pytest

    from fedprivacy.fl.population import discover_nodes

    app = ClientApp()  # answers nothing: any message sent would be an error reply
    assert discover_nodes(InProcessGrid(app, 5), 5) == [2, 3, 4, 5, 6]
    grid = InProcessGrid(app, 3, node_ids=[40, 7, 19])
    assert discover_nodes(grid, 3) == [40, 7, 19] and not grid._pending
    with pytest.raises(RuntimeError, match="holds 3 partitions, the run needs 4"):
        discover_nodes(grid, 4)
