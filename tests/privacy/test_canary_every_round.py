"""The every-round canary statistic (Andrew et al., arXiv:2302.03098, the "all iterates" adversary):
:func:`fedprivacy.privacy.canary_estimates.max_over_rounds`, simulated on the Gaussian mechanism."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fedprivacy.privacy.accounting import epsilon_for
from fedprivacy.privacy.canary_estimates import cosines, gaussian_pair_epsilon, max_over_rounds, one_shot_epsilon

DIM, CANARIES, UNUSED, ROUNDS, RATE, DELTA = 2000, 200, 200, 10, 0.5, 1e-5


def _every_round_estimate(z: float, seed: int):
    """``ROUNDS`` releases of the Poisson-subsampled Gaussian mechanism (clip norm 1, noise std ``z``) whose only
    members are ``CANARIES`` unit-direction canaries, half of them included; the one-shot estimate of the
    every-round statistic (the included canaries against the excluded ones and ``UNUSED`` fresh directions)."""
    g, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    directions = torch.randn(CANARIES + UNUSED, DIM, generator=g, dtype=torch.float64)
    directions /= torch.linalg.vector_norm(directions, dim=1, keepdim=True)
    included = rng.random(CANARIES) < 0.5
    running = None
    for _ in range(ROUNDS):
        sampled = torch.from_numpy(included & (rng.random(CANARIES) < RATE))
        release = directions[:CANARIES][sampled].sum(0) + z * torch.randn(DIM, generator=g, dtype=torch.float64)
        running = max_over_rounds(running, cosines(release, directions))
    null = np.concatenate([running[:CANARIES][~included], running[CANARIES:]])
    return one_shot_epsilon(running[:CANARIES][included], null, DELTA, resamples=200, rng=rng)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_correct_mechanism_is_not_estimated_above_its_claim(seed):
    """z = 1, q = 1/2, 10 rounds: the accountant's (pld) epsilon of the composition is 10.5; the every-round
    estimate reads about 5, and its whole 95% interval lies below the claim."""
    claim = epsilon_for("poisson", RATE, 1.0, ROUNDS, DELTA, "pld")
    estimate = _every_round_estimate(1.0, seed)
    assert 0 < estimate.epsilon and estimate.interval[1] < claim


def test_no_noise_is_estimated_far_above_any_claim():
    claim = epsilon_for("poisson", RATE, 1.0, ROUNDS, DELTA, "pld")
    assert _every_round_estimate(0.0, 0).interval[0] > 3 * claim


def test_a_round_of_too_little_noise_shows_in_the_every_round_statistic():
    """z / 4 claimed as z: the every-round estimate exceeds the claim of z."""
    claim = epsilon_for("poisson", RATE, 1.0, ROUNDS, DELTA, "pld")
    assert _every_round_estimate(0.25, 0).interval[0] > claim


@given(rounds=st.lists(arrays(np.float64, 5, elements=st.floats(-1, 1)), min_size=1, max_size=6))
def test_the_running_statistic_is_the_maximum_over_rounds(rounds):
    running = None
    for cos in rounds:
        before = None if running is None else running.copy()
        running = max_over_rounds(running, cos)
        if before is not None:
            assert (running >= before).all()
    assert np.array_equal(running, np.max(np.stack(rounds), axis=0))


def test_a_round_of_another_length_is_refused():
    with pytest.raises(ValueError, match=r"round_cosines has shape \(3,\), the running statistic \(4,\)"):
        max_over_rounds(np.zeros(4), np.zeros(3))


@pytest.mark.parametrize("mean, null_mean, std", [(0.01, 0.0, 0.0035), (-0.0368, 0.00128, 0.000182213151989512),
                                                  (0.000495, -0.01695, 0.000151865342792733)])
@pytest.mark.parametrize("ratio", [1 + 1e-16, 1 - 1e-15, 1 + 1e-12])
def test_stds_equal_up_to_rounding_read_as_equal_ones(mean, null_mean, std, ratio):
    """A bootstrap fit can give two stds a rounding error apart (the quadratic's leading coefficient 0 or tiny):
    the epsilon is the equal-std one (continuity), in either direction, not a crash or garbage."""
    equal = gaussian_pair_epsilon(mean, std, null_mean, std, DELTA)
    assert gaussian_pair_epsilon(mean, std * ratio, null_mean, std, DELTA) == pytest.approx(equal, rel=1e-3)
    assert gaussian_pair_epsilon(null_mean, std, mean, std * ratio, DELTA) == pytest.approx(equal, rel=1e-3)


def test_stds_whose_squares_round_alike_read_as_equal_ones():
    """Two stds one float apart whose ``1 / (2 s^2)`` round to one value: the log-likelihood ratio is linear."""
    std = 0.00022454905991317237
    other = float(np.nextafter(std, 1))
    assert other != std and 1 / (2 * std**2) == 1 / (2 * other**2)
    equal = gaussian_pair_epsilon(0.001, std, 0.0, std, DELTA)
    assert gaussian_pair_epsilon(0.001, other, 0.0, std, DELTA) == pytest.approx(equal, rel=1e-6)
    assert gaussian_pair_epsilon(0.0, std, 0.001, other, DELTA) == pytest.approx(equal, rel=1e-6)
