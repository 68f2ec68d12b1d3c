"""The DP strategy inside a ServerApp written as in Flower's quickstart, with a plain PyTorch ClientApp
that imports nothing of fedprivacy (issue "Open the engine", acceptance)."""

import logging
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Result
from torch import nn

from fedprivacy.engines.inprocess import run_inprocess
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.privacy.accounting import epsilon_for
from fedprivacy.privacy.bounds import MAX_NOISE_MULTIPLIER
from fedprivacy.privacy.sampling import SCHEDULES
from fedprivacy.updates import SparseUpdate

IN, OUT = 200, 100  # 20,100 parameters


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(IN, OUT)


def _plain_client_app(reply=None, mods=None) -> ClientApp:
    """A stock Flower ClientApp: local SGD on its own data, replies its full weights."""
    app = ClientApp(mods=mods)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = _model()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        gen = torch.Generator().manual_seed(int(context.node_config["partition-id"]))
        x, y = torch.randn(32, IN, generator=gen), torch.randint(0, OUT, (32,), generator=gen)
        opt = torch.optim.SGD(model.parameters(), lr=float(msg.content["config"]["lr"]))
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                              "metrics": MetricRecord({"num-examples": 32})})
        if reply is not None:
            content = reply(content)
        return Message(content, reply_to=msg)

    return app


def _start(strategy, client_app: ClientApp, nodes: int, rounds: int, lr: float) -> Result:
    out = {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        out["result"] = strategy.start(grid=grid, initial_arrays=ArrayRecord(_model().state_dict()),
                                       num_rounds=rounds, train_config=ConfigRecord({"lr": lr}))

    run_inprocess(app, client_app, nodes)
    return out["result"]


def _run(strategy, client_app: ClientApp, nodes: int, rounds: int, lr: float) -> ArrayRecord:
    return _start(strategy, client_app, nodes, rounds, lr).arrays


def _flat(arrays: ArrayRecord) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in arrays.to_torch_state_dict().values()])


def test_without_noise_and_clipping_it_equals_flowers_fedavg_with_equal_weights():
    dp = _run(DPFedAvg(noise_multiplier=0.0, clip_norm=1e9, expected_cohort=10, population=10, sampling="fixed"),
              _plain_client_app(), 10, rounds=2, lr=0.5)
    plain = _run(FedAvg(min_train_nodes=10, min_available_nodes=10, fraction_evaluate=0.0),
                 _plain_client_app(), 10, rounds=2, lr=0.5)
    assert not torch.allclose(_flat(plain), _flat(ArrayRecord(_model().state_dict())))  # it trained
    torch.testing.assert_close(_flat(dp), _flat(plain), rtol=1e-5, atol=1e-6)


def test_with_client_lr_zero_the_model_moves_by_noise_of_std_zC_over_m():
    dp = _run(DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=10, population=10, sampling="fixed"),
              _plain_client_app(), 10, rounds=1, lr=0.0)
    change = _flat(dp) - _flat(ArrayRecord(_model().state_dict()))
    assert float(change.std()) == pytest.approx(0.1, rel=0.02)


def test_its_epsilon_equals_fedprivacy_epsilon_for_the_same_events():
    strategy = DPFedAvg(noise_multiplier=1.2, clip_norm=1.0, expected_cohort=5, population=20, delta=1e-3)
    _run(strategy, _plain_client_app(), 20, rounds=3, lr=0.1)
    eps = strategy.epsilons()
    for kind in ("rdp", "pld"):
        assert eps[kind] == pytest.approx(epsilon_for("poisson", 0.25, 1.2, 3, 1e-3, kind), rel=1e-12)


def test_a_reply_it_cannot_use_is_counted_and_warned_about(caplog):
    def wrong_shape(content: RecordDict) -> RecordDict:
        content["arrays"] = ArrayRecord({"weight": torch.zeros(3)})  # not the model that was sent
        return content

    strategy = DPFedAvg(noise_multiplier=0.0, clip_norm=1.0, expected_cohort=4, population=4, sampling="fixed")
    with caplog.at_level(logging.WARNING):
        arrays = _run(strategy, _plain_client_app(wrong_shape), 4, rounds=1, lr=0.5)
    assert torch.equal(_flat(arrays), _flat(ArrayRecord(_model().state_dict())))  # every update counted zero
    assert any("4 update(s) rejected as zero (malformed)" in r.getMessage() for r in caplog.records)


def test_the_budget_stops_the_run_before_the_round_that_would_exceed_it():
    probe = DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=5, population=20)
    _run(probe, _plain_client_app(), 20, rounds=2, lr=0.1)
    two_rounds = probe.epsilons()["rdp"]
    strategy = DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=5, population=20,
                        target_epsilon=two_rounds * 1.0001)
    _run(strategy, _plain_client_app(), 20, rounds=5, lr=0.1)
    assert strategy.stopped and strategy.mechanism.ledger.rounds == 2
    assert strategy.epsilons()["rdp"] == pytest.approx(two_rounds)


def test_the_readme_example_runs_and_learns(tmp_path):
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).parents[2] / "examples" / "dp_strategy.py"
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    accuracy, eps = map(float, re.search(r"accuracy ([\d.]+) .* epsilon ([\d.]+)", out.stdout).groups())
    assert accuracy > 0.75 and 0 < eps < 20


@pytest.mark.parametrize(("placement", "std"), [("distributed", 0.1), ("local", 10**-0.5)])
def test_client_noise_mod_with_a_stock_client_carries_the_placements_noise(placement, std):
    """lr 0: every update is 0, so what moves the model is the clients' noise alone. Distributed: 10
    shares of N(0, (zC)^2/m) sum to N(0, (zC)^2), divided by m: std zC/m = 0.1. Local: each client adds
    N(0, (zC)^2): std zC/sqrt(m)."""
    from fedprivacy.fl.mods import client_noise_mod

    app = _plain_client_app(mods=[client_noise_mod(placement=placement, noise_multiplier=1.0, clip_norm=1.0,
                                                   expected_cohort=10)])
    strategy = DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=10, population=10, sampling="fixed",
                        placement=placement)
    dp = _run(strategy, app, 10, rounds=1, lr=0.0)
    change = _flat(dp) - _flat(ArrayRecord(_model().state_dict()))
    assert float(change.std()) == pytest.approx(std, rel=0.02)


@pytest.mark.parametrize("placement", ["distributed", "local"])
def test_client_noise_mod_sends_the_untrusted_server_only_the_noisy_arrays_and_the_dp_event(placement):
    """Hardening II, finding 6: the mod passed the reply's metrics (training loss, example counts) and any
    other record through to the server these placements do not trust."""
    from fedprivacy.fl.mods import client_noise_mod

    seen = []

    def spy(msg, context, call_next):
        reply = call_next(msg, context)
        seen.append((sorted(reply.content.keys()), sorted(reply.content["metrics"].keys())))
        return reply

    def leaky(content: RecordDict) -> RecordDict:
        content = _reporting()(content)
        content["metrics"]["train_loss"] = 1.23
        content["private"] = ConfigRecord({"user": "alice"})
        return content

    app = _plain_client_app(leaky, mods=[spy, client_noise_mod(placement=placement, noise_multiplier=1.0,
                                                                  clip_norm=1.0, expected_cohort=4)])
    strategy = DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, population=4, sampling="fixed",
                        placement=placement, record_level=True, delta=1e-2)
    _run(strategy, app, 4, rounds=1, lr=0.1)
    event_keys = sorted(f"sample-dp-{k}" for k in ("noise-multiplier", "population", "expected-batch", "q", "steps",
                                                   "delta"))
    assert seen and all(reply == (["arrays", "metrics"], event_keys) for reply in seen)
    assert len(strategy.client_epsilons()) == 4  # what the server needs to account still arrives


def test_topk_uplink_mod_sends_a_sparse_clipped_delta_and_keeps_the_residual_on_the_client():
    """A stock client behind the mod: each upload has ceil(0.05 d) coordinates, norm <= C; what was not
    sent stays in the node's Context.state; at density 1 and no clipping it is plain FedAvg again."""
    from fedprivacy.fl.mods import RESIDUAL_KEY, topk_uplink_mod
    from fedprivacy.fl.records import record_to_update

    seen = []

    def spy(msg, context, call_next):
        reply = call_next(msg, context)
        seen.append((record_to_update(reply.content["arrays"], d), RESIDUAL_KEY in context.state))
        return reply

    d = IN * OUT + OUT
    app = _plain_client_app(mods=[spy, topk_uplink_mod(density=0.05, clip_norm=0.5)])
    _run(DPFedAvg(noise_multiplier=0.0, clip_norm=0.5, expected_cohort=5, population=5, sampling="fixed"),
         app, 5, rounds=2, lr=0.5)
    assert len(seen) == 10
    for update, has_residual in seen:
        assert update.indices is not None and len(update.indices) == math.ceil(0.05 * d)
        assert float(update.values.norm()) <= 0.5 * (1 + 1e-6) and has_residual
    full = _run(DPFedAvg(noise_multiplier=0.0, clip_norm=1e9, expected_cohort=5, population=5, sampling="fixed"),
                _plain_client_app(mods=[topk_uplink_mod(density=1.0, clip_norm=1e9)]), 5, rounds=1, lr=0.5)
    plain = _run(DPFedAvg(noise_multiplier=0.0, clip_norm=1e9, expected_cohort=5, population=5, sampling="fixed"),
                 _plain_client_app(), 5, rounds=1, lr=0.5)
    torch.testing.assert_close(_flat(full), _flat(plain))


def _lookahead_spy(seen: list):
    """A client mod recording each train message's round, model, DiSK lookahead and coefficient (or None)."""
    def spy(msg, context, call_next):
        ahead = msg.content.array_records.get("lookahead")
        seen.append((int(msg.content["config"]["server-round"]), _flat(msg.content["arrays"]),
                     None if ahead is None else _flat(ahead), msg.content["config"].get("disk-c")))
        return call_next(msg, context)
    return spy


def test_disk_with_kappa_one_is_exactly_the_strategy_without_disk():
    def strategy(**disk):
        return DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, population=8, optimizer="adam",
                        lr=0.05, optimizer_settings={"tau": 1e-3}, seed=0, **disk)
    seen: list = []
    with_disk = _run(strategy(disk_kappa=1.0, disk_gamma=0.5), _plain_client_app(mods=[_lookahead_spy(seen)]), 8,
                     rounds=3, lr=0.5)
    without = _run(strategy(), _plain_client_app(), 8, rounds=3, lr=0.5)
    assert torch.equal(_flat(with_disk), _flat(without))
    assert seen and all(ahead is None for *_, ahead, _ in seen)  # kappa = 1: one pass, no lookahead sent


def test_disk_filters_broadcasts_the_lookahead_feeds_adambc_the_filtered_phi_and_costs_no_epsilon():
    """V_1 = Phi, V_2 = (1 - k)^2 Phi + k^2 Phi: with k = 0.7, V_2 = 0.58 Phi (optim/disk.py), and that is
    what DP-FedAdamBC subtracts at round 2; the lookahead x_2 + gamma (x_2 - x_1) goes out in round 2."""
    def strategy(**disk):
        return DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, population=8, sampling="fixed",
                        optimizer="adambc", lr=1e-3, delta=1e-3, **disk)
    seen: list = []
    disk = strategy(disk_kappa=0.7, disk_gamma=0.5)
    _run(disk, _plain_client_app(mods=[_lookahead_spy(seen)]), 8, rounds=2, lr=0.5)
    phi = disk.mechanism.phi()
    assert phi == pytest.approx((1.0 * 1.0 / 4) ** 2)
    assert disk.optimizer.phi == pytest.approx(0.58 * phi, rel=1e-12)  # filtered V_2, not Phi
    (_, x1, a1, _), *_, (r2, x2, a2, c2) = seen
    assert r2 == 2 and a1 is None and a2 is not None and c2 == pytest.approx((1 - 0.7) / (0.7 * 0.5))
    torch.testing.assert_close(a2, x2 + 0.5 * (x2 - x1))  # d_1 recorded from the first round's actual move
    plain = strategy()
    _run(plain, _plain_client_app(), 8, rounds=2, lr=0.5)
    assert plain.optimizer.phi == pytest.approx(phi, rel=1e-12)
    assert disk.epsilons() == plain.epsilons()


def _reporting(**fields):
    """A reply hook adding a sample-level DP event to the metrics: ``event_metrics`` of 5 steps of
    GaussianRound(1.0, poisson, 100, 10) at delta 1e-3, claiming epsilon 0.01, with ``fields`` changed
    (None: left out)."""
    from types import SimpleNamespace

    from fedprivacy.privacy.accounting import GaussianRound
    from fedprivacy.privacy.client_ledgers import event_metrics

    reported = event_metrics(SimpleNamespace(event=GaussianRound(1.0, "poisson", 100, 10.0), steps=5,
                                             target_delta=1e-3, epsilon=0.01))
    for name, value in fields.items():
        reported.pop(f"sample-dp-{name}")
        if value is not None:
            reported[f"sample-dp-{name}"] = value

    def reply(content: RecordDict) -> RecordDict:
        content["metrics"] = MetricRecord({**content["metrics"], **reported})
        return content
    return reply


def _record_level(required: bool) -> DPFedAvg:
    return DPFedAvg(noise_multiplier=0.0, clip_norm=1e9, expected_cohort=4, population=4, sampling="fixed",
                    record_level=required, delta=1e-2)


def test_a_valid_client_event_is_composed_per_client_and_its_claimed_epsilon_is_not_believed():
    strategy = _record_level(True)
    result = _start(strategy, _plain_client_app(_reporting()), 4, rounds=2, lr=0.5)
    truth = epsilon_for("poisson", 0.1, 1.0, 10, 1e-3, "rdp")  # 2 rounds x 5 steps, at the client's own delta
    eps = strategy.client_epsilons()
    assert len(eps) == 4 and all(e == pytest.approx(truth, rel=1e-12) for e in eps.values())
    assert truth > 0.5  # the claimed 0.01 was a lie, and ignored
    assert result.train_metrics_clientapp[2]["client_epsilon_max"] == pytest.approx(truth, rel=1e-12)
    assert result.train_metrics_clientapp[1]["client_epsilon_max"] < truth
    assert not torch.equal(_flat(result.arrays), _flat(ArrayRecord(_model().state_dict())))  # accepted


@pytest.mark.parametrize("bad", [{"steps": 0}, {"delta": 2.0}, {"noise-multiplier": float("nan")},
                                 {"population": 2.5}, {"steps": None}, {"noise-multiplier": -1.0}])
def test_a_lying_or_missing_event_is_rejected_as_unaccounted_when_record_level_is_required(bad, caplog):
    strategy = _record_level(True)
    with caplog.at_level(logging.WARNING):
        result = _start(strategy, _plain_client_app(_reporting(**bad)), 4, rounds=1, lr=0.5)
    assert torch.equal(_flat(result.arrays), _flat(ArrayRecord(_model().state_dict())))  # every update zero
    assert result.train_metrics_clientapp[1]["rejected_unaccounted"] == 4
    assert any("4 update(s) rejected as zero (unaccounted)" in r.getMessage() for r in caplog.records)
    assert strategy.client_epsilons() == {} and "client_epsilon_max" not in result.train_metrics_clientapp[1]


def test_without_record_level_no_reported_event_is_composed_and_the_update_kept():
    """Hardening II, finding 2: a valid event was composed unasked (and an extreme one crashed the round)."""
    for hook in (None, _reporting(steps=0), _reporting(), _reporting(**{"noise-multiplier": 1e-300})):
        strategy = _record_level(False)
        result = _start(strategy, _plain_client_app(hook), 4, rounds=1, lr=0.5)
        assert result.train_metrics_clientapp[1]["rejected_unaccounted"] == 0
        assert not torch.equal(_flat(result.arrays), _flat(ArrayRecord(_model().state_dict())))
        assert strategy.client_epsilons() == {}
    required = _record_level(True)
    result = _start(required, _plain_client_app(), 4, rounds=1, lr=0.5)  # no event at all, but required
    assert result.train_metrics_clientapp[1]["rejected_unaccounted"] == 4 and required.client_epsilons() == {}


@pytest.mark.parametrize(("field", "value"), [("noise-multiplier", 1e-300), ("noise-multiplier", 1e300),
                                              ("population", 2.0**53), ("expected-batch", 1e-300), ("steps", 10**5)])
@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_an_extreme_but_valid_client_event_is_accounted_without_failing_and_never_lower(field, value, accountant):
    """Hardening II, finding 2: z = 1e-300 raised ZeroDivisionError and 1e300 OverflowError after the
    release; under PLD an extreme event stalled each round. Now: accounted, on the side that only raises it."""
    strategy = DPFedAvg(noise_multiplier=0.0, clip_norm=1e9, expected_cohort=4, population=4, sampling="fixed",
                        record_level=True, delta=1e-2, budget_accountant=accountant)
    result = _start(strategy, _plain_client_app(_reporting(**{field: value})), 4, rounds=2, lr=0.5)
    assert result.train_metrics_clientapp[2]["rejected_unaccounted"] == 0
    eps = strategy.client_epsilons()
    accounted = {"noise-multiplier": (0.0 if value < 1 else MAX_NOISE_MULTIPLIER, 0.1, 10),  # z moved out of reach
                 "population": (1.0, 1e-4, 10), "expected-batch": (1.0, 1e-4, 10),  # q raised to the client floor
                 "steps": (1.0, 0.1, 2 * 10**5)}[field]
    z, q, steps = accounted
    expected = math.inf if z == 0 else epsilon_for("poisson", q, z, steps, 1e-3, accountant)
    assert len(eps) == 4 and all(e == pytest.approx(expected, rel=1e-9) for e in eps.values())
    assert result.train_metrics_clientapp[2]["client_epsilon_max"] == pytest.approx(expected, rel=1e-9)


def test_a_second_reply_from_a_node_or_one_from_an_unsampled_node_never_counts(caplog):
    """Hardening II, finding 6: DPFedAvg summed a second reply of the same node (2 C from one user)."""
    strategy = DPFedAvg(noise_multiplier=0.0, clip_norm=1.0, expected_cohort=4, population=4, sampling="fixed",
                        seed=0)
    strategy.configure_train(1, ArrayRecord(_model().state_dict()), ConfigRecord({"lr": 0.5}), _FakeGrid(4))
    sent = ArrayRecord(_model().state_dict())
    moved = {k: v + 1.0 for k, v in _model().state_dict().items()}  # an update of norm >> C: clipped to C
    replies = [_reply(1, moved), _reply(1, moved), _reply(99, moved)]
    with caplog.at_level(logging.WARNING):
        arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics["cohort_received"] == 1 and metrics["cohort_accepted"] == 1
    step = _flat(arrays) - _flat(sent)
    assert float(step.norm()) == pytest.approx(1.0 / 4, rel=1e-4)  # one clipped update over m = 4: C / m (float32)
    assert sum("ignoring a reply from node" in r.getMessage() for r in caplog.records) == 2


class _FakeGrid:
    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self):
        return list(range(1, self.n + 1))


def _reply(node: int, state: dict) -> Message:

    msg = Message(RecordDict({"arrays": ArrayRecord(state)}), dst_node_id=node, message_type="train")
    msg.metadata.__dict__["_src_node_id"] = node
    return msg


def test_the_default_draws_cohort_and_noise_from_the_os_and_a_seed_is_logged_as_a_simulation(caplog):
    """Hardening II, finding 1: with the old defaults (seed=0, secure_noise=False) an outsider rebuilt every
    cohort and every noise draw. Now two default strategies differ; two seeded ones agree, and say so."""
    def released(**kw):
        strategy = DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=5, population=20, **kw)
        cohort = strategy.mechanism.sample()
        g = strategy.mechanism.release(strategy.mechanism.aggregator(1000), 1).g
        return strategy, cohort, g
    a, cohort_a, ga = released()
    b, cohort_b, gb = released()
    assert a.mechanism.secure and not torch.equal(ga, gb)
    assert a.mechanism.state_dict()["noise"] is None  # nothing kept that rebuilds a draw
    with caplog.at_level(logging.WARNING):
        c, cohort_c, gc = released(seed=7)
    _, cohort_d, gd = released(seed=7)
    assert torch.equal(gc, gd) and (cohort_c == cohort_d).all()
    assert any("SIMULATION" in r.getMessage() and "seed=7" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("kwargs", "field"), [({"delta": 2.0}, "delta"), ({"delta": 0.0}, "delta"),
                                               ({"population": 1, "expected_cohort": 1}, "delta"),
                                               ({"noise_multiplier": 1e-300}, "noise_multiplier"),
                                               ({"noise_multiplier": 1e-30}, "noise_multiplier"),
                                               ({"noise_multiplier": 1e300}, "noise_multiplier")])
def test_settings_the_accountants_cannot_handle_are_refused_before_any_release(kwargs, field):
    """Hardening II, finding 3: delta=2 or population=1 crashed after a release, z = 1e-300 after release 1."""
    with pytest.raises(ValueError, match=field):
        DPFedAvg(**{**_VALID, **kwargs})


def test_a_delta_of_at_least_one_over_n_is_allowed_with_a_warning_saying_what_it_permits(caplog):
    with caplog.at_level(logging.WARNING):
        DPFedAvg(**_VALID)  # the default 1 / population
        DPFedAvg(**_VALID, delta=0.5)
    warnings = [r.getMessage() for r in caplog.records if ">= 1/population" in r.getMessage()]
    assert len(warnings) == 2 and all("publishing a random user's data in full" in w for w in warnings)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        DPFedAvg(**_VALID, delta=1e-3)
    assert not any(">= 1/population" in r.getMessage() for r in caplog.records)


_VALID = dict(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=10, population=100)


@settings(max_examples=60, deadline=None)
@given(st.one_of(
    st.tuples(st.just("noise_multiplier"), st.one_of(st.floats(max_value=-1e-300), st.just(math.nan),
                                                    st.just(math.inf))),
    st.tuples(st.just("clip_norm"), st.one_of(st.floats(max_value=0.0), st.just(math.nan), st.just(math.inf))),
    st.tuples(st.just("expected_cohort"), st.one_of(st.integers(max_value=0), st.just(2.5))),
    st.tuples(st.just("sampling"), st.text().filter(lambda s: s not in SCHEDULES)),  # any name but a built-in one
    st.tuples(st.just("placement"), st.text().filter(lambda s: s not in ("central", "distributed", "local")))))
def test_a_bad_argument_is_refused_up_front_naming_it(bad):
    name, value = bad
    with pytest.raises(ValueError, match=name):
        DPFedAvg(**{**_VALID, name: value})


# -- hardening III: what the round would fail on is refused at construction ----------------------------------
def test_a_noise_std_the_draw_overflows_is_refused_by_the_configs_rule():
    """DPFedAvg(clip_norm=1e38, noise_multiplier=10) constructed, then overflowed inside the round's draw."""
    with pytest.raises(ValueError, match=r"noise_multiplier \* clip_norm = 1e\+39"):
        DPFedAvg(**{**_VALID, "noise_multiplier": 10.0, "clip_norm": 1e38})


def test_a_budget_accountant_that_cannot_account_the_stream_is_refused_naming_both():
    from fedprivacy.privacy.correlated import CorrelatedMechanism

    with pytest.raises(ValueError, match=r"budget_accountant='prv' cannot account MatrixMechanismRun.*noise_stream="):
        DPFedAvg(**_VALID, sampling="min_separated", groups=2, noise_stream=CorrelatedMechanism("tree", 4, groups=2),
                 budget_accountant="prv", target_epsilon=5.0)
    with pytest.raises(ValueError, match=r"budget_accountant='pld'.*sampling='fixed'"):
        DPFedAvg(**_VALID, sampling="fixed", budget_accountant="pld", target_epsilon=5.0)
    DPFedAvg(**_VALID, sampling="fixed", budget_accountant="pld")  # no budget: pld reports the clients' epsilons
    for bad, name in ((math.nan, "target_epsilon"), (0.0, "target_epsilon")):
        with pytest.raises(ValueError, match=name):
            DPFedAvg(**_VALID, target_epsilon=bad)
    with pytest.raises(ValueError, match="accountants"):
        DPFedAvg(**_VALID, accountants=("rdp", "moments"))


_STREAMS = ("independent", "tree", "bandmf", "blt")


@settings(max_examples=40, deadline=None)
@given(z=st.one_of(st.just(0.0), st.floats(2.0 ** -6, 2.0 ** 20), st.floats(1e15, 1e40)),
       clip=st.one_of(st.floats(1e-3, 10.0), st.floats(1e15, 1e40)), m=st.integers(1, 6), n=st.integers(1, 12),
       accountant=st.sampled_from(["rdp", "prv", "pld"]), stream=st.sampled_from(_STREAMS))
def test_construction_refuses_naming_a_field_or_a_round_and_its_budget_check_run(z, clip, m, n, accountant, stream):
    from fedprivacy.privacy.correlated import CorrelatedMechanism
    from fedprivacy.privacy.noise import GaussianNoise

    correlated = stream != "independent"
    kwargs = dict(noise_multiplier=z, clip_norm=clip, expected_cohort=m, population=n, seed=0, delta=1e-5,
                  budget_accountant=accountant, accountants=("rdp", "prv", "pld"), target_epsilon=50.0,
                  sampling="min_separated" if correlated else "poisson", groups=2 if correlated else 1,
                  noise_stream=CorrelatedMechanism(stream, horizon=4, groups=2, bands=2) if correlated else GaussianNoise)
    try:
        strategy = DPFedAvg(**kwargs)
    except ValueError as err:
        assert any(name in str(err) for name in ("noise_multiplier", "clip_norm", "expected_cohort", "population",
                                                 "budget_accountant")), str(err)
        return
    mech = strategy.mechanism
    if not strategy._out_of_budget(1):  # the round's budget check, its release, the next round's check
        agg = mech.aggregator(5)
        agg.add_(SparseUpdate.dense(torch.full((5,), 2.0)), "node")
        assert torch.isfinite(mech.release(agg, 1).g).all()
        strategy._out_of_budget(2)
    assert strategy.epsilons()["rdp"] is not None
