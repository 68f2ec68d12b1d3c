"""A user's own task, named in the config as ``package.module:factory``: nothing in fedprivacy's core
dispatches on its name, and the run trains it under user-level DP (issue "Open the engine", item 4)."""

import json
import textwrap

import pytest

from fedprivacy.config import ConfigError, build_config
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task
from fedprivacy.task import Task

USER_TASK = textwrap.dedent('''
    """A toy task a user writes: 30 users, 2-D points, label = sign of the first coordinate."""
    import torch
    from torch import nn


    class Blobs:
        population = 30
        majority_baseline = 0.5

        def __init__(self, data_config):
            gen = torch.Generator().manual_seed(0)
            self.x = torch.randn(30, 40, 2, generator=gen)
            self.test_x = torch.randn(500, 2, generator=gen)

        def new_model(self, device="cpu"):
            torch.manual_seed(1)
            return nn.Linear(2, 2).to(device)

        def client_data(self, index):
            x = self.x[index]
            return x, (x[:, 0] > 0).long()

        def loss(self, logits, labels):
            return nn.functional.cross_entropy(logits, labels)

        def evaluate(self, model):
            with torch.no_grad():
                accuracy = (model(self.test_x).argmax(1) == (self.test_x[:, 0] > 0).long()).float().mean()
            return {"test_accuracy": float(accuracy)}


    def make(data_config):
        return Blobs(data_config)
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_blobs.py").write_text(USER_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_blobs:make"


def test_a_user_task_trains_under_user_level_dp_and_reports_epsilon(user_module, tmp_path):
    cfg = build_config({"rounds": 10, "eval_every": 10, "output_dir": str(tmp_path / "run"),
                        "data": {"task": user_module},
                        "client": {"epochs": 1, "batch_size": 10, "lr": 0.5},
                        "privacy": {"clip_norm": 1.0, "noise_multiplier": 0.5, "expected_cohort": 10,
                                    "accountants": ["rdp"]}})
    assert isinstance(load_task(cfg.data), Task)
    summary = run(cfg)
    assert summary["rounds_completed"] == 10 and summary["test_accuracy"] > 0.8  # majority 0.5
    assert 0 < summary["epsilon_rdp"] < 100
    assert summary["data"] == {"source": "user task", "task": user_module}
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["releases"] == 10


def test_a_bad_task_name_or_object_is_refused_naming_the_field(user_module, tmp_path):
    with pytest.raises(ConfigError, match="data.task"):
        build_config({"data": {"task": "not a module path"}})
    (tmp_path / "broken_task.py").write_text("def make(cfg):\n    return object()\n")
    with pytest.raises(ConfigError, match="data.task: 'broken_task:make' returned a object without population"):
        load_task(build_config({"data": {"task": "broken_task:make"}}).data)
    with pytest.raises(ConfigError, match="data.task: cannot import"):
        load_task(build_config({"data": {"task": "no_such_module_x:make"}}).data)
