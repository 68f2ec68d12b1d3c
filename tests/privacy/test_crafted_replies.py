"""A client's reply is untrusted input: whatever it holds, its contribution to the sum has L2 norm at
most C (computed exactly), and nothing it holds crashes the round (invariants 1, 11, 12).

Crafted replies: the float32-norm fooling update (a few large entries, millions of tiny ones whose
squares vanish in a float32 sum), payloads whose real dtype or byte order is not what the ``Array``
metadata says, wrong shapes and index sets, extreme and subnormal values.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedprivacy.fl.records import record_to_update, update_to_record
from fedprivacy.privacy.aggregation import PrivateSum
from fedprivacy.privacy.bounds import MAX_NOISE_MULTIPLIER, MIN_DELTA, MIN_NOISE_MULTIPLIER
from fedprivacy.privacy.client_ledgers import MAX_STEPS_PER_ROUND, MIN_CLIENT_SAMPLING_RATE
from fedprivacy.privacy.clipping import flat_l2_clip_, l2_norm_bound
from fedprivacy.updates import REJECTION_REASONS, RejectedUpdate, SparseUpdate


def exact_norm(t: torch.Tensor) -> float:
    """The L2 norm in float64 via numpy's pairwise sum of exact float64 squares of float32 values."""
    a = t.detach().cpu().numpy().astype(np.float64).reshape(-1)
    return math.sqrt(float(np.dot(a, a)))


def contribution(update: SparseUpdate, clip: float, dim: int) -> tuple[bool, torch.Tensor]:
    """What ``update`` adds to an empty round's sum (no noise, divisor 1)."""
    s = PrivateSum(dim, clip_norm=clip, noise_multiplier=0.0, expected_cohort=1.0)
    accepted = s.add_(update, "crafted")
    assert s.stats.received == 1 and sum(s.stats.rejected.values()) == (not accepted)
    return accepted, s._sum


def test_an_update_built_to_fool_a_float32_norm_is_clipped_to_c():
    # 8 entries of 1 and 5M entries of 2e-4: a float32 norm reads 2.828, the true norm is 2.863 (1.012x)
    d = 5_000_500
    x = np.full(d, 2e-4, dtype=np.float32)
    x[:8] = 1.0
    clip = float(torch.linalg.vector_norm(torch.from_numpy(x)))  # exactly what a float32 clip would let through
    assert exact_norm(torch.from_numpy(x)) > 1.01 * clip  # the attack works on a float32 norm
    accepted, added = contribution(SparseUpdate.dense(torch.from_numpy(x)), clip, d)
    assert accepted
    assert exact_norm(added) <= clip


def test_float16_bytes_behind_float32_metadata_are_rejected_not_reinterpreted():
    # the reply's .npy bytes hold float16 while the Array says float32: read as float16, its norm
    # would be computed on other numbers than the metadata claims
    values = np.full(1000, 60000.0, dtype=np.float16)
    good = Array(values)
    lying = Array(dtype="float32", shape=(1000,), stype=SType.NUMPY, data=good.data)
    with pytest.raises(RejectedUpdate) as err:
        record_to_update(ArrayRecord({"values": lying}), 1000)
    assert err.value.reason == "dtype"


@pytest.mark.parametrize("payload", [
    np.arange(6, dtype=np.int64), np.ones(6, dtype=bool), np.ones(6, dtype=">f4"), np.ones(6, dtype=np.float64),
    np.ones(6, dtype=np.float16),
], ids=["int64", "bool", "big-endian-f4", "float64", "float16"])
@pytest.mark.parametrize("declared", ["own", "float32"])
def test_payloads_of_another_dtype_or_byte_order_are_rejected_as_dtype(payload, declared):
    arr = Array(payload)
    if declared == "float32":  # the metadata lies
        arr = Array(dtype="float32", shape=payload.shape, stype=SType.NUMPY, data=arr.data)
    for record in (ArrayRecord({"values": arr}),
                   ArrayRecord({"indices": Array(np.arange(6, dtype=np.int32)), "values": arr})):
        with pytest.raises(RejectedUpdate) as err:
            record_to_update(record, 6)
        assert err.value.reason == "dtype"


def test_indices_of_another_byte_order_or_float_dtype_are_rejected():
    values = Array(np.ones(3, dtype=np.float32))
    for indices in (np.array([0, 1, 2], dtype=">i8"), np.array([0, 1, 2], dtype=np.float32)):
        with pytest.raises(RejectedUpdate) as err:
            record_to_update(ArrayRecord({"indices": Array(indices), "values": values}), 6)
        assert err.value.reason == "dtype"


def test_metadata_shape_that_lies_is_rejected():
    real = Array(np.ones(6, dtype=np.float32))
    for shape in ((3,), (12,), (2, 3)):
        lying = Array(dtype="float32", shape=shape, stype=SType.NUMPY, data=real.data)
        with pytest.raises(RejectedUpdate):
            record_to_update(ArrayRecord({"values": lying}), 6)


def test_the_exact_clip_never_exceeds_c_and_leaves_short_vectors_alone():
    u = torch.tensor([3.0, 4.0])
    assert flat_l2_clip_(u, 10.0) == pytest.approx(5.0, rel=1e-14) and torch.equal(u, torch.tensor([3.0, 4.0]))
    flat_l2_clip_(u, 1.0)
    assert exact_norm(u) <= 1.0 and exact_norm(u) == pytest.approx(1.0, rel=1e-5)
    assert math.isnan(l2_norm_bound(torch.tensor([float("nan"), 1.0]))) and l2_norm_bound(torch.full((600,), float("inf"))) == math.inf


# -- property tests: any values, any index set, any payload --------------------------------------------
@settings(max_examples=200, deadline=None)
@given(values=hnp.arrays(np.float32, st.integers(0, 3000), elements=st.floats(width=32, allow_nan=False,
                                                                                 allow_infinity=False)),
       fill=st.sampled_from([None, 0.0, 2e-4, 1e-20, 1e-40, 3e38]), big=st.integers(0, 8))
def test_the_norm_bound_is_never_below_the_exact_norm_and_tight(values, fill, big):
    if fill is not None:  # the fooling shape: a few large entries among many equal small ones
        values = np.concatenate([np.ones(big, np.float32), np.full(4000, fill, np.float32), values])
    exact = exact_norm(torch.from_numpy(values)) if values.size else 0.0
    bound = l2_norm_bound(torch.from_numpy(values))
    assert bound >= exact
    assert bound <= exact * (1 + 2e-5) + 4e-23 * math.sqrt(values.size)  # the underflow allowance



_FLOATS = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.floats(width=32, min_value=float(np.float32(-1e-38)), max_value=float(np.float32(1e-38))),  # subnormals, tiny
    st.sampled_from([float(np.float32(v)) for v in (3.4e38, -3.4e38, 1e-45, 1.0, 0.0)]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=hnp.arrays(np.float32, st.integers(1, 300), elements=_FLOATS),
       clip=st.floats(1e-30, 1e30), tiny_fill=st.booleans())
def test_any_finite_dense_update_contributes_at_most_c(values, clip, tiny_fill):
    if tiny_fill:  # the fooling shape at a small scale: one big entry among tiny ones
        values = np.concatenate([values, np.full(5000, np.float32(abs(float(values[0])) * 1e-4 + 1e-30), np.float32)])
    d = values.size
    accepted, added = contribution(SparseUpdate.dense(torch.from_numpy(values)), clip, d)
    assert accepted
    assert exact_norm(added) <= clip


@settings(max_examples=150, deadline=None)
@given(data=st.data(), dim_rows=st.integers(1, 50), block=st.sampled_from([1, 2, 5]), clip=st.floats(1e-6, 1e6))
def test_any_index_set_is_either_rejected_or_contributes_at_most_c(data, dim_rows, block, clip):
    dim = dim_rows * block
    k = data.draw(st.integers(0, 2 * dim_rows))
    idx = data.draw(hnp.arrays(np.int64, k, elements=st.integers(-3, dim_rows + 3)))
    shape = (k,) if block == 1 else (k, block)
    vals = data.draw(hnp.arrays(np.float32, shape, elements=_FLOATS))
    update = SparseUpdate(torch.from_numpy(idx), torch.from_numpy(vals), dim)
    accepted, added = contribution(update, clip, dim)
    valid = k == 0 or (idx.min() >= 0 and idx.max() < dim_rows and bool(np.all(np.diff(idx) > 0)))
    assert accepted == valid
    assert exact_norm(added) <= clip


_DTYPES = st.sampled_from(["<f4", ">f4", "<f2", "<f8", ">f8", "<i4", ">i4", "<i8", "|b1", "|u1"])


@settings(max_examples=200, deadline=None)
@given(data=st.data(), values_dtype=_DTYPES, indices_dtype=st.one_of(st.none(), _DTYPES),
       declare=st.sampled_from(["own", "float32", "int32", "garbage"]), dim=st.integers(1, 40),
       clip=st.floats(1e-3, 1e3))
def test_any_record_decodes_to_an_update_or_a_named_rejection_and_never_exceeds_c(
        data, values_dtype, indices_dtype, declare, dim, clip):
    n = data.draw(st.integers(0, dim))
    values = data.draw(hnp.arrays(np.dtype(values_dtype), n))
    arrays = {"values": values}
    if indices_dtype is not None:
        arrays["indices"] = data.draw(hnp.arrays(np.dtype(indices_dtype), n))
    record = ArrayRecord()
    for key, a in arrays.items():
        arr = Array(a)
        if declare != "own":
            shape = data.draw(st.sampled_from([a.shape, (a.size + 1,), (1, a.size)]))
            arr = Array(dtype=declare, shape=shape, stype=SType.NUMPY, data=arr.data)
        record[key] = arr
    if data.draw(st.booleans()):  # truncated or padded bytes
        key = data.draw(st.sampled_from(sorted(arrays)))
        cut = data.draw(st.integers(0, len(record[key].data) + 8))
        old = record[key]
        record[key] = Array(dtype=old.dtype, shape=old.shape, stype=old.stype, data=(old.data + b"\0" * 8)[:cut])
    s = PrivateSum(dim, clip_norm=clip, noise_multiplier=0.0, expected_cohort=1.0)
    try:
        update = record_to_update(record, dim)
    except RejectedUpdate as err:
        assert err.reason in REJECTION_REASONS
        s.reject(err.reason, "crafted", str(err))
    else:
        s.add_(update, "crafted")
    assert s.stats.received == 1
    assert exact_norm(s._sum) <= clip


def test_an_honest_update_round_trips_exactly():
    update = SparseUpdate(torch.tensor([1, 4]), torch.tensor([0.5, -2.0]), 6)
    decoded = record_to_update(update_to_record(update), 6)
    assert torch.equal(decoded.indices, update.indices) and torch.equal(decoded.values, update.values)


# -- a sample-level DP client's reported event: lies in metadata ---------------------------------------
_VALUES = st.one_of(st.integers(-5, 10**7), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                    st.text(max_size=3), st.none(), st.lists(st.floats(), max_size=2))


@settings(max_examples=300, deadline=None)
@given(fields=st.dictionaries(st.sampled_from(["noise-multiplier", "population", "expected-batch", "steps", "delta",
                                               "q", "epsilon"]), _VALUES))
def test_any_reported_sample_dp_event_parses_to_a_valid_event_or_a_value_error(fields):
    from fedprivacy.privacy.client_ledgers import ClientLedgers, event_from_metrics

    metrics = {f"sample-dp-{k}": v for k, v in fields.items()}
    try:
        event, steps, delta = event_from_metrics(metrics)
    except ValueError:
        return
    assert 1 <= steps <= MAX_STEPS_PER_ROUND and MIN_DELTA <= delta < 1
    z = event.noise_multiplier
    assert z == 0 or MIN_NOISE_MULTIPLIER <= z <= MAX_NOISE_MULTIPLIER  # within what the accountants compute
    assert event.q == 0 or event.q >= MIN_CLIENT_SAMPLING_RATE
    ledgers = ClientLedgers()
    ledgers.compose(0, event, steps, delta=delta)  # whatever parses, the ledger accepts
    assert ledgers.epsilons(1e-3, "rdp")[0] >= 0  # and accounts without failing


def test_above_the_ceiling_no_grid_is_built_and_epsilon_is_inf(monkeypatch):
    """An extreme but valid event (z = 2^-6, q = 1, 1e5 steps) made PLD stall or ask for TiBs: above RDP
    epsilon 100, prv and pld report inf without building a grid."""
    from fedprivacy.privacy import accounting

    def no_grid(*args):
        raise AssertionError("a PRV/PLD grid was built for an epsilon above the ceiling")
    monkeypatch.setattr(accounting, "_pld_epsilon", no_grid)
    monkeypatch.setattr(accounting, "_prv_epsilon", no_grid)
    event = accounting.GaussianRound(MIN_NOISE_MULTIPLIER, "poisson", 100, 100.0)
    for kind in ("pld", "prv"):
        assert accounting.epsilon([(event, MAX_STEPS_PER_ROUND)], 1e-5, kind) == math.inf
    assert accounting.epsilon([(event, MAX_STEPS_PER_ROUND)], 1e-5, "rdp") > accounting.EPSILON_CEILING
