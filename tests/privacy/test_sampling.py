"""Invariant 5: samplers over the full population, each with its matching accounting event."""

import dp_accounting
import numpy as np
import pytest

from fedprivacy.privacy.sampling import FixedSizeSampler, PoissonSampler, make_sampler


def test_poisson_inclusion_rate_and_event():
    s = PoissonSampler(population=1000, expected_cohort=50, seed=0)
    counts = np.zeros(1000)
    sizes = []
    for _ in range(400):
        idx = s.sample()
        counts[idx] += 1
        sizes.append(len(idx))
    assert np.mean(sizes) == pytest.approx(50, rel=0.03)
    assert np.std(sizes) > 3  # random cohort size: Poisson, not fixed
    assert counts.min() > 0  # every user of the full population can be drawn
    ev = s.round_event(0.7).dp_event()
    assert isinstance(ev, dp_accounting.PoissonSampledDpEvent)
    assert ev.sampling_probability == pytest.approx(0.05)
    assert ev.event == dp_accounting.GaussianDpEvent(0.7)


def test_fixed_size_without_replacement_and_event():
    s = FixedSizeSampler(population=200, expected_cohort=20, seed=0)
    for _ in range(50):
        idx = s.sample()
        assert len(idx) == 20 and len(set(idx.tolist())) == 20 and idx.max() < 200
    ev = s.round_event(1.1).dp_event()
    assert isinstance(ev, dp_accounting.SampledWithoutReplacementDpEvent)
    assert (ev.source_dataset_size, ev.sample_size) == (200, 20)


def test_sampler_state_round_trip():
    a = make_sampler("poisson", 500, 10, seed=3)
    a.sample()
    state = a.state_dict()
    nxt = a.sample()
    b = make_sampler("poisson", 500, 10, seed=99)
    b.load_state_dict(state)
    assert np.array_equal(b.sample(), nxt)


def test_cohort_larger_than_population_is_rejected_naming_the_field():
    with pytest.raises(ValueError, match="expected_cohort"):
        make_sampler("fixed", 10, 11, seed=0)


def test_a_secure_sampler_is_not_determined_by_the_seed():
    from fedprivacy.privacy.sampling import make_sampler

    for kind in ("poisson", "fixed"):
        seeded = [make_sampler(kind, 1000, 50, 7).sample().tolist() for _ in range(2)]
        secure = [make_sampler(kind, 1000, 50, 7, secure=True).sample().tolist() for _ in range(2)]
        assert seeded[0] == seeded[1]
        assert secure[0] != secure[1] and seeded[0] not in secure
