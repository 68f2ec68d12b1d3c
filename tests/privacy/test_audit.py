"""The privacy audit: valid statistics, passes on the real server, FAILS on broken ones (issue 4)."""

import json
import math

import numpy as np
import pytest

from fedprivacy.audit import BROKEN_VARIANTS, run_audit
from fedprivacy.cli import BROKEN_VARIANT_NAMES, main
from fedprivacy.config import build_config
from fedprivacy.privacy.audit_stats import best_threshold, clopper_pearson_upper, epsilon_lower_bound

TRIALS = 200
# 2,010 parameters, cohort 4, z = 2 (one-round claim 1.99 under PLD at delta 1e-5). Adam with a
# tiny tau is nonlinear in its input, which is what makes noise-after-the-optimizer detectable.
AUDIT = {"data": {"vocab_size": 200, "num_tags": 10},
         "privacy": {"clip_norm": 1.0, "noise_multiplier": 2.0, "expected_cohort": 4}}
ADAM = ["server.optimizer=adam", "server.lr=0.1", "server.tau=1e-6"]


def _cfg(*overrides):
    return build_config(AUDIT, list(overrides), source="test")


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


def test_cli_names_exactly_the_audit_variants():
    assert set(BROKEN_VARIANT_NAMES) == set(BROKEN_VARIANTS)


@pytest.mark.parametrize("overrides", [[], ADAM], ids=["fedavgm", "fedadam"])
def test_audit_passes_on_the_real_server(overrides):
    report = run_audit(_cfg(*overrides), trials=TRIALS)
    assert report.passed and report.epsilon_lower_bound < report.epsilon_claimed
    assert report.epsilon_claimed == pytest.approx(1.99, abs=0.01)


@pytest.mark.parametrize("overrides", [[], ADAM], ids=["fedavgm", "fedadam"])
def test_audit_fails_with_the_noise_switched_off(overrides):
    report = run_audit(_cfg(*overrides), trials=TRIALS, variant="noise_off")
    assert not report.passed and report.epsilon_lower_bound > report.epsilon_claimed


def test_audit_fails_with_the_noise_added_after_the_adaptive_optimizer():
    report = run_audit(_cfg(*ADAM), trials=TRIALS, variant="noise_after_optimizer")
    assert not report.passed and report.epsilon_lower_bound > report.epsilon_claimed


def test_audit_command_exit_status(tmp_path, capsys):
    cfg = tmp_path / "audit.yaml"
    cfg.write_text(json.dumps(AUDIT))  # JSON is YAML
    args = ["audit", str(cfg), "--trials", str(TRIALS), *sum((["--set", o] for o in ADAM), [])]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True
    assert main([*args, "--break", "noise_after_optimizer"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["passed"] is False and "audit FAILED" in captured.err


def test_audit_rejects_unknown_variant_and_too_few_trials():
    with pytest.raises(ValueError, match="variant"):
        run_audit(_cfg(), trials=TRIALS, variant="nope")
    with pytest.raises(ValueError, match="trials"):
        run_audit(_cfg(), trials=1)
