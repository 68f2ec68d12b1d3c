"""Adaptive clipping (invariant 7): the quantile estimate is privatized and its cost composed."""

import numpy as np
import pandas as pd
import pytest
import torch

from fedprivacy.config import ConfigError
from fedprivacy.privacy.adaptive_clipping import AdaptiveClip, value_noise_multiplier
from fedprivacy.privacy.noise import GaussianNoise
from fedprivacy.run import run


@pytest.mark.parametrize("z,sigma_b", [(0.5, 5.0), (1.0, 1.0), (1.9, 1.0)])
def test_value_and_count_noise_compose_to_the_configured_multiplier(z, sigma_b):
    zv = value_noise_multiplier(z, sigma_b)
    assert zv > z  # the value noise is inflated to pay for the count
    assert (zv**-2 + (2 * sigma_b) ** -2) ** -0.5 == pytest.approx(z, rel=1e-12)


def test_impossible_split_is_rejected_with_the_field_named():
    with pytest.raises(ValueError, match="clipped_count_stddev"):
        value_noise_multiplier(2.0, 1.0)


def test_clip_norm_tracks_the_target_quantile_of_a_norm_stream():
    rng = np.random.default_rng(0)
    noise = GaussianNoise(0)
    m, target = 100, 0.3
    clip = AdaptiveClip(0.05, target_quantile=target, learning_rate=0.2, count_stddev=m / 20, expected_cohort=m)
    history = []
    for _ in range(400):
        norms = rng.lognormal(mean=0.0, sigma=0.5, size=rng.poisson(m))
        clip.update_(int((norms <= clip.clip_norm).sum()), len(norms), noise)
        history.append(clip.clip_norm)
    true_quantile = float(np.exp(0.5 * -0.5244))  # lognormal(0, 0.5) 30% quantile: exp(sigma * z_0.3)
    assert np.mean(history[-100:]) == pytest.approx(true_quantile, rel=0.08)
    assert history[0] < 0.1 < true_quantile  # it had to travel from 0.05


def test_count_release_is_noised_from_the_dedicated_generator():
    a = AdaptiveClip(1.0, target_quantile=0.5, learning_rate=0.2, count_stddev=5.0, expected_cohort=100)
    b = AdaptiveClip(1.0, target_quantile=0.5, learning_rate=0.2, count_stddev=5.0, expected_cohort=100)
    fa = a.update_(50, 100, GaussianNoise(1))
    fb = b.update_(50, 100, GaussianNoise(2))
    assert fa != fb and abs(fa - 0.5) < 0.5  # noise of std 5/100 on the fraction
    c = AdaptiveClip(1.0, target_quantile=0.5, learning_rate=0.2, count_stddev=5.0, expected_cohort=100)
    assert c.update_(50, 100, GaussianNoise(1), noise_free=True) == 0.5


def test_adaptive_run_is_accounted_like_the_fixed_clip_run_and_moves_the_clip(small_config, tmp_path):
    fixed = small_config("rounds=4", f"output_dir={tmp_path / 'fixed'}")
    adaptive = small_config("rounds=4", "privacy.adaptive_clipping={target_quantile: 0.5, learning_rate: 0.5}",
                            "privacy.clip_norm=0.01", f"output_dir={tmp_path / 'adaptive'}")
    s_fixed, s_adaptive = run(fixed), run(adaptive)
    assert s_adaptive["epsilon_rdp"] == s_fixed["epsilon_rdp"]
    assert s_adaptive["epsilon_pld"] == s_fixed["epsilon_pld"]
    clips = pd.read_csv(tmp_path / "adaptive" / "metrics.csv")["clip_norm"].tolist()
    assert clips[0] == pytest.approx(0.01) and clips[-1] > clips[0]  # everything clipped at 0.01: C grows
    state = torch.load(tmp_path / "adaptive" / "checkpoint.pt", weights_only=False)["adaptive_clip"]
    assert state["clip_norm"] > clips[-1]  # C_5 after the last update is in the checkpoint


def test_value_noise_is_the_inflated_multiplier(small_config):
    z, m, c0 = 1.0, 8, 0.5
    cfg = small_config("rounds=1", "client.lr=0", f"privacy.noise_multiplier={z}", f"privacy.clip_norm={c0}",
                       f"privacy.expected_cohort={m}", "privacy.adaptive_clipping={clipped_count_stddev: 1.0}",
                       "server.momentum=0")
    run(cfg)
    final = torch.load(cfg.output_dir / "final_model.pt")
    initial = torch.load(cfg.output_dir / "initial_model.pt")
    change = torch.cat([(final[k] - initial[k]).reshape(-1) for k in final])
    assert float(change.std()) == pytest.approx(value_noise_multiplier(z, 1.0) * c0 / m, rel=0.01)


def test_adambc_with_adaptive_clipping_uses_each_rounds_phi(small_config):
    """Phi_t = (z_value C_t / m)^2 with the clip norm C_t each round used; the optimizer's EMA holds them."""
    cfg = small_config("rounds=3", "server.optimizer=adambc", "server.lr=0.01", "privacy.adaptive_clipping={}")
    run(cfg)
    clips = pd.read_csv(cfg.output_dir / "metrics.csv")["clip_norm"].tolist()
    p = cfg.privacy
    z_value = value_noise_multiplier(p.noise_multiplier, p.count_stddev)
    phis = [(z_value * c / p.expected_cohort) ** 2 for c in clips]
    assert len(set(phis)) == 3  # the clip norm moved every round
    state = torch.load(cfg.output_dir / "checkpoint.pt", weights_only=False)["optimizer"]
    b2 = cfg.server.beta2 if cfg.server.beta2 is not None else 0.999
    ema = sum((1 - b2) * b2 ** (3 - k) * phi for k, phi in enumerate(phis, start=1))
    assert state["phi"] == pytest.approx(phis[-1], rel=1e-9) and state["phi_ema"] == pytest.approx(ema, rel=1e-9)


def test_adaptive_clipping_refuses_a_multiplier_it_cannot_compose(small_config):
    with pytest.raises(ConfigError, match="clipped_count_stddev"):
        small_config("privacy.noise_multiplier=3", "privacy.adaptive_clipping={clipped_count_stddev: 1.0}")
