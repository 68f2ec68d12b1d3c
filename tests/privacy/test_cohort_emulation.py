"""Large-cohort emulation: noise as for cohort M, epsilon for that deployment, stated as such."""

import pytest
import torch

from fedprivacy.config import ConfigError
from fedprivacy.fl.server_app import resolve_noise_multiplier
from fedprivacy.privacy.accounting import epsilon, epsilon_for
from fedprivacy.privacy.mechanism import planned_ledger
from fedprivacy.fl.server_app import noise_stream_of
from fedprivacy.run import run


def test_noise_is_scaled_to_the_emulated_cohort_and_the_claim_names_the_deployment(small_config):
    z, clip, m, big_m, big_n = 1.0, 0.5, 8, 400, 100_000
    cfg = small_config("rounds=2", "client.lr=0", "server.momentum=0", f"privacy.noise_multiplier={z}",
                       f"privacy.clip_norm={clip}", f"privacy.expected_cohort={m}", f"privacy.noise_cohort={big_m}",
                       f"privacy.noise_population={big_n}")
    summary = run(cfg)
    final, initial = torch.load(cfg.output_dir / "final_model.pt"), torch.load(cfg.output_dir / "initial_model.pt")
    change = torch.cat([(final[k] - initial[k]).reshape(-1) for k in final])
    # two rounds of noise z C m / M on the sum, divided by m: per-round std z C / M
    assert float(change.std()) == pytest.approx(z * clip / big_m * 2**0.5, rel=0.01)
    expected = epsilon_for("poisson", big_m / big_n, z, 2, 1 / big_n, "rdp")
    assert summary["epsilon_rdp"] == pytest.approx(expected, rel=1e-12)
    assert summary["delta"] == pytest.approx(1 / big_n)
    claim = summary["privacy_claim"]
    assert "DEPLOYMENT" in claim and str(big_m) in claim and str(big_n) in claim and "NOT" in claim


def test_plain_runs_claim_their_own_cohort(small_config):
    assert "DEPLOYMENT" not in run(small_config("rounds=1"))["privacy_claim"]


@pytest.mark.parametrize("overrides,field", [
    (("privacy.noise_cohort=4",), "noise_cohort"),
    (("privacy.noise_population=100",), "noise_population"),
    (("privacy.noise_cohort=100", "privacy.noise_population=50"), "noise_population"),
])
def test_inconsistent_emulation_settings_are_refused(small_config, overrides, field):
    with pytest.raises(ConfigError, match=field):
        small_config(*overrides)


def test_auto_calibrates_an_emulated_correlated_deployment_to_its_own_budget(small_config):
    """BandMF on cyclic Poisson, emulating 50 of 20,000 users per round: z is calibrated on the deployment's events."""
    cfg = small_config("rounds=12", "privacy.noise_multiplier=auto", "privacy.target_epsilon=4",
                       "privacy.accountants=[rdp]", "privacy.sampling=cyclic_poisson", "privacy.groups=4",
                       "privacy.mechanism.kind=bandmf", "privacy.mechanism.bands=4", "privacy.expected_cohort=4",
                       "privacy.noise_cohort=50", "privacy.noise_population=20000")
    z = resolve_noise_multiplier(cfg, population=40).privacy.noise_multiplier
    deployment = planned_ledger(z, 12, expected_cohort=50, population=20_000, sampling="cyclic_poisson", groups=4,
                                noise_stream=noise_stream_of(cfg))
    assert 0.99 * 4 <= epsilon(deployment, 1 / 20_000, "rdp") <= 4
