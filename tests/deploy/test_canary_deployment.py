"""``fedprivacy deploy local`` with ``privacy.canaries``: a real SuperLink and 3 + 4 SuperNodes (TLS, SuperNode auth),
the users' and then one per canary (a canary's node runs the same ClientApp, which answers with the canary's
update); the canaries are counted in the population and sampled like users, and the run writes both estimates of
both scores (about a minute)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from fedprivacy.config import build_config
from fedprivacy.data.synthetic import generate
from fedprivacy.deploy.local import deploy_local
from fedprivacy.experiments.canary_report import estimates_line

pytestmark = pytest.mark.slow

USERS, CANARIES = 3, 4


def test_a_deployment_with_canaries_writes_both_estimates(tmp_path: Path):
    data = tmp_path / "so3"
    generate(data, num_clients=USERS, seed=1)
    cfg = build_config({
        "rounds": 3, "eval_every": 3, "output_dir": str(tmp_path / "run"), "seed": 3,
        "data": {"path": str(data), "generate_if_missing": False, "vocab_size": 2000, "num_tags": 50},
        "client": {"epochs": 1, "batch_size": 10, "lr": 5.0},
        "privacy": {"clip_norm": 1.0, "noise_multiplier": 1.0, "expected_cohort": USERS, "delta": 1e-5,
                    "accountants": ["rdp", "pld"], "budget_accountant": "pld",
                    "canaries": {"count": CANARIES, "unused": 10, "seed": 1, "every_round": True}},
    })
    lines: list[str] = []
    summary = deploy_local(cfg, USERS, secure=True, reproducible=True, timeout=600, printer=lines.append)

    assert summary["engine"] == "deployment" and summary["rounds_completed"] == 3
    assert summary["deployment"]["secure"] is True and len(set(summary["deployment"]["node_ids"])) == USERS + CANARIES
    assert summary["population"] == USERS + CANARIES  # the claim's population counts the canaries
    assert f"cohort 3 of {USERS + CANARIES} users" in summary["privacy_claim"]
    metrics = pd.read_csv(Path(cfg.output_dir) / "metrics.csv")
    # q = 3/7 of 7 members: the cohorts count sampled canaries too; a canary never drops out
    assert metrics["cohort_sampled"].sum() > 0 and (metrics["cohort_dropped"] == 0).all()
    e = summary["empirical_epsilon"]
    included = e["included"]
    assert e["canaries"] == CANARIES and e["epsilon_claimed"] == summary["epsilon_pld"]
    for scored in (e, e["every_round"]):
        assert scored["andrew"]["inserted"] == included and scored["andrew"]["unobserved"] == CANARIES - included + 10
        assert scored["steinke"]["guesses"] == 2 and scored["steinke"]["epsilon_lower_bound"] <= summary["epsilon_pld"]
    assert estimates_line(e).endswith(f"accountant {summary['epsilon_pld']:.2f} (pld)")
