"""Run tracking read back with the libraries' own readers: TensorBoard's EventAccumulator and MLflow's
MlflowClient hold exactly metrics.csv (each column under its private/not_private name, steps = rounds), the
resolved config, one run per run folder (a resume continues it without a duplicated step) and one experiment
per study."""

import ast
import json
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import fedprivacy

from fedprivacy.config import TrackingConfig, flat
from fedprivacy.experiments.study import expand
from fedprivacy.experiments.sweep import check_compatible, manifest, prepare_tracking
from fedprivacy.experiments.report import write_report
from fedprivacy.experiments import load_study
from fedprivacy.run import run
from fedprivacy.tracking import STATE_FILE, TrackingUnavailable, open_tracker, tracked_name, tracking_uri
from fedprivacy.tracking.tracker import read_state

TRACK = ("tracking.tensorboard=true", "tracking.mlflow=true")


def expected(folder: Path) -> dict[str, dict[int, float]]:
    """metrics.csv as tracked: each column's name -> {round: value}, NaN cells left out."""
    frame = pd.read_csv(folder / "metrics.csv", float_precision="round_trip")
    kinds = json.loads((folder / "metrics_columns.json").read_text())["columns"]
    return {tracked_name(c, kinds[c]["private"]): {int(r): float(v) for r, v in zip(frame["round"], frame[c])
                                                    if not np.isnan(v)}
            for c in frame.columns if c != "round"}


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mlflow_run(folder: Path, uri: str | None = None):
    state = json.loads((folder / STATE_FILE).read_text())["mlflow"]
    client = MlflowClient(tracking_uri=uri or state["tracking_uri"])
    return client, client.get_run(state["run_id"])


def assert_tracked_as_csv(folder: Path) -> None:
    want = expected(folder)
    scalars = tensorboard_scalars(folder)
    assert set(scalars) == {name for name, values in want.items() if values}
    for name, values in want.items():  # float32 in TensorBoard's events, each round once
        assert [s for s, _ in scalars.get(name, [])] == sorted(values), name
        assert [np.float32(v) for _, v in scalars.get(name, [])] == [np.float32(values[s]) for s in sorted(values)]
    client, mlrun = mlflow_run(folder)
    assert set(mlrun.data.metrics) == set(scalars)
    for name, values in want.items():  # MLflow keeps the float64 exactly
        history = sorted((m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, name))
        assert history == sorted(values.items()), name
    config = flat(yaml.safe_load((folder / "config.yaml").read_text()))
    resumed = {k.removeprefix("resumed."): v for k, v in mlrun.data.tags.items() if k.startswith("resumed.")}
    assert mlrun.data.params | resumed == {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}


def test_a_run_tracks_every_metrics_column_and_its_config(small_config):
    cfg = small_config(*TRACK, "privacy.noise_multiplier=auto", "privacy.target_epsilon=20")
    run(cfg)
    folder = Path(cfg.output_dir)
    assert_tracked_as_csv(folder)
    names = set(tensorboard_scalars(folder))
    assert {"private/epsilon_rdp", "not_private/test_accuracy", "not_private/train_loss",
            "not_private/clipped_fraction", "not_private/seconds", "private/server_noise_std"} <= names
    client, mlrun = mlflow_run(folder)
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "run"
    assert float(mlrun.data.params["privacy.noise_multiplier"]) > 0  # the calibrated z, not "auto"
    text = EventAccumulator(str(folder / "tensorboard"), size_guidance={"tensors": 0})
    text.Reload()
    assert "privacy:" in text.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


def test_a_resume_continues_the_same_runs_without_a_duplicated_step(small_config):
    run(small_config(*TRACK))
    folder = Path(small_config().output_dir)
    client, first = mlflow_run(folder)
    state = json.loads((folder / STATE_FILE).read_text())
    state["tensorboard"]["round"] = 1  # as if killed after round 2 reached the trackers but not tracking.json
    (folder / STATE_FILE).write_text(json.dumps(state))
    run(small_config(*TRACK, "rounds=4", "client.lr=4.0"), resume=True)
    assert_tracked_as_csv(folder)
    assert len(pd.read_csv(folder / "metrics.csv")) == 4
    client, again = mlflow_run(folder)
    assert again.info.run_id == first.info.run_id and again.info.status == "FINISHED"
    assert len(client.search_runs([again.info.experiment_id])) == 1
    assert again.data.tags["resumed.client.lr"] == "4.0"  # MLflow keeps a param's first value


@pytest.fixture
def tiny_study(small_data, tmp_path):
    """``make(*overrides) -> path`` of a study YAML: one method with a 2-point grid, 1 budget, 1 seed, 2 rounds."""

    def make() -> Path:
        tree = {"name": "tiny", "output_dir": str(tmp_path / "study"),
                "base": {"rounds": 2, "eval_every": 1, "data": {"path": str(small_data), "generate_if_missing": False,
                                                                 "vocab_size": 2000, "num_tags": 50},
                         "client": {"epochs": 1, "batch_size": 10, "lr": 5.0},
                         "privacy": {"clip_norm": 1.0, "expected_cohort": 8, "accountants": ["rdp", "pld"]}},
                "methods": {"DP-FedAvg": {"grid": {"server.lr": [0.5, 1.0]}}},
                "budgets": [{"epsilon": 8}], "seeds": [0]}
        (tmp_path / "study.yaml").write_text(yaml.safe_dump(tree))
        return tmp_path / "study.yaml"

    return make


def test_a_run_started_afresh_in_a_tracked_folder_starts_new_tracking_runs(small_config):
    run(small_config(*TRACK, "rounds=3"))
    folder = Path(small_config().output_dir)
    _, first = mlflow_run(folder)
    for name in ("checkpoint.pt", "releases.jsonl"):  # a run started over, not resumed
        (folder / name).unlink()
    run(small_config(*TRACK, "client.lr=4.0"))
    assert_tracked_as_csv(folder)  # TensorBoard: the earlier 3 rounds dropped; MLflow: the new run's 2
    client, again = mlflow_run(folder)
    assert again.info.run_id != first.info.run_id
    assert len(client.search_runs([again.info.experiment_id])) == 2


def test_a_study_tracks_its_runs_in_one_experiment_and_one_logdir_each(tiny_study):
    study = load_study(tiny_study(), [f"base.{t}" for t in TRACK])
    specs = expand(study)
    prepare_tracking(specs)
    for spec in specs:
        run(spec.config)
    client = MlflowClient(tracking_uri=tracking_uri(Path(), str(study.output_dir / "mlruns")))
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == sorted(s.run_id for s in specs)
    assert len(client.search_experiments()) == 2  # the study's and MLflow's Default
    for spec in specs:
        assert (study.output_dir / "runs" / spec.run_id / "tensorboard").is_dir()
        assert_tracked_as_csv(study.output_dir / "runs" / spec.run_id)
    (study.output_dir / "study.json").write_text(json.dumps(manifest(study, specs)))
    report = write_report(study.output_dir).read_text()
    assert "clip_norm: 1.0" in report and "tracking" not in report  # a setting of no result, left out


def test_switching_tracking_on_does_not_change_a_study(tiny_study):
    def manifest(*extra):
        study = load_study(tiny_study(), list(extra))
        return {"study": {"output_dir": str(study.output_dir)},
                "runs": [{"run_id": s.run_id, "config": json.loads(s.config.to_json())} for s in expand(study)]}

    check_compatible(manifest(), manifest(*(f"base.{t}" for t in TRACK)))
    with pytest.raises(ValueError, match="rounds"):
        check_compatible(manifest(), manifest("base.rounds=3"))


def test_a_study_stored_before_an_optional_section_existed_still_resumes(tiny_study):
    """study.json written by an older fedprivacy lacks the sections added since (null: off); it resumes, and a
    section that is set now is still a change."""
    study = load_study(tiny_study())
    runs = [{"run_id": s.run_id, "config": json.loads(s.config.to_json())} for s in expand(study)]
    older = [{**r, "config": {**r["config"], "privacy": {k: v for k, v in r["config"]["privacy"].items()
                                                         if k != "canaries"}}} for r in runs]
    assert all(r["config"]["privacy"]["canaries"] is None for r in runs)
    check_compatible({"study": {"output_dir": "x"}, "runs": older}, {"study": {}, "runs": runs})
    runs[0]["config"]["privacy"]["canaries"] = {"count": 8}
    with pytest.raises(ValueError, match="privacy.canaries: None -> "):
        check_compatible({"study": {"output_dir": "x"}, "runs": older}, {"study": {}, "runs": runs})


def test_a_missing_library_names_the_extra(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] == "mlflow"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.delitem(sys.modules, "fedprivacy.tracking.mlflow_writer", raising=False)
    with pytest.raises(TrackingUnavailable, match=r"tracking\.mlflow.*pip install 'fedprivacy\[tracking\]'"):
        open_tracker(tmp_path, TrackingConfig(mlflow=True), {}, "central")


WRITERS = ("fedprivacy.tracking.tensorboard_writer", "fedprivacy.tracking.mlflow_writer")


def test_the_libraries_are_imported_only_when_tracking_is_on():
    """Only the writer modules import TensorBoard or MLflow at module level, and every other module imports a
    writer module only inside a function (:func:`fedprivacy.tracking.tracker.open_tracker` when tracking is on)."""
    package = Path(fedprivacy.__file__).parent
    heavy = ("mlflow", "tensorboard", "torch.utils.tensorboard", *WRITERS)
    for path in package.rglob("*.py"):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        if module in WRITERS:
            continue
        for node in ast.parse(path.read_text()).body:  # module level only
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n.startswith(heavy)], (module, names)


def test_tracking_state_round_trips_and_damage_names_the_file(tmp_path):
    state = {"tensorboard": {"round": 3}, "mlflow": {"run_id": "abc", "tracking_uri": "file:///x"}}
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    assert read_state(tmp_path) == state
    (tmp_path / STATE_FILE).unlink()
    assert read_state(tmp_path) == {}


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3),
                    max_leaves=8)


@settings(max_examples=100, deadline=None)
@given(content=st.one_of(st.binary(max_size=40), JSON.map(lambda v: json.dumps(v).encode()),
                         st.fixed_dictionaries({}, optional={
                             "tensorboard": st.fixed_dictionaries({"round": JSON}),
                             "mlflow": st.fixed_dictionaries({"run_id": JSON, "tracking_uri": JSON})})
                         .map(lambda v: json.dumps(v).encode())))
def test_a_damaged_tracking_state_is_refused_naming_the_file(tmp_path_factory, content):
    folder = tmp_path_factory.mktemp("state")
    (folder / STATE_FILE).write_bytes(content)
    try:
        state = read_state(folder)
    except ValueError as err:
        assert str(folder / STATE_FILE) in str(err)
        return
    assert isinstance(state.get("tensorboard", {}).get("round", 0), int)
    assert all(isinstance(v, str) for v in state.get("mlflow", {}).values())


def _example():
    sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
    try:
        import tracked_strategy
    finally:
        sys.path.pop(0)
    return tracked_strategy


def test_the_strategy_reports_each_round_metrics_as_flower_records_them():
    from flwr.app import ArrayRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from torch import nn

    from fedprivacy.engines.inprocess import run_inprocess
    from fedprivacy.fl.strategy import DPFedAvg

    example, calls, results = _example(), {}, []
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, population=8, delta=1e-3, seed=0,
                            on_round=lambda rnd, metrics: calls.setdefault(rnd, dict(metrics)))
        results.append(strategy.start(grid=grid, initial_arrays=ArrayRecord(nn.Linear(20, 2).state_dict()),
                                      num_rounds=2))

    run_inprocess(app, example.client_app, 8)
    assert calls == {rnd: dict(m) for rnd, m in results[0].train_metrics_clientapp.items()} and list(calls) == [1, 2]
    assert calls[2]["epsilon_rdp"] > calls[1]["epsilon_rdp"] > 0


def test_the_documented_server_app_example_tracks_its_rounds(tmp_path):
    example = _example()
    from fedprivacy.engines.inprocess import run_inprocess

    run_inprocess(example.tracked_server_app(tmp_path, rounds=2, users=12), example.client_app, 12)
    scalars = tensorboard_scalars(tmp_path)
    assert [s for s, _ in scalars["private/epsilon_rdp"]] == [1, 2]
    assert [s for s, _ in scalars["not_private/test_accuracy"]] == [0, 1, 2]  # Flower evaluates x_0 too
    client, mlrun = mlflow_run(tmp_path)
    assert {"private/epsilon_rdp", "not_private/test_accuracy", "not_private/clipped_fraction"} <= set(mlrun.data.metrics)
    history = client.get_metric_history(mlrun.info.run_id, "not_private/test_accuracy")
    assert [(m.step, np.float32(m.value)) for m in history] == [(s, v) for s, v in scalars["not_private/test_accuracy"]]
    assert mlrun.data.params["rounds"] == "2" and mlrun.info.status == "FINISHED"


def test_the_track_flag_sets_the_tracking_fields():
    from fedprivacy.cli import build_parser

    assert build_parser().parse_args(["run", "--track", "tensorboard,mlflow"]).track == ["tensorboard", "mlflow"]
    assert build_parser().parse_args(["compare", "s.yaml", "--track", "mlflow"]).track == ["mlflow"]
    assert build_parser().parse_args(["run"]).track == []


@given(st.lists(st.sampled_from(["tensorboard", "mlflow", " mlflow", "tensorboard ", "", "mlfow", "TensorBoard", ","]),
                min_size=1, max_size=4))
def test_the_track_flag_takes_known_trackers_only_naming_an_unknown_one(parts):
    from argparse import ArgumentTypeError

    from fedprivacy.cli import TRACKERS, trackers

    text = ",".join(parts)
    names = [p.strip() for p in text.split(",")]
    if all(n in TRACKERS for n in names):
        assert trackers(text) == names
    else:
        with pytest.raises(ArgumentTypeError, match=repr(next(n for n in names if n not in TRACKERS))):
            trackers(text)


def test_the_documented_privacy_table_is_metrics_columns():
    from fedprivacy.outputs import METRICS_COLUMNS

    text = (Path(__file__).parents[2] / "docs" / "TRACKING.md").read_text()
    table = text[text.index("### Which metrics are not private"):text.index("## One's own ServerApp")]
    rows = dict(re.findall(r"^\| `(\w+)` \| (yes|no)", table, re.MULTILINE))
    assert rows == {column: "yes" if private else "no" for column, (private, _) in METRICS_COLUMNS.items()}
