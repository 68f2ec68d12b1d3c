"""Secure aggregation with distributed Skellam noise through ``fedprivacy run`` and the config (issue "Secure
aggregation", items 2 and 3): every release is a Skellam round of the survivors' shares, ``fedprivacy epsilon``
gives the run's epsilon, the summary says what the server sees, and the settings it cannot account are refused
naming the field."""

import csv
import io
import json
from contextlib import redirect_stdout

import pytest

from fedprivacy.cli import main as cli
from fedprivacy.config import ConfigError
from fedprivacy.deploy.local import deployment_config, secure_aggregation_defaults
from fedprivacy.privacy.release_log import ReleaseLog
from fedprivacy.privacy.skellam_accounting import SkellamRound
from fedprivacy.run import run

SECAGG = ("privacy.placement=distributed", "privacy.secure_aggregation.threshold=3",
          "privacy.secure_aggregation.neighbours=5", "privacy.accountants=[rdp]")


def test_a_secure_run_accounts_skellam_rounds_as_fedprivacy_epsilon_does(small_config):
    cfg = small_config("rounds=2", *SECAGG)
    summary = run(cfg)
    with open(cfg.output_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    events = [entry["event"] for entry in ReleaseLog(cfg.output_dir).entries]
    assert summary["releases"] == 2 and all(isinstance(e, SkellamRound) for e in events)
    survivors = [int(float(r["secagg_survivors"])) for r in rows]
    assert [float(r["server_noise_std"]) for r in rows] == [0.0, 0.0]  # the server adds nothing
    assert "SecAgg+" in summary["privacy_claim"] and "masked" in summary["privacy_claim"]
    q = cfg.privacy.expected_cohort / summary["population"]
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        assert cli(["epsilon", "--sampling", "poisson", "--q", str(q), "--noise-multiplier",
                    str(cfg.privacy.noise_multiplier), "--steps", "2", "--delta", str(summary["delta"]),
                    "--skellam-dim", "100050", "--bits", "20", "--clip-norm", "1.0",
                    "--expected-cohort", str(cfg.privacy.expected_cohort),
                    "--survivors", ",".join(map(str, survivors))]) == 0
    out = json.loads(buffer.getvalue())
    assert out["epsilon"]["rdp"] == pytest.approx(summary["epsilon_rdp"], rel=1e-12)
    assert out["epsilon"]["pld"] is None and out["epsilon"]["prv"] is None  # they do not model Skellam noise


@pytest.mark.parametrize("override, field", [
    ("privacy.placement=central", "privacy.placement"),
    ("privacy.sampling=fixed", "privacy.sampling"),
    ("privacy.budget_accountant=pld", "privacy.budget_accountant"),
    ("privacy.secure_aggregation.threshold=7", "threshold"),
    ("privacy.secure_aggregation.neighbours=4", "neighbours"),
    ("privacy.secure_aggregation.threshold=2", "privacy.secure_aggregation.threshold"),  # 2 t > k needed
    ("privacy.secure_aggregation.bits=40", "bits"),
    ("client.compression.density=0.1", "client.compression"),
    ("processes=2", "processes"),
])
def test_settings_secure_aggregation_cannot_account_are_refused_naming_the_field(small_config, override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        small_config(*SECAGG, "privacy.accountants=[rdp, pld]", override)


def test_deploy_secure_aggregation_sets_distributed_placement_rdp_and_a_neighbourhood_for_the_cohort(small_config):
    cfg = small_config("privacy.expected_cohort=5")
    deployed = deployment_config(cfg, 10, 20, secure_aggregation=True)
    p = deployed.privacy
    assert p.placement == "distributed" and p.budget_accountant == "rdp" and p.accountants == ("rdp",)
    assert (p.secure_aggregation.threshold, p.secure_aggregation.neighbours) == (4, 5)
    assert [secure_aggregation_defaults(m) for m in (2, 3, 6, 50)] == [
        {"neighbours": 3, "threshold": 2}, {"neighbours": 3, "threshold": 2}, {"neighbours": 5, "threshold": 4},
        {"neighbours": 7, "threshold": 5}]


def test_the_secure_aggregation_example_runs_learns_and_reports_its_skellam_epsilon(tmp_path):
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).parents[2] / "examples" / "secure_aggregation.py"
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    found = re.search(r"accuracy ([\d.]+) .* epsilon ([\d.]+) .* after (\d+) Skellam rounds, (\d+) aborted", out.stdout)
    accuracy, eps, rounds, aborted = found.groups()
    # Poisson cohorts of mean 10 from 50 users fall below the threshold of 4 with probability 0.0057 per round
    # (about 1 run in 18 has an aborted round): such a round is neither released nor accounted.
    assert float(accuracy) > 0.75 and int(rounds) + int(aborted) == 10 and int(aborted) <= 2 and 0 < float(eps) < 20


def test_auto_calibrates_on_the_fewest_shares_a_round_can_release_with_and_never_exceeds_the_target(small_config):
    """The budget check assumes the next round completes with only ``threshold`` shares (whoever drops out, the
    run never exceeds the target); ``auto`` calibrates on the same worst case, so the run is not stopped early and
    spends less than the target when more clients survive."""
    cfg = small_config("rounds=3", *SECAGG, "privacy.noise_multiplier=auto", "privacy.target_epsilon=4")
    summary = run(cfg)
    assert summary["rounds_completed"] == 3 and summary["stop_reason"] == "rounds"
    assert summary["epsilon_rdp"] <= 4.0
    tight = small_config("rounds=3", *SECAGG, f"privacy.noise_multiplier={summary['noise_multiplier'] * 0.8}",
                         "privacy.target_epsilon=4", f"output_dir={cfg.output_dir}-tight")
    assert run(tight)["stop_reason"] == "privacy_budget"  # less noise: the worst case of a round would exceed it


def test_the_audit_refuses_a_secure_aggregation_config_naming_it(small_config):
    from fedprivacy.audit import run_audit

    with pytest.raises(ValueError, match="privacy.secure_aggregation"):
        run_audit(small_config(*SECAGG), trials=10)


def test_a_seeded_secure_simulation_is_reproducible_although_keys_and_masks_are_fresh(small_config, tmp_path):
    """Keys, the neighbour ring and the masks come from the OS every round, but the masks cancel exactly modulo
    2^b: with the same seed (rounding, Skellam shares and rotation seeded) two runs release the same model."""
    import torch

    models = []
    for name in ("a", "b"):
        cfg = small_config("rounds=2", *SECAGG, f"output_dir={tmp_path / name}")
        run(cfg)
        models.append(torch.load(tmp_path / name / "final_model.pt"))
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
