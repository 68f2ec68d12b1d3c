"""The mechanism object: what it draws and what it accounts come from the same fields."""

import math

import pytest
import torch

from fedprivacy.privacy.accounting import GaussianRound, PrivacyLedger, epsilon
from fedprivacy.privacy.adaptive_clipping import value_noise_multiplier
from fedprivacy.privacy.mechanism import AdaptiveClipping, GaussianMechanism
from fedprivacy.updates import SparseUpdate


def _mechanism(**kw):
    args = dict(noise_multiplier=2.0, clip_norm=0.5, expected_cohort=10, population=1000, seed=3)
    return GaussianMechanism(**{**args, **kw})


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_the_event_matches_the_sampler_and_the_draw_matches_the_event(sampling):
    m = _mechanism(sampling=sampling)
    assert m.event() == GaussianRound(2.0, sampling, 1000, 10.0)
    agg = m.aggregator(200_000)
    g, _, _, fraction = m.release(agg, 1)
    assert fraction is None
    # one dense draw of std zC on the (empty) sum, divided by the expected cohort: std zC/m = 0.1
    assert float(g.std()) == pytest.approx(2.0 * 0.5 / 10, rel=0.01)
    assert m.phi() == pytest.approx((2.0 * 0.5 / 10) ** 2)
    assert m.ledger.entries == ((m.event(), 1),)


def test_emulation_draws_for_the_simulated_cohort_and_accounts_the_deployment():
    m = _mechanism(noise_cohort=100, noise_population=10**6)
    assert m.value_noise_multiplier == pytest.approx(2.0 * 10 / 100)
    assert m.event() == GaussianRound(2.0, "poisson", 10**6, 100.0)
    g = m.release(m.aggregator(200_000), 1).g
    assert float(g.std()) == pytest.approx(0.2 * 0.5 / 10, rel=0.01)


def test_adaptive_clipping_inflates_the_value_noise_so_both_releases_compose_to_z():
    m = _mechanism(noise_multiplier=1.0, adaptive=AdaptiveClipping(0.5, 0.2, count_stddev=2.0))
    z_v = m.value_noise_multiplier
    assert z_v == pytest.approx(value_noise_multiplier(1.0, 2.0))
    assert (z_v**-2 + (2 * 2.0) ** -2) ** -0.5 == pytest.approx(1.0)  # Andrew et al. Thm. 1
    agg = m.aggregator(10)
    agg.add_(SparseUpdate.dense(torch.full((10,), 1.0)))  # norm 3.16 > C: clipped
    before = m.clip_norm
    fraction = m.release(agg, 1).unclipped_fraction
    assert fraction is not None and m.clip_norm != before
    assert m.ledger.entries == ((GaussianRound(1.0, "poisson", 1000, 10.0), 1),)  # accounted at z, not z_v


def test_the_budget_check_asks_about_the_next_release():
    m = _mechanism()
    one = epsilon(PrivacyLedger().compose(m.event()), 1e-3, "rdp")
    assert not m.would_exceed(1e-3, "rdp", one * 1.001)
    assert m.would_exceed(1e-3, "rdp", one * 0.999)
    m.release(m.aggregator(5), 1)
    assert m.epsilons(1e-3, ["rdp"])["rdp"] == pytest.approx(one)


def test_state_round_trip_continues_the_same_draws_and_cohorts():
    a = _mechanism()
    a.sample()
    a.release(a.aggregator(50), 1)
    b = _mechanism(seed=99)
    b.load_state_dict(a.state_dict())
    assert (a.sample() == b.sample()).all()
    ga = a.release(a.aggregator(50), 2).g
    gb = b.release(b.aggregator(50), 2).g
    assert torch.equal(ga, gb) and a.ledger.entries == b.ledger.entries


def test_without_a_seed_mechanisms_draw_from_the_os_and_differ():
    a, b = _mechanism(seed=None), GaussianMechanism(noise_multiplier=2.0, clip_norm=0.5, expected_cohort=10,
                                                    population=1000)  # the default: no seed
    assert a.secure and b.secure
    ga = a.release(a.aggregator(100), 1).g
    gb = b.release(b.aggregator(100), 1).g
    assert not torch.equal(ga, gb)
    assert not math.isnan(float(ga.sum()))


def test_a_secure_mechanism_persists_nothing_that_rebuilds_a_draw_or_a_cohort():
    a = _mechanism(seed=None)
    state = a.state_dict()
    assert state["noise"] is None and state["sampler"] is None  # the checkpoint holds no generator state
    b = _mechanism(seed=None)
    b.load_state_dict(state)  # a resume: the ledger comes back, the generators stay fresh from the OS
    assert b.ledger.entries == a.ledger.entries
    ga = a.release(a.aggregator(100), 1).g
    gb = b.release(b.aggregator(100), 1).g
    assert not torch.equal(ga, gb)


@pytest.mark.parametrize("z", [1e-300, 1e-30, 0.01, 1e300, 2.0**21])
def test_a_noise_multiplier_the_accountants_cannot_compute_is_refused_naming_it(z):
    with pytest.raises(ValueError, match="noise_multiplier must be 0 .*what the accountants compute"):
        _mechanism(noise_multiplier=z)


def test_a_sampling_rate_the_accountants_cannot_compute_is_refused_before_any_release():
    with pytest.raises(ValueError, match="expected_cohort / population"):
        _mechanism(expected_cohort=1, population=10**13)
