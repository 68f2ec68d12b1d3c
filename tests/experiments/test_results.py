"""Tables, figures and report from stored (fake) results: numbers by hand, nothing rerun."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedprivacy.run
from fedprivacy.cli import main
from fedprivacy.experiments.report import markdown_table, write_report
from fedprivacy.experiments.results import load_results, read_metrics, without_wall_time
from fedprivacy.experiments.study import build_study, expand
from fedprivacy.experiments.sweep import manifest
from fedprivacy.privacy.accounting import GaussianRound, PrivacyLedger, epsilon

# final test accuracy of each (method, lr, seed); round 2's value is final - 0.05, round 1 is not evaluated
FINAL = {("A", 0.1, 0): 0.30, ("A", 0.1, 1): 0.34, ("A", 1.0, 0): 0.20, ("A", 1.0, 1): 0.50,
         ("B", None, 0): 0.10, ("B", None, 1): 0.12}
Z = 0.8


def _fake_study(folder, selection=None):
    tree = {"name": "fake", "output_dir": str(folder),
            "base": {"rounds": 3, "data": {"path": str(folder / "no-data")}, "privacy": {"expected_cohort": 8}},
            "methods": {"A": {"set": {"server": {"momentum": 0.0}}, "grid": {"server.lr": [0.1, 1.0]}},
                        "B": {"set": {"server": {"optimizer": "adam"}}}},
            "budgets": [{"noise_multiplier": Z}], "seeds": [0, 1]}
    if selection:
        tree["selection"] = selection
    study = build_study(tree)
    specs = expand(study)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "study.json").write_text(json.dumps(manifest(study, specs)))
    ledger = PrivacyLedger([(GaussianRound(Z, "poisson", 40, 8.0), 3)])
    for s in specs:
        run = folder / "runs" / s.run_id
        run.mkdir(parents=True)
        final = FINAL[(s.method, s.hparams.get("server.lr"), s.seed)]
        pd.DataFrame({"round": [1, 2, 3], "train_loss": [3.0, 2.5, 2.0 + final],
                      "test_accuracy": [math.nan, final - 0.05, final], "epsilon_rdp": [1.0, 1.5, 2.0],
                      "seconds": [0.5, 0.25, 0.25]}).to_csv(run / "metrics.csv", index=False)
        (run / "summary.json").write_text(json.dumps({
            "rounds_completed": 3, "stop_reason": "rounds", "delta": 0.025, "noise_multiplier": Z,
            "majority_baseline_accuracy": 0.15, "epsilon_rdp": 2.0}))
        (run / "ledger.json").write_text(json.dumps(ledger.state_dict()))
        (run / "sweep_run.json").write_text(json.dumps({"attempts": [{"start_round": 0, "wall_seconds": 2.0}]}))
    return study, specs, ledger


def test_tables_from_stored_results(tmp_path):
    study, specs, ledger = _fake_study(tmp_path / "fake")
    r = load_results(tmp_path / "fake")
    assert len(r.rounds) == 3 * len(specs)
    assert list(r.rounds.columns[:8]) == ["run_id", "method", "budget", "budget_epsilon", "seed", "hparams",
                                          "hp.server.lr", "finished"]
    assert r.rounds["hp.server.lr"].dtype == float
    runs = r.runs.set_index("run_id")
    a = next(s for s in specs if s.method == "A" and s.hparams["server.lr"] == 1.0 and s.seed == 1)
    assert runs.loc[a.run_id, "final_test_accuracy"] == pytest.approx(0.50)
    assert runs.loc[a.run_id, "best_test_accuracy"] == pytest.approx(0.50)
    assert runs.loc[a.run_id, "train_seconds"] == pytest.approx(1.0)
    assert runs.loc[a.run_id, "wall_seconds"] == pytest.approx(2.0)
    for kind in ("rdp", "prv", "pld"):  # every accountant, from the run's ledger (the run tracked only rdp)
        assert runs.loc[a.run_id, f"epsilon_{kind}"] == pytest.approx(epsilon(ledger, 0.025, kind))
    # selection: A's lr=1.0 (mean 0.35) beats lr=0.1 (mean 0.32) on the mean over seeds
    grid = r.grid.set_index(["method", "hparams"])
    assert grid.loc[("A", "server.lr=1.0"), "selected"] and not grid.loc[("A", "server.lr=0.1"), "selected"]
    assert grid.loc[("A", "server.lr=0.1"), "final_test_accuracy_std"] == pytest.approx(np.std([0.30, 0.34], ddof=1))
    summary = r.summary.set_index("method")
    assert summary.loc["A", "hparams"] == "server.lr=1.0" and summary.loc["A", "grid_points"] == 2
    assert summary.loc["A", "final_test_accuracy_mean"] == pytest.approx(0.35)
    assert summary.loc["A", "final_test_accuracy_std"] == pytest.approx(np.std([0.20, 0.50], ddof=1))
    assert summary.loc["B", "final_test_accuracy_mean"] == pytest.approx(0.11)
    assert summary.loc["B", "epsilon_pld"] == pytest.approx(epsilon(ledger, 0.025, "pld"))
    assert not r.incomplete and not r.failed


def test_selection_on_train_loss_picks_the_lowest(tmp_path):
    _fake_study(tmp_path / "fake", selection={"metric": "train_loss"})
    r = load_results(tmp_path / "fake")
    assert r.selection == ("train_loss", "min", "final")
    assert r.summary.set_index("method").loc["A", "hparams"] == "server.lr=0.1"  # final train loss 2.32 < 2.35


def test_unfinished_and_failed_runs_are_listed_not_averaged(tmp_path):
    _, specs, _ = _fake_study(tmp_path / "fake")
    b0 = next(s for s in specs if s.method == "B" and s.seed == 0)
    (tmp_path / "fake" / "runs" / b0.run_id / "summary.json").unlink()
    (tmp_path / "fake" / "runs" / b0.run_id / "error.txt").write_text("Traceback ...")
    r = load_results(tmp_path / "fake")
    assert r.incomplete == [b0.run_id] and r.failed == [b0.run_id]
    summary = r.summary.set_index("method")
    assert summary.loc["B", "n_seeds"] == 1 and summary.loc["B", "final_test_accuracy_mean"] == pytest.approx(0.12)
    assert math.isnan(summary.loc["B", "final_test_accuracy_std"])
    report = write_report(tmp_path / "fake").read_text()
    assert f"`{b0.run_id}`: failed" in report


def test_a_live_runs_empty_metrics_file_reads_as_no_rounds_yet(tmp_path):
    """A study reported while it runs: a run that has written no row yet, or is rewriting its metrics.csv for new
    columns at that moment, is an unfinished run with no rounds, not an error."""
    _, specs, _ = _fake_study(tmp_path / "fake")
    b0 = next(s for s in specs if s.method == "B" and s.seed == 0)
    folder = tmp_path / "fake" / "runs" / b0.run_id
    (folder / "summary.json").unlink()
    (folder / "metrics.csv").write_text("")
    r = load_results(tmp_path / "fake")
    assert r.incomplete == [b0.run_id]
    assert r.runs.set_index("run_id").loc[b0.run_id, "rounds_completed"] == 0


@given(content=st.binary(max_size=200))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_metrics_file_reads_as_a_table_or_an_error_naming_it(tmp_path, content):
    (tmp_path / "metrics.csv").write_bytes(content)
    try:
        table = read_metrics(tmp_path)
    except ValueError as err:
        assert str(err).startswith(f"{tmp_path / 'metrics.csv'}: not a metrics table")
    else:
        assert isinstance(table, pd.DataFrame)
    (tmp_path / "metrics.csv").unlink()
    assert read_metrics(tmp_path).empty  # no file yet


def test_report_regenerates_tables_figures_and_markdown_without_rerunning(tmp_path, monkeypatch, capsys):
    _fake_study(tmp_path / "fake")

    def no_runs(*a, **k):
        raise AssertionError("fedprivacy report must not run anything")

    monkeypatch.setattr(fedprivacy.run, "run", no_runs)
    assert main(["report", str(tmp_path / "fake")]) == 0
    out = tmp_path / "fake"
    for name in ("rounds", "runs", "grid", "summary"):
        csv = pd.read_csv(out / "results" / f"{name}.csv")
        parquet = pd.read_parquet(out / "results" / f"{name}.parquet")
        assert len(csv) == len(parquet) > 0
    for name in ("metric_vs_round", "final_vs_epsilon", "epsilon_vs_round"):
        assert (out / "figures" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert b"<svg" in (out / "figures" / f"{name}.svg").read_bytes()[:2000]
    report = (out / "report.md").read_text()
    assert "| A | z0.8 | server.lr=1.0 | 2 | 2 | 0.35 ± 0.2121 |" in report
    assert "selects on the **test split**" in report
    assert "every method spent the same privacy" in report
    assert "![metric_vs_round](figures/metric_vs_round.png)" in report
    before = (out / "results" / "summary.csv").read_text()
    assert main(["report", str(out)]) == 0  # idempotent
    assert (out / "results" / "summary.csv").read_text() == before


def test_report_of_a_folder_that_is_not_a_study_names_it(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "study.json" in capsys.readouterr().err


def test_markdown_table_and_wall_time_helpers():
    df = pd.DataFrame({"a": ["x|y"], "b": [math.nan], "c": [0.123456], "seconds": [1.0], "wall_seconds": [2.0]})
    assert markdown_table(df[["a", "b", "c"]]).splitlines()[-1] == "| x\\|y | - | 0.1235 |"
    assert list(without_wall_time(df).columns) == ["a", "b", "c"]


def test_report_of_a_study_with_no_finished_run(tmp_path):
    study = build_study({"name": "empty", "output_dir": str(tmp_path / "empty"), "methods": {"A": {}},
                         "budgets": [{"epsilon": 1}]})
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "study.json").write_text(json.dumps(manifest(study, expand(study))))
    assert "No run has finished yet." in write_report(tmp_path / "empty").read_text()
