"""Study fixtures: a tiny study on the session's small synthetic data."""

import pytest
import yaml


@pytest.fixture
def tiny_study(small_data, tmp_path):
    """``make(**top_level_overrides) -> path`` of a study YAML: 2 methods (one with a 2-point grid) x 1 budget x 2 seeds."""

    def make(**over):
        tree = {
            "name": "tiny",
            "description": "two methods on 40 users",
            "output_dir": str(tmp_path / "study"),
            "base": {"rounds": 4, "eval_every": 2, "checkpoint_every": 1,
                     "data": {"path": str(small_data), "generate_if_missing": False, "vocab_size": 2000, "num_tags": 50},
                     "client": {"epochs": 1, "batch_size": 10, "lr": 5.0},
                     "privacy": {"clip_norm": 1.0, "expected_cohort": 8, "accountants": ["rdp", "pld"]}},
            "methods": {"DP-FedAvg": {"set": {"server": {"optimizer": "sgd", "momentum": 0.0}},
                                      "grid": {"server.lr": [0.5, 1.0]}},
                        "DP-FedAdam": {"set": {"server.optimizer": "adam", "server.lr": 0.01}}},
            "budgets": [{"epsilon": 8}],
            "seeds": [0, 1],
        }
        tree.update(over)
        path = tmp_path / "study.yaml"
        path.write_text(yaml.safe_dump(tree, sort_keys=False))
        return path

    return make
