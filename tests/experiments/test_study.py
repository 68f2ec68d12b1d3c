"""Study schema: grid expansion, merge order, run ids, and errors that name the field."""

from pathlib import Path

import pytest

from fedprivacy.cli import main
from fedprivacy.config import ConfigError
from fedprivacy.experiments.study import build_study, expand, load_study, run_id, selection_rule, study_metric

REPO = Path(__file__).resolve().parents[2]


def _study(**over):
    tree = {"name": "s", "output_dir": "out",
            "base": {"rounds": 3, "privacy": {"clip_norm": 2.0}, "server": {"lr": 0.7}},
            "methods": {"A": {"set": {"server": {"optimizer": "sgd", "momentum": 0.0}},
                              "grid": {"server.lr": [0.1, 1.0], "privacy.clip_norm": [1.0, 5.0, 10.0]}},
                        "B": {"set": {"server.optimizer": "adam"}}},
            "budgets": [{"epsilon": 1}, {"epsilon": 8}, {"noise_multiplier": 0.3}],
            "seeds": [0, 1]}
    tree.update(over)
    return build_study(tree)


def test_grid_expands_methods_x_budgets_x_points_x_seeds():
    specs = expand(_study())
    assert len(specs) == (2 * 3 + 1) * 3 * 2
    a = [s for s in specs if s.method == "A"]
    assert {(s.hparams["server.lr"], s.hparams["privacy.clip_norm"]) for s in a} == {
        (lr, c) for lr in (0.1, 1.0) for c in (1.0, 5.0, 10.0)}
    assert len({s.run_id for s in specs}) == len(specs)  # ids are unique ...
    assert [s.run_id for s in expand(_study())] == [s.run_id for s in specs]  # ... and deterministic


def test_merge_order_base_budget_method_point_seed():
    specs = expand(_study())
    first = next(s for s in specs if s.method == "A" and s.budget == "eps8" and s.seed == 1
                 and s.hparams == {"server.lr": 1.0, "privacy.clip_norm": 5.0})
    cfg = first.config
    assert cfg.rounds == 3  # base
    assert cfg.privacy.noise_multiplier == "auto" and cfg.privacy.target_epsilon == 8  # budget
    assert cfg.server.momentum == 0.0  # method
    assert cfg.server.lr == 1.0 and cfg.privacy.clip_norm == 5.0  # grid point over base
    assert cfg.seed == 1
    assert cfg.output_dir == Path("out") / "runs" / first.run_id
    b = next(s for s in specs if s.method == "B" and s.budget == "z0.3")
    assert b.config.server.optimizer == "adam" and b.config.server.lr == 0.7  # base lr kept
    assert b.config.privacy.noise_multiplier == 0.3 and b.config.privacy.target_epsilon is None
    assert b.hparams == {} and b.hparams_label == "-"


def test_run_ids_are_readable_and_safe_as_folder_names():
    rid = run_id("DiSK + FedAvgM", "eps8", {"server.lr": 0.1, "server.disk": {"kappa": 0.7}}, 2)
    assert rid.startswith("DiSK-FedAvgM__eps8__server.lr=0.1_server.disk=")
    assert rid.endswith("__s2") and "/" not in rid and " " not in rid


def test_metric_and_selection_defaults_follow_the_task():
    study = _study()
    assert study_metric(study, expand(study)[0].config.data.task) == "test_accuracy"
    multilabel = _study(base={"data": {"task": "tag_multilabel"}})
    assert study_metric(multilabel, expand(multilabel)[0].config.data.task) == "test_recall_at_5"
    assert selection_rule(study, "test_accuracy") == ("test_accuracy", "max", "final")
    loss = _study(selection={"metric": "train_loss"})
    assert selection_rule(loss, "test_accuracy") == ("train_loss", "min", "final")


@pytest.mark.parametrize("over, field", [
    ({"seeds": [0, 0]}, "seeds"),
    ({"budgets": [{"epsilon": 1, "noise_multiplier": 1}]}, "budgets.0"),
    ({"budgets": [{"epsilon": -1}]}, "budgets.0.epsilon"),
    ({"budgets": []}, "budgets"),
    ({"methods": {"A": {"sett": {}}}}, "methods.A.sett"),
    ({"methods": {"A": {"grid": {"server.lr": []}}}}, "methods.A.grid"),
    ({"selection": {"at": "middle"}}, "selection.at"),
    ({"colour": "red"}, "colour"),
])
def test_study_errors_name_the_field(over, field):
    with pytest.raises(ConfigError) as err:
        _study(**over)
    assert field in str(err.value)


def test_run_config_errors_name_the_method_and_the_field():
    with pytest.raises(ConfigError) as err:
        expand(_study(methods={"B": {"set": {"server": {"optimizer": "adam", "momentun": 0.9}}}}))
    assert "methods.B" in str(err.value) and "server.momentun" in str(err.value)
    with pytest.raises(ConfigError) as err:
        expand(_study(methods={"A": {"grid": {"privacy.clip_norm": [1.0, -2.0]}}}))
    assert "privacy.clip_norm" in str(err.value) and "grid point" in str(err.value)


def test_a_method_cannot_change_the_budget():
    with pytest.raises(ConfigError, match="privacy.noise_multiplier is set by the study's budgets"):
        expand(_study(methods={"A": {"set": {"privacy": {"noise_multiplier": 2.0}}}}))
    with pytest.raises(ConfigError, match="privacy.target_epsilon"):
        expand(_study(methods={"A": {"grid": {"privacy.target_epsilon": [1, 2]}}}))


def test_set_overrides_address_study_fields(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\noutput_dir: out\nmethods: {A: {}}\nbudgets: [{epsilon: 3}]\n")
    study = load_study(path, ["seeds=[3,4]", "base.rounds=5", "methods.A.grid.server.lr=[0.1,0.2]"])
    specs = expand(study)
    assert [s.seed for s in specs] == [3, 4, 3, 4]
    assert {s.config.rounds for s in specs} == {5}
    assert [s.hparams for s in specs][::2] == [{"server.lr": 0.1}, {"server.lr": 0.2}]


def test_compare_cli_names_the_bad_study_field(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\noutput_dir: out\nmethods: {A: {set: {client: {lr: -1}}}}\nbudgets: [{epsilon: 3}]\n")
    assert main(["compare", str(path)]) == 2
    assert "client.lr" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    assert main(["compare", str(path), "--set", "seeds=[0,"]) == 2
    assert "'seeds'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("study_*.yaml"))
                         + ["compare_server_optimizers.yaml", "compare_adambc_regime.yaml",
                            "compare_adambc_low_noise.yaml"])
def test_shipped_studies_are_valid(name):
    specs = expand(load_study(REPO / "configs" / name))
    assert specs and all(s.config.rounds >= 1 for s in specs)


def test_study_e_parts_share_part_1s_setting_and_take_its_selected_rates():
    """Parts 2 and 4 run part 1's methods (same settings, same grids, so its selection applies) on part 1's
    setting; part 4 only trains the emulated cohort for real; part 3 runs on the same setting."""
    grid, comparison, real, nonprivate = (load_study(REPO / "configs" / f"study_e_{n}.yaml")
                                          for n in ("lr_grid", "comparison", "real_cohort", "nonprivate"))
    for tuned_part in (comparison, real):
        assert tuned_part.tuned_on is not None
        assert tuned_part.tuned_on.summary == Path("docs/results/study_e_lr_grid.json")
        assert tuned_part.tuned_on.budget == "eps8" and "eps8" in {b.name for b in grid.budgets}
        assert tuned_part.methods == grid.methods
    assert comparison.base == grid.base == nonprivate.base and comparison.output_dir == grid.output_dir
    emulation = {"expected_cohort": 100, "noise_cohort": 1000, "noise_population": 342477}
    assert {k: grid.base["privacy"][k] for k in emulation} == emulation
    assert real.base["privacy"]["expected_cohort"] == 1000 and "noise_cohort" not in real.base["privacy"]
    strip = lambda base: {**base, "checkpoint_every": None,  # noqa: E731
                          "privacy": {k: v for k, v in base["privacy"].items() if k not in emulation}}
    assert strip(real.base) == strip(grid.base)
