"""Invariants 1-4, 11, 12 at the core level: clip, unweighted sum, one draw, fixed divisor."""

import math

import pytest
import torch

from fedprivacy.privacy.aggregation import PrivateSum
from fedprivacy.privacy.clipping import flat_l2_clip_
from fedprivacy.privacy.noise import GaussianNoise
from fedprivacy.updates import SparseUpdate


def test_clip_bounds_norm_preserves_direction_and_short_vectors():
    g = torch.Generator().manual_seed(0)
    for scale in (0.1, 1.0, 10.0, 1e4):
        u = torch.randn(1000, generator=g) * scale
        before = u.clone()
        norm = flat_l2_clip_(u, 1.5)
        assert float(before.norm()) * (1 - 1e-6) <= norm <= float(before.norm()) * (1 + 2e-5)  # an upper bound
        assert float(u.norm()) <= 1.5 * (1 + 1e-6)
        if norm <= 1.5:
            assert torch.equal(u, before)
        else:
            assert torch.allclose(u / u.norm(), before / before.norm(), atol=1e-6)


def test_clip_of_zero_update_is_zero_without_nan():
    u = torch.zeros(10)
    assert flat_l2_clip_(u, 1.0) == 0.0
    assert torch.equal(u, torch.zeros(10))


def test_clip_is_flat_over_all_coordinates_not_per_part():
    # two "parameters" of norm 3 and 4: a per-part clip to 1 would give norm sqrt(2); flat gives 1
    u = torch.tensor([3.0, 0.0, 4.0, 0.0])
    flat_l2_clip_(u, 1.0)
    assert torch.allclose(u, torch.tensor([0.6, 0.0, 0.8, 0.0]))


def _sum(noise_multiplier=0.0, clip=10.0, m=4.0, dim=6):
    return PrivateSum(dim, clip_norm=clip, noise_multiplier=noise_multiplier, expected_cohort=m)


def test_unweighted_fixed_divisor_ignores_realised_count():
    a, b = torch.arange(6.0), torch.ones(6)
    s = _sum()
    s.add_(SparseUpdate.dense(a.clone()))
    s.add_(SparseUpdate.dense(b.clone()))
    out = s.release(GaussianNoise(0))
    assert torch.allclose(out, (a + b) / 4.0)  # divisor is the configured m=4, not the 2 replies


def test_nonfinite_and_malformed_updates_contribute_zero_and_do_not_change_noise():
    good = torch.full((6,), 0.5)
    ref = _sum(noise_multiplier=1.0)
    ref.add_(SparseUpdate.dense(good.clone()))
    expected = ref.release(GaussianNoise(7))

    s = _sum(noise_multiplier=1.0)
    assert s.add_(SparseUpdate.dense(torch.tensor([float("nan")] * 6))) is False
    assert s.add_(SparseUpdate(torch.tensor([2]), torch.tensor([float("inf")]), 6)) is False
    s.reject("failed", "node 3", "its ClientApp raised")
    assert s.add_(SparseUpdate.dense(torch.ones(5))) is False  # wrong dimension
    assert s.add_(SparseUpdate.dense(good.clone())) is True
    out = s.release(GaussianNoise(7))
    assert torch.equal(out, expected)
    st = s.stats
    assert (st.received, st.accepted, st.rejected["nonfinite"], st.rejected["malformed"], st.rejected["failed"]) == \
        (5, 1, 2, 1, 1)


def test_one_dense_draw_per_release_from_the_dedicated_generator():
    dim, z, clip, m = 50_000, 2.0, 0.5, 10.0
    s = _sum(noise_multiplier=z, clip=clip, m=m, dim=dim)
    out = s.release(GaussianNoise(3))
    # the same generator, drawing ONE dense vector of d normals, reproduces it exactly
    twin = GaussianNoise(3)
    expected = torch.zeros(dim)
    twin.add_(expected, z * clip)
    assert torch.equal(out, expected / m)
    assert float(out.std()) == pytest.approx(z * clip / m, rel=0.02)


def test_noise_generator_is_isolated_from_global_rng_and_reproducible():
    a, b = torch.zeros(1000), torch.zeros(1000)
    torch.manual_seed(1)
    GaussianNoise(5).add_(a, 1.0)
    torch.manual_seed(999)
    torch.randn(100)  # other code drawing from the global generator
    GaussianNoise(5).add_(b, 1.0)
    assert torch.equal(a, b)
    c = torch.zeros(1000)
    GaussianNoise(6).add_(c, 1.0)
    assert not torch.equal(a, c)


def test_noise_state_round_trip_continues_the_stream():
    n = GaussianNoise(0)
    first = torch.zeros(10)
    n.add_(first, 1.0)
    state = n.state_dict()
    x, y = torch.zeros(10), torch.zeros(10)
    n.add_(x, 1.0)
    m = GaussianNoise(123)
    m.load_state_dict(state)
    m.add_(y, 1.0)
    assert torch.equal(x, y)


def test_secure_noise_is_not_determined_by_the_seed():
    a, b = torch.zeros(100), torch.zeros(100)
    GaussianNoise(0, secure=True).add_(a, 1.0)
    GaussianNoise(0, secure=True).add_(b, 1.0)
    assert not torch.equal(a, b)


def test_zero_noise_multiplier_is_deterministic():
    s = _sum(noise_multiplier=0.0)
    s.add_(SparseUpdate.dense(torch.ones(6)))
    assert torch.equal(s.release(GaussianNoise(0)), torch.full((6,), 0.25))
    assert math.isfinite(float(s.stats.as_metrics()["update_norm_median"]))


def test_the_signal_is_the_noise_free_clipped_mean_and_only_central_placement_reports_it():
    s = _sum(noise_multiplier=2.0)
    s.add_(SparseUpdate.dense(torch.full((6,), 10.0)))  # clipped to C
    s.add_(SparseUpdate.dense(torch.tensor([0.1, 0, 0, 0, 0, 0])))
    clipped = torch.full((6,), 10.0) * (10.0 / 600.0 ** 0.5) + torch.tensor([0.1, 0, 0, 0, 0, 0])
    released = s.release(GaussianNoise(0))
    want = float(clipped.norm()) / 4.0
    assert s.stats.as_metrics()["clipped_mean_norm"] == pytest.approx(want, rel=1e-5)  # float32 clip
    assert float(released.norm()) != pytest.approx(want, rel=1e-3)  # the release carries noise, the metric none
    distributed = PrivateSum(6, clip_norm=10.0, noise_multiplier=2.0, expected_cohort=4.0, placement="distributed")
    distributed.add_(SparseUpdate.dense(torch.ones(6)))
    distributed.release(GaussianNoise(0))
    assert "clipped_mean_norm" not in distributed.stats.as_metrics()


def test_sparse_update_equals_its_dense_vector():
    idx, vals = torch.tensor([0, 3, 5]), torch.tensor([3.0, 4.0, 12.0])  # norm 13
    dense = SparseUpdate(idx, vals.clone(), 6).to_dense()
    a, b = _sum(clip=1.0, dim=6), _sum(clip=1.0, dim=6)
    a.add_(SparseUpdate(idx, vals.clone(), 6))
    b.add_(SparseUpdate.dense(dense.clone()))
    assert torch.allclose(a.release(GaussianNoise(0)), b.release(GaussianNoise(0)))


@pytest.mark.parametrize("indices", [[1, 1, 2], [2, 1, 3], [-1, 2, 3], [0, 2, 6]])
def test_sparse_update_with_repeated_unsorted_or_out_of_range_indices_is_rejected(indices):
    # a repeated index would add more than the clipped norm: the sensitivity bound would break
    s = _sum(clip=1.0, dim=6)
    assert s.add_(SparseUpdate(torch.tensor(indices), torch.ones(3), 6)) is False
    assert s.stats.rejected["malformed"] == 1
    assert torch.equal(s.release(GaussianNoise(0)), torch.zeros(6))


def _round(prefetch: bool, placement: str = "central") -> tuple[torch.Tensor, dict]:
    noise = GaussianNoise(7)
    agg = PrivateSum(5000, clip_norm=2.0, noise_multiplier=1.3, expected_cohort=3.0, placement=placement)
    if prefetch:
        agg.prefetch_noise(noise)
    agg.add_(SparseUpdate.dense(torch.ones(5000)))
    return agg.release(noise).clone(), noise.state_dict()


def test_prefetched_noise_releases_bit_identical_values_and_generator_state():
    plain, plain_state = _round(prefetch=False)
    early, early_state = _round(prefetch=True)
    assert torch.equal(plain, early)
    assert torch.equal(plain_state["generator"], early_state["generator"])


def test_prefetch_only_where_the_std_cannot_depend_on_the_replies():
    noise = GaussianNoise(7)
    agg = PrivateSum(10, clip_norm=1.0, noise_multiplier=1.0, expected_cohort=2.0, placement="distributed")
    agg.prefetch_noise(noise)  # distributed: the top-up depends on how many shares arrive
    assert noise._pending is None


def test_a_prefetched_draw_must_be_consumed_as_prefetched():
    noise = GaussianNoise(7)
    noise.prefetch_(torch.zeros(10))
    with pytest.raises(RuntimeError, match="already prefetched"):
        noise.prefetch_(torch.zeros(11))
    with pytest.raises(RuntimeError, match="does not match"):
        noise.add_(torch.zeros(11), 2.0)
    noise.prefetch_(torch.zeros(10))
    with pytest.raises(RuntimeError, match="does not match"):
        noise.add_(torch.zeros(10), 0.0)  # a std-0 release draws nothing: the stream would shift


def test_prefetching_twice_is_one_draw():
    plain, early = GaussianNoise(7), GaussianNoise(7)
    x, y = torch.zeros(100), torch.zeros(100)
    plain.add_(x, 1.5)
    early.prefetch_(y)
    early.prefetch_(y)  # already pending: nothing more drawn
    early.add_(y, 1.5)
    assert torch.equal(x, y)
    assert torch.equal(plain.state_dict()["generator"], early.state_dict()["generator"])


def test_a_checkpoint_while_a_draw_is_pending_redraws_it_on_resume():
    noise = GaussianNoise(7)
    noise.prefetch_(torch.zeros(1000))  # the next round's draw, started before the checkpoint
    noise._pending.draw.result()  # the generator has moved past the draw
    state = noise.state_dict()
    released = torch.zeros(1000)
    noise.add_(released, 2.0)
    resumed = GaussianNoise(0)
    resumed.load_state_dict(state)
    again = torch.zeros(1000)
    resumed.add_(again, 2.0)
    assert torch.equal(released, again)
    assert torch.equal(noise.state_dict()["generator"], resumed.state_dict()["generator"])
