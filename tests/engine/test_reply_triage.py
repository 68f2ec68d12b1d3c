"""One reply triage (fl/records.reply_to_update) for the strategy and fedprivacy's server: a fedprivacy
delta (zero-copy on the CPU) or Flower-style full weights minus the broadcast; anything else a named
rejection."""

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from fedprivacy.fl.records import reply_content, reply_to_update, typed_record, update_to_record, vector_to_record
from fedprivacy.fl.server_app import DPFedAvgServer
from fedprivacy.stackoverflow_tasks import load_task
from fedprivacy.updates import RejectedUpdate, SparseUpdate

LAYOUT = {"weight": (3, 4), "bias": (3,)}


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    """Flower stamps new messages with the running task's identity: give this process one."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


def _reply(arrays: ArrayRecord, **metrics: float) -> Message:
    """A stand-in for a client's reply (the triage reads only its content)."""
    return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)}), dst_node_id=1,
                   message_type="train")


def _weights(x: torch.Tensor, dtype=np.float32, bias_shape=(3,)) -> ArrayRecord:
    w = x.numpy() + 0.5
    return ArrayRecord({"weight": Array(w[:12].reshape(3, 4).astype(dtype)),
                        "bias": Array(np.resize(w[12:], bias_shape).astype(np.float32))})


def test_full_weights_become_weights_minus_the_broadcast_in_the_broadcasts_order():
    x = torch.arange(15, dtype=torch.float32)
    w = _weights(x)
    reordered = ArrayRecord({"bias": w["bias"], "weight": w["weight"]})  # keys in another order
    for record in (w, reordered):
        update = reply_to_update(reply_content(_reply(record)), x, LAYOUT)
        assert update.indices is None and torch.equal(update.values, torch.full((15,), 0.5))


@pytest.mark.parametrize(("record", "reason"), [
    (lambda x: _weights(x, dtype=np.float64), "dtype"),
    (lambda x: _weights(x, bias_shape=(1, 3)), "malformed"),
    (lambda x: ArrayRecord({"weight": Array(np.zeros((3, 4), np.float32))}), "malformed"),  # bias missing
])
def test_full_weights_of_another_dtype_or_shape_or_keys_are_rejected_by_name(record, reason):
    x = torch.zeros(15)
    with pytest.raises(RejectedUpdate) as err:
        reply_to_update(reply_content(_reply(record(x))), x, LAYOUT)
    assert err.value.reason == reason


def test_a_sparse_delta_is_decoded_as_a_read_only_view_of_the_message_bytes():
    x = torch.zeros(15)
    sent = SparseUpdate(torch.tensor([1, 7]), torch.tensor([0.25, -1.0]), 15)
    record = update_to_record(sent)
    update = reply_to_update(reply_content(_reply(record)), x, LAYOUT)
    assert torch.equal(update.to_dense(), sent.to_dense())
    payload = record["values"].data
    start = np.frombuffer(payload, np.uint8).ctypes.data
    assert start <= update.values.data_ptr() < start + len(payload)  # no copy of the values was made


def test_the_server_accepts_flower_style_full_weights_as_well_as_its_own_deltas(small_config):
    cfg = small_config()
    strategy = DPFedAvgServer(cfg, load_task(cfg.data)).strategy
    model = load_task(cfg.data).new_model()
    x = strategy.params
    u = torch.randn(x.numel(), generator=torch.Generator().manual_seed(0)) * 1e-2
    full = strategy._accept(_reply(vector_to_record(x + u, model), train_loss=1.5))
    torch.testing.assert_close(full.to_dense(), u, rtol=0, atol=1e-6)
    delta = strategy._accept(_reply(update_to_record(SparseUpdate.dense(u))))
    assert torch.equal(delta.to_dense(), u)


KINDS = {"array_records": ArrayRecord, "config_records": ConfigRecord, "metric_records": MetricRecord}
_RECORDS = st.sampled_from([lambda: ArrayRecord({"values": Array(np.zeros(2, np.float32))}),
                            lambda: ConfigRecord({"secagg": 1}), lambda: MetricRecord({"train_loss": 0.5}),
                            ArrayRecord, ConfigRecord, MetricRecord])  # empty records of each kind too


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["arrays", "metrics", "config", "secagg", "lookahead", "a.b", ""]), _RECORDS,
                       max_size=5), st.sampled_from(["arrays", "metrics", "config", "secagg", "lookahead", "absent"]))
def test_a_typed_record_is_flowers_typed_view_of_the_same_key(records, key):
    """``typed_record(content, key, kind)`` is ``content.<kind>_records.get(key)``: the very record or None,
    whatever records of other kinds share the content (crafted keys, empty records included)."""
    content = RecordDict({name: make() for name, make in records.items()})
    for view, kind in KINDS.items():
        assert typed_record(content, key, kind) is getattr(content, view).get(key)


def test_an_encoded_update_is_the_record_flowers_constructor_builds_of_the_same_arrays():
    sent = SparseUpdate(torch.tensor([0, 3]), torch.randn(2, 5), 25)
    for _ in range(2):  # the second encoding reads the cached .npy headers
        record = update_to_record(sent)
        expected = ArrayRecord({"indices": Array(np.array([0, 3], np.int32)), "values": Array(sent.values.numpy())})
        assert list(record.keys()) == list(expected.keys())
        for name in record.keys():
            got, want = record[name], expected[name]
            assert (got.dtype, got.shape, got.stype, got.data) == (want.dtype, want.shape, want.stype, want.data)
