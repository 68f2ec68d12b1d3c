"""The benchmark's bare loop (``benchmarks/bare_loop.py``, issue "Speed" goal 3) computes the same
DP-FedAvg model as the framework: without noise, on the same cohorts, the final models agree."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedprivacy.privacy.sampling import make_sampler
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bare_loop import bare_dp_fedavg  # noqa: E402


@pytest.mark.parametrize(("overrides", "bare"), [
    (("client.epochs=2", "server.lr=0.7"), {"epochs": 2, "client_lr": 5.0, "server_lr": 0.7}),
    (("data.task=tag_multilabel", "client.lr=50"), {"client_lr": 50.0}),  # sigmoid BCE (so_multilabel_round.py)
])
def test_bare_loop_trains_the_same_model_as_the_framework(small_config, overrides, bare):
    cfg = small_config("rounds=3", "privacy.noise_multiplier=0", "privacy.sampling=fixed", "privacy.accountants=[rdp]",
                       "server.momentum=0", *overrides)
    run(cfg)
    task = load_task(cfg.data)
    sampler = make_sampler("fixed", task.population, 8, cfg.seed)
    cohorts = [sampler.sample() for _ in range(3)]
    f = task.train.features
    multilabel = cfg.data.task == "tag_multilabel"
    params, _ = bare_dp_fedavg(f.indptr, f.indices, f.data, None if multilabel else task.train.labels,
                               task.partition.starts, task.partition.stops, vocab=2000, classes=50, rounds=3, cohort=8,
                               batch_size=10, clip=1.0, z=0.0, seed=cfg.seed, cohorts=cohorts,
                               **({"tags": task.train.tags} if multilabel else {}), **bare)
    state = torch.load(cfg.output_dir / "final_model.pt")
    assert max(np.asarray(task.partition.stops) - task.partition.starts) > 10  # some clients take several steps
    assert params.abs().max() > 1e-3
    assert torch.allclose(params[0], state["bias"], atol=1e-6)
    assert torch.allclose(params[1:], state["embedding.weight"], atol=1e-6)
