"""Correlated noise (DP-FTRL's tree, BandMF, BLT): each stream releases exactly the noise its strategy matrix
implies, its sensitivity is the true maximum over participation patterns, its accounting is what the papers
state, and every combination without sound accounting is refused."""

import itertools
import json
import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import rdp

from fedprivacy.privacy.accounting import CoveredRelease, GaussianRound, MatrixMechanismRun, PrivacyLedger, epsilon
from fedprivacy.privacy.bandmf import BandMFNoise, bandmf_coefficients
from fedprivacy.privacy.blt import BLTNoise, blt_coefficients, blt_loss, blt_parameters
from fedprivacy.privacy.correlated import CorrelatedMechanism
from fedprivacy.privacy.events import event_to_dict
from fedprivacy.privacy.matrix_factorization import inverse_coefficients, prefix_error, toeplitz_sensitivity
from fedprivacy.privacy.mechanism import GaussianMechanism, planned_ledger
from fedprivacy.privacy.noise import GaussianNoise
from fedprivacy.privacy.release_log import RELEASES, ReleaseLog
from fedprivacy.privacy.sampling import make_sampler
from fedprivacy.privacy.tree import TreeNoise, level_variance, tree_sensitivity


def _dense_toeplitz(c: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((n, n))
    for i in range(n):
        for j in range(max(0, i - len(c) + 1), i + 1):
            out[i, j] = c[i - j]
    return out


def _scripted(stream, draws: list[torch.Tensor]):
    """Make ``stream`` draw ``draws`` in order instead of from its generator (the recurrence is then checkable)."""
    queue = iter(draws)
    stream._fresh = lambda like: next(queue).clone()
    return stream


def _released(stream, n: int, dim: int = 3) -> np.ndarray:
    """Releases 1..n at std = std_factor(t) (z C = 1): rows are ``s(C) (C^{-1} w)_t``."""
    out = []
    for t in range(1, n + 1):
        x = torch.zeros(dim, dtype=torch.float64)
        stream.add_(x, stream.std_factor(t))
        out.append(x.numpy())
    return np.array(out)


# -- the recurrences are the strategy's C^{-1} -------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda: BandMFNoise(0, horizon=12, separation=4, bands=4),
    lambda: BandMFNoise(0, horizon=12, separation=3, bands=3, amplified=True),
    lambda: BLTNoise(0, horizon=12, separation=12, buffers=3),
    lambda: BLTNoise(0, horizon=12, separation=3, buffers=2),
])
def test_toeplitz_streams_release_exactly_the_strategy_noise(make):
    n, dim = 12, 3
    gen = torch.Generator().manual_seed(5)
    w = [torch.randn(dim, dtype=torch.float64, generator=gen) for _ in range(n)]
    stream = _scripted(make(), w)
    got = _released(stream, n, dim)
    c_inv = np.linalg.inv(_dense_toeplitz(stream.coefficients, n))
    want = stream.sensitivity * c_inv @ torch.stack(w).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def _tree_reference(n: int, draws: list[torch.Tensor]) -> np.ndarray:
    """Release t = P_t - P_{t-1} from the definition: node (level, end) gets the next draw when it completes
    (leaf first, then bottom-up), its efficient estimate combines its own draw and its children's estimates."""
    queue = iter(draws)
    own, est, out, previous = {}, {}, [], 0.0
    for t in range(1, n + 1):
        own[(0, t)] = next(queue).numpy()
        est[(0, t)] = own[(0, t)]
        level = 1
        while t % (2 ** level) == 0:
            own[(level, t)] = next(queue).numpy()
            v = level_variance(level - 1)
            children = est[(level - 1, t - 2 ** (level - 1))] + est[(level - 1, t)]
            est[(level, t)] = (2 * v * own[(level, t)] + children) / (2 * v + 1)
            level += 1
        prefix, end = 0.0, 0
        for bit in reversed(range(t.bit_length())):  # the binary decomposition of t, largest node first
            if t >> bit & 1:
                end += 2 ** bit
                prefix = prefix + est[(bit, end)]
        out.append(prefix - previous)
        previous = prefix
    return np.array(out)


def test_the_tree_releases_differences_of_honakers_efficient_prefix_estimates():
    n, dim = 13, 2
    gen = torch.Generator().manual_seed(1)
    draws = [torch.randn(dim, dtype=torch.float64, generator=gen) for _ in range(2 * n)]
    stream = _scripted(TreeNoise(0, horizon=16, separation=16), list(draws))
    got = _released(stream, n, dim)
    np.testing.assert_allclose(got, stream.sensitivity * _tree_reference(n, draws), rtol=1e-10, atol=1e-12)


def test_the_trees_prefix_variance_is_the_efficient_estimators():
    n, m = 16, 40_000
    stream = TreeNoise(3, horizon=n, separation=n)
    prefix = np.cumsum(_released(stream, n, m), axis=0) / stream.sensitivity
    for t in range(1, n + 1):
        want = sum(level_variance(bit) for bit in range(t.bit_length()) if t >> bit & 1)
        assert prefix[t - 1].var() == pytest.approx(want, rel=0.04)
    assert level_variance(10) == pytest.approx(0.5, rel=1e-3)  # sigma^2 / 2 for a tall tree (Kairouz et al.)


@pytest.mark.parametrize("make", [
    lambda: TreeNoise(0, horizon=8, separation=8),
    lambda: BandMFNoise(0, horizon=8, separation=2, bands=2),
    lambda: BLTNoise(0, horizon=8, separation=4, buffers=2),
])
def test_released_noise_has_the_covariance_the_strategy_implies_through_the_mechanism(make):
    """Clients send nothing: the mechanism's released sums are the stream's noise, z C s(C) C^{-1} w."""
    n, m, z, clip = 8, 60_000, 0.7, 2.0
    probe = make()
    mech = GaussianMechanism(noise_multiplier=z, clip_norm=clip, expected_cohort=5, population=40, seed=2,
                             sampling="min_separated", groups=probe.separation,
                             noise_stream=lambda seed, device, secure: make())
    sums = np.array([(mech.release(mech.aggregator(m), t).g * 5).numpy() for t in range(1, n + 1)], dtype=np.float64)
    if isinstance(probe, TreeNoise):  # the tree's covariance from the reference estimator on unit draws
        basis = np.eye(2 * n)
        ref = _tree_reference(n, [torch.tensor(basis[i]) for i in range(2 * n)])
        implied = ref @ ref.T
    else:
        c_inv = np.linalg.inv(_dense_toeplitz(probe.coefficients, n))
        implied = c_inv @ c_inv.T
    implied *= (z * clip * probe.sensitivity) ** 2
    empirical = sums @ sums.T / m
    scale = np.sqrt(np.outer(np.diag(implied), np.diag(implied)))
    assert np.abs(empirical - implied).max() / scale.max() < 6 / math.sqrt(m) * 2


# -- sensitivity: the true maximum over participation patterns ------------------------------------------
def _patterns(n: int, b: int, k: int):
    for size in range(1, k + 1):
        for combo in itertools.combinations(range(n), size):
            if all(j - i >= b for i, j in zip(combo, combo[1:])):
                yield combo


def _brute_force(matrix: np.ndarray, b: int, k: int) -> float:
    return max(np.linalg.norm(matrix[:, list(p)].sum(1)) for p in _patterns(matrix.shape[1], b, k))


@pytest.mark.parametrize(("n", "b"), [(8, 1), (8, 2), (9, 3), (10, 4), (6, 6)])
def test_toeplitz_sensitivity_is_the_maximum_over_min_separated_patterns(n, b):
    k = -(-n // b)
    theta, omega = blt_parameters(n, 2, b)
    c = blt_coefficients(theta, omega, n)
    assert float(toeplitz_sensitivity(c, n, b, k)) == pytest.approx(_brute_force(_dense_toeplitz(c.numpy(), n), b, k),
                                                                    rel=1e-9)
    band = bandmf_coefficients(n, b if b < n else 3)
    if len(band) <= b:
        assert float(toeplitz_sensitivity(torch.tensor(np.array(band)), n, b, k)) == pytest.approx(
            _brute_force(_dense_toeplitz(band, n), b, k), rel=1e-9)


def test_a_toeplitz_strategy_without_an_exact_formula_is_refused():
    with pytest.raises(ValueError, match="non-negative, non-increasing"):
        toeplitz_sensitivity(torch.tensor([1.0, -0.5, 0.2], dtype=torch.float64), 6, 1, 6)


def _tree_matrix(n: int) -> np.ndarray:
    """The tree's strategy: one row per node (level, end) with end <= n, ones on the leaves it covers."""
    rows = []
    for level in range(int(math.log2(n)) + 1):
        for end in range(2 ** level, n + 1, 2 ** level):
            row = np.zeros(n)
            row[end - 2 ** level:end] = 1
            rows.append(row)
    return np.array(rows)


@pytest.mark.parametrize(("n", "b"), [(8, 8), (7, 7), (8, 1), (8, 3), (12, 4), (16, 5)])
def test_tree_sensitivity_is_exact_for_one_participation_and_an_upper_bound_otherwise(n, b):
    k = -(-n // b)
    true = _brute_force(_tree_matrix(n), b, k)
    bound = tree_sensitivity(n, b, k)
    if k == 1:
        assert bound == pytest.approx(true, rel=1e-12)
    else:
        assert true <= bound + 1e-12


# -- defining properties -----------------------------------------------------------------------------
def test_bandmf_with_one_band_is_independent_noise_bit_for_bit():
    band, plain = BandMFNoise(4, horizon=6, separation=2, bands=1), GaussianNoise(4)
    for t in range(1, 7):
        a, b = torch.zeros(1000), torch.zeros(1000)
        band.add_(a, 0.3)
        plain.add_(b, 0.3)
        assert torch.equal(a, b)
        assert band.std_factor(t) == pytest.approx(math.sqrt(3))  # s = sqrt(k) ||c||, k = 3 participations


def test_optimized_strategies_beat_independent_noise_and_the_tree_at_equal_sensitivity():
    n, b = 256, 256
    independent = (n + 1) / 2  # ||A||_F^2 / n with s(I) = 1
    band = torch.tensor(np.array(bandmf_coefficients(n, 8)))
    band_loss = float(prefix_error(inverse_coefficients(band, n)) * toeplitz_sensitivity(band, n, b, 1) ** 2)
    theta, omega = blt_parameters(n, 3, b)
    blt = float(blt_loss(theta, omega, n, b))
    assert blt < band_loss < independent / 4
    assert math.sqrt(blt / independent) < 0.25  # BLT: RMSE well under a quarter of independent noise's


def test_blt_memory_does_not_grow_with_the_horizon():
    sizes = []
    for horizon in (16, 1024):
        stream = BLTNoise(0, horizon=horizon, separation=horizon, buffers=3)
        for t in range(1, 20):
            stream.add_(torch.zeros(100), stream.std_factor(t))
        sizes.append(sum(b.numel() for b in stream._buffers))
    assert sizes == [300, 300]


# -- accounting ---------------------------------------------------------------------------------------
def _dp_accounting_rdp(events, delta):
    accountant = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for e in events:
        accountant.compose(e)
    return accountant.get_epsilon(delta)


def test_a_correlated_run_is_one_gaussian_event_per_horizon():
    spec = CorrelatedMechanism(kind="blt", horizon=10, groups=2, buffers=2)
    ledger = planned_ledger(1.5, 25, expected_cohort=4, population=40, sampling="min_separated", groups=2,
                            noise_stream=spec)
    runs = [e for e, _ in ledger.entries if isinstance(e, MatrixMechanismRun)]
    assert sum(n for e, n in ledger.entries if isinstance(e, MatrixMechanismRun)) == 3  # releases 1, 11, 21
    assert runs[0] == MatrixMechanismRun(1.5, "blt", 10, 2, 5)
    assert all(isinstance(e, CoveredRelease) for e, _ in ledger.entries if not isinstance(e, MatrixMechanismRun))
    want = _dp_accounting_rdp([dp_accounting.GaussianDpEvent(1.5)] * 3, 1e-5)
    assert epsilon(ledger, 1e-5, "rdp") == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("stream", [GaussianNoise, CorrelatedMechanism(kind="bandmf", horizon=12, groups=4, bands=4,
                                                                       amplified=True)])
def test_amplified_bandmf_and_cyclic_poisson_are_dp_sgd_with_ceil_t_over_b_steps(stream):
    n_pop, m, b, t, z = 400, 5, 4, 30, 1.1
    ledger = planned_ledger(z, t, expected_cohort=m, population=n_pop, sampling="cyclic_poisson", groups=b,
                            noise_stream=stream)
    steps = -(-t // b)
    event = dp_accounting.PoissonSampledDpEvent(m * b / n_pop, dp_accounting.GaussianDpEvent(z))
    for kind in ("rdp", "pld"):
        got = epsilon(ledger, 1e-5, kind)
        acc = (rdp.RdpAccountant() if kind == "rdp" else dp_accounting.pld.PLDAccountant())
        acc.compose(event, steps)
        assert got == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3 if kind == "pld" else 0.05)


def test_min_separated_independent_noise_is_one_gaussian_per_cycle():
    ledger = planned_ledger(2.0, 9, expected_cohort=3, population=30, sampling="min_separated", groups=3)
    assert [(type(e).__name__, n) for e, n in ledger.entries][:2] == [("GaussianRound", 1), ("CoveredRelease", 2)]
    assert epsilon(ledger, 1e-5, "rdp") == pytest.approx(
        epsilon(PrivacyLedger([(GaussianRound(2.0, "none", 30, 30.0), 3)]), 1e-5, "rdp"), rel=1e-12)


# -- a resume after a crash between a logged release and its checkpoint ------------------------------------
_HORIZON_4 = {"tree": CorrelatedMechanism(kind="tree", horizon=4, groups=2),
              "bandmf": CorrelatedMechanism(kind="bandmf", horizon=4, groups=2, bands=2),
              "blt": CorrelatedMechanism(kind="blt", horizon=4, groups=2, buffers=2)}


def _correlated(kind: str, seed: int | None) -> GaussianMechanism:
    return GaussianMechanism(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=2, population=8, seed=seed,
                             sampling="min_separated", groups=2, noise_stream=_HORIZON_4[kind])


def _release(mechanism: GaussianMechanism, releases: int) -> None:
    for _ in range(releases):
        mechanism.release(mechanism.aggregator(5), mechanism.next_release)


def _crash_twice(folder, kind: str, seed: int | None) -> tuple[dict, GaussianMechanism]:
    """Releases 1-3 checkpointed; 4-6 logged, then a crash; the resume logs 7-8, then crashes before a checkpoint.
    Returns the checkpoint and the mechanism of the second resume."""
    first = _correlated(kind, seed)
    first.attach_release_log(ReleaseLog(folder))
    _release(first, 3)
    checkpoint = first.state_dict()
    _release(first, 3)  # release 5 begins the strategy's second horizon
    resumed = _correlated(kind, seed)
    resumed.load_state_dict(checkpoint)
    assert resumed.attach_release_log(ReleaseLog(folder)) == 3 and (resumed.epoch, resumed.stream_start) == (1, 7)
    _release(resumed, 2)
    again = _correlated(kind, seed)
    again.load_state_dict(checkpoint)
    assert again.attach_release_log(ReleaseLog(folder)) == 5 and (again.epoch, again.stream_start) == (2, 9)
    return checkpoint, again


@pytest.mark.parametrize("seed", [None, 0], ids=["os", "seeded"])
@pytest.mark.parametrize("kind", sorted(_HORIZON_4))
def test_lost_releases_across_horizons_and_resumes_are_each_checked_against_the_stream_that_made_them(
        tmp_path, kind, seed):
    """Before: under OS noise, release 4 was checked against a new stream's first release and refused, whatever
    was logged; the run could never go on."""
    checkpoint, resumed = _crash_twice(tmp_path, kind, seed)
    assert checkpoint["noise"] is None if seed is None else checkpoint["noise"] is not None
    _release(resumed, 1)
    entries = ReleaseLog(tmp_path).entries
    logged = [e["event"] for e in entries]
    assert [e for e, n in resumed.ledger.entries for _ in range(n)] == logged  # every logged release, accounted
    new_horizon = [isinstance(e, MatrixMechanismRun) for e in logged]  # horizon 4: releases 1 and 5; resumes: 7, 9
    assert new_horizon == [k in (1, 5, 7, 9) for k in range(1, 10)]
    assert [e["epoch"] for e in entries] == [0] * 6 + [1] * 2 + [2]
    draws = [e["draw"] for e in entries]
    assert len(set(draws)) == len(draws)  # no draw released twice (seeded: re-keyed by the epoch)


@pytest.mark.parametrize(("release", "forged"), [
    (7, CoveredRelease(1.0, "blt")),  # a resume's new stream claimed as covered by the old one
    (5, CoveredRelease(1.0, "blt")),  # the second horizon's start claimed as covered by the first
    (6, MatrixMechanismRun(1.0, "blt", 4, 2, 2)),  # a new stream mid-horizon, with no resume (epoch) there
])
def test_a_log_claiming_an_event_its_stream_could_not_have_made_is_refused(tmp_path, release, forged):
    checkpoint, _ = _crash_twice(tmp_path, "blt", None)
    lines = (tmp_path / RELEASES).read_text().splitlines(keepends=True)
    entry = json.loads(lines[release - 1])
    entry["event"] = event_to_dict(forged)
    lines[release - 1] = json.dumps(entry) + "\n"
    (tmp_path / RELEASES).write_text("".join(lines))
    resumed = _correlated("blt", None)
    resumed.load_state_dict(checkpoint)
    with pytest.raises(ValueError, match=f"release {release} logs the event .* cannot have made it there"):
        resumed.attach_release_log(ReleaseLog(tmp_path))


@pytest.mark.parametrize("kind", sorted(_HORIZON_4))
def test_an_os_noise_resume_from_its_last_checkpoint_begins_a_new_epoch_that_a_later_resume_reads(tmp_path, kind):
    """Nothing is lost, yet the OS stream is not continued: its fresh stream (a new horizon at release 4) is marked by
    a new epoch, so a crash before its first checkpoint resumes with releases 4-5 checked as that stream made them."""
    ran = _correlated(kind, None)
    ran.attach_release_log(ReleaseLog(tmp_path))
    _release(ran, 3)
    checkpoint = ran.state_dict()
    resumed = _correlated(kind, None)
    resumed.load_state_dict(checkpoint)
    assert resumed.attach_release_log(ReleaseLog(tmp_path)) == 0 and (resumed.epoch, resumed.stream_start) == (1, 4)
    _release(resumed, 2)
    again = _correlated(kind, None)
    again.load_state_dict(checkpoint)
    assert again.attach_release_log(ReleaseLog(tmp_path)) == 2
    logged = [e["event"] for e in ReleaseLog(tmp_path).entries]
    assert [isinstance(e, MatrixMechanismRun) for e in logged] == [True, False, False, True, False]
    assert [e for e, n in again.ledger.entries for _ in range(n)] == logged


def test_an_os_noise_restore_numbers_its_fresh_stream_from_the_next_release():
    """Nothing persisted rebuilds the OS stream: the restored mechanism's next release begins a new horizon."""
    ran = _correlated("blt", None)
    _release(ran, 3)
    restored = _correlated("blt", None)
    restored.load_state_dict(ran.state_dict())
    assert restored.stream_start == 4 and isinstance(restored.event(), MatrixMechanismRun)


# -- participation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["cyclic_poisson", "min_separated"])
def test_cyclic_schedules_keep_every_users_participations_b_apart(kind):
    b, population = 3, 31
    sampler = make_sampler(kind, population, 4, seed=0, groups=b)
    last: dict[int, int] = {}
    for release in range(1, 40):
        cohort = sampler.sample(release)
        assert np.all(cohort % b == (release - 1) % b)
        for user in cohort.tolist():
            assert release - last.get(user, -b) >= b
            last[user] = release
    with pytest.raises(ValueError, match="privacy.expected_cohort=11 times privacy.groups=3"):
        make_sampler(kind, population, 11, seed=0, groups=b)


# -- refusals -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"sampling": "poisson", "groups": 1}, "needs privacy.sampling: min_separated or cyclic_poisson"),
    ({"sampling": "min_separated", "groups": 3}, "built for min separation 2"),
    ({"sampling": "min_separated", "placement": "distributed"}, "needs placement='central'"),
])
def test_unsound_combinations_are_refused_in_one_line(kwargs, message):
    spec = CorrelatedMechanism(kind="tree", horizon=8, groups=2)
    settings = {"noise_multiplier": 1.0, "clip_norm": 1.0, "expected_cohort": 4, "population": 40, "seed": 0,
                "noise_stream": spec, "groups": 2, **kwargs}
    with pytest.raises(ValueError, match=message) as err:
        GaussianMechanism(**settings)
    assert "\n" not in str(err.value)


def test_bandmf_with_more_bands_than_the_separation_and_amplified_blt_are_refused():
    with pytest.raises(ValueError, match="bands=5 must be <= privacy.groups=4"):
        CorrelatedMechanism(kind="bandmf", horizon=8, groups=4, bands=5)(0)
    with pytest.raises(ValueError, match="amplified accounting is BandMF's"):
        CorrelatedMechanism(kind="blt", horizon=8, groups=4, amplified=True)
    with pytest.raises(ValueError, match="amplified bandmf accounting needs privacy.sampling: cyclic_poisson"):
        GaussianMechanism(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, population=40, seed=0,
                          sampling="min_separated", groups=4,
                          noise_stream=CorrelatedMechanism(kind="bandmf", horizon=8, groups=4, amplified=True))


# -- large-cohort emulation ---------------------------------------------------------------------------
@pytest.mark.parametrize(("sampling", "spec"), [
    ("cyclic_poisson", CorrelatedMechanism(kind="bandmf", horizon=12, groups=4, bands=4, amplified=True)),
    ("min_separated", CorrelatedMechanism(kind="blt", horizon=12, groups=4, buffers=2)),
    ("cyclic_poisson", GaussianNoise),
])
def test_emulation_accounts_the_deployments_schedule_and_scales_the_whole_correlated_draw(sampling, spec):
    """Simulate m = 4 of 40 users per round; claim M = 40 of N' = 1000 with the same b = 4 groups: the events are the
    deployment's own (a mechanism that samples 40 of 1000), the draws the deployment's times m / M."""
    z, m, big_m, big_n, b = 1.3, 4, 40, 1000, 4
    common = {"noise_multiplier": z, "clip_norm": 0.5, "sampling": sampling, "groups": b, "noise_stream": spec,
              "seed": 7}
    emulated = GaussianMechanism(expected_cohort=m, population=40, noise_cohort=big_m, noise_population=big_n,
                                 **common)
    deployment = GaussianMechanism(expected_cohort=big_m, population=big_n, **common)
    assert emulated.planned_ledger(12).entries == deployment.planned_ledger(12).entries
    assert planned_ledger(z, 12, expected_cohort=m, population=40, sampling=sampling, groups=b, noise_stream=spec,
                          noise_cohort=big_m, noise_population=big_n).entries == deployment.planned_ledger(12).entries
    plain = GaussianMechanism(expected_cohort=m, population=40, **common)  # same seed: the same stream of draws
    for release in range(1, 6):
        g = emulated.release(emulated.aggregator(1000), release).g
        want = plain.release(plain.aggregator(1000), release).g * (m / big_m)
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-7)
    assert emulated.ledger.entries == deployment.planned_ledger(5).entries


def test_an_emulated_cyclic_deployment_too_small_for_its_groups_is_refused_naming_noise_cohort():
    with pytest.raises(ValueError, match=r"privacy.noise_cohort=300 times privacy.groups=4 must be <= the emulated"):
        GaussianMechanism(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, population=40, seed=0,
                          sampling="cyclic_poisson", groups=4, noise_cohort=300, noise_population=1000)
