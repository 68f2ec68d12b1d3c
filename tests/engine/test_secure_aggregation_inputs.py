"""What the SecAgg+ server parses from clients, crafted like an attacker would (issue "Secure aggregation"; the
project's rule for anything that parses a client's reply): a masked upload of any dtype, byte order, shape or lying
metadata is either exactly the expected number of b-bit values, packed (``fedprivacy.fl.bit_packing``), or
rejected with a reason; setup and share-keys replies of any content only ever drop their sender from the round (or
abort it below the threshold)."""

from uuid import uuid4

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.constant import SType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedprivacy.fl.bit_packing import pack_bits, packed_size, padding_is_zero, unpack_bits
from fedprivacy.fl.records import arrays_to_record
from fedprivacy.fl.secure_aggregation import SECAGG, SecAggAborted, SecAggRound, SecureAggregation, masked_upload
from fedprivacy.updates import RejectedUpdate

SIZE = 13  # 13 b-bit values leave unused bits in the last byte for odd b


@pytest.fixture(autouse=True)
def _server_identity():
    """Messages are created as the ServerApp of run 1 (what Flower's runtime sets)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1

DTYPES = ["|u1", "<u4", ">u4", "<u8", "<i4", "<f4", "<u2", "|i1"]


@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from(DTYPES), exact=st.booleans(), shape=st.lists(st.integers(0, 60), max_size=2),
       key=st.sampled_from(["masked", "values", "arrays"]), declared=st.sampled_from(["uint8", "uint32", "float32"]),
       lie=st.booleans(), extra=st.booleans(), bits=st.integers(8, 32), data=st.data())
def test_any_masked_upload_is_b_bit_values_of_the_length_or_rejected(dtype, exact, shape, key, declared, lie, extra,
                                                                    bits, data):
    shape = [packed_size(SIZE, bits)] if exact else shape
    raw = data.draw(st.binary(min_size=int(np.prod(shape)) * np.dtype(dtype).itemsize,
                              max_size=int(np.prod(shape)) * np.dtype(dtype).itemsize))
    values = np.frombuffer(raw, dtype=dtype).reshape(shape)
    record = arrays_to_record({key: values})
    if lie:  # the metadata says something the bytes are not
        record = ArrayRecord({key: Array(dtype=declared, shape=(packed_size(SIZE, bits),), stype=SType.NUMPY,
                                         data=record[key].data)})
    if extra:
        record["other"] = Array(np.zeros(2, dtype=np.uint8))
    try:
        out = masked_upload(RecordDict({SECAGG: record}), SIZE, bits)
    except RejectedUpdate as err:
        assert err.reason in ("malformed", "dtype")
        return
    assert out.dtype == np.dtype("uint32") and out.shape == (SIZE,) and out.dtype.byteorder in ("=", "<", "|")
    assert (out >> bits == 0).all()  # every value lives mod 2^b
    assert pack_bits(out, bits).tobytes() == record[key].numpy().tobytes()  # nothing dropped, nothing invented
    assert key == "masked" and not extra


@settings(max_examples=200, deadline=None)
@given(bits=st.integers(8, 32), data=st.data())
def test_any_bytes_of_the_packed_length_are_read_exactly_when_their_padding_is_zero(bits, data):
    raw = np.frombuffer(data.draw(st.binary(min_size=packed_size(SIZE, bits), max_size=packed_size(SIZE, bits))),
                        dtype=np.uint8)
    content = RecordDict({SECAGG: arrays_to_record({"masked": raw})})
    if not padding_is_zero(raw, SIZE, bits):
        with pytest.raises(RejectedUpdate, match="after its last value"):
            masked_upload(content, SIZE, bits)
        return
    out = masked_upload(content, SIZE, bits)
    assert out.shape == (SIZE,) and (out >> bits == 0).all() and np.array_equal(pack_bits(out, bits), raw)


def _reference_pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Bit by bit: value i's bits, least significant first, at stream positions [i b, (i + 1) b)."""
    stream = np.unpackbits(values.astype("<u4").view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")[:, :bits]
    return np.packbits(stream.reshape(-1), bitorder="little")


@settings(max_examples=300, deadline=None)
@given(bits=st.integers(8, 32), data=st.data())
def test_packing_is_the_bit_stream_of_the_values_and_unpacking_inverts_it(bits, data):
    values = np.array(data.draw(st.lists(st.integers(0, 2 ** bits - 1), max_size=70)), dtype=np.uint32)
    packed = pack_bits(values, bits)
    assert packed.dtype == np.uint8 and packed.size == packed_size(values.size, bits) == -(-values.size * bits // 8)
    assert np.array_equal(packed, _reference_pack(values, bits))
    assert np.array_equal(unpack_bits(packed, values.size, bits), values)
    assert padding_is_zero(packed, values.size, bits)


def test_packing_refuses_a_value_wider_than_the_bits_and_widths_it_cannot_pack():
    with pytest.raises(ValueError, match="20 bits"):
        pack_bits(np.array([1, 2 ** 20], dtype=np.uint32), 20)
    with pytest.raises(ValueError, match="bits"):
        pack_bits(np.array([1], dtype=np.uint32), 7)


@settings(max_examples=100, deadline=None)
@given(bits=st.integers(9, 31).filter(lambda b: SIZE * b % 8), last=st.integers(1, 255))
def test_an_upload_with_bits_set_after_its_last_value_is_rejected(bits, last):
    packed = pack_bits(np.arange(SIZE, dtype=np.uint32), bits)
    used = SIZE * bits % 8
    packed[-1] |= (last << used) & 0xFF
    if packed[-1] >> used == 0:  # nothing set beyond the used bits
        return
    with pytest.raises(RejectedUpdate, match="after its last value"):
        masked_upload(RecordDict({SECAGG: arrays_to_record({"masked": packed})}), SIZE, bits)


class ScriptedGrid:
    """A grid whose nodes answer each stage with what ``answer(stage, node, message)`` returns (None: no reply)."""

    def __init__(self, answer):
        self.answer = answer

    def send_and_receive(self, messages, *, timeout=None):
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            content = self.answer(msg.content.config_records[SECAGG]["stage"], msg.metadata.dst_node_id, msg)
            if content is not None:
                reply = Message(RecordDict({SECAGG: ConfigRecord(content)}), reply_to=msg)
                reply.metadata.__dict__["_src_node_id"] = msg.metadata.dst_node_id
                yield reply


def _honest_keys():
    from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes

    return [public_key_to_bytes(generate_key_pairs()[1]) for _ in range(2)]


VALUES = st.one_of(st.integers(-2**63, 2**63 - 1), st.binary(max_size=120), st.text(max_size=10),
                   st.lists(st.binary(max_size=40), max_size=3), st.lists(st.integers(0, 10), max_size=3))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(liars=st.sets(st.integers(2, 7), max_size=6),
       crafted=st.dictionaries(st.sampled_from(["pk1", "pk2", "destinations", "ciphertexts", "x"]), VALUES, max_size=4))
def test_crafted_setup_and_share_keys_replies_only_drop_their_senders(liars, crafted):
    nodes = list(range(2, 8))
    keys = {n: _honest_keys() for n in nodes}

    def answer(stage, node, msg):
        if node in liars:
            return crafted
        if stage == "setup":
            return {"pk1": keys[node][0], "pk2": keys[node][1]}
        return {"destinations": [], "ciphertexts": []}

    rnd = SecAggRound(ScriptedGrid(answer), SecureAggregation(threshold=3, neighbours=5), 1, 7, nodes)
    try:
        receivers = rnd.prepare()
    except SecAggAborted:
        return
    assert set(receivers) <= set(nodes) and len(receivers) >= 3
    for node in receivers:
        assert rnd.public_keys[node] == tuple(keys[node]) or node in liars
        content = rnd.collect_content(node)
        assert all(src in receivers for src in content.get("sources", []))


def test_a_reply_from_a_node_outside_the_round_is_ignored():
    nodes = [2, 3, 4]
    keys = {n: _honest_keys() for n in nodes}

    def answer(stage, node, msg):
        return {"pk1": keys[node][0], "pk2": keys[node][1]} if stage == "setup" else {}

    class Impostor(ScriptedGrid):
        def send_and_receive(self, messages, *, timeout=None):
            for reply in super().send_and_receive(messages, timeout=timeout):
                reply.metadata.__dict__["_src_node_id"] = 99  # claims to be another node
                yield reply

    with pytest.raises(SecAggAborted):
        SecAggRound(Impostor(answer), SecureAggregation(threshold=2, neighbours=3), 1, 7, nodes).prepare()
