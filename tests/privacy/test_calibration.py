"""Calibration: ε-band round trips, the max_rounds boundary, DP-MicroAdam's step counts, refusals."""

import math

import pytest
from opacus.accountants.utils import get_noise_multiplier

from fedprivacy.privacy.accounting import ADADPS_RDP_ORDERS, GaussianRound, epsilon
from fedprivacy.privacy.calibration import MIN_NOISE_MULTIPLIER, calibrate_noise_multiplier, max_rounds

pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the:UserWarning")

N_SO = 342_477  # StackOverflow users (TFF's train split)


def eps_of(z, rounds, delta, sampling, population, expected_cohort, accountant="rdp", rdp_orders=None):
    rnd = GaussianRound(z, sampling, population, expected_cohort)
    return epsilon([(rnd, rounds)], delta, accountant, rdp_orders=rdp_orders)


# (sampling, population, expected_cohort, rounds, delta, accountant, rdp_orders, target_epsilon)
CALIBRATION_POINTS = [
    ("poisson", N_SO, 100, 1500, 1 / N_SO, "rdp", None, 1.0),
    ("poisson", N_SO, 100, 1500, 1 / N_SO, "pld", None, 0.5),
    ("poisson", N_SO, 100, 1500, 1 / N_SO, "prv", None, 0.5),
    ("poisson", 400, 20, 40, 1 / 400, "rdp", ADADPS_RDP_ORDERS, 8.0),
    ("poisson", 45_000, 4096, 537, 1e-5, "rdp", None, 8.0),
    ("fixed", 400, 20, 40, 1e-5, "rdp", None, 4.0),
    ("none", 50, 50, 40, 1e-5, "rdp", None, 10.0),
    ("none", 50, 50, 40, 1e-5, "pld", None, 10.0),
]


@pytest.mark.parametrize("sampling,population,cohort,rounds,delta,accountant,orders,target", CALIBRATION_POINTS)
def test_calibrated_epsilon_is_within_one_percent_below_target(sampling, population, cohort, rounds, delta,
                                                               accountant, orders, target):
    z = calibrate_noise_multiplier(target, delta, sampling=sampling, population=population, expected_cohort=cohort,
                                   rounds=rounds, accountant=accountant, rdp_orders=orders)

    def eps(noise: float) -> float:
        return eps_of(noise, rounds, delta, sampling, population, cohort, accountant, orders)
    assert 0.99 * target <= eps(z) <= target
    assert eps(z / 1.05) > target  # nearly the smallest: 5% less noise breaks the budget
    if accountant == "rdp":  # round trip through max_rounds (pld/prv boundaries are tested below)
        assert max_rounds(target, delta, noise_multiplier=z, sampling=sampling, population=population,
                          expected_cohort=cohort, rdp_orders=orders) >= rounds


def test_tolerance_tightens_the_band_and_matches_opacus_get_noise_multiplier():
    q, rounds, delta, target = 0.05, 40, 1e-5, 3.0
    z = calibrate_noise_multiplier(target, delta, sampling="poisson", population=400, expected_cohort=20,
                                   rounds=rounds, tolerance=1e-4)
    assert (1 - 1e-4) * target <= eps_of(z, rounds, delta, "poisson", 400, 20) <= target
    # Opacus' bisection (absolute epsilon tolerance) on its own RDPAccountant: the same z to ~1e-4.
    opacus_z = get_noise_multiplier(target_epsilon=target, target_delta=delta, sample_rate=q, steps=rounds,
                                    accountant="rdp", epsilon_tolerance=1e-4 * target)
    assert z == pytest.approx(opacus_z, rel=1e-3)


def test_fixed_sampling_calibrates_with_the_replace_one_sensitivity():
    """m = N under fixed sampling is the unsampled Gaussian at z / 2 (sensitivity 2C): twice the noise."""
    fixed = calibrate_noise_multiplier(5.0, 1e-5, sampling="fixed", population=60, expected_cohort=60, rounds=30,
                                       tolerance=1e-4)
    none = calibrate_noise_multiplier(5.0, 1e-5, sampling="none", population=60, expected_cohort=60, rounds=30,
                                      tolerance=1e-4)
    assert fixed == pytest.approx(2 * none, rel=1e-3)


# (noise_multiplier, sampling, population, expected_cohort, delta, accountant, target_epsilon)
BOUNDARY_POINTS = [
    (1.0, "poisson", N_SO, 100, 1 / N_SO, "rdp", 1.0),
    (1.0, "poisson", 400, 20, 1e-5, "pld", 4.0),
    (1.0, "poisson", N_SO, 100, 1 / N_SO, "prv", 0.1),
    (2.0, "fixed", 400, 20, 1e-5, "rdp", 2.0),
    (5.0, "none", 50, 50, 1e-5, "rdp", 3.0),
]


@pytest.mark.parametrize("z,sampling,population,cohort,delta,accountant,target", BOUNDARY_POINTS)
def test_max_rounds_is_the_last_round_within_budget(z, sampling, population, cohort, delta, accountant, target):
    rounds = max_rounds(target, delta, noise_multiplier=z, sampling=sampling, population=population,
                        expected_cohort=cohort, accountant=accountant)
    assert rounds >= 1

    def eps(t: int) -> float:
        return eps_of(z, t, delta, sampling, population, cohort, accountant)
    assert eps(rounds) <= target < eps(rounds + 1)


def test_max_rounds_edges():
    kw = dict(sampling="none", population=50, expected_cohort=50)
    assert max_rounds(1.0, 1e-5, noise_multiplier=0.1, **kw) == 0  # one round already exceeds
    assert max_rounds(1.0, 1e-5, noise_multiplier=0.0, **kw) == 0  # no noise: infinite epsilon
    assert max_rounds(1e6, 1e-5, noise_multiplier=5.0, limit=10, **kw) == 10
    assert max_rounds(1.0, 1e-5, noise_multiplier=1.0, sampling="poisson", population=50, expected_cohort=0,
                      limit=123) == 123  # q = 0 spends nothing


# --- DP-MicroAdam (arXiv:2511.20509, Table 8): q = 4096/45000, delta = 1e-5, Opacus RDP ---

MICROADAM = dict(sampling="poisson", population=45_000, expected_cohort=4096)


@pytest.mark.parametrize("z,first_over", [(1.56, 537), (2.0, 999)])
def test_dp_microadam_fine_tuning_counts_are_the_first_round_over_budget(z, first_over):
    """537 and 999 are where epsilon first EXCEEDS 8 (the notes: "reaches eps >= 8 at T = 537"), so max_rounds,
    the last round WITHIN 8, is one less. No RDP orders change that: eps(537) at z = 1.56 is 8.0058 with Opacus'
    orders and 8.0045 even on a 0.01-spaced grid of orders in (1, 100); AdaDPS' orders give 535 and 998; q = 1/11
    (Opacus' 1 / len(data_loader)) gives 537 but 1000; PLD/PRV give about 620 and 1140."""
    assert max_rounds(8.0, 1e-5, noise_multiplier=z, **MICROADAM) == first_over - 1
    assert eps_of(z, first_over - 1, 1e-5, **MICROADAM) <= 8.0 < eps_of(z, first_over, 1e-5, **MICROADAM)
    assert max_rounds(8.0, 1e-5, noise_multiplier=z, rdp_orders=ADADPS_RDP_ORDERS, **MICROADAM) == {
        1.56: 535, 2.0: 998}[z]


@pytest.mark.parametrize("z,updates", [(3.0, 2480), (4.0, 4556), (5.0, 7227), (6.0, 10492)])
def test_dp_microadam_table8_counts_are_max_rounds(z, updates):
    """Table 8 trains "until the cumulative privacy loss reaches the target": its counts are exactly max_rounds
    (except z = 8: 18798 reported, max_rounds 18803)."""
    assert max_rounds(8.0, 1e-5, noise_multiplier=z, **MICROADAM) == updates


# --- refusals ----------------------------------------------------------------------------------

SO = dict(sampling="poisson", population=N_SO, expected_cohort=100, rounds=1500)


@pytest.mark.parametrize("target", [0.0, -1.0, math.inf, math.nan, True])
def test_nonpositive_or_nonfinite_target_is_refused(target):
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_noise_multiplier(target, 1e-5, **SO)
    with pytest.raises(ValueError, match="target_epsilon"):
        max_rounds(target, 1e-5, noise_multiplier=1.0, sampling="poisson", population=N_SO, expected_cohort=100)


@pytest.mark.parametrize("accountant,target", [("rdp", 0.05), ("prv", 0.005)])
def test_target_below_the_accountant_floor_is_unreachable(accountant, target):
    """RDP's epsilon tends to 0.1029 at delta = 1e-5 as z grows (largest order 63); PRV's to its 0.01 slack."""
    with pytest.raises(ValueError, match=r"target_epsilon=.* is unreachable"):
        calibrate_noise_multiplier(target, 1e-5, accountant=accountant, **SO)


def test_pld_reaches_targets_below_the_rdp_floor():
    z = calibrate_noise_multiplier(0.05, 1e-5, sampling="poisson", population=400, expected_cohort=20, rounds=40,
                                   accountant="pld")
    assert 0.99 * 0.05 <= eps_of(z, 40, 1e-5, "poisson", 400, 20, "pld") <= 0.05


def test_target_met_without_meaningful_noise_is_refused():
    with pytest.raises(ValueError, match=rf"target_epsilon=.*noise_multiplier={MIN_NOISE_MULTIPLIER}"):
        calibrate_noise_multiplier(1e7, 1e-5, **SO)


@pytest.mark.parametrize("kwargs,name", [
    (dict(tolerance=0.0), "tolerance"),
    (dict(tolerance=1.0), "tolerance"),
    (dict(rounds=0), "rounds"),
    (dict(rounds=1.5), "rounds"),
    (dict(expected_cohort=0), "expected_cohort"),
    (dict(expected_cohort=N_SO + 1), "expected_cohort"),
    (dict(sampling="shuffle"), "sampling"),
    (dict(sampling="fixed", expected_cohort=100, accountant="pld"), "accountant='pld'"),
    (dict(accountant="gdp"), "accountant kind"),
    (dict(delta=0.0), "delta"),
])
def test_calibration_argument_errors_name_the_argument(kwargs, name):
    args = {**SO, "delta": 1e-5, **kwargs}
    with pytest.raises(ValueError, match=name):
        calibrate_noise_multiplier(1.0, args.pop("delta"), **args)


def test_max_rounds_argument_errors_name_the_argument():
    kw = dict(noise_multiplier=1.0, sampling="fixed", population=400, expected_cohort=20)
    with pytest.raises(ValueError, match="limit"):
        max_rounds(1.0, 1e-5, limit=0, **kw)
    with pytest.raises(ValueError, match="accountant='prv'"):
        max_rounds(1.0, 1e-5, accountant="prv", **kw)
    with pytest.raises(ValueError, match="noise_multiplier"):
        max_rounds(1.0, 1e-5, **{**kw, "noise_multiplier": -1.0})
