"""The privacy audit: valid statistics, passes on the real server, FAILS on every broken one (issues 4, 21)."""

import json
import math

import numpy as np
import pytest

from fedprivacy.audit import BROKEN_VARIANTS, run_audit
from fedprivacy.cli import BROKEN_VARIANT_NAMES, main
from fedprivacy.config import build_config
from fedprivacy.privacy.accounting import GaussianRound, PrivacyLedger, epsilon
from fedprivacy.privacy.audit_stats import (best_threshold, clopper_pearson_upper, epsilon_lower_bound, gaussian_fit,
                                            gdp_delta, gdp_epsilon)
from fedprivacy.privacy.noise import GaussianNoise
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task

TRIALS = 200
# 2,010 parameters, cohort 4, z = 2 (one-round claim 1.99 under PLD at delta 1e-5, mu = 0.5). Adam with
# a tiny tau is nonlinear in its input, which is what makes noise-after-the-optimizer detectable.
AUDIT = {"data": {"vocab_size": 200, "num_tags": 10},
         "privacy": {"clip_norm": 1.0, "noise_multiplier": 2.0, "expected_cohort": 4}}
ADAM = ["server.optimizer=adam", "server.lr=0.1", "server.tau=1e-6"]


def _cfg(*overrides):
    return build_config(AUDIT, list(overrides), source="test")


# -- statistics -------------------------------------------------------------------------------
def test_clopper_pearson_upper_closed_form_at_zero_successes():
    # P(Bin(n, p) = 0) = (1 - p)^n = alpha at the bound.
    n, alpha = 160, 0.025
    assert clopper_pearson_upper(0, n, alpha) == pytest.approx(1 - alpha ** (1 / n), rel=1e-9)
    assert clopper_pearson_upper(n, n, alpha) == 1.0


def test_lower_bound_is_zero_when_the_test_is_no_better_than_chance():
    assert epsilon_lower_bound(50, 100, 50, 100, delta=1e-5) == 0.0


def test_lower_bound_for_perfect_separation_is_the_binomial_limit():
    n, alpha, delta = 160, 0.05, 1e-5
    p = 1 - (alpha / 2) ** (1 / n)
    assert epsilon_lower_bound(0, n, 0, n, delta, alpha) == pytest.approx(math.log((1 - delta - p) / p))


def test_lower_bound_respects_the_gaussian_mechanism_it_audits():
    """Scores of the exact Gaussian mechanism at sensitivity 1, sigma 2: the bound stays below its epsilon."""
    rng = np.random.default_rng(0)
    n = 20_000
    s_in, s_out = rng.normal(1.0, 2.0, n), rng.normal(0.0, 2.0, n)
    t = best_threshold(s_in[:2000], s_out[:2000])
    lb = epsilon_lower_bound(int((s_out[2000:] > t).sum()), n - 2000, int((s_in[2000:] <= t).sum()), n - 2000, 1e-5)
    assert 0.2 < lb < 1.99  # informative, and below the mechanism's PLD epsilon


def test_gdp_delta_at_zero_epsilon_is_the_total_variation():
    # delta(0) = Phi(mu/2) - Phi(-mu/2) = TV(N(0,1), N(mu,1))
    assert gdp_delta(0.0, 1.0) == pytest.approx(0.3829249225480262, rel=1e-12)


@pytest.mark.parametrize("z", [0.5, 1.0, 2.0, 5.0])
def test_gdp_epsilon_is_the_pld_epsilon_of_one_gaussian_round(z):
    """mu = 1/z GDP is exactly one unsampled Gaussian round (dp_accounting's PLD, within its discretization)."""
    pld = epsilon(PrivacyLedger().compose(GaussianRound(z, "none", 4, 4.0)), 1e-5, "pld")
    assert gdp_epsilon(1 / z, 1e-5) == pytest.approx(pld, rel=2e-3)
    assert gdp_delta(gdp_epsilon(1 / z, 1e-5), 1 / z) == pytest.approx(1e-5, rel=1e-6)


def test_gdp_epsilon_known_values_and_limits():
    assert gdp_epsilon(1.0, 1e-5) == pytest.approx(4.3772, abs=1e-4)
    assert gdp_epsilon(0.5, 1e-5) == pytest.approx(1.9931, abs=1e-4)
    assert gdp_epsilon(0.0, 1e-5) == 0.0 and gdp_epsilon(math.inf, 1e-5) == math.inf


def test_gaussian_fit_lower_bound_covers_the_true_mu():
    """Exact Gaussian pairs at mu = 0.5: the 95% lower bound exceeds mu in about 5% of samples, never much more."""
    rng = np.random.default_rng(1)
    mu, n, reps, alpha = 0.5, 100, 400, 0.05
    misses = sum(gaussian_fit(rng.normal(mu, math.sqrt(2), n), alpha).mu_lower_bound > mu for _ in range(reps))
    assert misses <= 30  # Binomial(400, <= 0.05): mean <= 20, sd ~4.4
    fit = gaussian_fit(rng.normal(mu, math.sqrt(2), 100_000), alpha)
    assert fit.mu == pytest.approx(mu, abs=0.02) and fit.mu_lower_bound == pytest.approx(mu, abs=0.03)


def test_gaussian_fit_of_a_noiseless_mechanism_is_unbounded():
    assert gaussian_fit(np.full(50, 0.25), 0.05).mu_lower_bound > 100  # float-level spread only
    assert gaussian_fit(np.zeros(50), 0.05).mu_lower_bound == 0.0


# -- the audit --------------------------------------------------------------------------------
def test_cli_names_exactly_the_audit_variants():
    assert set(BROKEN_VARIANT_NAMES) == set(BROKEN_VARIANTS)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [[], ADAM], ids=["fedavgm", "fedadam"])
def test_audit_passes_on_the_real_server(overrides):
    report = run_audit(_cfg(*overrides), trials=TRIALS)
    assert report.passed and report.epsilon_lower_bound < report.epsilon_claimed
    assert report.epsilon_claimed == pytest.approx(1.99, abs=0.01) and report.mu_claimed == 0.5
    assert report.ratio_to_claim == pytest.approx(report.epsilon_lower_bound / report.epsilon_claimed)
    if not overrides:  # the Gaussian fit of the linear server is tight: more than half the claim
        assert report.ratio_to_claim > 0.5


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "overrides", "trials"), [
    ("noise_off", [], 20),
    ("noise_halved", [], TRIALS),
    ("realised_divisor", [], TRIALS),
    ("clip_after_sum", [], TRIALS),
    ("noise_after_optimizer", ADAM, 50),
    ("double_clip_half_noise", [], TRIALS),
    ("noise_over_cohort", [], 50),
])
def test_audit_fails_every_broken_server(variant, overrides, trials):
    report = run_audit(_cfg(*overrides), trials=trials, variant=variant)
    assert not report.passed and report.epsilon_lower_bound > report.epsilon_claimed
    assert report.ratio_to_claim > 1
    if variant == "noise_off":  # unbounded, written as strict JSON
        assert report.epsilon_lower_bound == math.inf and report.as_dict()["ratio_to_claim"] == "inf"
        json.loads(json.dumps(report.as_dict()), parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))


class UnderstatedNoise(GaussianNoise):
    """BROKEN on purpose: a plug-in stream that adds noise for z/4 while its event (the inherited one: the
    sampler's Gaussian of multiplier z) accounts z."""

    def std_factor(self, release: int) -> float:
        return 0.25


def test_the_audit_judges_a_stream_by_the_epsilon_its_run_reports(small_config):
    """The claim comes from the round's ledger: a stream that under-states its noise in its event passes a claim
    taken from its own std factor, and fails the one the run reports."""
    spec = f"privacy.noise_stream={__name__}:UnderstatedNoise"
    cfg = small_config("rounds=2", spec)
    summary = run(cfg)  # the run reports the event (z), not the noise it added (z / 4)
    accounted = GaussianRound(cfg.privacy.noise_multiplier, "poisson", load_task(cfg.data).population,
                              float(cfg.privacy.expected_cohort))
    assert summary["epsilon_rdp"] == pytest.approx(epsilon(PrivacyLedger([(accounted, 2)]), summary["delta"], "rdp"))
    report = run_audit(_cfg(spec), trials=50)
    assert report.epsilon_reported == pytest.approx(1.99, abs=0.01)  # the event: z = 2, one round, unamplified
    assert report.epsilon_of_release > 4 * report.epsilon_reported  # the noise actually added: z / 4
    assert report.epsilon_claimed == report.epsilon_reported
    assert not report.passed and report.epsilon_lower_bound > report.epsilon_reported


def test_the_correct_stream_meets_both_claims():
    report = run_audit(_cfg(), trials=20)
    assert report.epsilon_reported == pytest.approx(report.epsilon_of_release, rel=1e-9)
    assert report.epsilon_claimed == report.epsilon_reported


def test_audit_command_exit_status(tmp_path, capsys):
    cfg = tmp_path / "audit.yaml"
    cfg.write_text(json.dumps(AUDIT))  # JSON is YAML
    args = ["audit", str(cfg), "--trials", "50", *sum((["--set", o] for o in ADAM), [])]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True and 0 <= report["ratio_to_claim"] < 1
    assert main([*args, "--break", "noise_after_optimizer"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["passed"] is False and "audit FAILED" in captured.err


def test_audit_rejects_unknown_variant_and_too_few_trials():
    with pytest.raises(ValueError, match="variant"):
        run_audit(_cfg(), trials=TRIALS, variant="nope")
    with pytest.raises(ValueError, match="trials"):
        run_audit(_cfg(), trials=1)
