"""Broken mechanisms that only show ACROSS rounds, caught by a canary run (fedprivacy.fl.canaries): each round's
noise looks right, but the run leaks more than it accounts. The correct mechanism passes (the one-shot
estimate's interval starts and the one-run bound lies at most at the claim, 95%); each broken one fails (the
interval or the bound lies above it):

(a) a correlated stream with wrong coefficients: noise of the claimed std every release, accounted as
    independent, drawn as (w_t - w_{t-1}) / sqrt 2, so that the noise of the run's sum telescopes away;
(b) a min-separated schedule whose separation is not enforced: every group's cohort every round;
(c) a resume that replays noise draws: a stream that restarts from its seed instead of its checkpointed state
    (with fresh draw fingerprints, or the release log would refuse it), scored on the release differences
    that cancel the replayed noise;
(d) secure aggregation whose Skellam shares have half the variance the ledger accounts.

Each runs a model of 2,010 parameters (vocabulary 200, 10 tags) for a few rounds."""

import json
import math

import numpy as np
import pytest
import torch
from flwr.serverapp import ServerApp
from torch.nn.utils import parameters_to_vector

from fedprivacy.engines.inprocess import run_inprocess
from fedprivacy.fl import secure_aggregation
from fedprivacy.fl.canaries import RunCanaries, population_with_canaries
from fedprivacy.fl.client_app import build_client_app
from fedprivacy.fl.server_app import DPFedAvgServer, initial_model
from fedprivacy.privacy.canary_estimates import cosines, one_run_bound, one_shot_epsilon
from fedprivacy.privacy.noise import GaussianNoise
from fedprivacy.privacy.sampling import MinSeparatedSampler
from fedprivacy.privacy.skellam import SkellamParams
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task

SMALL = ("data.vocab_size=200", "data.num_tags=10", "privacy.delta=1e-5")


class AntiCorrelatedNoise(GaussianNoise):
    r"""(a) Noise with wrong coefficients: release ``t`` adds :math:`zC (w_t - w_{t-1})/\sqrt 2` (``w_0`` drawn
    first), of the claimed marginal std :math:`zC`, and keeps :class:`GaussianNoise`'s event (independent noise);
    the noise of releases ``1..T`` sums to :math:`zC (w_T - w_0)/\sqrt 2` instead of std :math:`zC\sqrt T`."""

    def __init__(self, seed: int, **kwargs) -> None:
        super().__init__(seed, **kwargs)
        self._last: torch.Tensor | None = None

    def prefetch_(self, like: torch.Tensor) -> None:
        """No early draw (the protocol allows doing nothing)."""

    def add_(self, target: torch.Tensor, std: float) -> None:
        if self._last is None:
            self._last = self._draw(target)
        w = self._draw(target)
        target.add_(w - self._last, alpha=std / math.sqrt(2))
        self._last = w


class EveryGroup(MinSeparatedSampler):
    """(b) Min-separated in name and accounting (one Gaussian per cycle), but every group's cohort is drawn every
    round: each user takes part ``groups`` times per cycle."""

    def sample(self, release: int = 1) -> np.ndarray:
        return np.sort(np.concatenate([super(EveryGroup, self).sample(r) for r in range(release, release + self.groups)]))


def every_group(population: int, expected_cohort: int, seed: int, secure: bool, groups: int) -> EveryGroup:
    return EveryGroup(population, expected_cohort, seed, secure, groups)


class ReplayingNoise(GaussianNoise):
    """(c) A stream that ignores its checkpointed generator on resume: it draws again from its seed's start, so the
    releases after a resume replay the first ones' noise; its draw fingerprints count the resumes, so the release
    log sees new draws."""

    def __init__(self, seed: int, **kwargs) -> None:
        super().__init__(seed, **kwargs)
        self._resumes = 0

    def draw_id(self) -> str:
        return f"{super().draw_id()}-{self._resumes}"

    def load_state_dict(self, state: dict) -> None:
        self._resumes += 1


class HalfShareSkellam(SkellamParams):
    """(d) The clients' Skellam shares with half the variance the server's ledger accounts (the server keeps
    :class:`SkellamParams`)."""

    @property
    def share_variance(self) -> float:
        return super().share_variance / 2


def _passes(e: dict) -> bool:
    """The canaries' verdict (module docstring): True when neither the interval's start nor the bound is above."""
    claim = e["epsilon_claimed"]
    return e["andrew"]["interval"][0] <= claim and e["steinke"]["epsilon_lower_bound"] <= claim


ANTI = ("privacy.canaries={count: 100, unused: 100, seed: 3}", "rounds=20", "privacy.noise_multiplier=1.0",
        "privacy.budget_accountant=pld", "eval_every=20")


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["independent", "wrong-coefficients"])
def test_a_stream_whose_noise_cancels_across_rounds_is_caught(small_config, broken):
    stream = (f"privacy.noise_stream={__name__}:AntiCorrelatedNoise",) if broken else ()
    e = run(small_config(*SMALL, *ANTI, *stream))["empirical_epsilon"]
    assert _passes(e) != broken, e


SEPARATED = ("privacy.canaries={count: 60, unused: 100, seed: 3}", "rounds=10", "privacy.noise_multiplier=2.0",
             "privacy.budget_accountant=pld", "privacy.groups=5", "privacy.expected_cohort=20", "eval_every=10")


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["min-separated", "separation-not-enforced"])
def test_a_schedule_that_ignores_the_separation_is_caught(small_config, broken):
    """40 users and 60 canaries in 5 groups of 20: the schedule takes a whole group per round, so each member joins
    2 of the 10 rounds as accounted; the broken one takes every group every round (10 of 10)."""
    sampling = f"{__name__}:every_group" if broken else "min_separated"
    e = run(small_config(*SMALL, *SEPARATED, f"privacy.sampling={sampling}"))["empirical_epsilon"]
    assert _passes(e) != broken, e


def _releases(cfg, resume: bool) -> list[torch.Tensor]:
    """The model after each round of a (resumed) run of ``cfg``, from DPFedAvgServer's on_round."""
    task, models = load_task(cfg.data), []
    app = ServerApp()

    @app.main()
    def main(grid, context):
        server = DPFedAvgServer(cfg, task, on_round=lambda t, row: models.append(server.params.detach().clone()),
                                resume=resume)
        server.run(grid)

    run_inprocess(app, build_client_app(cfg), population_with_canaries(cfg, task.population))
    return models


REPLAY = ("privacy.canaries={count: 100, unused: 100, seed: 3}", "privacy.noise_multiplier=1.0", "privacy.budget_accountant=pld",
          "checkpoint_every=5", "eval_every=10", "server.momentum=0")


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["fresh-after-resume", "replayed"])
def test_a_resume_that_replays_noise_draws_is_caught(small_config, tmp_path, broken):
    """5 rounds, a resume, 5 more, server SGD without momentum (each model step is the release): the adversary who
    sees every release scores each canary by the largest |cosine| of its direction with the difference of release
    j + 5 and release j (j = 1..5), in which replayed noise cancels; the claim is the run's own (pld, 10 rounds)."""
    stream = (f"privacy.noise_stream={__name__}:ReplayingNoise",) if broken else ()
    opts = (*SMALL, *REPLAY, *stream, f"output_dir={tmp_path / 'run'}")
    first = _releases(small_config(*opts, "rounds=5"), resume=False)
    cfg = small_config(*opts, "rounds=10")
    later = _releases(cfg, resume=True)
    task = load_task(cfg.data)
    start = parameters_to_vector(initial_model(task, cfg.seed, cfg.device).parameters()).detach()
    steps = [b - a for a, b in zip([start, *first, *later][:-1], [*first, *later])]
    differences = torch.stack([steps[j + 5] - steps[j] for j in range(5)])
    canaries = RunCanaries(cfg.privacy.canaries, task.population, start.numel())
    directions = torch.stack([canaries.direction(i) for i in range(canaries.count + canaries.cfg.unused)])
    scores = np.max([np.abs(cosines(d, directions)) for d in differences], axis=0)
    inc, k = canaries.included, canaries.count
    claim = json.loads((tmp_path / "run" / "summary.json").read_text())["epsilon_pld"]
    andrew = one_shot_epsilon(scores[:k][inc], np.concatenate([scores[:k][~inc], scores[k:]]), 1e-5,
                              rng=np.random.default_rng(0))
    steinke = one_run_bound(scores[:k], inc, k // 4, k // 4, 1e-5)
    verdict = {"epsilon_claimed": claim, "andrew": {"interval": andrew.interval},
               "steinke": {"epsilon_lower_bound": steinke.epsilon_lower_bound}}
    assert _passes(verdict) != broken, verdict


SECURE = ("privacy.canaries={count: 400, unused: 400, seed: 3}", "privacy.placement=distributed",
          "privacy.secure_aggregation={threshold: 3, neighbours: 5}", "privacy.accountants=[rdp]",
          "privacy.budget_accountant=rdp", "privacy.expected_cohort=440", "rounds=2",
          f"privacy.noise_multiplier={math.sqrt(2)}", "eval_every=2", "client.lr=0.001", "server.momentum=0")


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["skellam", "half-share-variance"])
def test_secure_aggregation_with_half_the_share_variance_is_caught(small_config, monkeypatch, broken):
    """Every member every round (Poisson with q = 440 / 440 = 1), server SGD without momentum and users that barely
    train (client lr 1e-3: their updates would add to the canaries' scores what is not the mechanism's noise), so
    the final model is the run's sufficient statistic and the estimate is close to the claim (GDP mu = sqrt(T) / z
    = 1); shares of half the variance raise mu by sqrt 2."""
    if broken:
        monkeypatch.setattr(secure_aggregation, "SkellamParams", HalfShareSkellam)  # the clients' side only
    e = run(small_config(*SMALL, *SECURE))["empirical_epsilon"]
    assert _passes(e) != broken, e
