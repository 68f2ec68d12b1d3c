"""Noise placements: the released model carries the configured noise wherever it is drawn (issue 4)."""

import math

import pandas as pd
import pytest
import torch

from fedprivacy.config import ConfigError
from fedprivacy.fl.server_app import build_strategy
from fedprivacy.privacy.accounting import GaussianRound, PrivacyLedger, epsilon
from fedprivacy.privacy.aggregation import PrivateSum
from fedprivacy.privacy.noise import GaussianNoise
from fedprivacy.privacy.placement import (client_noise_std, local_upload_event, privatize_upload_,
                                          released_noise_variance)
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task
from fedprivacy.updates import SparseUpdate

D, Z, C, M = 200_000, 1.5, 2.0, 8


def _released(placement: str, shares: int, seed: int = 0) -> torch.Tensor:
    """g_t when ``shares`` clients upload a zero update under ``placement``."""
    agg = PrivateSum(D, clip_norm=C, noise_multiplier=Z, expected_cohort=M, placement=placement)
    std = client_noise_std(placement, Z, C, M)
    for i in range(shares):
        upload = privatize_upload_(torch.zeros(D), C, std, GaussianNoise(seed, stream=(1, i)))
        agg.add_(SparseUpdate.dense(upload))
    return agg.release(GaussianNoise(seed))


@pytest.mark.parametrize("placement,shares", [("central", M), ("distributed", M), ("distributed", 3),
                                              ("distributed", 0)])
def test_released_average_carries_the_full_noise(placement, shares):
    """std of g_t = zC/m: m client shares of N(0, z^2C^2/m), or fewer shares topped up by the server."""
    g = _released(placement, shares)
    assert float(g.std()) == pytest.approx(Z * C / M, rel=0.01)


def test_local_noise_is_per_upload_and_the_server_adds_none():
    g = _released("local", 5)
    assert float(g.std()) == pytest.approx(math.sqrt(5) * Z * C / M, rel=0.01)
    agg = PrivateSum(D, clip_norm=C, noise_multiplier=Z, expected_cohort=M, placement="local")
    assert agg.server_noise_std() == 0.0


def test_client_clips_the_vector_it_sends_and_server_does_not_reclip():
    u = torch.full((D,), 1.0)
    sent = privatize_upload_(u.clone(), C, 0.0, GaussianNoise(0))
    assert float(sent.norm()) == pytest.approx(C, rel=1e-4)
    agg = PrivateSum(D, clip_norm=C, noise_multiplier=0.0, expected_cohort=1, placement="distributed")
    agg.add_(SparseUpdate.dense(u.clone()))  # a noised upload is far above C: kept whole
    assert torch.equal(agg.release(GaussianNoise(0)), u)


def test_client_shares_use_generators_disjoint_from_the_server_and_each_other():
    draws = []
    for stream in [(), (1, 0), (1, 1), (2, 0)]:
        x = torch.zeros(1000)
        GaussianNoise(7, stream=stream).add_(x, 1.0)
        draws.append(x)
    for i in range(len(draws)):
        for j in range(i + 1, len(draws)):
            assert abs(float(torch.corrcoef(torch.stack([draws[i], draws[j]]))[0, 1])) < 0.15


def test_released_noise_variance_by_placement():
    assert released_noise_variance("central", Z, C, M) == pytest.approx((Z * C / M) ** 2)
    assert released_noise_variance("distributed", Z, C, M) == pytest.approx((Z * C / M) ** 2)
    assert released_noise_variance("local", Z, C, M) == pytest.approx(Z ** 2 * C ** 2 / M)


def test_placement_refused_with_adaptive_clipping(small_config):
    with pytest.raises(ConfigError, match="privacy.placement"):
        small_config("privacy.placement=local", "privacy.adaptive_clipping.target_quantile=0.5")


@pytest.mark.parametrize("placement", ["distributed", "local"])
def test_zero_updates_release_exactly_the_placement_noise(small_config, placement):
    """End to end with client lr 0: the model's change in round 1 is pure noise of std zC/m (distributed,
    at least m shares of N(0, z^2C^2/m)) or sqrt(n) zC/m (local, n uploads)."""
    cfg = small_config("rounds=1", "client.lr=0", "server.momentum=0", f"privacy.placement={placement}",
                       "privacy.noise_multiplier=2.0")
    summary = run(cfg)
    start = torch.load(cfg.output_dir / "initial_model.pt")
    end = torch.load(cfg.output_dir / "final_model.pt")
    change = torch.cat([(end[k] - start[k]).flatten() for k in start])
    n = summary["cohort_accepted"]
    m = cfg.privacy.expected_cohort
    variance_in_units = max(n, m) / m if placement == "distributed" else n  # of (zC)^2 on the sum
    expected = math.sqrt(variance_in_units) * 2.0 * 1.0 / m
    assert float(change.std()) == pytest.approx(expected, rel=0.02)


def test_local_placement_reports_each_clients_epsilon(small_config, tmp_path):
    cfg = small_config("rounds=3", "privacy.placement=local", "privacy.noise_multiplier=4.0")
    summary = run(cfg)
    clients = pd.read_csv(cfg.output_dir / "client_privacy.csv")
    metrics = pd.read_csv(cfg.output_dir / "metrics.csv")
    assert clients["releases"].sum() == metrics["cohort_received"].sum()
    for _, row in clients.iterrows():
        ledger = PrivacyLedger([(GaussianRound(2.0, "none", 1, 1.0), int(row["releases"]))])
        assert row["epsilon_rdp"] == pytest.approx(epsilon(ledger, summary["delta"], "rdp"))
    assert summary["client_epsilon_max"] == pytest.approx(clients["epsilon_rdp"].max())
    assert local_upload_event(4.0) == GaussianRound(2.0, "none", 1, 1.0)
    # resuming keeps every client's ledger
    part = small_config("rounds=2", "privacy.placement=local", "privacy.noise_multiplier=4.0",
                        f"output_dir={tmp_path / 'part'}")
    run(part)
    resumed = small_config("rounds=3", "privacy.placement=local", "privacy.noise_multiplier=4.0",
                           f"output_dir={tmp_path / 'part'}")
    run(resumed, resume=True)
    assert pd.read_csv(tmp_path / "part" / "client_privacy.csv").equals(clients)


def test_adambc_phi_follows_the_placement(small_config):
    cfg = small_config("server.optimizer=adambc", "server.lr=0.01", "privacy.placement=local")
    task = load_task(cfg.data)
    model = task.new_model()
    opt = build_strategy(cfg, task.population, model).optimizer
    p = cfg.privacy
    assert opt.phi == pytest.approx(p.noise_multiplier ** 2 * p.clip_norm ** 2 / p.expected_cohort)
