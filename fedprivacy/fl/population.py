"""The population a DP-FedAvg round samples over: every registered node, and no other (ARCHITECTURE
invariant 5: the accountant's ``q = m / N`` holds only if sampling ranges over exactly ``N`` nodes).

One rule for the strategy and fedprivacy's run (:func:`wait_for_population`): wait until exactly
``population`` nodes are registered; more is an error at once; fewer after ``timeout`` is an error, and
so is a count that stays below the population for ``settle`` seconds once nodes have started to register
(a mismatch is then an immediate error, not a long wait).

A node's node id is not who it is: SuperNodes without persistent keys register under new ids after a
restart. Its **identity** is the ``partition-id`` of its node config, which it reports in reply to the
identity query, a ``query.identity`` message (:func:`node_identities`; fedprivacy's ClientApp answers it,
any other ClientApp once :func:`~fedprivacy.fl.mods.answer_identity_query` registers the answer).
:func:`discover_nodes` orders the nodes by it, and a strategy whose schedule gives each user a group keeps
the users' order by identity across restarts (:func:`population_change`, :func:`in_order`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

NODE_DISCOVERY_TIMEOUT_S = 600.0
IDENTITY_ACTION = "identity"
"""The identity query's action: a ``query.identity`` message, answered ``{"node": {"partition-id": i}}``."""
_REGISTER = "register the answer on yours with fedprivacy.answer_identity_query(app)"
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


def identity_query(node: int) -> Message:
    """The identity query to ``node``."""
    return Message(RecordDict(), dst_node_id=node, message_type=f"query.{IDENTITY_ACTION}")


def identity_reply(partition: int, msg: Message) -> Message:
    """A node's answer to the identity query ``msg``: its ``partition``."""
    return Message(RecordDict({"node": ConfigRecord({"partition-id": partition})}), reply_to=msg)


def reported_identity(reply: Message) -> int:
    """The ``partition-id`` a reply to the identity query reports (a non-negative int), else ValueError."""
    if reply.has_error():
        raise ValueError(f"it answered with an error: {reply.error.reason}")
    record = reply.content.config_records.get("node")
    value = None if record is None else record.get("partition-id")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"its reply holds no non-negative int node.partition-id (got {value!r})")
    return value


def node_identities(grid: Grid, node_ids: Sequence[int], timeout: float = NODE_DISCOVERY_TIMEOUT_S) -> dict[int, int]:
    """The identity (``partition-id``) of each of ``node_ids``, asked with the identity query.

    Raises:
        RuntimeError: a node answered with an error or without a valid identity, or did not answer (naming the
            node and the call its ClientApp needs).
    """
    identities: dict[int, int] = {}
    asked = set(node_ids)
    for reply in grid.send_and_receive([identity_query(n) for n in node_ids], timeout=timeout):
        node = reply.metadata.src_node_id
        if node not in asked or node in identities:
            continue
        try:
            identities[node] = reported_identity(reply)
        except ValueError as err:
            raise RuntimeError(f"node {node} failed the identity query ({err}): its ClientApp must report its "
                               f"partition-id (fedprivacy's ClientApp does; {_REGISTER})") from None
    silent = [n for n in node_ids if n not in identities]
    if silent:
        raise RuntimeError(f"{len(silent)} nodes did not answer the identity query within {timeout:.0f} s (node ids "
                           f"{_listed(silent)}): their ClientApps must report their partition-id (fedprivacy's "
                           f"ClientApp does; {_REGISTER})")
    return identities


def population_change(identities: Mapping[int, int], order: Sequence[int]) -> str | None:
    """How the identities the nodes reported (node id -> identity) differ from ``order``'s: None when each
    identity of ``order`` is reported by exactly one node and no node reports another."""
    counts = Counter(identities.values())
    missing = [i for i in order if i not in counts]
    known = set(order)
    unknown = sorted(i for i in counts if i not in known)
    twice = sorted(i for i, c in counts.items() if c > 1)
    parts = ([f"{len(missing)} users of the population are not among the registered nodes (partition-id "
              f"{_listed(missing)})"] if missing else []) + \
        ([f"{len(unknown)} unknown ones registered (partition-id {_listed(unknown)})"] if unknown else []) + \
        ([f"{len(twice)} identities are reported by more than one node (partition-id {_listed(twice)})"]
         if twice else [])
    return " and ".join(parts) or None


def in_order(identities: Mapping[int, int], order: Sequence[int]) -> list[int]:
    """The node id of each identity of ``order``, in that order (:func:`population_change` must be None)."""
    node_of = {identity: node for node, identity in identities.items()}
    return [node_of[i] for i in order]


def _listed(values: Sequence[int], shown: int = 10) -> str:
    return ", ".join(map(str, values[:shown])) + (f", ... ({len(values) - shown} more)" if len(values) > shown else "")


def discover_nodes(grid: Grid, population: int, timeout: float = NODE_DISCOVERY_TIMEOUT_S,
                   settle: float = REGISTRATION_SETTLE_S) -> list[int]:
    """Node id of each client partition ``0..population-1`` (:func:`wait_for_population`, then each node
    reports its ``partition-id``: :func:`node_identities`). A grid that assigns the partitions itself (fedprivacy's
    in-process engine) says which node holds which with ``partition_nodes()``, and is not asked."""
    own = getattr(grid, "partition_nodes", None)
    if callable(own):
        nodes = list(own())
        if len(nodes) != population:
            raise RuntimeError(f"the grid holds {len(nodes)} partitions, the run needs {population}")
        return nodes
    node_ids = wait_for_population(grid, population, timeout, settle)
    identities = node_identities(grid, node_ids, timeout)
    partitions = range(population)
    if (change := population_change(identities, partitions)) is not None:
        raise RuntimeError(f"the nodes' partitions are not 0..{population - 1}: {change}")
    return in_order(identities, partitions)
