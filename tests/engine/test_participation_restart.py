"""A cyclic schedule's groups survive restarts.

User ``i`` of a cyclic schedule is in group ``i mod b``; ``i`` is the user's place in the population's order,
which ``DPFedAvg`` keys by each node's identity (its ``partition-id``) and keeps in its state, not by node ids,
which SuperNodes without persistent keys change at every restart. A restart with another population is refused
naming the identities; a state that kept no order is refused for a cyclic schedule and accepted for Poisson."""

import random

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.task_identity import TaskIdentity
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedprivacy import answer_identity_query
from fedprivacy.checkpoints import ResumeError, atomic_save
from fedprivacy.engines.inprocess import InProcessGrid, run_inprocess
from fedprivacy.fl.population import (PopulationMismatch, identity_query, in_order, node_identities,
                                      population_change, reported_identity)
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.fl.strategy_state import STATE, StrategyState
from fedprivacy.outputs import CHECKPOINT
from fedprivacy.privacy.correlated import CorrelatedMechanism
from fedprivacy.privacy.release_log import ReleaseLog
from fedprivacy.run import run

USERS, GROUPS, RELEASES = 6, 3, 200
NOISE = {"independent": {}, "blt": {"noise_stream": CorrelatedMechanism(kind="blt", horizon=12, groups=GROUPS,
                                                                        buffers=2)}}


def _settings(sampling: str, noise: str = "independent") -> dict:
    """m b = N: every user of the release's group participates (cyclic Poisson's q = m b / N = 1); RDP alone (PLD's
    epsilon after every round would take most of the test's time)."""
    return dict(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=USERS // GROUPS, population=USERS, delta=1e-3,
                sampling=sampling, groups=GROUPS, accountants=("rdp",), **NOISE[noise])


def _client_app(participations: list[tuple[int, int]], identity: bool = True, mods: list | None = None) -> ClientApp:
    """A stock ClientApp that records ``(partition-id, release)`` and replies the weights it got; ``identity``:
    it answers the identity query."""
    app = ClientApp(mods=mods)
    if identity:
        answer_identity_query(app)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        participations.append((int(context.node_config["partition-id"]), int(msg.content["config"]["server-round"])))
        return Message(RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord({"num-examples": 1})}),
                       reply_to=msg)

    return app


def _start(strategy: DPFedAvg, client_app: ClientApp, rounds: int, node_ids: list[int] | None = None) -> None:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, initial_arrays=ArrayRecord({"w": torch.zeros(3)}), num_rounds=rounds,
                       train_config=ConfigRecord({"lr": 0.1}))

    run_inprocess(app, client_app, USERS, node_ids=node_ids)


def _min_gap(participations: list[tuple[int, int]]) -> int:
    releases: dict[int, list[int]] = {}
    for user, release in participations:
        releases.setdefault(user, []).append(release)
    return min(b - a for r in releases.values() for a, b in zip(sorted(r), sorted(r)[1:]))


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["min_separated", "cyclic_poisson"])
@pytest.mark.parametrize("noise", ["independent", "blt"])
def test_restarts_under_shuffled_node_ids_keep_every_user_b_releases_apart(tmp_path, sampling, noise):
    rng, participations, done, starts = random.Random(0), [], 0, 0
    while done < RELEASES:
        done = min(RELEASES, done + rng.randint(7, 20))
        node_ids = rng.sample(range(10, 10_000), USERS)  # the same users under new node ids, in another order
        strategy = DPFedAvg(**_settings(sampling, noise), state_dir=tmp_path)
        _start(strategy, _client_app(participations), done, node_ids)
        starts += 1
    assert starts >= 10 and strategy.round == RELEASES == len(ReleaseLog(tmp_path).entries)
    assert sorted({r for _, r in participations}) == list(range(1, RELEASES + 1))
    assert len(participations) == RELEASES * USERS // GROUPS  # the whole group, every release
    assert _min_gap(participations) == GROUPS
    assert strategy.identities == list(range(USERS))


def _first_run(tmp_path, sampling: str = "min_separated") -> None:
    _start(DPFedAvg(**_settings(sampling), state_dir=tmp_path), _client_app([]), 2)


def _renumbered(partitions: dict[int, int]):
    """A mod that makes node ``p`` report the ``partition-id`` ``partitions.get(p, p)``."""
    def mod(msg, context, call_next):
        p = int(context.node_config["partition-id"])
        context.node_config["partition-id"] = partitions.get(p, p)
        return call_next(msg, context)
    return mod


@pytest.mark.parametrize(("partitions", "message"), [
    ({4: 12, 5: 13}, "resume refused: 2 users of the population are not among the registered nodes (partition-id 4, 5) "
                     "and 2 unknown ones registered (partition-id 12, 13): the min_separated schedule's groups would "
                     "change"),
    ({5: 4}, "resume refused: 1 users of the population are not among the registered nodes (partition-id 5) and 1 "
             "identities are reported by more than one node (partition-id 4)"),
])
def test_a_restart_with_another_population_is_refused_naming_the_identities(tmp_path, partitions, message):
    _first_run(tmp_path)
    participations: list[tuple[int, int]] = []
    app = _client_app(participations, mods=[_renumbered(partitions)])
    with pytest.raises(ResumeError) as err:
        _start(DPFedAvg(**_settings("min_separated"), state_dir=tmp_path), app, 4, node_ids=[20, 21, 22, 23, 24, 25])
    assert message in str(err.value)
    assert participations == [] and len(ReleaseLog(tmp_path).entries) == 2  # refused before any message went out


def test_a_first_start_with_a_duplicated_identity_is_refused(tmp_path):
    app = _client_app([], mods=[_renumbered({5: 4})])
    with pytest.raises(PopulationMismatch, match=r"identities are reported by more than one node \(partition-id 4\)"):
        _start(DPFedAvg(**_settings("cyclic_poisson"), state_dir=tmp_path), app, 1)


def test_a_node_that_does_not_report_its_identity_is_an_error_naming_the_call_to_add(tmp_path):
    with pytest.raises(RuntimeError, match=r"node \d+ failed the identity query .*fedprivacy.answer_identity_query\(app\)"):
        _start(DPFedAvg(**_settings("min_separated"), state_dir=tmp_path), _client_app([], identity=False), 1)


def test_without_state_dir_a_cyclic_schedule_asks_no_identity_and_keeps_no_order():
    """Nothing outlives the start: any order of the users is as good as another (a stock ClientApp runs)."""
    strategy = DPFedAvg(**_settings("min_separated"))
    participations: list[tuple[int, int]] = []
    _start(strategy, _client_app(participations, identity=False), 4, [30, 31, 32, 33, 34, 35])
    assert strategy.nodes == [30, 31, 32, 33, 34, 35] and strategy.state_dict()["identities"] is None
    assert _min_gap(participations) == GROUPS


def _drop_identities(tmp_path) -> None:
    """Make the state one an older fedprivacy wrote: no ``identities``."""
    state = torch.load(tmp_path / STATE, weights_only=False)
    del state["identities"]
    atomic_save(state, tmp_path / STATE)


def test_an_older_state_without_the_users_order_is_refused_for_a_cyclic_schedule(tmp_path):
    _first_run(tmp_path)
    _drop_identities(tmp_path)
    with pytest.raises(ResumeError, match="the saved state keeps no order of its users .* the min_separated "
                                          "schedule's groups could change"):
        _start(DPFedAvg(**_settings("min_separated"), state_dir=tmp_path), _client_app([]), 4, [30, 31, 32, 33, 34, 35])


def test_poisson_resumes_an_older_state_and_asks_no_identity(tmp_path):
    """Poisson treats every user alike each round: the order of its users is not kept, nor asked for."""
    settings = dict(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=2, population=USERS, delta=1e-3,
                    accountants=("rdp",))
    _start(DPFedAvg(**settings, state_dir=tmp_path), _client_app([], identity=False), 2)
    assert torch.load(tmp_path / STATE, weights_only=False)["identities"] is None
    _drop_identities(tmp_path)
    restarted = DPFedAvg(**settings, state_dir=tmp_path)
    _start(restarted, _client_app([], identity=False), 4, [30, 31, 32, 33, 34, 35])  # it answers no identity query
    assert restarted.round == 4 and restarted.mechanism.ledger.rounds == 4


def test_use_population_takes_the_nodes_in_the_saved_order_of_identities(tmp_path):
    """fedprivacy's run gives the nodes in partition order with their partitions as labels."""
    _first_run(tmp_path)
    strategy = DPFedAvg(**_settings("min_separated"), state_dir=tmp_path)
    strategy.adopt(ArrayRecord({"w": torch.zeros(3)}))
    strategy.resume(StrategyState(tmp_path).load(strategy.settings), ReleaseLog(tmp_path))
    strategy.use_population([45, 43, 41, 44, 42, 40], labels=[5, 3, 1, 4, 2, 0])
    assert strategy.nodes == [40, 41, 42, 43, 44, 45]
    with pytest.raises(ResumeError, match=r"partition-id 7\)"):
        strategy.use_population([40, 41, 42, 43, 44, 45], labels=[0, 1, 2, 3, 4, 7])
    with pytest.raises(ValueError, match="labels="):
        strategy.use_population([40, 41, 42, 43, 44, 45])


@pytest.fixture
def task_identity(monkeypatch):
    """What the engines set before a ServerApp creates messages."""
    for name in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1, raising=False)


def test_answer_identity_query_leaves_the_apps_own_queries_alone(task_identity):
    app = answer_identity_query(ClientApp())

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"own": ConfigRecord({"answer": 1})}), reply_to=msg)

    context = Context(run_id=1, node_id=7, node_config={"partition-id": 3}, state=RecordDict(), run_config={})
    assert reported_identity(app(identity_query(7), context)) == 3
    assert "own" in app(Message(RecordDict(), dst_node_id=7, message_type="query"), context).content


def test_the_in_process_grid_registers_its_nodes_under_the_ids_given(task_identity):
    grid = InProcessGrid(_client_app([]), 3, node_ids=[9, 4, 7])
    assert list(grid.get_node_ids()) == [9, 4, 7]
    assert node_identities(grid, [9, 4, 7]) == {9: 0, 4: 1, 7: 2}
    for bad in ([9, 4], [9, 4, 9], [9, 1, 7], [9, 0, 7]):
        with pytest.raises(ValueError, match="node_ids must be 3 distinct positive ids"):
            InProcessGrid(_client_app([]), 3, node_ids=bad)


_VALUES = st.one_of(st.integers(-5, 2**40), st.booleans(), st.floats(allow_nan=True), st.text(max_size=5),
                    st.lists(st.integers(0, 3), max_size=2))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_VALUES, key=st.sampled_from(["partition-id", "partition_id"]), record=st.sampled_from(["node", "x"]))
def test_a_reported_identity_is_a_non_negative_int_or_refused(task_identity, value, key, record):
    reply = Message(RecordDict({record: ConfigRecord({key: value})}), dst_node_id=1, message_type="query")
    valid = record == "node" and key == "partition-id" and type(value) is int and value >= 0
    if valid:
        assert reported_identity(reply) == value
    else:
        with pytest.raises(ValueError, match="node.partition-id"):
            reported_identity(reply)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), order=st.lists(st.integers(0, 10**6), unique=True, min_size=1, max_size=30))
def test_in_order_keeps_every_identity_in_its_place_and_any_change_is_named(data, order):
    nodes = data.draw(st.lists(st.integers(2, 10**9), unique=True, min_size=len(order), max_size=len(order)))
    shuffled = data.draw(st.permutations(order))
    identities = dict(zip(nodes, shuffled))
    assert population_change(identities, order) is None
    assert [identities[n] for n in in_order(identities, order)] == order
    gone = data.draw(st.sampled_from(order))
    node = next(n for n, i in identities.items() if i == gone)
    changed = {**identities, node: data.draw(st.sampled_from([10**6 + 1, *order]))}  # a new one, or a duplicate
    change = population_change(changed, order)
    if changed[node] == gone:
        assert change is None
    else:
        assert change is not None and f"not among the registered nodes (partition-id {gone})" in change


@pytest.mark.slow
def test_fedprivacy_run_keeps_its_partition_order_and_resumes_a_checkpoint_that_kept_none(small_config, tmp_path):
    """``fedprivacy run`` maps partition ``i`` to user ``i`` (``discover_nodes``) on every start: its checkpoint
    keeps that order, and one of an older fedprivacy without it resumes in the same order."""
    blt = ("privacy.sampling=min_separated", "privacy.groups=2", "privacy.mechanism.kind=blt",
           "privacy.mechanism.buffers=2", "privacy.mechanism.horizon=3", "privacy.expected_cohort=6",
           "privacy.accountants=[rdp]")
    out = tmp_path / "run"
    summary = run(small_config("rounds=2", f"output_dir={out}", *blt))
    saved = torch.load(out / CHECKPOINT, weights_only=False)
    assert saved["identities"] == list(range(summary["population"]))
    del saved["identities"]
    atomic_save(saved, out / CHECKPOINT)
    assert run(small_config("rounds=3", f"output_dir={out}", *blt), resume=True)["rounds_completed"] == 3
    assert torch.load(out / CHECKPOINT, weights_only=False)["identities"] == list(range(summary["population"]))
