"""One client's round of record-level DP training and its per-client accounting over rounds."""

import dataclasses
import json

import pytest
import torch
from opacus.accountants import RDPAccountant
from torch.utils.data import TensorDataset

from fedprivacy.client.sample_dp import ClientPrivacyAccountant, MicroBatchUnits, train_sample_dp
from fedprivacy.optim.sample_dp import SampleDPConfig
from sdp_helpers import flat_params, tiny_model

CFG = SampleDPConfig(base="adam", lr=0.05, noise_multiplier=1.2, clip_norm=1.0, batch_size=8)


def _examples(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    return TensorDataset(x, (x[:, 1] > 0).long())


def test_round_returns_the_delta_and_restores_the_model():
    model = tiny_model()
    start = flat_params(model)
    global_state = torch.random.get_rng_state()
    first = train_sample_dp(model, _examples(40), CFG, 7, epochs=1.0)
    assert torch.equal(torch.random.get_rng_state(), global_state)  # sampling and noise use their own streams
    assert torch.equal(flat_params(model), start)
    assert first.steps == 5 and first.num_examples == 40 and first.target_delta == 0.1 / 40
    again = train_sample_dp(model, _examples(40), CFG, 7, epochs=1.0)
    assert torch.equal(first.delta, again.delta) and first.delta.abs().sum() > 0
    other = train_sample_dp(model, _examples(40), CFG, 8, epochs=1.0)
    assert not torch.equal(first.delta, other.delta)


def test_participation_epsilon_is_the_clients_own_poisson_mechanism():
    result = train_sample_dp(tiny_model(), _examples(40), CFG, 7, epochs=2.0, target_delta=1e-3)
    q = 8 / 40
    assert result.event.q == pytest.approx(q) and result.steps == 10
    reference = RDPAccountant()
    reference.history = [(CFG.noise_multiplier, q, 10)]
    assert result.epsilon == pytest.approx(reference.get_epsilon(1e-3), rel=1e-12)


def test_client_accountant_composes_participations_and_round_trips():
    small = train_sample_dp(tiny_model(), _examples(40), CFG, 1, epochs=1.0)
    large = train_sample_dp(tiny_model(), _examples(80), CFG, 2, epochs=1.0)
    acct = ClientPrivacyAccountant().record(small).record(large)
    reference = RDPAccountant()
    reference.history = [(CFG.noise_multiplier, 8 / 40, 5), (CFG.noise_multiplier, 8 / 80, 10)]
    assert acct.epsilon(1e-3) == pytest.approx(reference.get_epsilon(1e-3), rel=1e-9)
    assert acct.epsilon(small.target_delta) > small.epsilon  # composing a second round costs privacy
    restored = ClientPrivacyAccountant.from_state_dict(json.loads(json.dumps(acct.state_dict())))
    assert restored.epsilon(1e-3) == acct.epsilon(1e-3)
    assert ClientPrivacyAccountant().epsilon(1e-3) == 0.0


def test_client_with_fewer_records_than_a_batch_uses_every_record_every_step():
    result = train_sample_dp(tiny_model(), _examples(5), CFG, 3, epochs=3.0)
    assert result.event.q == 1.0 and result.event.expected_cohort == 5 and result.steps == 3


def test_micro_batch_units_are_the_accounting_units():
    cfg = dataclasses.replace(CFG, batch_size=8, micro_batch_size=4)
    result = train_sample_dp(tiny_model(), _examples(42), cfg, 4, epochs=1.0)
    assert result.event.population == 10 and result.event.expected_cohort == pytest.approx(2.0)
    units = MicroBatchUnits(_examples(42), 4, torch.Generator().manual_seed(0))
    members = sorted(i for group in units.groups for i in group)
    assert len(units) == 10 and len(set(members)) == 40  # disjoint, two records left over
    x, _ = units[0]
    assert x.shape == (4, 4)


def test_centralized_runner_evaluates_and_reports_the_accountants_epsilon():
    from fedprivacy.centralized import pooled, train_centralized

    data = pooled([_examples(20, seed=1), _examples(20, seed=2)])
    model = tiny_model()
    loss_fn = lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none")  # noqa: E731
    result = train_centralized(model, data, CFG, seed=5, steps=7, target_delta=1e-3, loss_fn=loss_fn,
                               evaluate=lambda m: 0.0, eval_every=3)
    assert [t for t, _ in result.history] == [3, 6, 7] and result.steps == 7
    reference = RDPAccountant()
    reference.history = [(CFG.noise_multiplier, 8 / 40, 7)]
    assert result.epsilon == pytest.approx(reference.get_epsilon(1e-3), rel=1e-12)
