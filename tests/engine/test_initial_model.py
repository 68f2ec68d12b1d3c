"""The initial model is a function of the run seed alone (a random initialisation, e.g. the LSTM's)."""

import torch

from fedprivacy.fl.server_app import initial_model
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task


def _flat(state: dict) -> torch.Tensor:
    return torch.cat([state[k].reshape(-1) for k in sorted(state)])


def test_a_run_starts_from_its_seeds_model_whatever_ran_before_in_the_process(small_config, tmp_path):
    """Two identical next-word runs in one process (as a sweep worker runs them), with torch's global
    generator moved in between, start from the same x_0 and end bit-identical; another seed starts elsewhere."""
    def once(name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        torch.randn(1000)  # whatever ran before: another run, a client's model, a user's code
        cfg = small_config("data.task=next_word", "rounds=1", "eval_every=1", "privacy.noise_multiplier=0",
                           f"seed={seed}", f"output_dir={tmp_path / name}")
        run(cfg)
        return (_flat(torch.load(cfg.output_dir / "initial_model.pt")),
                _flat(torch.load(cfg.output_dir / "final_model.pt")))

    first, second, other = once("a", 0), once("b", 0), once("c", 1)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not torch.equal(first[0], other[0])


def test_it_leaves_torchs_global_generator_as_it_was(small_config):
    task = load_task(small_config("data.task=next_word").data)
    before = torch.get_rng_state()
    initial_model(task, 0, "cpu")
    assert torch.equal(torch.get_rng_state(), before)
