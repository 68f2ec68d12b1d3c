"""Docs tables generated from stored study summaries, and selection on held-out users."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fedprivacy.cli import main
from fedprivacy.config import ConfigError
from fedprivacy.data.prepared import prepared_tags
from fedprivacy.data.sources import open_source
from fedprivacy.experiments import compare, load_study
from fedprivacy.experiments.docs import (DocsTableError, export_summary, load_summary, marked_tables, render_docs,
                                         stale_tables)
from fedprivacy.experiments.report import write_report
from fedprivacy.experiments.results import load_results
from fedprivacy.experiments.study import build_study
from test_results import _fake_study

REPO = Path(__file__).resolve().parents[2]
DOCS = {"docs/STUDIES.md": {"study_a_adadps_federated", "study_a_adadps_federated:grid", "study_b_reddi_tags",
                             "study_c_next_word", "study_e_lr_grid:grid"},
        "docs/audit.md": {"canaries_quickstart:canaries", "canaries_quickstart_120:canaries",
                          "canaries_study_scale:canaries",
                          *(f"canary_{run}:canaries" for run in ("half_correct", "half_noise_halved",
                                                                 "half_double_clip_half_noise", "norm10_correct",
                                                                 "norm10_unclipped", "norm10_clip_after_sum"))},
        "docs/DEPLOYMENT.md": {"canary_deployment:canaries", "canary_deployment_inprocess:canaries"},
        "docs/COMPARISON.md": {"compare_adambc_regime", "compare_adambc_regime:grid", "compare_adambc_low_noise",
                               "compare_server_optimizers", "compare_server_optimizers:grid"}}


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_docs_tables_equal_what_the_stored_summaries_give(doc):
    """The committed docs carry their tables exactly as `fedprivacy report --docs` renders them."""
    path = REPO / doc
    assert DOCS[doc] <= set(marked_tables(path.read_text()))
    assert stale_tables(path, REPO / "docs" / "results") == []


def test_a_hand_edited_number_turns_the_check_red(tmp_path, capsys):
    doc = tmp_path / "STUDIES.md"
    shutil.copy(REPO / "docs" / "STUDIES.md", doc)
    text = doc.read_text()
    start = text.index("<!-- table:study_a_adadps_federated -->")
    row = text.index("| AdaDPS |", start)
    line = text[row:text.index("\n", row)]
    cells = line.split(" | ")  # "| AdaDPS", budget, selected, seeds, selection score, final test accuracy, ...
    assert cells[5].startswith("0.")
    cells[5] = cells[5][:2] + str((int(cells[5][2]) + 1) % 10) + cells[5][3:]  # its first decimal, by hand
    edited = text[:row] + " | ".join(cells) + text[row + len(line):]
    doc.write_text(edited)
    assert stale_tables(doc, REPO / "docs" / "results") == ["study_a_adadps_federated"]
    assert main(["report", "--docs", str(doc), "--results", str(REPO / "docs" / "results"), "--check"]) == 1
    assert "table study_a_adadps_federated differs" in capsys.readouterr().err
    assert main(["report", "--docs", str(doc), "--results", str(REPO / "docs" / "results")]) == 0  # regenerate
    assert doc.read_text() == text
    assert main(["report"]) == 2 and "not both" in capsys.readouterr().err  # a folder or --docs, one of them


def test_summary_round_trip_and_rendering_by_hand(tmp_path):
    """Export from stored runs, render: the selected point, mean ± std and epsilon are the report's."""
    _fake_study(tmp_path / "fake")
    results = load_results(tmp_path / "fake")
    path = export_summary(results, tmp_path / "results" / "fake.json")
    stored = load_summary(path)
    assert len(stored.runs) == 6 and stored.selection["split"] == "test"
    summ = stored.summary().set_index("method")
    ref = results.summary.set_index("method")
    for col in ("hparams", "final_test_accuracy_mean", "final_test_accuracy_std", "epsilon_rdp", "epsilon_pld"):
        assert list(summ[col]) == list(ref[col])
    doc = ("intro\n<!-- table:fake -->\nold\n<!-- /table:fake -->\nmiddle\n"
           "<!-- table:fake:grid -->\n<!-- /table:fake:grid -->\n")
    out = render_docs(doc, tmp_path / "results")
    # A: lr 1.0 selected (seeds 0.20, 0.50: mean 0.350, std 0.212), of 2 grid points
    assert "| A | z0.8 | server.lr=1.0 (of 2) | 2 | 0.350 ± 0.212 | 0.350 ± 0.212 | 0.350 ± 0.212 |" in out
    assert "| A | z0.8 | server.lr=0.1 | 2 | 0.320 ± 0.028 | 0.320 ± 0.028 |  |" in out
    assert "Majority baseline (test_accuracy): 0.150." in out and "(the test split: optimistic)" in out
    assert out.startswith("intro\n<!-- table:fake -->\n|") and "\nmiddle\n" in out
    assert render_docs(out, tmp_path / "results") == out  # idempotent
    with pytest.raises(DocsTableError, match="no stored summary"):
        render_docs("<!-- table:missing -->\n<!-- /table:missing -->", tmp_path / "results")


def test_extra_columns_average_the_last_rounds(tmp_path):
    _, specs, _ = _fake_study(tmp_path / "fake")
    study = json.loads((tmp_path / "fake" / "study.json").read_text())
    study["study"]["columns"] = [{"column": "epsilon_rdp", "last_rounds": 2}]
    (tmp_path / "fake" / "study.json").write_text(json.dumps(study))
    r = load_results(tmp_path / "fake")
    assert (r.runs["epsilon_rdp_last2"] == 1.75).all()  # rounds 2 and 3 of [1.0, 1.5, 2.0]
    assert (r.summary["epsilon_rdp_last2_mean"] == 1.75).all()
    export_summary(r, tmp_path / "fake.json")
    assert "epsilon_rdp (mean of last 2 rounds)" in render_docs("<!-- table:fake -->\n<!-- /table:fake -->",
                                                                  tmp_path)
    report = write_report(tmp_path / "fake").read_text()  # the study's own report has the column too
    assert report.count("| epsilon_rdp (mean of last 2 rounds) |") == 2 and "| 1.75 ± 0 |" in report


@pytest.mark.parametrize("selection, field", [({"split": "heldout", "at": "best"}, "selection.at"),
                                              ({"heldout_clients": 3}, "heldout_clients")])
def test_heldout_selection_settings_are_checked(selection, field):
    tree = {"name": "x", "output_dir": "x", "methods": {"A": {}}, "budgets": [{"epsilon": 1}], "selection": selection}
    with pytest.raises(ConfigError, match=field):
        build_study(tree)


@pytest.mark.slow
def test_selection_on_heldout_users_uses_the_final_models_heldout_accuracy(tiny_study, small_data):
    study = load_study(tiny_study(selection={"split": "heldout"}))
    result, report = compare(study, jobs=2, show_progress=False)
    assert not result.failed
    r = load_results(study.output_dir)
    assert r.selection == ("heldout_accuracy", "max", "final")
    held, _ = prepared_tags(open_source("tff-sqlite", small_data), "heldout", vocab_size=2000, num_tags=50,
                            no_tag="label0")
    x = torch.as_tensor(held.features.toarray())
    by_hand = {}
    for _, run in r.runs.iterrows():  # the final model's accuracy on every held-out user's posts, by hand
        state = torch.load(Path(study.output_dir) / "runs" / run["run_id"] / "final_model.pt")
        logits = x @ state["embedding.weight"] + state["bias"]
        by_hand[run["run_id"]] = float((logits.argmax(1).numpy() == held.labels).mean())
        assert run["selection_score"] == pytest.approx(by_hand[run["run_id"]], abs=1e-6)
    fedavg = r.runs[r.runs["method"] == "DP-FedAvg"]
    means = fedavg.assign(h=fedavg["run_id"].map(by_hand)).groupby("hparams")["h"].mean()
    assert r.summary.set_index("method").loc["DP-FedAvg", "hparams"] == means.idxmax()
    assert "held-out users" in report.read_text()
    assert held.features.shape[0] > 0 and not math.isnan(r.summary["selection_score_mean"].iloc[0])
    assert np.isfinite(r.summary["final_test_accuracy_mean"]).all()


def _verdict_summary(tmp_path: Path, finals: dict[tuple[str, str], list[float]]) -> Path:
    """A stored summary with one setting per method and budget and the given final metric per seed."""
    runs = [{"method": method, "budget": budget, "budget_epsilon": 8.0, "hparams": "-", "seed": seed,
             "rounds_completed": 10, "noise_multiplier": 0.5, "majority_baseline": 0.2, "selection_score": value,
             "epsilon_rdp": 8.0, "epsilon_prv": 7.0, "epsilon_pld": 7.0, "final_test_recall_at_5": value,
             "best_test_recall_at_5": value}
            for (method, budget), values in finals.items() for seed, value in enumerate(values)]
    payload = {"version": 1, "study": "v", "metric": "test_recall_at_5", "columns": [], "runs": runs,
               "selection": {"metric": "heldout_recall_at_5", "mode": "max", "at": "final", "split": "heldout",
                             "heldout_clients": None}}
    path = tmp_path / "v.json"
    path.write_text(json.dumps(payload))
    return path


def test_the_verdict_names_the_best_method_its_margins_and_whether_they_exceed_the_seed_spread(tmp_path):
    from fedprivacy.experiments.docs import render_verdict_table

    path = _verdict_summary(tmp_path, {("DP-FedAvg", "eps8"): [0.30, 0.32], ("Adagrad", "eps8"): [0.40, 0.42],
                                       ("Adam", "eps8"): [0.39, 0.43], ("DP-FedAvg", "eps1"): [0.25, 0.27],
                                       ("Adagrad", "eps1"): [0.24, 0.30]})
    rows = [line.split(" | ") for line in render_verdict_table(load_summary(path)).splitlines()
            if line.startswith("| eps")]
    eps8, eps1 = rows
    # eps8: Adagrad 0.41 vs Adam 0.41 (margin 0.000, within the spread), vs DP-FedAvg 0.31: +0.100, se 0.01414 -> clear
    assert eps8[1] == "Adagrad" and eps8[2] == "0.410 ± 0.014"
    assert eps8[3].startswith("Adam: +0.000") and eps8[4] == "within the seeds' spread"
    assert eps8[5] == "DP-FedAvg: +0.100 (se 0.014)" and eps8[6] == "clear"
    assert eps8[7].rstrip(" |") == "0.210"
    # eps1: Adagrad 0.27 vs DP-FedAvg 0.26: +0.010 against se sqrt(0.0424^2/2 + 0.0141^2/2) = 0.0316 -> not clear
    assert eps1[1] == "Adagrad" and eps1[4] == "within the seeds' spread" == eps1[6]
    assert eps1[3] == eps1[5] == "DP-FedAvg: +0.010 (se 0.032)"  # the runner-up is the reference
    one_seed = _verdict_summary(tmp_path, {("A", "eps8"): [0.5], ("B", "eps8"): [0.1]})
    assert "unknown (one seed)" in render_verdict_table(load_summary(one_seed))


def test_a_verdict_block_is_rendered_and_checked_like_the_other_tables(tmp_path):
    _verdict_summary(tmp_path, {("A", "eps8"): [0.5, 0.52], ("B", "eps8"): [0.1, 0.12]})
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- table:v:verdict -->\nstale\n<!-- /table:v:verdict -->\n")
    assert marked_tables(doc.read_text()) == ["v:verdict"]
    assert stale_tables(doc, tmp_path) == ["v:verdict"]
    assert "| eps8 | A | 0.510 ± 0.014 | B: +0.400 (se 0.014) | clear |" in render_docs(doc.read_text(), tmp_path)


def _tuning_summary(tmp_path: Path, scores: dict[tuple[str, str], list[float]]) -> Path:
    """A stored summary of a tuning study at eps8: per (method, server.lr label) the held-out score of each seed."""
    runs = [{"method": method, "budget": "eps8", "budget_epsilon": 8.0, "hparams": point, "seed": seed,
             "rounds_completed": 10, "noise_multiplier": 0.5, "majority_baseline": 0.2, "selection_score": score,
             "epsilon_rdp": 8.0, "epsilon_prv": None, "epsilon_pld": None, "final_test_recall_at_5": score,
             "best_test_recall_at_5": score}
            for (method, point), values in scores.items() for seed, score in enumerate(values)]
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"version": 1, "study": "tuning", "metric": "test_recall_at_5", "columns": [],
                                "runs": runs, "selection": {"metric": "heldout_recall_at_5", "mode": "max",
                                                            "at": "final", "split": "heldout",
                                                            "heldout_clients": 10}}))
    return path


def _tuned_study(tmp_path: Path, summary: Path, grid: dict) -> Path:
    study = tmp_path / "study.yaml"
    study.write_text(json.dumps({
        "name": "tuned", "output_dir": str(tmp_path / "out"), "base": {"rounds": 2},
        "methods": {"A": {"set": {"server": {"optimizer": "sgd"}}, "grid": grid},
                    "B": {"set": {"server": {"optimizer": "adam"}}, "grid": {"server.lr": [0.01, 0.1]}}},
        "budgets": [{"epsilon": 1}, {"epsilon": 8}], "seeds": [0, 1],
        "tuned_on": {"summary": str(summary), "budget": "eps8"}}))
    return study


def test_a_tuned_study_runs_each_methods_selected_point_at_every_budget_and_seed(tmp_path):
    from fedprivacy.experiments.study import expand

    summary = _tuning_summary(tmp_path, {("A", "server.lr=1.0"): [0.3], ("A", "server.lr=3.0"): [0.4],
                                         ("B", "server.lr=0.01"): [0.5], ("B", "server.lr=0.1"): [0.2]})
    study = load_study(_tuned_study(tmp_path, summary, {"server.lr": [1.0, 3.0]}))
    assert {m: spec.grid for m, spec in study.methods.items()} == {"A": {"server.lr": [3.0]},
                                                                  "B": {"server.lr": [0.01]}}
    runs = expand(study)
    assert len(runs) == 2 * 2 * 2  # methods x budgets x seeds, one point each
    assert {(r.method, r.config.server.lr) for r in runs} == {("A", 3.0), ("B", 0.01)}
    assert load_study(_tuned_study(tmp_path, summary, {"server.lr": [1.0, 3.0]})) == study  # the same on resume


@pytest.mark.parametrize(("scores", "grid", "message"), [
    ({("A", "server.lr=1.0"): [0.3], ("B", "server.lr=0.01"): [0.5], ("B", "server.lr=0.1"): [0.2]},
     {"server.lr": [1.0, 3.0]}, r"lacks method 'A' at budget 'eps8' for 1 of its 2 grid points \(server.lr=3.0\)"),
    ({("B", "server.lr=0.01"): [0.5], ("B", "server.lr=0.1"): [0.2]}, {"server.lr": [1.0]},
     r"lacks method 'A'"),
])
def test_a_tuned_study_refuses_a_tuning_that_is_not_finished_naming_the_method(tmp_path, scores, grid, message):
    summary = _tuning_summary(tmp_path, scores)
    with pytest.raises(ConfigError, match=message):
        load_study(_tuned_study(tmp_path, summary, grid))
    with pytest.raises(ConfigError, match="tuned_on.summary: .* does not exist"):
        load_study(_tuned_study(tmp_path, tmp_path / "nowhere.json", grid))
