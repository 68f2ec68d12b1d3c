"""Cross-checks of our epsilon() against independent accountants, driven as their users would drive them.

Tolerances (relative), and why:

- Opacus ``RDPAccountant`` / ``PRVAccountant`` stepped T times: 1e-12. Same formulas; checks our
  wiring (orders, history, conversion, PRV slack).
- dp_accounting ``RdpAccountant`` on the Poisson event, Opacus' orders, and Flower's ``RdpAccountant``
  (a wrapper of it) with those orders: ours <= theirs and within 2e-3. At fractional orders
  dp_accounting 0.6.0 sums |binomial coefficients|, a looser bound than Opacus' exact series (seen:
  up to 1.3e-3 at q = 0.05, z = 0.8).
- The same with their default orders (Opacus' plus 11, 128, ..., 1024): within 2e-3, either side.
- dp_accounting ``PLDAccountant`` (its default grid, 1e-4): 5e-3. Both pessimistic; our grid
  (``pld_value_discretization_interval``) is finer where ε is small (seen: 4e-3 at q = 100/342477).
- Our PLD against Opacus PRV minus its additive slack: 2e-3 (seen: 4e-4).
"""

import dp_accounting
import pytest
from dp_accounting import pld as dp_pld
from dp_accounting import rdp as dp_rdp
from flwr.serverapp import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    RdpAccountant as FlowerRdpAccountant,
    SamplingMethod,
)
from opacus.accountants import PRVAccountant, RDPAccountant

from fedprivacy.privacy.accounting import PRV_EPS_ERROR, GaussianRound, epsilon

pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the:UserWarning")

OPACUS_ORDERS = tuple(float(a) for a in RDPAccountant.DEFAULT_ALPHAS)

# (expected_cohort m, population N, z, T, delta): q = m / N, as Flower's events need an integer m.
POINTS = [
    (100, 342_477, 1.0, 1500, 1 / 342_477),  # StackOverflow federated setting
    (20, 400, 0.8, 200, 1e-5),  # q = 0.05, large epsilon
    (4096, 45_000, 1.56, 537, 1e-5),  # DP-MicroAdam fine-tuning
    (1, 1000, 2.0, 3000, 1e-6),  # q = 1e-3, small epsilon
]


def ours(m, n, z, steps, delta, kind):
    return epsilon([(GaussianRound(z, "poisson", n, m), steps)], delta, kind)


def poisson_event(m, n, z, steps):
    once = dp_accounting.PoissonSampledDpEvent(m / n, dp_accounting.GaussianDpEvent(z))
    return dp_accounting.SelfComposedDpEvent(once, steps)


def flower_epsilon(m, n, z, steps, delta, sampling=SamplingMethod.POISSON,
                   relation=NeighboringRelation.ADD_OR_REMOVE_ONE, orders=None):
    accountant = FlowerRdpAccountant(PrivacyConfig(delta, n, relation, sampling), orders=orders)
    accountant.compose(GaussianPrivacyEvent(z, m, n), steps)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("m,n,z,steps,delta", POINTS)
def test_opacus_accountants_stepped_per_round(m, n, z, steps, delta):
    rdp, prv = RDPAccountant(), PRVAccountant()
    for _ in range(steps):
        rdp.step(noise_multiplier=z, sample_rate=m / n)
        prv.step(noise_multiplier=z, sample_rate=m / n)
    assert ours(m, n, z, steps, delta, "rdp") == pytest.approx(rdp.get_epsilon(delta), rel=1e-12)
    assert ours(m, n, z, steps, delta, "prv") == pytest.approx(prv.get_epsilon(delta, eps_error=PRV_EPS_ERROR),
                                                               rel=1e-12)


@pytest.mark.parametrize("m,n,z,steps,delta", POINTS)
def test_dp_accounting_rdp_accountant(m, n, z, steps, delta):
    eps = ours(m, n, z, steps, delta, "rdp")
    same_orders = dp_rdp.RdpAccountant(OPACUS_ORDERS).compose(poisson_event(m, n, z, steps)).get_epsilon(delta)
    assert eps <= same_orders * (1 + 1e-12)
    assert eps == pytest.approx(same_orders, rel=2e-3)
    own_orders = dp_rdp.RdpAccountant().compose(poisson_event(m, n, z, steps)).get_epsilon(delta)
    assert eps == pytest.approx(own_orders, rel=2e-3)


@pytest.mark.parametrize("m,n,z,steps,delta", POINTS)
def test_flower_rdp_accountant_in_poisson_mode(m, n, z, steps, delta):
    eps = ours(m, n, z, steps, delta, "rdp")
    same_orders = flower_epsilon(m, n, z, steps, delta, orders=OPACUS_ORDERS)
    assert eps <= same_orders * (1 + 1e-12)
    assert eps == pytest.approx(same_orders, rel=2e-3)
    assert eps == pytest.approx(flower_epsilon(m, n, z, steps, delta), rel=2e-3)


@pytest.mark.parametrize("m,n,z,steps,delta", POINTS)
def test_dp_accounting_pld_accountant_and_opacus_prv(m, n, z, steps, delta):
    eps = ours(m, n, z, steps, delta, "pld")
    reference = dp_pld.PLDAccountant().compose(poisson_event(m, n, z, steps)).get_epsilon(delta)
    assert eps == pytest.approx(reference, rel=5e-3)
    prv = ours(m, n, z, steps, delta, "prv")
    assert eps <= prv and prv - PRV_EPS_ERROR == pytest.approx(eps, rel=2e-3)


def test_flower_without_replacement_takes_z_relative_to_c_not_2c():
    """Flower 1.41 passes z straight to dp_accounting's replace-one bound, which wants z relative to the 2C
    replace-one sensitivity of a clipped sum (issue #378): our fixed-sampling epsilon at z is Flower's at z / 2,
    and Flower's own at z is smaller, i.e. under-accounted."""
    m, n, z, steps, delta = 20, 400, 1.0, 100, 1e-5
    eps = epsilon([(GaussianRound(z, "fixed", n, m), steps)], delta, "rdp")
    kwargs = dict(sampling=SamplingMethod.WITHOUT_REPLACEMENT, relation=NeighboringRelation.REPLACE_ONE,
                  orders=OPACUS_ORDERS)
    assert eps == pytest.approx(flower_epsilon(m, n, z / 2, steps, delta, **kwargs), rel=1e-12)
    assert flower_epsilon(m, n, z, steps, delta, **kwargs) < 0.5 * eps


QUICKSTART = GaussianRound(1.0, "poisson", 1000, 100)  # configs/quickstart.yaml: q = 100 / 1000, z = 1


@pytest.mark.parametrize("entries", [
    [(QUICKSTART, t)] for t in (1, 2, 5, 17, 40)] + [
    [(QUICKSTART, 3), (GaussianRound(0.7, "poisson", 1000, 50), 5), (QUICKSTART, 2)],  # heterogeneous, in order
    [(GaussianRound(2.0, "none", 1, 1), 3)],  # q = 1
    [(GaussianRound(1.0, "poisson", 342_477, 100), 1500)],  # StackOverflow federated setting
])
def test_prv_is_bit_for_bit_opacus_prv_accountant(entries):
    """The PRV domain sized from the memoized RDP vectors gives exactly Opacus' epsilon (not merely close)."""
    delta = 1e-3
    reference = PRVAccountant()
    reference.history = [(rnd.noise_multiplier, rnd.q, count) for rnd, count in entries]
    assert epsilon(entries, delta, "prv") == reference.get_epsilon(delta, eps_error=PRV_EPS_ERROR)
