"""Record-level DP via Opacus for any model in a stock Flower ClientApp (fedprivacy.fl.record_dp):
the reply's metrics are the event Opacus accounted, DP-SGD without noise or clip is SGD on the same
Poisson batches, the noise and batches do not come from the global RNG, and the documented client
(docs/extending.md) runs."""

import math
import re
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedprivacy.fl.record_dp import make_record_dp
from fedprivacy.privacy.accounting import epsilon
from fedprivacy.privacy.client_ledgers import event_from_metrics

N, BATCH = 64, 16  # q = 1 / len(loader) = 1/4, B = 16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, 5, generator=gen), torch.randint(0, 3, (N,), generator=gen))


def _train(model: nn.Module, passes: int = 1, batch_size: int = BATCH, **kw):
    """DP-SGD as a user writes it; returns the RecordDP and the batches it trained on."""
    batches = []
    with make_record_dp(model, torch.optim.SGD(model.parameters(), lr=0.5),
                        DataLoader(_data(), batch_size=batch_size), **{"max_grad_norm": 1.0, **kw}) as dp:
        for _ in range(passes):
            for x, y in dp.data_loader:
                batches.append((x.clone(), y.clone()))
                dp.optimizer.zero_grad()
                nn.functional.cross_entropy(dp.module(x), y).backward()
                dp.optimizer.step()
    return dp, batches


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("kind", ["rdp", "prv"])
def test_the_reply_metrics_are_the_event_opacus_accounted(kind):
    dp, batches = _train(_model(), passes=2, noise_multiplier=1.1, accountant=kind, seed=0)
    event, steps, delta = event_from_metrics(MetricRecord(dp.metrics()))
    assert (event.noise_multiplier, event.population, event.q, steps) == (1.1, N, 0.25, 8) == (
        dp.optimizer.noise_multiplier, len(dp.data_loader.dataset), dp.data_loader.sample_rate, len(batches))
    assert delta == pytest.approx(0.1 / N, rel=1e-12)  # fedprivacy's delta_i = f / n_i
    opacus = dp.accountant.get_epsilon(delta)
    assert epsilon([(event, steps)], delta, kind) == pytest.approx(opacus, rel=1e-6)
    assert dp.metrics()["sample-dp-epsilon"] == pytest.approx(opacus, rel=1e-6) and 1 < opacus < 20


def test_without_noise_or_clipping_it_is_sgd_on_the_same_poisson_batches():
    """z = 0, C huge: each step is SGD on the sampled batch's summed loss over Opacus' fixed B = 16;
    with a binding clip the same batches give another model (the comparison can tell)."""
    dp_model, clipped_model, plain = _model(), _model(), _model()
    dp, batches = _train(dp_model, passes=2, noise_multiplier=0.0, max_grad_norm=1e9, seed=5)
    _, clipped_batches = _train(clipped_model, passes=2, noise_multiplier=0.0, max_grad_norm=1e-3, seed=5)
    assert dp.optimizer.expected_batch_size == BATCH and {len(x) for x, _ in batches} != {BATCH}
    opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    for x, y in batches:
        opt.zero_grad()
        (nn.functional.cross_entropy(plain(x), y, reduction="sum") / BATCH).backward()
        opt.step()
    torch.testing.assert_close(_flat(dp_model), _flat(plain), rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, clipped_batches, strict=True))
    assert not torch.allclose(_flat(clipped_model), _flat(plain), atol=1e-3)
    assert dp.epsilon == math.inf and dp.metrics()["sample-dp-epsilon"] == math.inf


def test_noise_and_batches_come_from_the_os_not_the_global_rng_unless_seeded():
    """The device's code seeds torch's global RNG before every run: unseeded runs still differ, in
    their batches and (with q = 1, every record in every batch) in their noise; seeded runs repeat."""
    def run(seed, batch_size=BATCH):
        torch.manual_seed(0)
        model = _model()
        _, batches = _train(model, noise_multiplier=1.0, seed=seed, batch_size=batch_size)
        return _flat(model), [x for x, _ in batches]

    def same(b1, b2):
        return len(b1) == len(b2) and all(x1.shape == x2.shape and torch.equal(x1, x2) for x1, x2 in zip(b1, b2))

    assert not same(run(None)[1], run(None)[1])
    (w1, b1), (w2, b2) = run(None, batch_size=N), run(None, batch_size=N)
    assert same(b1, b2) and len(b1[0]) == N and not torch.equal(w1, w2)
    (w1, b1), (w2, b2) = run(7), run(7)
    assert same(b1, b2) and torch.equal(w1, w2)


def test_a_target_epsilon_is_calibrated_by_opacus_and_spent_at_the_clients_delta():
    dp, batches = _train(_model(), passes=2, target_epsilon=2.0, epochs=2)
    assert len(batches) == 8 and 1.9 < dp.epsilon <= 2.0
    assert dp.metrics()["sample-dp-noise-multiplier"] == dp.optimizer.noise_multiplier > 0


@pytest.mark.parametrize(("kw", "message"), [
    ({}, "exactly one of noise_multiplier and target_epsilon"),
    ({"noise_multiplier": 1.0, "target_epsilon": 1.0}, "exactly one of noise_multiplier and target_epsilon"),
    ({"target_epsilon": 1.0}, "target_epsilon needs epochs"),
    ({"noise_multiplier": 1.0, "accountant": "pld"}, "accountant must be 'rdp' or 'prv'"),
    ({"noise_multiplier": 1.0, "delta_factor": 1.5}, "delta_factor must be in"),
    ({"noise_multiplier": 1.0, "target_delta": 0.0}, "target_delta must be in"),
])
def test_bad_settings_are_refused_naming_the_field(kw, message):
    model = _model()
    with pytest.raises(ValueError, match=message):
        make_record_dp(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_data(), batch_size=BATCH),
                       max_grad_norm=1.0, **kw)


def test_metrics_before_any_step_are_refused():
    dp, _ = _train(_model(), passes=0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="no private step"):
        dp.metrics()


def test_leaving_the_context_lets_the_same_model_be_made_private_again():
    """Opacus refuses to hook a model twice; the context's exit removes its hooks and per-record gradients."""
    model = _model()
    for _ in range(2):  # two rounds on one model object
        dp, _ = _train(model, noise_multiplier=1.0, seed=0)
        assert dp.steps == 4 and not any(hasattr(p, "grad_sample") for p in model.parameters())


def _call(app: ClientApp, model: nn.Module) -> Message:
    """One train message to ``app``, as a SuperNode delivers it."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    msg = Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": ConfigRecord({"server-round": 1})}),
                  dst_node_id=5, message_type="train")
    return app(msg, Context(run_id=1, node_id=5, node_config={"partition-id": 0}, state=RecordDict(), run_config={}))


def test_a_stock_client_app_replies_weights_and_the_accountable_event():
    sent = _model()
    reply = _call(_record_dp_client_app(), sent)
    assert not reply.has_error(), reply.error
    event, steps, delta = event_from_metrics(reply.content["metrics"])
    assert (event.noise_multiplier, event.population, event.q, steps, delta) == (1.0, N, 0.25, 4, 0.1 / N)
    assert reply.content["metrics"]["sample-dp-epsilon"] == pytest.approx(epsilon([(event, steps)], delta, "rdp"))
    received = reply.content["arrays"].to_torch_state_dict()
    assert received.keys() == sent.state_dict().keys()  # the user's model, not Opacus' wrapper
    assert not all(torch.equal(received[k], v) for k, v in sent.state_dict().items())


def _record_dp_client_app() -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = _model()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        dp, _ = _train(model, noise_multiplier=1.0)
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": N, **dp.metrics()})}), reply_to=msg)

    return app


def test_dpfedavg_composes_each_clients_reported_event_over_its_rounds():
    """4 clients, each in both rounds: each ledger holds 2 x 4 steps of the event Opacus accounted, at delta_i."""
    from flwr.serverapp import Grid, ServerApp

    from fedprivacy.engines.inprocess import run_inprocess
    from fedprivacy.fl.strategy import DPFedAvg

    strategy = DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, population=4, sampling="fixed",
                        record_level=True)
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, initial_arrays=ArrayRecord(_model().state_dict()), num_rounds=2,
                       train_config=ConfigRecord())

    run_inprocess(server, _record_dp_client_app(), 4)
    event = _train(_model(), noise_multiplier=1.0)[0].event
    expected = epsilon([(event, 8)], 0.1 / N, "rdp")
    eps = strategy.client_epsilons("rdp")
    assert len(eps) == 4 and all(v == pytest.approx(expected, rel=1e-9) for v in eps.values())


def test_the_documented_record_dp_client_runs():
    guide = (Path(__file__).parents[2] / "docs" / "extending.md").read_text()
    section = guide[guide.index("## Record-level DP in your own ClientApp"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {}
    exec(compile(code, "docs/extending.md", "exec"), namespace)
    reply = _call(namespace["app"], nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 2)))
    assert not reply.has_error(), reply.error
    event, steps, _ = event_from_metrics(reply.content["metrics"])
    assert steps >= 1 and event.noise_multiplier == 1.0 and reply.content["metrics"]["sample-dp-epsilon"] > 0


def test_a_second_optimizer_step_on_one_batch_is_refused_not_counted_as_an_independent_release():
    """Hardening II, finding 5: two steps per batch were reported as 2x the steps at z (epsilon 4.52);
    the truth is one step per batch at z / sqrt 2 (6.92). Such an event is refused."""
    model = _model()
    with make_record_dp(model, torch.optim.SGD(model.parameters(), lr=0.5), DataLoader(_data(), batch_size=4),
                        max_grad_norm=1.0, noise_multiplier=1.1, seed=0) as dp:
        for x, y in dp.data_loader:
            for _ in range(2):
                dp.optimizer.zero_grad()
                nn.functional.cross_entropy(dp.module(x), y).backward()
                dp.optimizer.step()
    assert dp.steps == 2 * dp.data_loader.batches
    with pytest.raises(ValueError, match="one step per batch"):
        dp.metrics()
    with pytest.raises(ValueError, match="one step per batch"):
        dp.epsilon
