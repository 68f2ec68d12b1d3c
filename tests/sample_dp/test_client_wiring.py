"""Sample-level DP clients from a run config: exact ghost-norm clipping, the round, the server's per-client ledgers."""

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from opacus.accountants import RDPAccountant
from torch import nn

from fedprivacy.client.sample_dp import softmax_regression_clipped_sum, train_sample_dp_softmax
from fedprivacy.config import ConfigError
from fedprivacy.fl.client_app import sample_dp_config
from fedprivacy.optim.sample_dp import SampleDPConfig
from fedprivacy.privacy.client_ledgers import event_from_metrics, event_metrics
from fedprivacy.privacy.accounting import GaussianRound
from fedprivacy.privacy.client_ledgers import ClientLedgers
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task

V, K = 7, 3


def _problem(n=6, seed=0):
    rng = np.random.default_rng(seed)
    x = sp.random(n, V, density=0.4, format="csr", random_state=rng, dtype=np.float32) * 3
    x[0] = 0  # an empty post: its gradient is the bias part alone
    x = sp.csr_matrix(x, dtype=np.float32)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(V, K, generator=gen, dtype=torch.float64)
    b = torch.randn(K, generator=gen, dtype=torch.float64)
    y = torch.randint(0, K, (n,), generator=gen)
    return x, y, w, b


def _autograd_per_example(x, y, w, b):
    """Each record's flat gradient (W then b), by autograd on the dense model ``x @ W + b``."""
    dense = torch.from_numpy(x.toarray()).double()
    rows = []
    for i in range(len(y)):
        wi, bi = w.clone().requires_grad_(), b.clone().requires_grad_()
        nn.functional.cross_entropy(dense[i:i + 1] @ wi + bi, y[i:i + 1]).backward()
        rows.append(torch.cat([wi.grad.reshape(-1), bi.grad]))
    return torch.stack(rows)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_ghost_norms_and_clipped_sum_match_autograd(k):
    x, y, w, b = _problem()
    grads = _autograd_per_example(x, y, w, b)
    units = grads.view(len(y) // k, k, -1).mean(dim=1)
    norms = units.norm(dim=1)
    clip = float(norms.median())  # some units clipped, some not
    s = softmax_regression_clipped_sum(x, y, w, b, clip, k)
    assert torch.allclose(s.unit_norms, norms, rtol=1e-10, atol=0)
    expected = (units * torch.clamp(clip / norms, max=1.0)[:, None]).sum(0)
    assert torch.allclose(torch.cat([s.weight.reshape(-1), s.bias]), expected, rtol=1e-10, atol=1e-12)
    dense = torch.from_numpy(x.toarray()).double()
    assert torch.allclose(s.losses, nn.functional.cross_entropy(dense @ w + b, y, reduction="none"), rtol=1e-12)


def test_clip_bounds_each_examples_contribution():
    x, y, w, b = _problem(n=8, seed=3)
    grads = _autograd_per_example(x, y, w, b)
    clip = float(grads.norm(dim=1).median())
    for i in range(len(y)):
        s = softmax_regression_clipped_sum(x[i:i + 1], y[i:i + 1], w, b, clip)
        alone = torch.cat([s.weight.reshape(-1), s.bias])
        assert float(alone.norm()) <= clip * (1 + 1e-12)
        if float(grads[i].norm()) <= clip:
            assert torch.allclose(alone, grads[i], rtol=1e-12)
        else:
            assert float(alone.norm()) == pytest.approx(clip, rel=1e-12)


def test_empty_batch_gives_a_zero_sum():
    x, y, w, b = _problem()
    s = softmax_regression_clipped_sum(x[:0], y[:0], w, b, 1.0, 2)
    assert not s.weight.any() and not s.bias.any() and s.unit_norms.numel() == 0


@pytest.fixture
def client(small_config):
    cfg = small_config()
    task = load_task(cfg.data)
    features, labels = task.client_data(0)
    return task.new_model(), features, labels


def test_round_noises_every_coordinate_and_restores_the_model(client):
    """Off the client's words the update is pure noise: -lr sum_t N(0, z^2 C^2) / B, std lr z C sqrt(T) / B."""
    model, features, labels = client
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    cfg = SampleDPConfig(base="sgd", lr=2.0, noise_multiplier=1.5, clip_norm=0.5, batch_size=4.0)
    result = train_sample_dp_softmax(model, features, labels, cfg, 11, epochs=1.0)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), start)
    n = features.shape[0]
    q = min(1.0, 4.0 / n)
    assert result.event == GaussianRound(1.5, "poisson", n, q * n) and result.steps == max(1, round(1 / q))
    assert result.target_delta == 0.1 / n and result.num_examples == n
    reference = RDPAccountant()
    reference.history = [(1.5, q, result.steps)]
    assert result.epsilon == pytest.approx(reference.get_epsilon(0.1 / n), rel=1e-12)
    off = torch.ones(model.embedding.weight.shape, dtype=torch.bool)
    off[np.unique(features.indices)] = False
    noise = result.delta[model.bias.numel():].view_as(off)[off]
    assert float(noise.std()) == pytest.approx(2.0 * 1.5 * 0.5 * math.sqrt(result.steps) / (q * n), rel=0.02)
    again = train_sample_dp_softmax(model, features, labels, cfg, 11, epochs=1.0)
    assert torch.equal(again.delta, result.delta)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adambc", "microadam"])
def test_every_base_optimizer_trains_from_the_config(client, small_config, optimizer):
    model, features, labels = client
    cfg = small_config(f"client.sample_dp.optimizer={optimizer}", "client.sample_dp.lr=0.01",
                       "client.sample_dp.batch_size=4", "client.sample_dp.micro_batch_size=2")
    result = train_sample_dp_softmax(model, features, labels, sample_dp_config(cfg.client.sample_dp), 5)
    assert torch.isfinite(result.delta).all() and result.delta.abs().sum() > 0
    assert result.event.population == features.shape[0] // 2
    event, steps, delta = event_from_metrics(event_metrics(result))
    assert (event, steps, delta) == (result.event, result.steps, result.target_delta)


@pytest.mark.slow
def test_run_reports_each_clients_record_level_epsilon(small_config):
    z, batch = 0.8, 3.0
    cfg = small_config("client.sample_dp.optimizer=adam", "client.sample_dp.lr=0.05",
                       f"client.sample_dp.noise_multiplier={z}", f"client.sample_dp.batch_size={batch}",
                       "client.sample_dp.epochs=0.5")
    summary = run(cfg)
    clients = pd.read_csv(cfg.output_dir / "client_privacy.csv")
    metrics = pd.read_csv(cfg.output_dir / "metrics.csv")
    assert len(clients) and summary["rounds_completed"] == 2 and np.isfinite(metrics["train_loss"]).all()
    task = load_task(cfg.data)
    participations = 0
    for _, row in clients.iterrows():
        n = task.client_data(int(row["client"]))[0].shape[0]
        q = min(1.0, batch / n)
        steps = max(1, round(0.5 / q))
        assert row["releases"] % steps == 0 and row["delta"] == pytest.approx(0.1 / n, rel=1e-15)
        participations += row["releases"] // steps
        reference = RDPAccountant()
        reference.history = [(z, q, int(row["releases"]))]
        assert row["epsilon_rdp"] == pytest.approx(reference.get_epsilon(0.1 / n), rel=1e-9)
        assert row["epsilon_pld"] <= row["epsilon_rdp"] * 1.001  # PLD is the tighter accountant
    assert participations == metrics["cohort_received"].sum()
    assert summary["client_epsilon_max"] == pytest.approx(clients["epsilon_rdp"].max())
    assert "sample-level DP" in summary["privacy_claim"]


def test_client_ledgers_keep_each_clients_delta_across_a_checkpoint():
    ledgers = ClientLedgers()
    event = GaussianRound(1.0, "poisson", 50, 5.0)
    ledgers.compose(3, event, 10, delta=1 / 50)
    ledgers.compose(4, event, 10)
    restored = ClientLedgers()
    restored.load_state_dict(ledgers.state_dict())
    eps = restored.epsilons(1e-5, "rdp")
    assert restored.delta(3, 1e-5) == 1 / 50 and restored.delta(4, 1e-5) == 1e-5 and eps[3] < eps[4]
    legacy = ClientLedgers()
    legacy.load_state_dict({"4": ledgers.state_dict()["ledgers"]["4"]})
    assert legacy.epsilons(1e-5, "rdp") == {4: eps[4]}


@pytest.mark.parametrize("overrides,field", [
    (["client.sample_dp.batch_size=2", "client.sample_dp.micro_batch_size=4"], "client.sample_dp.micro_batch_size"),
    (["client.sample_dp.optimizer=lamb"], "client.sample_dp.optimizer"),
    (["client.sample_dp.clip_norm=0"], "client.sample_dp.clip_norm"),
    (["client.sample_dp.accountant=pld"], "client.sample_dp.accountant"),
    (["client.sample_dp.target_delta=1"], "client.sample_dp.target_delta"),
    (["client.sample_dp.noise=1"], "client.sample_dp.noise"),
    (["client.sample_dp.epochs=1", "data.task=next_word"], "data.task"),
    (["client.sample_dp.epochs=1", "server.disk.kappa=0.5"], "server.disk"),
    (["client.sample_dp.epochs=1", "privacy.placement=local"], "privacy.placement"),
    (["client.sample_dp.disk_kappa=0.7", "client.sample_dp.disk_gamma=0"], "client.sample_dp.disk_gamma"),
    (["client.sample_dp.disk_kappa=1.5"], "client.sample_dp.disk_kappa"),
])
def test_config_errors_name_the_field(small_config, overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        small_config(*overrides)


def test_sample_dp_is_off_by_default(small_config):
    assert small_config().client.sample_dp is None


# -- DiSK and AdaDPS in the closed form (the federated tag path) ------------------------------------


def _clipped(units, clip):
    norms = units.norm(dim=1)
    return (units * torch.clamp(clip / norms, max=1.0)[:, None]).sum(0), norms


@pytest.mark.parametrize("k", [1, 2])
def test_two_point_preconditioned_clipped_sum_matches_autograd(k):
    """DiSK's c g(x') + (1 - c) g(x) per record, divided by A, then ONE clip per unit (k records)."""
    x, y, w, b = _problem()
    gen = torch.Generator().manual_seed(4)
    w2, b2 = w + 0.7 * torch.randn(w.shape, generator=gen, dtype=torch.float64), b - 0.3
    a_w = torch.rand(V, K, generator=gen, dtype=torch.float64) + 0.1  # one value per coordinate
    a_b = torch.rand(K, generator=gen, dtype=torch.float64) + 0.5
    c = 0.6
    combined = c * _autograd_per_example(x, y, w2, b2) + (1 - c) * _autograd_per_example(x, y, w, b)
    preconditioned = combined / torch.cat([a_w.reshape(-1), a_b])
    units = preconditioned.view(len(y) // k, k, -1).mean(dim=1)
    clip = float(units.norm(dim=1).median())
    expected, norms = _clipped(units, clip)
    s = softmax_regression_clipped_sum(x, y, w, b, clip, k, lookahead=(w2, b2), c=c, preconditioner=(a_w, a_b))
    assert torch.allclose(s.unit_norms, norms, rtol=1e-10, atol=0)
    assert torch.allclose(torch.cat([s.weight.reshape(-1), s.bias]), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("k", [1, 3])
def test_row_preconditioner_leaves_the_bias_alone(k):
    """A of shape (V, 1) (one value per word, AdaDPS' frequency rules) and no bias A."""
    x, y, w, b = _problem()
    a_w = torch.linspace(0.2, 3.0, V, dtype=torch.float64)[:, None]
    grads = _autograd_per_example(x, y, w, b)
    grads[:, :V * K] /= a_w.expand(V, K).reshape(-1)
    units = grads.view(len(y) // k, k, -1).mean(dim=1)
    clip = float(units.norm(dim=1).median())
    expected, norms = _clipped(units, clip)
    s = softmax_regression_clipped_sum(x, y, w, b, clip, k, preconditioner=(a_w, None))
    assert torch.allclose(s.unit_norms, norms, rtol=1e-10, atol=0)
    assert torch.allclose(torch.cat([s.weight.reshape(-1), s.bias]), expected, rtol=1e-10, atol=1e-12)


def _small_lr_model(dtype=torch.float64):
    from fedprivacy.models.logistic import SparseLogisticRegression

    model = SparseLogisticRegression(V, K).to(dtype)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(2)
        model.embedding.weight.copy_(torch.randn(V, K, generator=gen, dtype=dtype))
        model.bias.copy_(torch.randn(K, generator=gen, dtype=dtype))
    return model


def test_local_disk_closed_form_steps_by_hand():
    """q = 1 (every record every step), no noise: step 1 is the base step; step 2 filters the clipped
    two-point combination at x_1 and x_1 + gamma (x_1 - x_0) (Alg. 3) and takes ONE accountant step."""
    x, y, _, _ = _problem(n=6, seed=5)
    model = _small_lr_model()
    kappa, gamma, lr, clip = 0.6, 0.5, 0.4, 0.3
    c = (1 - kappa) / (kappa * gamma)
    cfg = SampleDPConfig(base="sgd", lr=lr, noise_multiplier=0.0, clip_norm=clip, batch_size=6.0,
                         disk_kappa=kappa, disk_gamma=gamma)
    result = train_sample_dp_softmax(model, x, y.numpy(), cfg, 3, epochs=2.0)
    w0, b0 = model.embedding.weight.detach().clone(), model.bias.detach().clone()

    def mean_clipped(w, b, ahead=None):
        s = softmax_regression_clipped_sum(x, y, w, b, clip, lookahead=ahead, c=c)
        return s.weight / 6, s.bias / 6

    gw0, gb0 = mean_clipped(w0, b0)
    w1, b1 = w0 - lr * gw0, b0 - lr * gb0
    gw1, gb1 = mean_clipped(w1, b1, (w1 + gamma * (w1 - w0), b1 + gamma * (b1 - b0)))
    w2 = w1 - lr * ((1 - kappa) * gw0 + kappa * gw1)
    b2 = b1 - lr * ((1 - kappa) * gb0 + kappa * gb1)
    expected = torch.cat([b2 - b0, (w2 - w0).reshape(-1)])  # parameters_to_vector order: bias, embedding.weight
    assert torch.allclose(result.delta, expected, rtol=1e-10, atol=1e-12)
    plain = train_sample_dp_softmax(model, x, y.numpy(), dataclasses.replace(cfg, disk_kappa=1.0), 3, epochs=2.0)
    assert not torch.allclose(plain.delta, result.delta)  # the filter did act
    assert (result.steps, result.event, result.epsilon) == (plain.steps, plain.event, plain.epsilon)


def test_closed_form_adadps_with_unit_a_is_dp_sgd_and_scale_invariant():
    """AdaDPS with A = 1 is DP-SGD bit for bit; (cA, C, lr) == (A, cC, lr / c) with the same noise draws."""
    x, y, _, _ = _problem(n=30, seed=6)
    model = _small_lr_model()
    cfg = SampleDPConfig(base="sgd", lr=0.5, noise_multiplier=1.3, clip_norm=0.4, batch_size=6.0)
    plain = train_sample_dp_softmax(model, x, y.numpy(), cfg, 8)
    ones = train_sample_dp_softmax(model, x, y.numpy(), cfg, 8,
                                   preconditioner=(torch.ones(V, 1, dtype=torch.float64), None))
    assert torch.equal(plain.delta, ones.delta)
    gen = torch.Generator().manual_seed(1)
    a = (torch.rand(V, K, generator=gen, dtype=torch.float64) + 0.2, torch.rand(K, generator=gen, dtype=torch.float64) + 0.2)
    scale = 4.0
    scaled_a = train_sample_dp_softmax(model, x, y.numpy(), cfg, 8, preconditioner=(scale * a[0], scale * a[1]))
    scaled_c = train_sample_dp_softmax(model, x, y.numpy(), dataclasses.replace(cfg, clip_norm=scale * cfg.clip_norm,
                                                                                  lr=cfg.lr / scale), 8, preconditioner=a)
    torch.testing.assert_close(scaled_a.delta, scaled_c.delta, rtol=1e-9, atol=1e-12)
    unscaled = train_sample_dp_softmax(model, x, y.numpy(), cfg, 8, preconditioner=a)
    assert not torch.allclose(unscaled.delta, scaled_a.delta)


def test_local_disk_settings_reach_the_optimizer(small_config):
    cfg = small_config("client.sample_dp.disk_kappa=0.7", "client.sample_dp.disk_gamma=-1")
    made = sample_dp_config(cfg.client.sample_dp)
    assert (made.disk_kappa, made.disk_gamma) == (0.7, -1.0)
