"""examples/digits: a Flower App on scikit-learn's bundled digits (issue 22, item 4). It must train
above its majority baseline under DP and report epsilon, through fedprivacy's public API only."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn")

APP = Path(__file__).parents[2] / "examples" / "digits"
REPORT = re.compile(r"test accuracy ([\d.]+) \(majority baseline ([\d.]+)\).* epsilon ([\d.]+|inf) \(RDP\), "
                    r"([\d.]+|inf|none) \(PLD\)")


def _run(*overrides: str) -> tuple[float, float, float, float]:
    args = [sys.executable, str(APP / "run.py"), "-q"] + [a for o in overrides for a in ("-c", o)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=APP)
    assert out.returncode == 0, out.stderr[-3000:]
    match = REPORT.search(out.stdout)
    assert match, out.stdout[-2000:]
    return tuple(float("nan") if g == "none" else float(g) for g in match.groups())


@pytest.mark.slow
def test_the_default_run_trains_well_above_the_majority_baseline_under_single_digit_epsilon():
    accuracy, baseline, eps_rdp, eps_pld = _run()
    assert baseline == pytest.approx(0.1, abs=0.01)
    assert accuracy > baseline + 0.5
    assert math.isfinite(eps_rdp) and 0 < eps_pld <= eps_rdp < 10


@pytest.mark.slow
def test_distributed_noise_from_the_client_mod_also_learns():
    accuracy, baseline, eps_rdp, _ = _run("noise-placement='distributed' num-server-rounds=20")
    assert accuracy > baseline + 0.3
    assert math.isfinite(eps_rdp) and eps_rdp > 0


def test_the_app_is_a_valid_flower_app_with_no_legacy_federations_table():
    from flwr.cli.config_utils import load_and_validate

    sys.path.insert(0, str(APP))
    try:
        config, _ = load_and_validate(APP / "pyproject.toml", check_module=True)
    finally:
        sys.path.remove(str(APP))
    assert config["tool"]["flwr"]["app"]["components"] == {"serverapp": "digits.server_app:app",
                                                           "clientapp": "digits.client_app:app"}
    assert "federations" not in config["tool"]["flwr"]  # `flwr run` would rewrite the file to migrate it


def test_the_users_data_is_non_iid_deterministic_and_disjoint_from_the_test_set():
    sys.path.insert(0, str(APP))
    try:
        from digits.task import load_user, test_set
    finally:
        sys.path.remove(str(APP))
    users = [load_user(u, 100) for u in range(100)]
    assert sum(len(y) for _, y in users) + len(test_set()[1]) == 1797
    assert sum(len(set(y.tolist())) <= 2 for _, y in users) >= 90  # most users hold one or two digits
    x0, y0 = load_user(0, 100)
    assert (x0 == users[0][0]).all() and (y0 == users[0][1]).all()


@pytest.mark.slow
def test_the_app_runs_under_flwr_run_on_flowers_simulation_engine(tmp_path, flwr_cli):
    """The same App, unchanged, under `flwr run` (Flower's local SuperLink and Simulation Engine)."""
    flwr, env = flwr_cli
    out = subprocess.run([str(flwr), "run", str(APP), "--stream", "--run-config",
                          "num-users=10 expected-cohort=5 num-server-rounds=3",
                          "--federation-config", "num-supernodes=10"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    match = REPORT.search(out.stdout + out.stderr)
    assert match, (out.stdout + out.stderr)[-3000:]
    accuracy, _, eps_rdp, eps_pld = map(float, match.groups())
    assert 0 < eps_pld <= eps_rdp < math.inf and 0 <= accuracy <= 1


@pytest.mark.slow
def test_secure_aggregation_from_the_app_config_also_learns():
    """The same Flower App (what `flwr run .` runs) with SecAgg+ and Skellam shares: the server sees only masked
    uploads; the app reports RDP (PLD does not model Skellam rounds)."""
    accuracy, baseline, eps_rdp, eps_pld = _run("noise-placement='distributed' secure-aggregation=true "
                                                "num-server-rounds=15")
    assert accuracy > baseline + 0.3
    assert math.isfinite(eps_rdp) and eps_rdp > 0 and math.isnan(eps_pld)

