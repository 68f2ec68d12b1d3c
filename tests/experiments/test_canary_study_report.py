"""A study's report shows the canary estimates of its runs with ``privacy.canaries`` (stored fake runs)."""

import json
import math

import numpy as np

from fedprivacy.experiments.canary_report import estimate_columns
from fedprivacy.experiments.report import write_report
from test_results import _fake_study


def test_a_study_report_shows_the_estimates_of_the_runs_with_canaries(tmp_path):
    study, specs, _ = _fake_study(tmp_path / "fake")
    report = write_report(tmp_path / "fake").read_text()
    assert "Empirical epsilon of the runs with canary clients" not in report
    first = tmp_path / "fake" / "runs" / specs[0].run_id / "summary.json"
    fake = {"andrew": {"epsilon": 1.25, "interval": [0.5, 2.0]}, "steinke": {"epsilon_lower_bound": 0.0}}
    summary = {**json.loads(first.read_text()), "empirical_epsilon": {**fake, "every_round": {
        "andrew": {"epsilon": 3.5, "interval": [2.0, 5.0]}, "steinke": {"epsilon_lower_bound": 0.75}}}}
    first.write_text(json.dumps(summary))
    report = write_report(tmp_path / "fake").read_text()
    row = next(r for r in report.splitlines() if r.startswith(f"| {specs[0].run_id} |"))
    assert row.endswith("| 1.25 | 0 | 3.5 | 0.75 |")
    assert report.count("\n| " + specs[1].run_id + " | ") == 1  # a run without canaries: its row reads "-"
    assert estimate_columns(summary) == {"canary_andrew_final": 1.25, "canary_steinke_final": 0.0,
                                         "canary_andrew_every_round": 3.5, "canary_steinke_every_round": 0.75}
    assert all(math.isnan(v) for v in estimate_columns({"rounds_completed": 3}).values())
    assert np.isnan(estimate_columns(None)["canary_andrew_final"])
