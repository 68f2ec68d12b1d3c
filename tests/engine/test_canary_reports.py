"""The canary estimates of a run where users read them (fedprivacy.experiments.canary_report): the every-round
statistic in summary.json (and in the checkpoint), the line at the end of `fedprivacy run`, `fedprivacy report` of a
run folder and of a study, and the docs table generated from a run's stored summary."""

import io
import math

import numpy as np
import pytest
import torch
from flwr.serverapp import ServerApp
from rich.console import Console

from fedprivacy.audit import BROKEN_VARIANTS
from fedprivacy.cli import main
from fedprivacy.config import CanaryConfig
from fedprivacy.engines.inprocess import run_inprocess
from fedprivacy.experiments.canary_report import RunSummaryError, estimate_columns, estimates_line, load_run_summary
from fedprivacy.experiments.docs import render_docs, stale_tables
from fedprivacy.experiments.progress import RunProgress
import fedprivacy.fl.canaries as canaries_module
from fedprivacy.fl.canaries import RunCanaries, population_with_canaries
from fedprivacy.fl.client_app import build_client_app
from fedprivacy.fl.server_app import DPFedAvgServer
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task

CANARIES = ("privacy.canaries={count: 40, unused: 100, seed: 3, every_round: true}", "privacy.delta=1e-5", "privacy.noise_multiplier=1.0",
            "privacy.budget_accountant=pld", "rounds=20", "eval_every=20", "checkpoint_every=20")


def test_a_run_reports_both_scores_where_users_read_them(small_config, tmp_path, capsys):
    cfg = small_config(*CANARIES)
    summary = run(cfg)
    e, claim = summary["empirical_epsilon"], summary["epsilon_pld"]
    every = e["every_round"]
    assert every["andrew"]["inserted"] == e["andrew"]["inserted"] and every["steinke"]["guesses"] == 20
    assert every["andrew"]["interval"][0] <= claim and every["steinke"]["epsilon_lower_bound"] <= claim
    assert every["andrew"]["epsilon"] != e["andrew"]["epsilon"]  # another score: the rounds' changes, not x_T - x_0

    line = estimates_line(e)
    a, s = e["andrew"], every["andrew"]
    assert line == (f"empirical epsilon (canaries): Andrew et al. {a['epsilon']:.2f} [{a['interval'][0]:.2f}, "
                    f"{a['interval'][1]:.2f}] final model, {s['epsilon']:.2f} [{s['interval'][0]:.2f}, "
                    f"{s['interval'][1]:.2f}] every round; Steinke et al. >= "
                    f"{e['steinke']['epsilon_lower_bound']:.2f} final model, >= "
                    f"{every['steinke']['epsilon_lower_bound']:.2f} every round at 95%; accountant {claim:.2f} (pld)")
    out = io.StringIO()
    with RunProgress(20, "pld", mode="lines", console=Console(file=out)) as progress:
        progress.run_done(summary)
        progress.run_done({"rounds_completed": 20})  # no canaries: nothing
    assert out.getvalue() == line + "\n"

    assert main(["report", str(cfg.output_dir), "--summary", str(tmp_path / "results" / "canaries_t.json")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == line
    stored = load_run_summary(tmp_path / "results" / "canaries_t.json")
    assert stored["empirical_epsilon"] == e and stored["population"] == 80
    doc = tmp_path / "audit.md"
    doc.write_text("x\n<!-- table:canaries_t:canaries -->\n<!-- /table:canaries_t:canaries -->\n")
    doc.write_text(render_docs(doc.read_text(), tmp_path / "results"))
    rows = [r for r in doc.read_text().splitlines() if r.startswith("| final model") or r.startswith("| every round")]
    assert rows[0] == (f"| final model | {a['epsilon']:.2f} ({a['interval'][0]:.2f} - {a['interval'][1]:.2f}) | "
                       f"{e['steinke']['epsilon_lower_bound']:.2f} ({e['steinke']['correct']} / 20) | {claim:.2f} |")
    assert rows[1].startswith(f"| every round | {s['epsilon']:.2f} (")
    assert stale_tables(doc, tmp_path / "results") == []
    doc.write_text(doc.read_text().replace(rows[0], rows[0].replace("| final model | ", "| final model | 1")))
    assert stale_tables(doc, tmp_path / "results") == ["canaries_t:canaries"]


def test_too_little_noise_exceeds_the_claim_in_the_every_round_statistic(small_config):
    """The audit's broken server that adds the noise of z / 8 while claiming z."""
    cfg = small_config(*CANARIES)
    task, out = load_task(cfg.data), {}
    app = ServerApp()

    @app.main()
    def main_(grid, context):
        out["summary"] = DPFedAvgServer(cfg, task, strategy_cls=BROKEN_VARIANTS["noise_over_cohort"]).run(grid)

    run_inprocess(app, build_client_app(cfg), population_with_canaries(cfg, task.population))
    e = out["summary"]["empirical_epsilon"]
    assert e["every_round"]["andrew"]["interval"][0] > out["summary"]["epsilon_pld"]


def test_a_resumed_run_keeps_the_every_round_statistic_bit_exactly(small_config, tmp_path):
    opts = ("privacy.canaries={count: 8, unused: 10, seed: 5, every_round: true}", "privacy.delta=1e-5", "checkpoint_every=2")
    run(small_config("rounds=2", *opts, f"output_dir={tmp_path / 'part'}"))
    resumed = run(small_config("rounds=4", *opts, f"output_dir={tmp_path / 'part'}"), resume=True)
    full = run(small_config("rounds=4", *opts, f"output_dir={tmp_path / 'full'}"))
    maxima = [torch.load(tmp_path / d / "checkpoint.pt", weights_only=False)["canaries"]["round_max"]
              for d in ("part", "full")]
    assert maxima[0] == maxima[1] and len(maxima[0]) == 18
    assert resumed["empirical_epsilon"]["every_round"] == full["empirical_epsilon"]["every_round"]


def test_a_run_folder_without_canaries_is_named(small_config, capsys):
    cfg = small_config()
    run(cfg)
    assert main(["report", str(cfg.output_dir)]) != 0
    assert f"{cfg.output_dir / 'summary.json'}: no empirical_epsilon" in capsys.readouterr().err
    with pytest.raises(RunSummaryError, match="version None, expected 1"):
        (cfg.output_dir / "x.json").write_text("{}")
        load_run_summary(cfg.output_dir / "x.json")


def test_the_every_round_statistic_scores_each_rounds_model_change():
    c = RunCanaries(CanaryConfig(count=8, unused=4, seed=2), users=5, dim=50)
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(50, generator=g) for _ in range(4)]
    c.start(x[0])
    for t in (1, 2, 3):
        c.observe(x[t])
    expected = np.max(np.stack([c.scores(x[t] - x[t - 1]) for t in (1, 2, 3)]), axis=0)
    assert np.array_equal(c.round_max, expected)
    again = RunCanaries(CanaryConfig(count=8, unused=4, seed=2), users=5, dim=50)
    again.load_state_dict(c.state_dict())
    assert np.array_equal(again.round_max, c.round_max)
    with pytest.raises(ValueError, match="hold no every-round statistic"):
        again.load_state_dict({"seed": 2})


def test_a_run_whose_draw_included_fewer_than_two_canaries_still_ends_with_its_summary(small_config, capsys):
    """Each canary is included with probability 1/2 (from the OS by default): 4 canaries include at most one in
    5 draws of 16. The one-shot estimate needs two; the run must still write its summary, saying why."""
    summary = run(small_config("rounds=2", "privacy.canaries={count: 4, unused: 10, seed: 2}", "privacy.delta=1e-5"))
    e = summary["empirical_epsilon"]
    assert e["included"] == 1 and "the one-shot estimate needs at least 2" in e["error"] and "andrew" not in e
    assert estimates_line(e).startswith("empirical epsilon (canaries): not estimated (1 of the 4 canaries")
    assert all(math.isnan(v) for v in estimate_columns(summary).values())


def test_a_numerical_failure_of_the_estimators_still_ends_the_run_with_its_summary(small_config, monkeypatch):
    """The OS-seeded resume test once hit an OverflowError inside the one-shot estimate after the last round: whatever
    an estimator raises, the run keeps its summary and says what failed."""
    def overflow(*args, **kwargs):
        raise OverflowError("math range error")

    monkeypatch.setattr(canaries_module, "one_shot_epsilon", overflow)
    summary = run(small_config("rounds=2", "privacy.canaries={count: 8, unused: 10, seed: 1}", "privacy.delta=1e-5"))
    e = summary["empirical_epsilon"]
    assert e["error"] == "the estimate failed: OverflowError: math range error" and "andrew" not in e
    assert summary["rounds_completed"] == 2
