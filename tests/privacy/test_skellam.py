"""The distributed Skellam mechanism (fedprivacy.privacy.skellam): the defining properties of the rotation, the
conditional rounding, the client/server encoding modulo 2^b, the noise, and the RDP accounting."""

import json
import math

import mpmath
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opacus.accountants.analysis.rdp import compute_rdp
from scipy import stats
from scipy.linalg import hadamard

from fedprivacy.privacy.accounting import GaussianRound, PrivacyLedger, epsilon
from fedprivacy.privacy.events import event_from_dict, event_to_dict
from fedprivacy.privacy.skellam_accounting import SkellamRound, poisson_subsampled_rdp
from fedprivacy.privacy.skellam import (
    BETA,
    IntegrityCheckFailed,
    SkellamParams,
    _fwht_,
    _signs,
    client_rng,
    conditional_rounding,
    rotate,
    rounded_l2_bound,
    signed,
    skellam_square_norm_bound,
    skellam_tail,
    unrotate,
)

pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the:UserWarning")

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def padded(dim: int) -> int:
    return 1 << max(0, (dim - 1).bit_length())


def no_wrap_k(dim: int, m: int) -> float:
    """A headroom under which n <= m clipped clients' rounded sum can never wrap around: every coordinate of the
    scaled sum is at most m C s + m in absolute value, and k sqrt(m^2C^2s^2/D + m/4) >= that for this k."""
    return 1.5 * (math.sqrt(padded(dim)) + 2 * math.sqrt(m))


def modular_sum(params: SkellamParams, shares: list[np.ndarray]) -> np.ndarray:
    """What secure aggregation hands the server: the sum of the shares modulo 2^b."""
    total = np.zeros(params.padded_dim, dtype=np.uint64)
    for share in shares:
        total += share.astype(np.uint64)
    return total & np.uint64(params.modulus - 1)


def clip(u: torch.Tensor, c: float) -> torch.Tensor:
    u = u.to(torch.float64)
    norm = float(u.norm())
    return u * (c / norm) if norm > c else u


# --- the randomized Hadamard rotation ------------------------------------------------------------------------

@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_fwht_is_the_sylvester_hadamard_product(d):
    x = torch.from_numpy(np.random.default_rng(d).normal(size=d))
    expected = hadamard(d).astype(np.float64) @ x.numpy()
    out = _fwht_(x.clone())
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-12)


def test_fwht_works_in_place():
    x = torch.arange(8, dtype=torch.float64)
    out = _fwht_(x)
    assert out.data_ptr() == x.data_ptr()
    np.testing.assert_allclose(x.numpy(), hadamard(8) @ np.arange(8.0), atol=1e-12)


@pytest.mark.parametrize("dim", [1, 3, 1000, 1024])
def test_rotation_is_orthogonal_and_inverted_by_unrotate(dim):
    D = padded(dim)
    rng = np.random.default_rng(dim)
    x = torch.from_numpy(rng.normal(size=dim))
    w = torch.from_numpy(rng.normal(size=dim))
    y, v = rotate(x, 11, D), rotate(w, 11, D)
    assert y.dtype == torch.float64 and y.numel() == D
    assert abs(float(y.norm()) - float(x.norm())) <= 1e-9
    assert abs(float(y @ v) - float(x @ w)) <= 1e-9  # inner products too: orthogonal, not just norm-preserving
    back = unrotate(y, 11, dim)
    assert back.numel() == dim
    np.testing.assert_allclose(back.numpy(), x.numpy(), rtol=0, atol=1e-9)


def test_rotation_accepts_float32_input():
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    y = rotate(x, 3, 128)
    np.testing.assert_allclose(unrotate(y, 3, 100).numpy(), x.double().numpy(), atol=1e-6)


def test_unrotate_with_another_seed_does_not_invert():
    x = torch.from_numpy(np.random.default_rng(0).normal(size=1000))
    back = unrotate(rotate(x, 1, 1024), 2, 1000)
    assert float((back - x).norm()) > 0.5 * float(x.norm())


def test_different_seeds_give_different_rotations():
    x = torch.from_numpy(np.random.default_rng(0).normal(size=1024))
    a, b = rotate(x, 1, 1024), rotate(x, 2, 1024)
    assert float((a - b).norm()) > 0.5 * float(x.norm())
    assert not torch.equal(_signs(1, 1024), _signs(2, 1024))
    assert torch.equal(rotate(x, 1, 1024), a)  # the seed is the only randomness: the server can invert it


@pytest.mark.parametrize("dim", [1, 3, 1000, 1024])
@pytest.mark.parametrize("j", [0, -1])
def test_rotation_flattens_a_one_hot_vector(dim, j):
    D = padded(dim)
    e = torch.zeros(dim, dtype=torch.float64)
    e[j] = 1.0
    y = rotate(e, 5, D).abs()
    assert float(y.max()) == pytest.approx(1 / math.sqrt(D), rel=1e-12)
    assert float(y.min()) == pytest.approx(1 / math.sqrt(D), rel=1e-12)


# --- conditional rounding ------------------------------------------------------------------------------------

def test_conditional_rounding_outputs_floor_or_ceil():
    rng = np.random.default_rng(0)
    y = rng.normal(scale=10, size=5000)
    y[:10] = np.arange(-5, 5)  # integers round to themselves
    out = conditional_rounding(y, math.inf, rng)
    assert out.dtype == np.int64 and out.shape == y.shape
    delta = out - np.floor(y)
    assert set(np.unique(delta)) <= {0.0, 1.0}
    np.testing.assert_array_equal(out[:10], np.arange(-5, 5))


def test_conditional_rounding_is_unbiased_without_a_binding_bound():
    values = np.array([-2.7, -0.5, 0.1, 0.5, 3.9, 7.25])
    reps = 40_000
    y = np.repeat(values, reps)
    out = conditional_rounding(y, math.inf, np.random.default_rng(1)).reshape(len(values), reps)
    means = out.mean(axis=1)
    frac = values - np.floor(values)
    se = np.sqrt(frac * (1 - frac) / reps)
    assert np.all(np.abs(means - values) <= 5 * se + 1e-12), (means, values)


def test_conditional_rounding_never_exceeds_a_binding_bound():
    # Sixteen halves: the unconditional rounding's squared norm is Binomial(16, 1/2); the bound admits <= 6 ones,
    # which a single draw meets only ~23% of the time, so most calls must redraw.
    y = np.full(16, 0.5)
    bound = math.sqrt(6.5)
    rng = np.random.default_rng(2)
    counts = []
    for _ in range(300):
        out = conditional_rounding(y, bound, rng)
        assert set(np.unique(out)) <= {0, 1}
        assert float(np.linalg.norm(out)) <= bound + 1e-12
        counts.append(int(out.sum()))
    assert max(counts) == 6 and min(counts) < 6  # random, and the bound is reached, not crudely undershot
    unconditional = np.random.default_rng(3).random((300, 16)) < 0.5
    assert (unconditional.sum(axis=1) > 6).mean() > 0.5  # so the bound did bind


def test_conditional_rounding_raises_when_the_bound_is_impossible():
    y = np.full(4, 1.5)  # every rounding has entries >= 1: squared norm >= 4
    with pytest.raises(RuntimeError, match="bound"):
        conditional_rounding(y, 1.99, np.random.default_rng(0))


def test_rounded_l2_bound_holds_with_probability_at_least_one_minus_beta():
    # Kairouz et al. 2021 Thm. 1: P(||round(y)|| > bound(||y||)) <= beta for unconditional randomized rounding;
    # fractional parts of 1/2 maximize the rounding's variance.
    rng = np.random.default_rng(4)
    D = 1024
    y = np.floor(rng.normal(scale=3.0, size=D)) + 0.5
    bound = rounded_l2_bound(float(np.linalg.norm(y)), D)
    assert bound < float(np.linalg.norm(y)) + math.sqrt(D)  # the tight branch is the one tested
    draws = np.floor(y) + (rng.random((2000, D)) < 0.5)
    exceed = (np.linalg.norm(draws, axis=1) > bound).mean()
    assert exceed <= BETA
    # and the bound is not vacuous: it is below the norm of rounding every coordinate away from zero
    assert bound < float(np.linalg.norm(np.where(y > 0, np.ceil(y), np.floor(y))))


def test_rounded_l2_bound_formula():
    for cs, D in [(0.0, 1), (1.0, 4), (100.0, 1024), (1e6, 2 ** 14)]:
        loose = cs + math.sqrt(D)
        tight = math.sqrt(cs ** 2 + D / 4 + math.sqrt(2 * math.log(1 / BETA)) * (cs + math.sqrt(D) / 2))
        assert rounded_l2_bound(cs, D) == pytest.approx(min(loose, tight), rel=1e-12)
        assert rounded_l2_bound(cs, D, beta=0.0) == pytest.approx(loose, rel=1e-12)
        assert rounded_l2_bound(cs, D) >= cs


# --- SkellamParams: derived quantities and validation --------------------------------------------------------

@FAST
@given(bits=st.integers(8, 32), dim=st.integers(1, 5000), m=st.integers(1, 1000),
       c=st.floats(1e-3, 1e3), z=st.floats(0, 100), k=st.floats(1, 10))
def test_scale_is_the_largest_that_fits_m_clients_with_k_stddevs(bits, dim, m, c, z, k):
    try:
        p = SkellamParams(dim=dim, clip_norm=c, noise_multiplier=z, expected_cohort=m, bits=bits, k_stddevs=k)
    except ValueError as err:
        assert (2.0 ** (bits - 1) / k) ** 2 <= m / 4, err  # the only refusal these ranges can trigger
        return
    s, D = p.scale, p.padded_dim
    assert D == padded(dim) and D >= dim and (D == 1 or D < 2 * dim)
    assert math.isfinite(s) and s > 0
    spread = k * math.sqrt(m * m * c * c * s * s / D + (z * c * s) ** 2 + m / 4)
    assert spread == pytest.approx(2.0 ** (bits - 1), rel=1e-9)
    assert p.total_variance == pytest.approx((z * c * s) ** 2, rel=1e-12)
    assert p.share_variance == pytest.approx((z * c * s) ** 2 / m, rel=1e-12)
    assert p.released_std(m) == pytest.approx(z * c, rel=1e-9)  # m shares: the Gaussian's z C, unscaled
    l2 = p.l2_sensitivity
    cs = c * s
    expected = min(cs + math.sqrt(D),
                   math.sqrt(cs ** 2 + D / 4 + math.sqrt(2 * math.log(1 / BETA)) * (cs + math.sqrt(D) / 2)))
    assert l2 == pytest.approx(expected, rel=1e-12)
    assert l2 >= cs
    assert p.l1_sensitivity == pytest.approx(min(l2 * l2, math.sqrt(D) * l2), rel=1e-12)


@pytest.mark.parametrize("kwargs, name", [
    ({"bits": 7}, "bits"),
    ({"bits": 33}, "bits"),
    ({"bits": 16.0}, "bits"),
    ({"dim": 0}, "dim"),
    ({"expected_cohort": 0}, "expected_cohort"),
    ({"noise_multiplier": -0.1}, "noise_multiplier"),
    ({"noise_multiplier": math.nan}, "noise_multiplier"),
    ({"clip_norm": 0.0}, "clip_norm"),
    ({"clip_norm": -1.0}, "clip_norm"),
    ({"clip_norm": math.nan}, "clip_norm"),
    ({"k_stddevs": 0.0}, "k_stddevs"),
    ({"beta": 1.0}, "beta"),
    ({"beta": -0.1}, "beta"),
    ({"bits": 8, "expected_cohort": 8000}, "bits"),  # (128/3)^2 = 1820 <= 8000/4: the rounding alone overflows
])
def test_invalid_params_raise_value_error(kwargs, name):
    base = {"dim": 10, "clip_norm": 1.0, "noise_multiplier": 1.0, "expected_cohort": 4, "bits": 16}
    with pytest.raises(ValueError, match=name):
        SkellamParams(**{**base, **kwargs})


@pytest.mark.parametrize("field", ["clip_norm", "noise_multiplier"])
def test_infinite_params_raise_value_error(field):
    base = {"dim": 10, "clip_norm": 1.0, "noise_multiplier": 1.0, "expected_cohort": 4, "bits": 16}
    with pytest.raises(ValueError):
        SkellamParams(**{**base, field: math.inf})


def test_params_event_carries_the_surviving_shares_variance():
    p = SkellamParams(dim=100, clip_norm=0.5, noise_multiplier=1.3, expected_cohort=10, bits=20)
    e = p.event(7, 0.25)
    assert e == SkellamRound(q=0.25, variance=7 * p.share_variance, l2_sensitivity=p.l2_sensitivity,
                             l1_sensitivity=p.l1_sensitivity)
    assert e.variance == pytest.approx(0.7 * p.total_variance, rel=1e-12)


# --- encode / decode at z = 0: the sum comes back, up to rounding --------------------------------------------

def _round_trip(p: SkellamParams, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # norms of 1.5 C, 2.1 C, 2.7 C (clipped) and 0.3 C, 0.9 C (kept as they are)
    norms = [1.5, 0.3, 2.1, 0.9, 2.7]
    updates = [torch.randn(p.dim, generator=g, dtype=torch.float64) for _ in range(n)]
    updates = [u * (p.clip_norm * norms[i] / float(u.norm())) for i, u in enumerate(updates)]
    shares = [p.encode(u, rotation_seed=seed, rng=client_rng(seed, i)) for i, u in enumerate(updates)]
    exact = sum(clip(u, p.clip_norm) for u in updates)
    decoded = p.decode(modular_sum(p, shares), rotation_seed=seed)
    return shares, exact, decoded


@pytest.mark.parametrize("bits", [16, 20, 32])
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("dim", [1, 3, 1000, 1024])
def test_decode_of_modular_sum_recovers_the_clipped_sum(bits, n, dim):
    p = SkellamParams(dim=dim, clip_norm=2.0, noise_multiplier=0.0, expected_cohort=n, bits=bits,
                      k_stddevs=no_wrap_k(dim, n))
    shares, exact, decoded = _round_trip(p, n, seed=dim + n + bits)
    for share in shares:
        assert share.dtype == np.uint32 and share.shape == (p.padded_dim,)
        assert int(share.max()) < 2 ** bits
    assert decoded.dtype == torch.float32 and decoded.shape == (dim,)
    err = float((decoded.double() - exact).norm())
    # decode returns float32: allow its representation error (2^-24 relative per coordinate) on top of the bound
    slack = 2.0 ** -24 * float(decoded.double().norm())
    assert err <= p.rounding_error_bound(n) + slack, (err, p.rounding_error_bound(n), slack)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("dim", [1, 3])
def test_decode_with_default_headroom_for_tiny_dims(n, dim):
    # D <= 4: 4 sqrt(m^2C^2s^2/D + m/4) >= n C s + n, so the default k = 4 can never wrap around
    p = SkellamParams(dim=dim, clip_norm=1.0, noise_multiplier=0.0, expected_cohort=n, bits=16)
    _, exact, decoded = _round_trip(p, n, seed=7)
    assert float((decoded.double() - exact).norm()) <= p.rounding_error_bound(n)


def test_rounding_error_bound_holds_for_the_float32_output_at_32_bits():
    # D = 4 with the default k = 4 cannot wrap around (see the test above); the bound is 3 C / 2^31 ~ 1.4e-9 C,
    # below float32's resolution of the decoded values
    p = SkellamParams(dim=3, clip_norm=1.0, noise_multiplier=0.0, expected_cohort=1, bits=32)
    _, exact, decoded = _round_trip(p, 1, seed=7)
    assert float((decoded.double() - exact).norm()) <= p.rounding_error_bound(1)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_encode_refuses_non_finite_updates(bad):
    p = SkellamParams(dim=5, clip_norm=1.0, noise_multiplier=1.0, expected_cohort=2, bits=16)
    u = torch.zeros(5)
    u[2] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        p.encode(u, 0, client_rng(0, 0))


def test_encode_is_reproducible_from_the_client_stream():
    p = SkellamParams(dim=50, clip_norm=1.0, noise_multiplier=1.0, expected_cohort=3, bits=16)
    u = torch.randn(50, generator=torch.Generator().manual_seed(0))
    a = p.encode(u, 9, client_rng(5, 1, 2))
    np.testing.assert_array_equal(a, p.encode(u, 9, client_rng(5, 1, 2)))
    assert not np.array_equal(a, p.encode(u, 9, client_rng(5, 1, 3)))


# --- the noise -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [4, 2])
def test_decoded_noise_has_the_released_std(n):
    dim, m = 2 ** 14, 4
    # k = 8: no coordinate of the noisy sum comes near the modulus, so what is measured is the noise alone
    p = SkellamParams(dim=dim, clip_norm=1.0, noise_multiplier=1.0, expected_cohort=m, bits=20, k_stddevs=8.0)
    g = torch.Generator().manual_seed(n)
    updates = [torch.randn(dim, generator=g, dtype=torch.float64) for _ in range(n)]
    shares = [p.encode(u, 3, client_rng(21, n, i)) for i, u in enumerate(updates)]
    exact = sum(clip(u, 1.0) for u in updates)
    noise = (p.decode(modular_sum(p, shares), 3).double() - exact).numpy()
    expected = p.released_std(n)
    assert expected == pytest.approx(math.sqrt(n / m), rel=1e-9)  # z C sqrt(n / m), z = C = 1
    assert noise.std() == pytest.approx(expected, rel=0.03)
    assert abs(noise.mean()) <= 5 * expected / math.sqrt(dim)


@pytest.mark.parametrize("n", [4, 2])
def test_sum_of_noise_shares_is_skellam(n):
    # Zero updates round to zero, so the shares are pure noise. Small variance (k = 40 at 8 bits: mu ~ 9 at m
    # shares) so that the pmf is compared where it has mass; the modulus is over 40 standard deviations away.
    dim, m = 2 ** 16, 4
    p = SkellamParams(dim=dim, clip_norm=1.0, noise_multiplier=1.0, expected_cohort=m, bits=8, k_stddevs=40.0)
    shares = [p.encode(torch.zeros(dim), 0, client_rng(8, n, i)) for i in range(n)]
    total = modular_sum(p, shares).astype(np.int64)
    total[total >= p.modulus // 2] -= p.modulus
    var = n * p.share_variance
    assert 3 < var < 15
    assert total.var() == pytest.approx(var, rel=0.03)
    assert abs(total.mean()) <= 5 * math.sqrt(var / dim)
    # Skellam(var/2, var/2): the difference of two Poissons, total variation distance to the empirical pmf
    support = np.arange(-60, 61)
    pmf = stats.skellam.pmf(support, var / 2, var / 2)
    empirical = np.array([(total == v).mean() for v in support])
    assert total.min() >= -60 and total.max() <= 60
    assert 0.5 * np.abs(empirical - pmf).sum() < 0.02
    # the comparison can tell: a Skellam of 20% more variance is measurably farther away
    other = stats.skellam.pmf(support, 0.6 * var, 0.6 * var)
    assert 0.5 * np.abs(empirical - other).sum() > 0.04


# --- accounting ----------------------------------------------------------------------------------------------

def closed_form(alpha, mu, l2, l1):
    return alpha * l2 ** 2 / (2 * mu) + min(((2 * alpha - 1) * l2 ** 2 + 6 * l1) / (4 * mu ** 2), 3 * l1 / (2 * mu))


@pytest.mark.parametrize("mu, l2, l1", [
    (1e6, 1e3, 3e4),  # the 1/mu^2 branch of the min
    (4.0, 3.0, 9.0),  # the 3 l1 / (2 mu) branch
    (2.5e3, 50.0, 2500.0),
])
def test_skellam_rdp_closed_form_at_q_1(mu, l2, l1):
    orders = (2, 3, 5, 10, 32, 63)
    got = SkellamRound(q=1.0, variance=mu, l2_sensitivity=l2, l1_sensitivity=l1).rdp(orders)
    want = [closed_form(a, mu, l2, l1) for a in orders]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert np.all(got >= np.array(orders) * l2 ** 2 / (2 * mu))  # never below the Gaussian's


def test_skellam_rdp_is_inf_at_fractional_orders_and_without_noise():
    e = SkellamRound(q=0.5, variance=100.0, l2_sensitivity=10.0, l1_sensitivity=50.0)
    out = e.rdp((1.5, 2.0, 2.5, 10.1, 11.0))
    assert np.isinf(out[[0, 2, 3]]).all() and np.isfinite(out[[1, 4]]).all()
    noiseless = SkellamRound(q=0.5, variance=0.0, l2_sensitivity=10.0, l1_sensitivity=50.0)
    assert np.isinf(noiseless.rdp((2.0, 3.0, 64.0))).all()


def test_skellam_rdp_grows_with_q_and_never_exceeds_q_1():
    orders = tuple(range(2, 64))
    curves = [SkellamRound(q=q, variance=100.0, l2_sensitivity=10.0, l1_sensitivity=50.0).rdp(orders)
              for q in (0.0, 1e-4, 1e-3, 0.01, 0.1, 0.3, 0.5, 0.9, 1.0)]
    np.testing.assert_array_equal(curves[0], 0.0)
    for lo, hi in zip(curves, curves[1:]):
        assert np.all(lo <= hi)
    assert np.all(curves[1] < curves[-1])  # subsampling does amplify
    # at small q the amplified value is of order q^2 (Zhu & Wang's leading term), not q
    ratio = curves[2][0] / curves[1][0]
    assert 80 < ratio < 120


def zhu_wang_mp(alpha, q, rdp):
    """Zhu & Wang 2019 Thm. 6 evaluated term by term in 50-digit arithmetic (an independent implementation)."""
    mpmath.mp.dps = 50
    q = mpmath.mpf(q)
    total = (1 - q) ** (alpha - 1) * (alpha * q - q + 1)
    total += mpmath.binomial(alpha, 2) * q ** 2 * (1 - q) ** (alpha - 2) * mpmath.e ** rdp(2)
    for j in range(3, alpha + 1):
        total += 3 * mpmath.binomial(alpha, j) * (1 - q) ** (alpha - j) * q ** j * mpmath.e ** ((j - 1) * rdp(j))
    return float(mpmath.log(total) / (alpha - 1))


@pytest.mark.parametrize("q", [1e-4, 1e-3, 0.01, 0.1, 0.5, 0.9])
@pytest.mark.parametrize("z", [0.5, 1.0, 2.0, 5.0])
def test_poisson_subsampled_rdp_bounds_the_exact_subsampled_gaussian(q, z):
    def gauss(j):
        return j / (2 * z * z)

    for alpha in (2, 3, 4, 8, 16, 32, 64):
        ub = poisson_subsampled_rdp(alpha, q, gauss)
        exact = float(compute_rdp(q=q, noise_multiplier=z, steps=1, orders=[alpha])[0])
        assert ub == pytest.approx(zhu_wang_mp(alpha, q, gauss), rel=1e-9)
        assert ub >= exact * (1 - 1e-6), (alpha, ub, exact)
        if alpha == 2:  # Thm. 6's l = 2 term is exact for the Gaussian: the bound is tight there
            assert ub == pytest.approx(exact, rel=1e-6)
        if q <= 1e-4 and z >= 1 and alpha <= 8:  # small q: the loose l >= 3 terms are negligible
            assert ub <= 1.05 * exact


def test_poisson_subsampled_rdp_endpoints():
    def gauss(j):
        return j / 2

    assert poisson_subsampled_rdp(5, 0.0, gauss) == 0.0
    assert poisson_subsampled_rdp(5, 1.0, gauss) == 2.5


def ledger_eps(event, count, kind="rdp", delta=1e-5):
    return epsilon(PrivacyLedger([(event, count)]), delta, kind)


def test_ledger_epsilon_grows_with_rounds_and_shrinks_with_noise():
    p = SkellamParams(dim=1000, clip_norm=1.0, noise_multiplier=1.0, expected_cohort=50, bits=20)
    e = p.event(50, 0.01)
    eps = [ledger_eps(e, t) for t in (1, 10, 100, 1000)]
    assert all(math.isfinite(x) and x > 0 for x in eps)
    assert eps == sorted(eps) and len(set(eps)) == len(eps)
    fewer = p.event(25, 0.01)  # half the shares survive: half the variance
    assert ledger_eps(fewer, 100) > eps[2]
    noisier = SkellamRound(q=0.01, variance=4 * e.variance, l2_sensitivity=e.l2_sensitivity,
                           l1_sensitivity=e.l1_sensitivity)
    assert ledger_eps(noisier, 100) < eps[2]


@pytest.mark.parametrize("kind", ["pld", "prv"])
def test_grid_accountants_do_not_model_skellam(kind):
    e = SkellamRound(q=0.1, variance=1e4, l2_sensitivity=100.0, l1_sensitivity=1e3)
    assert ledger_eps(e, 10, kind) is None


@pytest.mark.parametrize("bits, dim", [(32, 1), (32, 4), (32, 16), (24, 4)])
def test_skellam_epsilon_approaches_the_gaussian_at_large_scale(bits, dim):
    p = SkellamParams(dim=dim, clip_norm=1.0, noise_multiplier=1.0, expected_cohort=1, bits=bits)
    assert p.scale > 1e6
    skellam = ledger_eps(p.event(1, 1.0), 1)
    gaussian = ledger_eps(GaussianRound(1.0, "none", 10, 10), 1)
    assert gaussian - 1e-9 <= skellam <= 1.1 * gaussian


# --- serialization -------------------------------------------------------------------------------------------

FIELDS = ("q", "variance", "l2_sensitivity", "l1_sensitivity")
positive = st.one_of(st.floats(min_value=1e-300, max_value=1e300), st.integers(1, 10 ** 12))
valid_events = st.builds(
    SkellamRound,
    q=st.one_of(st.floats(0, 1), st.sampled_from([0, 1])),
    variance=st.one_of(st.floats(min_value=0, max_value=1e300), st.integers(0, 10 ** 12)),
    l2_sensitivity=positive,
    l1_sensitivity=positive,
)


@FAST
@given(valid_events)
def test_event_round_trips_through_dict_and_json(event):
    d = event_to_dict(event)
    assert d["type"] == "SkellamRound" and set(d) == {"type", *FIELDS}
    assert event_from_dict(d) == event
    assert event_from_dict(json.loads(json.dumps(d))) == event
    assert all(type(getattr(event, f)) is float for f in FIELDS)


bad_values = st.one_of(
    st.text(max_size=5), st.booleans(), st.none(),
    st.sampled_from([math.nan, math.inf, -math.inf, "1.0", [1.0], {"v": 1.0}]),
    st.floats(max_value=-1e-300), st.integers(-10 ** 12, -1),
)


@FAST
@given(event=valid_events, field=st.sampled_from(FIELDS), value=bad_values)
def test_crafted_field_values_raise_value_error(event, field, value):
    d = {**event_to_dict(event), field: value}
    with pytest.raises(ValueError):
        event_from_dict(d)


@FAST
@given(event=valid_events, q=st.floats(min_value=1.0, exclude_min=True, allow_infinity=False),
       zero=st.sampled_from(["l2_sensitivity", "l1_sensitivity"]))
def test_q_above_one_and_zero_sensitivities_raise_value_error(event, q, zero):
    with pytest.raises(ValueError):
        event_from_dict({**event_to_dict(event), "q": q})
    with pytest.raises(ValueError):
        event_from_dict({**event_to_dict(event), zero: 0.0})


@FAST
@given(event=valid_events, missing=st.sampled_from(FIELDS + ("type",)),
       extra=st.text(min_size=1, max_size=8).filter(lambda s: s not in FIELDS + ("type",)))
def test_missing_or_extra_fields_raise_value_error(event, missing, extra):
    d = event_to_dict(event)
    with pytest.raises(ValueError):
        event_from_dict({k: v for k, v in d.items() if k != missing})
    with pytest.raises(ValueError):
        event_from_dict({**d, extra: 1.0})


@pytest.mark.parametrize("item", [None, [], "SkellamRound", {"type": "Skellam"}, {"type": None}])
def test_not_an_event_raises_value_error(item):
    with pytest.raises(ValueError):
        event_from_dict(item)


@pytest.mark.parametrize("field", FIELDS)
def test_huge_integer_field_raises_value_error(field):
    d = {"type": "SkellamRound", "q": 0.5, "variance": 1.0, "l2_sensitivity": 1.0, "l1_sensitivity": 1.0,
         field: 10 ** 400}
    with pytest.raises(ValueError):
        event_from_dict(d)


# --- client_rng ----------------------------------------------------------------------------------------------

def test_client_rng_unseeded_streams_differ():
    a = client_rng(None).integers(0, 2 ** 63, size=4)
    b = client_rng(None).integers(0, 2 ** 63, size=4)
    assert not np.array_equal(a, b)


def test_client_rng_seeded_streams_are_reproducible_and_distinct():
    a = client_rng(123, 1, 2).integers(0, 2 ** 63, size=4)
    np.testing.assert_array_equal(a, client_rng(123, 1, 2).integers(0, 2 ** 63, size=4))
    assert not np.array_equal(a, client_rng(123, 1, 3).integers(0, 2 ** 63, size=4))
    assert not np.array_equal(a, client_rng(124, 1, 2).integers(0, 2 ** 63, size=4))
    assert not np.array_equal(a, client_rng(123, 2, 1).integers(0, 2 ** 63, size=4))
    # disjoint from a plain generator seeded with the same numbers (the module's own stream tag)
    plain = np.random.Generator(np.random.PCG64(np.random.SeedSequence([123, 1, 2])))
    assert not np.array_equal(a, plain.integers(0, 2 ** 63, size=4))


# --- the decode-side integrity check --------------------------------------------------------------------------

@pytest.mark.parametrize("variance", [0.3, 2.0, 50.0, 1e4, 1e8])
@pytest.mark.parametrize("p", [1e-2, 1e-5, 1e-9])
def test_skellam_tail_bounds_the_exact_tail_and_is_not_loose(variance, p):
    t = skellam_tail(variance, p)
    exact = stats.skellam(variance / 2, variance / 2)
    assert exact.sf(math.ceil(t) - 1) <= p  # P(Sk >= t), computed exactly
    quantile = exact.isf(p)  # the smallest x with P(Sk > x) <= p: the exact tail the bound stands for
    assert t <= 1.5 * quantile + 3


def test_skellam_tail_without_noise_is_zero():
    assert skellam_tail(0.0, 1e-9) == 0.0 and skellam_square_norm_bound(0.0, 64, 1e-9) == 0.0


@pytest.mark.parametrize("variance, dim", [(0.5, 16), (4.0, 64), (100.0, 256), (1e4, 128)])
def test_skellam_square_norm_bound_holds_against_monte_carlo(variance, dim):
    """The squared norm of ``dim`` iid Skellam values exceeds the bound at ``p`` no more often than ``p`` (Monte
    Carlo, 40,000 draws); its excess over the mean is within a small factor of the empirical one (measured: 2.5 to
    3.1 at variance >= 100, where the rounds live, up to 7.3 in the Poisson regime of variance 0.5)."""
    draws = stats.skellam(variance / 2, variance / 2).rvs(size=(40_000, dim), random_state=np.random.default_rng(7))
    squares = np.einsum("ij,ij->i", draws, draws).astype(np.float64)
    for p in (1e-2, 1e-3):
        bound = skellam_square_norm_bound(variance, dim, p)
        assert np.mean(squares > bound) <= p
        excess = (bound - dim * variance) / (np.quantile(squares, 1 - p) - dim * variance)
        assert 1 < excess < (8 if variance < 100 else 3.5)


def _honest_round(params: SkellamParams, n: int, seed: int) -> tuple[np.ndarray, int]:
    """The modular sum of ``n`` honest clients' shares of the same clipped update (their signals add up: the
    largest honest sum) and how many of its coordinates wrapped around."""
    gen = np.random.default_rng(seed)
    update = torch.from_numpy(gen.normal(size=params.dim))
    shares = [params.encode(update, seed, client_rng(seed, i)) for i in range(n)]
    unwrapped = np.sum([signed(s, params.bits) for s in shares], axis=0)  # one share never wraps here
    total = modular_sum(params, shares)
    return total, int(np.sum(signed(total, params.bits) != unwrapped))


@pytest.mark.slow
def test_honest_rounds_are_never_refused_and_the_bound_is_not_loose():
    """Every honest decode passes, wrap-around included (k = 1.5 standard deviations of headroom wraps about 13%
    of the coordinates of a full cohort). The honest norm over the bound stays above 0.5: measured with n in
    (1, 4, 10), 0.56-0.73 at D = 2^10, 0.68-0.88 at 2^12, 0.75-0.95 at 2^14 with z >= 0.5, 0.79-0.99 at z = 0.02
    (where the signal-noise cross term matters), 0.80-1.00 without noise."""
    ratios, wraps = [], 0
    for seed, (log_d, n, z, bits, k) in enumerate(
            (log_d, n, z, bits, k) for log_d in (10, 12, 14) for n in (1, 10) for z in (0.0, 0.02, 0.5, 1.0, 2.0)
            for bits in (16, 20) for k in (4.0, 1.5)):
        params = SkellamParams(dim=2 ** log_d - 3, clip_norm=2.0, noise_multiplier=z, expected_cohort=10, bits=bits,
                               k_stddevs=k)
        total, wrapped = _honest_round(params, n, seed)
        values = signed(total, bits).astype(np.float64)
        norm, bound = float(np.linalg.norm(values)), params.integrity_bound(n)
        params.check_integrity(total, n)  # never raises for honest clients
        wraps += wrapped
        ratios.append(norm / bound)
    assert wraps > 1000  # the wrap-heavy rounds did wrap
    assert min(ratios) > 0.5, min(ratios)


def test_integrity_check_refuses_a_sum_beyond_the_bound_and_names_norm_and_bound():
    params = SkellamParams(dim=1000, clip_norm=1.0, noise_multiplier=1.0, expected_cohort=5, bits=20)
    total, _ = _honest_round(params, 5, 0)
    bound = params.integrity_bound(5)
    tampered = total.copy()
    tampered[::2] += np.uint64(params.modulus // 2 - 1)  # half the coordinates pushed to the far end of the range
    assert float(np.linalg.norm(signed(tampered, params.bits).astype(np.float64))) > bound
    with pytest.raises(IntegrityCheckFailed, match=r"5 uploads has norm [\d.]+, above the bound [\d.]+"):
        params.check_integrity(tampered, 5)


def test_undetected_norm_is_the_room_left_by_the_others_noise():
    params = SkellamParams(dim=100_050, clip_norm=10.0, noise_multiplier=1.0, expected_cohort=10, bits=20)
    bound, variance = params.integrity_bound(10), params.share_variance
    assert params.undetected_norm(10) == pytest.approx(
        math.sqrt(bound ** 2 - 9 * params.padded_dim * variance) / params.scale)
    assert params.undetected_norm(1) == pytest.approx(params.integrity_bound(1) / params.scale)
    one_wrap = params.modulus / 2 / params.scale  # one coordinate pushed by 2^(b-1): about 4 z C here
    assert one_wrap < params.undetected_norm(10)
