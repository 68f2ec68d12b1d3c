"""Accounting: published anchors, cross-checks against independent implementations, defining properties."""

import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld as dp_pld
from dp_accounting import rdp as dp_rdp
from opacus.accountants import RDPAccountant
from scipy import integrate

from fedprivacy.privacy.accounting import (
    ADADPS_RDP_ORDERS,
    PRV_EPS_ERROR,
    GaussianRound,
    PrivacyLedger,
    epsilon,
    epsilon_for,
    epsilons,
    pld_value_discretization_interval,
    would_exceed,
)

pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the:UserWarning")

N_SO = 342_477  # StackOverflow users (TFF's train split)


def poisson(z, m, n):
    return GaussianRound(noise_multiplier=z, sampling="poisson", population=n, expected_cohort=m)


def ledger_of(*pairs):
    return PrivacyLedger(pairs)


# --- published anchors -------------------------------------------------------------------------

def test_adadps_federated_budget():
    """AdaDPS FL StackOverflow: q=20/400, z=0.3, T=40, delta=1/400 (arXiv:2202.05963)."""
    led = ledger_of((poisson(0.3, 20, 400), 40))
    assert epsilon(led, 1 / 400, "rdp") == pytest.approx(33.446, abs=0.01)
    assert epsilon(led, 1 / 400, "rdp", rdp_orders=ADADPS_RDP_ORDERS) == pytest.approx(34.171, abs=0.01)


def test_adadps_orders_list():
    assert len(ADADPS_RDP_ORDERS) == 16 + 118 + 3
    assert ADADPS_RDP_ORDERS[15:18] == (4.75, 5.0, 5.5) and ADADPS_RDP_ORDERS[-4:] == (63.5, 128.0, 256.0, 512.0)


def test_dp_microadam_cifar10_budget():
    assert epsilon_for("poisson", 4096 / 45000, 3.0, 2480, 1e-5, "rdp") == pytest.approx(7.9996, abs=1e-3)


def test_stackoverflow_anchor_all_accountants():
    """q=100/342477, z=1, T=1500, delta=1/N: RDP 0.606, PLD/PRV about 0.05."""
    led = ledger_of((poisson(1.0, 100, N_SO), 1500))
    eps = epsilons(led, 1 / N_SO, ["rdp", "prv", "pld"])
    assert eps["rdp"] == pytest.approx(0.606, abs=1e-3)
    assert eps["pld"] == pytest.approx(0.0528, abs=1e-3)
    # Opacus PRV reports estimate + PRV_EPS_ERROR; the estimate agrees with PLD.
    assert eps["prv"] - PRV_EPS_ERROR == pytest.approx(eps["pld"], rel=0.03)


# --- cross-checks against independent implementations ------------------------------------------

GRID = [(0.01, 1.0, 500, 1e-5), (0.05, 0.8, 200, 1e-6), (0.1, 2.0, 1000, 1e-5), (1e-3, 1.5, 3000, 1e-6)]


@pytest.mark.parametrize("q,z,steps,delta", GRID)
def test_rdp_matches_dp_accounting_on_the_poisson_event(q, z, steps, delta):
    ours = epsilon_for("poisson", q, z, steps, delta, "rdp")
    event = dp_accounting.SelfComposedDpEvent(poisson(z, q, 1).dp_event(), steps)
    same_orders = dp_rdp.RdpAccountant(RDPAccountant.DEFAULT_ALPHAS).compose(event).get_epsilon(delta)
    own_orders = dp_rdp.RdpAccountant().compose(event).get_epsilon(delta)
    # dp_accounting 0.6.0 sums |binomial coefficients| at fractional orders: an upper bound.
    assert ours <= same_orders * (1 + 1e-12)
    assert ours == pytest.approx(same_orders, rel=1e-3)
    assert ours == pytest.approx(own_orders, rel=0.02)


@pytest.mark.parametrize("order", [1.5, 2.5, 7.0])
def test_rdp_matches_numerical_integration(order):
    """R(a) = log E_{x~N(0,z^2)}[(1 - q + q exp((2x - 1) / (2 z^2)))^a] / (a - 1) (arXiv:1908.10530, Sec. 3.3)."""
    q, z, steps, delta = 0.1, 2.0, 7, 1e-5

    def density(x: float) -> float:
        return math.exp(-x * x / (2 * z * z)) / (z * math.sqrt(2 * math.pi))
    moment, _ = integrate.quad(lambda x: density(x) * (1 - q + q * math.exp((2 * x - 1) / (2 * z * z))) ** order,
                               -60, 60, limit=500, epsabs=1e-14, epsrel=1e-13)
    rdp = steps * math.log(moment) / (order - 1)
    expected = rdp + math.log((order - 1) / order) - (math.log(delta) + math.log(order)) / (order - 1)
    ours = epsilon_for("poisson", q, z, steps, delta, "rdp", rdp_orders=[order])
    assert ours == pytest.approx(expected, rel=1e-7)


@pytest.mark.parametrize("q,z,steps,delta", GRID)
def test_pld_matches_prv_and_both_are_below_rdp(q, z, steps, delta):
    eps = {k: epsilon_for("poisson", q, z, steps, delta, k) for k in ("rdp", "prv", "pld")}
    assert eps["pld"] <= eps["prv"]  # PRV upper bound carries the additive PRV_EPS_ERROR
    assert eps["prv"] - PRV_EPS_ERROR <= eps["pld"] * 1.03
    assert eps["pld"] < eps["rdp"] and eps["prv"] < eps["rdp"]


def test_pld_backend_equals_dp_accounting_pld_accountant():
    """Our cached PLD path builds exactly what PLDAccountant builds, heterogeneous ledger included."""
    a, b, c = poisson(1.0, 20, 1000), poisson(0.7, 30, 1000), GaussianRound(4.0, "none", 50, 50)
    for entries in ([(a, 300), (b, 30), (a, 5)], [(c, 3), (a, 10)]):
        interval = pld_value_discretization_interval(r for r, _ in entries)
        acc = dp_pld.PLDAccountant(value_discretization_interval=interval)
        for rnd, count in entries:
            acc.compose(dp_accounting.SelfComposedDpEvent(rnd.dp_event(), count))
        assert epsilon(entries, 1e-6, "pld") == pytest.approx(acc.get_epsilon(1e-6), rel=1e-12)


def test_fixed_sampling_uses_replace_one_with_sensitivity_2c():
    """Replace-one moves a clipped sum by up to 2C: fixed m = N is the unsampled Gaussian with z/2."""
    full = epsilon_for("fixed", 1.0, 3.0, 50, 1e-5, "rdp", population=100)
    assert full == pytest.approx(epsilon_for("none", 1.0, 1.5, 50, 1e-5, "rdp"), rel=1e-9)
    rnd = GaussianRound(1.0, "fixed", 400, 20)
    assert rnd.dp_event() == dp_accounting.SampledWithoutReplacementDpEvent(400, 20, dp_accounting.GaussianDpEvent(1.0))
    halved = dp_accounting.SampledWithoutReplacementDpEvent(400, 20, dp_accounting.GaussianDpEvent(0.5))
    ref = dp_rdp.RdpAccountant(RDPAccountant.DEFAULT_ALPHAS, dp_accounting.NeighboringRelation.REPLACE_ONE)
    ref.compose(halved, 100)
    assert epsilon([(rnd, 100)], 1e-5, "rdp") == pytest.approx(ref.get_epsilon(1e-5), rel=1e-9)


# --- defining properties -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["rdp", "prv", "pld"])
def test_monotone_in_rounds(kind):
    eps = [epsilon_for("poisson", 0.02, 1.0, t, 1e-5, kind) for t in (1, 10, 100, 400)]
    assert eps == sorted(eps) and eps[0] < eps[-1]


@pytest.mark.parametrize("kind", ["rdp", "prv", "pld"])
def test_empty_ledger_and_zero_rate_give_zero(kind):
    assert epsilon(PrivacyLedger(), 1e-5, kind) == 0.0
    assert epsilon_for("poisson", 0.0, 1.0, 100, 1e-5, kind) == 0.0
    assert epsilon_for("fixed", 0.0, 1.0, 100, 1e-5, "rdp", population=50) == 0.0


@pytest.mark.parametrize("kind", ["rdp", "prv", "pld"])
def test_epsilon_decreases_as_the_rate_vanishes(kind):
    eps = [epsilon_for("poisson", q, 1.0, 100, 1e-5, kind) for q in (1e-2, 1e-3, 1e-4)]
    assert eps[0] > eps[1] > eps[2]
    if kind == "pld":  # RDP keeps a log(1/delta)/(a_max - 1) floor; PRV adds PRV_EPS_ERROR
        assert eps[2] < 0.01 * eps[0]


@pytest.mark.parametrize("kind", ["rdp", "prv", "pld"])
def test_more_noise_gives_smaller_epsilon(kind):
    eps = [epsilon_for("poisson", 0.05, z, 100, 1e-5, kind) for z in (0.8, 1.2, 2.0)]
    assert eps[0] > eps[1] > eps[2]


def test_zero_noise_is_infinite_epsilon():
    for kind in ("rdp", "prv", "pld"):
        assert epsilon_for("poisson", 0.05, 0.0, 3, 1e-5, kind) == math.inf


def test_fixed_sampling_is_none_for_prv_and_pld():
    led = ledger_of((GaussianRound(1.0, "fixed", 400, 20), 10))
    eps = epsilons(led, 1e-5, ["rdp", "prv", "pld"])
    assert eps["prv"] is None and eps["pld"] is None and eps["rdp"] > 0


@pytest.mark.parametrize("kind", ["rdp", "prv", "pld"])
def test_none_sampling_equals_q_one(kind):
    none = epsilon_for("none", 1.0, 2.0, 30, 1e-5, kind, population=80)
    full_poisson = epsilon(ledger_of((poisson(2.0, 80, 80), 30)), 1e-5, kind)
    assert none == pytest.approx(full_poisson, rel=1e-9 if kind != "pld" else 1e-3)


def test_heterogeneous_ledger_rdp_is_order_free_and_between_homogeneous():
    a, b = poisson(1.5, 20, 1000), poisson(0.8, 50, 1000)
    delta = 1e-5
    blocks = epsilon(ledger_of((a, 10), (b, 5)), delta, "rdp")
    assert epsilon(ledger_of((b, 5), (a, 10)), delta, "rdp") == pytest.approx(blocks, rel=1e-12)
    interleaved = PrivacyLedger()
    for rnd in [a, b] * 5 + [a] * 5:
        interleaved.compose(rnd)
    assert len(interleaved.entries) == 11 and interleaved.rounds == 15
    assert epsilon(interleaved, delta, "rdp") == pytest.approx(blocks, rel=1e-12)
    assert epsilon(ledger_of((a, 15)), delta, "rdp") < blocks < epsilon(ledger_of((b, 15)), delta, "rdp")
    for kind in ("prv", "pld"):
        assert epsilon(ledger_of((b, 5), (a, 10)), delta, kind) == pytest.approx(
            epsilon(ledger_of((a, 10), (b, 5)), delta, kind), rel=0.01)


def test_ledger_merges_runs_and_rejects_mixed_neighbouring_relations():
    led = PrivacyLedger().compose(poisson(1.0, 5, 100)).compose(poisson(1.0, 5, 100), 4)
    assert led.entries == ((poisson(1.0, 5, 100), 5),) and led.rounds == 5
    with pytest.raises(ValueError, match="fixed"):
        led.compose(GaussianRound(1.0, "fixed", 100, 5))
    led.compose(GaussianRound(1.0, "none", 100, 100))  # both add/remove-one
    with pytest.raises(ValueError, match="count"):
        led.compose(poisson(1.0, 5, 100), 0)


def test_state_dict_round_trip_preserves_epsilon_exactly():
    led = ledger_of((poisson(1.0, 20, 1000), 300), (poisson(0.9, 20.5, 1000), 3), (poisson(1.0, 20, 1000), 2))
    back = PrivacyLedger.from_state_dict(json.loads(json.dumps(led.state_dict())))
    assert back.entries == led.entries
    for kind in ("rdp", "prv", "pld"):
        assert epsilon(back, 1e-5, kind) == epsilon(led, 1e-5, kind)


def test_from_state_dict_rejects_unknown_event_type_and_bad_fields():
    state = ledger_of((poisson(1.0, 5, 100), 3)).state_dict()
    bad = json.loads(json.dumps(state))
    bad["entries"][0]["type"] = "os.system"
    with pytest.raises(ValueError, match=r"unknown event type 'os.system'.*GaussianRound"):
        PrivacyLedger.from_state_dict(bad)
    extra = json.loads(json.dumps(state))
    extra["entries"][0]["clip_norm"] = 1.0
    with pytest.raises(ValueError, match="expected fields"):
        PrivacyLedger.from_state_dict(extra)


def test_would_exceed_around_the_boundary():
    rnd, delta = poisson(1.0, 100, 10_000), 1e-5
    eps_20 = epsilon(ledger_of((rnd, 20)), delta, "rdp")
    eps_21 = epsilon(ledger_of((rnd, 21)), delta, "rdp")
    budget = (eps_20 + eps_21) / 2
    assert not would_exceed(ledger_of((rnd, 19)), rnd, delta, "rdp", budget)
    assert would_exceed(ledger_of((rnd, 20)), rnd, delta, "rdp", budget)
    assert not would_exceed(ledger_of((rnd, 20)), rnd, delta, "rdp", eps_21)  # reaching the max is allowed
    with pytest.raises(ValueError, match="cannot account"):
        would_exceed(PrivacyLedger(), GaussianRound(1.0, "fixed", 100, 5), delta, "pld", 1.0)


@pytest.mark.parametrize("kwargs,field", [
    (dict(noise_multiplier=-1.0, sampling="poisson", population=10, expected_cohort=1), "noise_multiplier"),
    (dict(noise_multiplier=1.0, sampling="shuffle", population=10, expected_cohort=1), "sampling"),
    (dict(noise_multiplier=1.0, sampling="poisson", population=0, expected_cohort=0), "population"),
    (dict(noise_multiplier=1.0, sampling="poisson", population=10, expected_cohort=11), "expected_cohort"),
    (dict(noise_multiplier=1.0, sampling="fixed", population=10, expected_cohort=2.5), "expected_cohort"),
    (dict(noise_multiplier=1.0, sampling="none", population=10, expected_cohort=5), "expected_cohort"),
])
def test_gaussian_round_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GaussianRound(**kwargs)


def test_epsilon_for_argument_errors():
    with pytest.raises(ValueError, match="population"):
        epsilon_for("fixed", 0.05, 1.0, 10, 1e-5, "rdp")
    with pytest.raises(ValueError, match="q must be 1"):
        epsilon_for("none", 0.5, 1.0, 10, 1e-5, "rdp")
    with pytest.raises(ValueError, match="delta"):
        epsilon_for("poisson", 0.05, 1.0, 10, 0.0, "rdp")
    with pytest.raises(ValueError, match="kind"):
        epsilon_for("poisson", 0.05, 1.0, 10, 1e-5, "gdp")
    assert epsilon_for("fixed", 0.05, 1.0, 10, 1e-5, "rdp", population=400) == epsilon(
        [(GaussianRound(1.0, "fixed", 400, 20), 10)], 1e-5, "rdp")


def test_numpy_scalars_are_normalized_so_the_state_is_json():
    rnd = GaussianRound(np.float32(1.5), "fixed", np.int64(400), np.int64(20))
    assert json.loads(json.dumps(ledger_of((rnd, 2)).state_dict()))["entries"][0]["population"] == 400
    assert rnd == GaussianRound(1.5, "fixed", 400, 20)
