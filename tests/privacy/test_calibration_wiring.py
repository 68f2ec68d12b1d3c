"""Calibration from the config (``noise_multiplier: auto``) and the ``calibrate`` command (issue 4)."""

import json

import pytest
import yaml

from fedprivacy.cli import main
from fedprivacy.config import ConfigError
from fedprivacy.privacy.accounting import epsilon_for
from fedprivacy.run import run


def test_auto_needs_a_target(small_config):
    with pytest.raises(ConfigError, match="target_epsilon"):
        small_config("privacy.noise_multiplier=auto")


def test_unknown_noise_multiplier_word_is_named(small_config):
    with pytest.raises(ConfigError, match="privacy.noise_multiplier"):
        small_config("privacy.noise_multiplier=automatic")


def test_auto_run_spends_its_budget_within_one_percent(small_config):
    cfg = small_config("privacy.noise_multiplier=auto", "privacy.target_epsilon=20", "rounds=3",
                       "privacy.accountants=[rdp]")
    summary = run(cfg)
    assert summary["rounds_completed"] == 3 and summary["stop_reason"] == "rounds"
    resolved = yaml.safe_load((cfg.output_dir / "config.yaml").read_text())
    z = resolved["privacy"]["noise_multiplier"]
    assert isinstance(z, float) and z > 0
    eps = epsilon_for("poisson", 8 / 40, z, 3, 1 / 40, "rdp", population=40)
    assert 0.99 * 20 <= eps <= 20
    assert summary["epsilon_rdp"] == pytest.approx(eps, rel=1e-9) and summary["noise_multiplier"] == z


def test_audit_refuses_auto(small_config):
    from fedprivacy.audit import run_audit

    with pytest.raises(ValueError, match="numeric privacy.noise_multiplier"):
        run_audit(small_config("privacy.noise_multiplier=auto", "privacy.target_epsilon=3"), trials=20)


def _calibrate(capsys, *args):
    assert main(["calibrate", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_calibrate_command_round_trips(capsys):
    """DP-MicroAdam's setting (q = 4096/45000, delta 1e-5): z for 537 steps lands within 1% below 8,
    and z = 1.56 affords 536 steps (537 is the first T over 8)."""
    common = ["--target-epsilon", "8", "--delta", "1e-5", "--sampling", "poisson", "--q", str(4096 / 45000)]
    out = _calibrate(capsys, *common, "--steps", "537")
    assert 0.99 * 8 <= out["epsilon"] <= 8
    out = _calibrate(capsys, *common, "--noise-multiplier", "1.56")
    assert out["steps"] == 536 and out["epsilon"] <= 8


def test_calibrate_command_needs_exactly_one_question(capsys):
    args = ["calibrate", "--target-epsilon", "8", "--delta", "1e-5", "--sampling", "poisson", "--q", "0.1"]
    assert main(args) == 2
    assert main([*args, "--steps", "5", "--noise-multiplier", "1"]) == 2
    assert "exactly one of --steps" in capsys.readouterr().err
