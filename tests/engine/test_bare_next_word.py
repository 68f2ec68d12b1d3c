"""The next-word benchmark's bare loop (``benchmarks/bare_next_word.py``, issue 24 item 1) computes the same
DP-FedAvg model as the framework: without noise, from the same initial LSTM, on the same cohorts, the final
models agree."""

import sys
from pathlib import Path

import pytest
import torch

from fedprivacy.privacy.sampling import make_sampler
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import NextWordTask, load_task

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bare_next_word import bare_next_word_dp_fedavg  # noqa: E402

pytestmark = pytest.mark.slow


def test_bare_next_word_loop_trains_the_same_model_as_the_framework(small_config, monkeypatch):
    cfg = small_config("data.task=next_word", "data.max_examples_per_client=12", "rounds=2", "eval_every=100",
                       "client.batch_size=4", "client.lr=0.5", "privacy.noise_multiplier=0", "privacy.sampling=fixed",
                       "privacy.accountants=[rdp]", "server.momentum=0", "server.lr=0.7")
    new_model = NextWordTask.new_model

    def same_initial_model(self, device="cpu"):  # every model built (the run's, the loop's) starts equal
        torch.manual_seed(7)
        return new_model(self, device)

    monkeypatch.setattr(NextWordTask, "new_model", same_initial_model)
    run(cfg)
    task = load_task(cfg.data)
    sampler = make_sampler("fixed", task.population, 8, cfg.seed)
    cohorts = [sampler.sample() for _ in range(2)]
    model = task.new_model()
    start = [p.detach().clone() for p in model.parameters()]
    bare_next_word_dp_fedavg(model, task.train.tokens, task.partition.starts, task.partition.stops, cohorts=cohorts,
                             batch_size=4, client_lr=0.5, clip=1.0, z=0.0, server_lr=0.7, seed=cfg.seed)
    state = torch.load(cfg.output_dir / "final_model.pt")
    assert max(task.partition.stops - task.partition.starts) > 4  # some clients take several steps
    for (name, p), p0 in zip(model.named_parameters(), start):
        assert not torch.equal(p, p0), name  # the loop trained
        torch.testing.assert_close(p.detach(), state[name], atol=2e-6, rtol=1e-5, msg=name)
