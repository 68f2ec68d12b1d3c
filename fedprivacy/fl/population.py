"""The population a DP-FedAvg round samples over: every registered node, and no other (ARCHITECTURE
invariant 5: the accountant's ``q = m / N`` holds only if sampling ranges over exactly ``N`` nodes).

One rule for the strategy and fedprivacy's run (:func:`wait_for_population`): wait until exactly
``population`` nodes are registered; more is an error at once; fewer after ``timeout`` is an error, and
so is a count that stays below the population for ``settle`` seconds once nodes have started to register
(a mismatch is then an immediate error, not a long wait). :func:`discover_nodes` further orders the nodes
by the partition each one reports (fedprivacy's ClientApp answers a ``query`` message with it).
"""

from __future__ import annotations

import time

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

NODE_DISCOVERY_TIMEOUT_S = 600.0
REGISTRATION_SETTLE_S = 5.0
"""Once some nodes are registered, how long fedprivacy's run lets their count stay below the population."""


class PopulationMismatch(RuntimeError):
    """The number of registered nodes differs from the population the accountant assumes."""


def mismatch_message(nodes: int, population: int) -> str:
    """The one-line error for ``nodes`` registered SuperNodes and ``population`` users."""
    return (f"{nodes} SuperNodes registered but the data has {population} users: run with "
            f"--federation-config \"num-supernodes={population}\" or set --run-config \"num-users={nodes}\" "
            "(DP-FedAvg samples over, and accounts for, the whole population: one SuperNode per user)")


def wait_for_population(grid: Grid, population: int, timeout: float = NODE_DISCOVERY_TIMEOUT_S,
                        settle: float | None = None) -> list[int]:
    """The sorted ids of exactly ``population`` registered nodes, once they are all registered.

    Raises:
        PopulationMismatch: more nodes than ``population``, or (``settle`` given) a count that stayed
            below it for ``settle`` seconds once some nodes were registered.
        TimeoutError: fewer than ``population`` nodes after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    seen, changed = -1, time.monotonic()
    while len(node_ids := sorted(grid.get_node_ids())) != population:
        now = time.monotonic()
        if len(node_ids) != seen:
            seen, changed = len(node_ids), now
        if len(node_ids) > population or (settle is not None and node_ids and now - changed > settle):
            raise PopulationMismatch(mismatch_message(len(node_ids), population))
        if now > deadline:
            raise TimeoutError(f"only {len(node_ids)} of population={population} nodes registered within "
                               f"{timeout:.0f} s")
        time.sleep(0.05)
    return node_ids


def discover_nodes(grid: Grid, population: int, timeout: float = NODE_DISCOVERY_TIMEOUT_S,
                   settle: float = REGISTRATION_SETTLE_S) -> list[int]:
    """Node id of each client partition ``0..population-1`` (:func:`wait_for_population`, then each node
    answers a ``query`` with its ``partition-id``)."""
    node_ids = wait_for_population(grid, population, timeout, settle)
    queries = [Message(RecordDict(), dst_node_id=n, message_type="query") for n in node_ids]
    by_partition: dict[int, int] = {}
    for reply in grid.send_and_receive(queries, timeout=timeout):
        if reply.has_error():
            raise RuntimeError(f"node {reply.metadata.src_node_id} failed the discovery query: {reply.error.reason}")
        by_partition[int(reply.content["node"]["partition-id"])] = reply.metadata.src_node_id
    missing = [p for p in range(population) if p not in by_partition]
    if missing:
        raise RuntimeError(f"{len(missing)} client partitions have no node (first: {missing[:5]})")
    return [by_partition[p] for p in range(population)]
