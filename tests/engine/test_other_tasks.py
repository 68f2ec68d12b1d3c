"""Federated runs of the multi-label tag and next-word tasks through the same pipeline (issue 3)."""

import math

import pandas as pd
import pytest
import torch

from fedprivacy.client.trainer import client_generator, local_sgd
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("task,metric", [("tag_multilabel", "test_recall_at_5"), ("next_word", "test_accuracy")])
def test_two_rounds_run_and_report_the_tasks_metric(small_config, task, metric):
    cfg = small_config(f"data.task={task}", "client.lr=0.5", "privacy.noise_multiplier=0.1")
    summary = run(cfg)
    assert summary["rounds_completed"] == 2
    rows = pd.read_csv(cfg.output_dir / "metrics.csv")
    assert math.isfinite(rows[metric].iloc[-1]) and 0.0 <= rows[metric].iloc[-1] <= 1.0
    assert math.isfinite(rows["epsilon_rdp"].iloc[-1])


@pytest.mark.parametrize("task", ["tag_multilabel", "next_word"])
def test_local_training_minimises_the_tasks_own_loss(small_config, task):
    """The client delta comes from the task's loss (BCE / masked CE), lowers it, and leaves x_t in place."""
    cfg = small_config(f"data.task={task}")
    t = load_task(cfg.data)
    model = t.new_model()
    x, y = t.client_data(0)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        loss0 = float(t.loss(model(x), y))
    result = local_sgd(model, x, y, epochs=3, batch_size=8, lr=0.5, rng=client_generator(0, 1, 0), loss_fn=t.loss)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # x_t restored
    vector = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    torch.nn.utils.vector_to_parameters(vector + result.update.to_dense(), model.parameters())
    with torch.no_grad():
        assert float(t.loss(model(x), y)) < loss0


def test_a_model_without_update_support_gets_a_dense_delta_equal_to_plain_sgd():
    """No ``update_support``: the delta is dense (indices None) and is plain SGD from ``start_from``; x_t is restored."""
    import copy

    import numpy as np
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x, y = torch.randn(10, 3), torch.randint(0, 2, (10,))
    x_t = parameters_to_vector(model.parameters()).detach().clone()
    start = x_t + 0.1

    def loss_fn(logits, labels):
        return torch.nn.functional.cross_entropy(logits, labels)

    result = local_sgd(model, x, y, epochs=2, batch_size=4, lr=0.3, rng=client_generator(0, 1, 0), start_from=start,
                       loss_fn=loss_fn)
    reference = copy.deepcopy(model)
    vector_to_parameters(start.clone(), reference.parameters())
    opt = torch.optim.SGD(reference.parameters(), lr=0.3)
    rng = client_generator(0, 1, 0)
    for _ in range(2):
        order = rng.permutation(10)
        for lo in range(0, 10, 4):
            idx = order[lo:lo + 4]
            opt.zero_grad()
            loss_fn(reference(x[idx]), y[idx]).backward()
            opt.step()
    assert result.update.indices is None and result.update.dim == x_t.numel()
    assert torch.equal(result.update.values, parameters_to_vector(reference.parameters()).detach() - start)
    assert torch.equal(parameters_to_vector(model.parameters()).detach(), x_t)
    assert np.isfinite(result.train_loss)
