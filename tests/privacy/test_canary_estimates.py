"""The two one-run privacy estimates (fedprivacy.privacy.canary_estimates): their defining properties, and
their validity and power on simulated mechanisms whose epsilon is known."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.integrate import quad
from scipy.optimize import brentq
from scipy.stats import binom, norm

from fedprivacy.privacy.audit_stats import gdp_delta, gdp_epsilon
from fedprivacy.privacy.canary_estimates import (EPSILON_BRACKET, _delta_one_way, _variance, cosines,
                                                 gaussian_pair_epsilon, one_run_bound, one_run_epsilon_lower_bound,
                                                 one_run_p_value, one_shot_epsilon)

DELTA = 1e-5


@given(mu=st.floats(0.05, 8.0), delta=st.sampled_from([1e-6, 1e-5, 1e-3, 0.05]),
       ratio=st.sampled_from([1 + 1e-9, 1 - 1e-9]))
@settings(max_examples=40, deadline=None)
def test_unequal_variance_path_converges_to_the_gdp_conversion(mu, delta, ratio):
    """The numerical privacy profile of two Gaussians, at a std ratio of 1 +- 1e-9, is the GDP conversion."""
    assert gaussian_pair_epsilon(mu, 1.0, 0.0, 1.0, delta) == gdp_epsilon(mu, delta)  # the shared function
    assert gaussian_pair_epsilon(mu, ratio, 0.0, 1.0, delta) == pytest.approx(gdp_epsilon(mu, delta), rel=1e-4,
                                                                              abs=1e-6)


@given(m1=st.floats(-3, 3), s1=st.floats(0.3, 3), m0=st.floats(-3, 3), s0=st.floats(0.3, 3),
       eps=st.floats(0.0, 4.0))
@settings(max_examples=30, deadline=None)
def test_privacy_profile_is_the_hockey_stick_integral(m1, s1, m0, s0, eps):
    """delta_{P||Q}(eps) = integral of (p(x) - e^eps q(x))_+ dx, the definition, by quadrature."""
    if abs(s1 - s0) < 1e-6:
        s1 = s0 + 1e-3
    p, q = norm(m1, s1), norm(m0, s0)
    lo, hi = min(m1 - 12 * s1, m0 - 12 * s0), max(m1 + 12 * s1, m0 + 12 * s0)
    # the integrand's kinks (where p = e^eps q) as edges too: quadrature across a kink is off by ~1e-7
    grid = np.linspace(lo, hi, 4001)
    log_ratio = p.logpdf(grid) - q.logpdf(grid) - eps
    kinks = [brentq(lambda x: p.logpdf(x) - q.logpdf(x) - eps, grid[i], grid[i + 1])
             for i in np.flatnonzero(np.sign(log_ratio[:-1]) != np.sign(log_ratio[1:]))]
    edges = np.unique(np.concatenate([np.linspace(lo, hi, 41), kinks]))
    exact = sum(quad(lambda x: max(p.pdf(x) - math.exp(eps) * q.pdf(x), 0.0), a, b, epsabs=1e-12)[0]
                for a, b in zip(edges[:-1], edges[1:]))
    assert _delta_one_way(eps, (m1, s1), (m0, s0)) == pytest.approx(exact, abs=1e-7)


@given(m1=st.floats(-2, 2), s1=st.floats(0.2, 3), m0=st.floats(-2, 2), s0=st.floats(0.2, 3))
@settings(max_examples=30, deadline=None)
def test_pair_epsilon_is_symmetric_and_zero_for_equal_laws(m1, s1, m0, s0):
    assert gaussian_pair_epsilon(m1, s1, m0, s0, DELTA) == gaussian_pair_epsilon(m0, s0, m1, s1, DELTA)
    assert gaussian_pair_epsilon(m1, s1, m1, s1, DELTA) == 0.0


def test_point_masses():
    assert gaussian_pair_epsilon(1.0, 0.0, 0.0, 0.0, DELTA) == math.inf
    assert gaussian_pair_epsilon(0.0, 0.0, 0.0, 1.0, DELTA) == math.inf
    assert gaussian_pair_epsilon(0.0, 0.0, 0.0, 0.0, DELTA) == 0.0
    with pytest.raises(ValueError, match="delta"):
        gaussian_pair_epsilon(0.0, 1.0, 0.0, 1.0, 0.0)


def test_three_inserted_canaries_bootstrap_without_overflow():
    """The OverflowError of an OS-seeded 8-canary run: 3 canaries included, a bootstrap resample drew one of
    them 3 times, numpy's variance of 3 equal values was its mean's rounding error (std 5e-19, not 0), and the
    separate-variances fit of that near point mass overflowed e^eps Q. The variance of equal values is 0 (a point
    mass: +inf), and the estimate ends with numbers."""
    a = 0.0028412428893877266
    assert np.array([a, a, a]).std(ddof=1) > 0 and _variance(np.array([a, a, a])) == 0.0
    rng = np.random.default_rng(10)
    obs, null = rng.normal(0.004, 0.003, 3), rng.normal(0.0, 0.003, 16)
    est = one_shot_epsilon(obs, null, DELTA, rng=np.random.default_rng(10), resamples=1000)
    assert math.isfinite(est.epsilon) and est.interval[0] <= est.epsilon
    assert est.interval_separate[1] == math.inf  # resamples of one value: a point mass against a Gaussian


_COSINE_SCALE = st.floats(1e-6, 1.0)


@given(scale=_COSINE_SCALE, log_ratio=st.floats(-20, 20), shift=st.floats(-1e4, 1e4), centre=st.floats(-3, 3),
       delta=st.sampled_from([1e-6, 1e-5, 1e-3]))
@settings(max_examples=300, deadline=None)
def test_pair_epsilon_of_extreme_fits_is_a_number_or_inf(scale, log_ratio, shift, centre, delta):
    """Any two Gaussian fits (std ratio 1e-20..1e20, means up to 1e4 stds apart, at a cosine's scale): a
    non-negative epsilon or +inf, never an exception (the old quadratic in x overflowed at a std of 1e-14 beside
    means of 1e-2), and the same either way round."""
    null = (centre * scale, scale)
    fit = (centre * scale + shift * scale, scale * 10.0**log_ratio)
    eps = gaussian_pair_epsilon(*fit, *null, delta)
    assert eps >= 0 and not math.isnan(eps)
    assert eps == gaussian_pair_epsilon(*null, *fit, delta)
    assert eps <= EPSILON_BRACKET or eps == math.inf


@given(scale=_COSINE_SCALE, log_ratio=st.one_of(st.just(0.0), st.floats(-20, 20)), shift=st.floats(-1e4, 1e4),
       eps=st.floats(0.0, 5000.0))
@settings(max_examples=300, deadline=None)
def test_privacy_profile_is_a_probability_at_any_epsilon(scale, log_ratio, shift, eps):
    """delta_{P||Q}(eps) = integral of (p - e^eps q)_+ lies in [0, 1] at any eps (to 5000: e^eps alone overflows
    from 710), either way round, however far apart or unequal (or equal) the laws."""
    p, q = (shift * scale, scale * 10.0**log_ratio), (0.0, scale)
    assert 0.0 <= _delta_one_way(eps, p, q) <= 1.0 and 0.0 <= _delta_one_way(eps, q, p) <= 1.0


@given(ratio=st.floats(1e-300, 1e-15), mean=st.floats(-1.0, 1.0), delta=st.sampled_from([1e-6, 1e-5, 1e-3]))
@settings(max_examples=60, deadline=None)
def test_a_near_point_mass_reads_as_the_point_mass(ratio, mean, delta):
    """A std 1e-15..1e-300 of the other's is distinguished as a point mass is (+inf): the other law puts its mass
    where the narrow one has none at any epsilon the bracket expresses."""
    assert gaussian_pair_epsilon(mean * 0.003, ratio * 0.003, 0.0, 0.003, delta) == math.inf
    assert gaussian_pair_epsilon(mean * 0.003, 0.0, 0.0, 0.003, delta) == math.inf


@given(mu=st.floats(1.0, 1e300), delta=st.sampled_from([1e-6, 1e-5, 1e-3]))
@settings(max_examples=60, deadline=None)
def test_equal_stds_far_apart_are_inf_exactly_beyond_the_bracket(mu, delta):
    """Equal stds: the GDP conversion while it is within :data:`EPSILON_BRACKET`, +inf beyond (mu up to 1e300:
    gdp_epsilon's own doubling overflowed from mu 1e154)."""
    eps = gaussian_pair_epsilon(mu, 1.0, 0.0, 1.0, delta)
    if eps != math.inf:
        assert eps == gdp_epsilon(mu, delta) <= EPSILON_BRACKET
    else:  # the profile at the bracket is still above delta: epsilon > 2^20 (mu-GDP's is mu^2/2 + O(mu))
        assert gdp_delta(EPSILON_BRACKET, mu) > delta and mu > 1000


@pytest.mark.parametrize("field,args", [("mean", (math.nan, 1.0, 0.0, 1.0)), ("std", (0.0, math.inf, 0.0, 1.0)),
                                        ("null_mean", (0.0, 1.0, -math.inf, 1.0)),
                                        ("null_std", (0.0, 1.0, 0.0, math.nan))])
def test_non_finite_fits_are_refused_by_name(field, args):
    """Cosines of a diverged model (NaN or inf) are refused with the field named, not fed to the root finder."""
    with pytest.raises(ValueError, match=f"{field}="):
        gaussian_pair_epsilon(*args, DELTA)


@given(n=st.integers(2, 4), values=st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=3),
       null_equal=st.booleans(), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_one_shot_estimate_of_few_or_equal_cosines_ends_with_numbers(n, values, null_equal, seed):
    """2-4 inserted canaries drawn from 1-3 distinct cosines (identical ones, all-zero ones), against a null that
    may be constant too: every resample's fit is a number or +inf and the interval is ordered."""
    rng = np.random.default_rng(seed)
    obs = rng.choice(np.array(values), n)
    null = np.zeros(5) if null_equal else rng.normal(0.0, 0.003, 5)
    est = one_shot_epsilon(obs, null, DELTA, rng=rng, resamples=20)
    for e, (lo, hi) in ((est.epsilon, est.interval), (est.epsilon_separate, est.interval_separate)):
        assert e >= 0 and lo <= hi and not math.isnan(lo + hi)


@given(canaries=st.integers(1, 10**6), data=st.data(), delta=st.floats(1e-12, 0.5), beta=st.floats(1e-6, 0.5))
@settings(max_examples=80, deadline=None)
def test_one_run_bound_of_extreme_counts_is_finite(canaries, data, delta, beta):
    """Steinke et al.'s bound at any counts (all guesses right, none right, one canary, a million) and delta up
    to 1/2: a finite epsilon >= 0 (its search doubles while the p-value stays below beta, which ends: the p-value
    tends to 1 as epsilon grows)."""
    guesses = data.draw(st.integers(0, min(canaries, 2000)))
    correct = data.draw(st.integers(0, guesses))
    eps = one_run_epsilon_lower_bound(canaries, guesses, correct, delta, beta)
    assert 0 <= eps < math.inf


def _gaussian_release(z: float, inserted: int, unobserved: int, dim: int, seed: int, noise: bool = True):
    """One Gaussian-mechanism release of ``inserted`` unit canaries (sensitivity 1, noise std z), and the
    cosines of the inserted and of fresh canaries with it."""
    g = torch.Generator().manual_seed(seed)
    directions = torch.randn(inserted + unobserved, dim, generator=g, dtype=torch.float64)
    directions /= directions.norm(dim=1, keepdim=True)
    change = directions[:inserted].sum(0) + (z * torch.randn(dim, generator=g, dtype=torch.float64) if noise else 0)
    scores = cosines(change, directions)
    return scores[:inserted], scores[inserted:]


def test_one_shot_estimate_of_a_gaussian_release_is_its_epsilon():
    """A Gaussian release with noise z is exactly (1/z)-GDP for each canary: the estimate's interval holds that
    epsilon, and the separate-variances estimate reads higher, never lower, on average (its bias)."""
    z, claim = 1.0, gdp_epsilon(1.0, DELTA)
    observed, unobserved = _gaussian_release(z, 300, 300, 20_000, seed=1)
    est = one_shot_epsilon(observed, unobserved, DELTA, rng=np.random.default_rng(0), resamples=300)
    assert est.interval[0] <= claim <= est.interval[1]
    assert est.epsilon == pytest.approx(claim, rel=0.25)
    assert est.null_std == pytest.approx(1 / math.sqrt(20_000), rel=0.15)


def test_one_shot_estimate_does_not_exceed_a_correct_claim():
    """Simulated (40 runs, the high-dimensional cosine law of a (1/z)-GDP release): the 95% interval's lower end
    stays at or below the true epsilon in at least 36 of them (expected 39)."""
    rng = np.random.default_rng(7)
    z, dim, k = 2.0, 10_000, 200
    claim = gdp_epsilon(1 / z, DELTA)
    below = 0
    for _ in range(40):
        observed = (1 / z + rng.standard_normal(k)) / math.sqrt(dim)
        unobserved = rng.standard_normal(k) / math.sqrt(dim)
        below += one_shot_epsilon(observed, unobserved, DELTA, rng=rng, resamples=200).interval[0] <= claim
    assert below >= 36


def test_one_shot_estimate_without_noise_is_large():
    observed, unobserved = _gaussian_release(0.0, 50, 50, 5_000, seed=2, noise=False)
    est = one_shot_epsilon(observed, unobserved, DELTA, rng=np.random.default_rng(0), resamples=100)
    assert est.epsilon > 30 and est.interval[0] > 30


def test_one_shot_refuses_too_few_canaries():
    with pytest.raises(ValueError, match="at least 2 inserted"):
        one_shot_epsilon(np.zeros(1), np.zeros(5), DELTA, rng=np.random.default_rng(0))


def test_cosines_of_a_zero_change_are_zero():
    assert (cosines(torch.zeros(4), torch.eye(4)) == 0).all()
    assert cosines(torch.tensor([3.0, 4.0]), torch.tensor([[1.0, 0.0], [0.0, -2.0]])) == pytest.approx([0.6, -0.8])


@given(r=st.integers(1, 60), data=st.data())
@settings(max_examples=40, deadline=None)
def test_pure_dp_p_value_is_the_binomial_tail(r, data):
    """Steinke et al. Thm. 3.1 at delta = 0: P[W >= v] <= P[Binomial(r, e^eps / (1 + e^eps)) >= v]."""
    v = data.draw(st.integers(0, r))
    eps = data.draw(st.floats(0.0, 5.0))
    q = math.exp(eps) / (1 + math.exp(eps))
    assert one_run_p_value(100, r, v, eps, 0.0) == pytest.approx(binom.sf(v - 1, r, q), rel=1e-12, abs=1e-300)


def test_p_value_delta_term_is_the_theorems():
    """The delta term 2 m delta max_i (f(v - i) - f(v)) / i, written out from the binomial CDF."""
    m, r, v, eps, delta = 500, 40, 33, 1.0, 1e-4
    q = math.exp(eps) / (1 + math.exp(eps))
    f = lambda u: binom.sf(u - 1, r, q)  # noqa: E731
    expected = f(v) + 2 * m * delta * max((f(v - i) - f(v)) / i for i in range(1, v + 1))
    assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(expected, rel=1e-9)


def test_one_run_bound_is_valid_for_randomized_response():
    """Randomized response at eps is exactly eps-DP for each canary and meets Thm. 3.1 with equality: guessing
    every canary, the bound exceeds eps in at most beta of 4000 runs (plus 3 standard errors)."""
    eps, m, beta = 1.0, 200, 0.05
    correct = np.random.default_rng(3).binomial(m, math.exp(eps) / (1 + math.exp(eps)), size=4000)
    bounds = {v: one_run_epsilon_lower_bound(m, m, int(v), 0.0, beta) for v in np.unique(correct)}
    exceed = np.mean([bounds[v] > eps for v in correct])
    assert exceed <= beta + 3 * math.sqrt(beta * (1 - beta) / 4000)
    assert exceed > 0.01  # and the bound is not vacuous: it reaches the truth at about the stated rate


def _gaussian_canaries(mu: float, m: int, rng: np.random.Generator):
    included = rng.random(m) < 0.5
    return included * mu + rng.standard_normal(m), included


def test_one_run_bound_is_valid_for_a_gaussian_mechanism():
    """Each canary's inclusion shifts its score by mu against unit Gaussian noise (mu-GDP): the 95% bound stays
    below the true epsilon in at least 95% of 200 runs (allowing 3 standard errors)."""
    rng = np.random.default_rng(11)
    mu, m = 2.0, 1000
    truth = gdp_epsilon(mu, DELTA)
    exceed = 0
    for _ in range(200):
        scores, included = _gaussian_canaries(mu, m, rng)
        exceed += one_run_bound(scores, included, 100, 100, DELTA, 0.05).epsilon_lower_bound > truth
    assert exceed / 200 <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 200)


def test_one_run_bound_catches_a_mechanism_with_too_little_noise():
    """The run claims mu = 0.5 (its accountant's epsilon) but adds the noise of mu = 8: the bound exceeds the claim."""
    scores, included = _gaussian_canaries(8.0, 1000, np.random.default_rng(5))
    result = one_run_bound(scores, included, 100, 100, DELTA, 0.05)
    assert result.correct == 200
    assert result.epsilon_lower_bound > gdp_epsilon(0.5, DELTA)


def test_one_run_bound_counts_the_guesses():
    scores = np.array([5.0, -1.0, 3.0, 0.0, -4.0, 2.0])
    included = np.array([True, False, False, True, False, True])
    result = one_run_bound(scores, included, 2, 2, DELTA)
    assert (result.guesses, result.correct) == (4, 3)  # top 2: 5 (in), 3 (out); bottom 2: -4 (out), -1 (out)


@given(m=st.integers(-2, 5), r=st.integers(-2, 5), v=st.integers(-2, 5))
def test_one_run_bound_refuses_impossible_counts(m, r, v):
    if 0 <= v <= r <= m:
        assert one_run_epsilon_lower_bound(m, r, v, DELTA, 0.05) >= 0
    else:
        with pytest.raises(ValueError, match="correct <= guesses <= canaries"):
            one_run_epsilon_lower_bound(m, r, v, DELTA, 0.05)


def test_one_run_bound_refuses_bad_guess_counts():
    with pytest.raises(ValueError, match="k_plus=3 and k_minus=2"):
        one_run_bound(np.zeros(4), np.zeros(4, dtype=bool), 3, 2, DELTA)
    with pytest.raises(ValueError, match="one length"):
        one_run_bound(np.zeros(4), np.zeros(3, dtype=bool), 1, 1, DELTA)
