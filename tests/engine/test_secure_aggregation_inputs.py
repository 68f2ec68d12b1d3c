"""What the SecAgg+ server parses from clients, crafted like an attacker would (issue "Secure aggregation"; the
project's rule for anything that parses a client's reply): a masked upload of any dtype, byte order, shape or lying
metadata is either exactly the expected number of b-bit values, packed (``fedprivacy.fl.bit_packing``), or
rejected with a reason; setup, share-keys and consistency replies of any content only ever drop their sender from the
round (or abort it below the threshold). And what a client parses from a lying server: a crafted consistency or
unmask message only makes the client refuse (ValueError: an error reply), or it reveals exactly what the protocol
reveals under the survivor set it signed (Hardening III)."""

from uuid import uuid4

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.constant import SType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedprivacy.fl.bit_packing import pack_bits, packed_size, padding_is_zero, unpack_bits
from fedprivacy.fl.records import arrays_to_record
from flwr.supercore.primitives.asymmetric import (generate_key_pairs, public_key_to_bytes, sign_message,
                                                  verify_signature)

from fedprivacy.fl import secure_aggregation as secagg
from fedprivacy.fl.secure_aggregation import (SECAGG, SecAggAborted, SecAggRound, SecureAggregation, keys_transcript,
                                              masked_upload, survivors_transcript)
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
    return [public_key_to_bytes(generate_key_pairs()[1]) for _ in range(2)], generate_key_pairs()[0]


def _setup_reply(keys, identity, msg):
    """An honest ``setup`` reply: the two public keys, the identity key and its signature over them."""
    transcript = keys_transcript(msg.metadata.run_id, msg.content.config_records[SECAGG]["round"],
                                 msg.metadata.dst_node_id, *keys)
    return {"pk1": keys[0], "pk2": keys[1], "identity": public_key_to_bytes(identity.public_key()),
            "signature": sign_message(identity, transcript)}


VALUES = st.one_of(st.integers(-2**63, 2**63 - 1), st.binary(max_size=120), st.text(max_size=10),
                   st.lists(st.binary(max_size=40), max_size=3), st.lists(st.integers(0, 10), max_size=3))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(liars=st.sets(st.integers(2, 7), max_size=6),
       crafted=st.dictionaries(st.sampled_from(["pk1", "pk2", "identity", "signature", "destinations", "ciphertexts",
                                                "x"]), VALUES, max_size=6))
def test_crafted_setup_and_share_keys_replies_only_drop_their_senders(liars, crafted):
    nodes = list(range(2, 8))
    keys = {n: _honest_keys() for n in nodes}

    def answer(stage, node, msg):
        if node in liars:
            return crafted
        if stage == "setup":
            return _setup_reply(*keys[node], msg)
        return {"destinations": [], "ciphertexts": []}

    rnd = SecAggRound(ScriptedGrid(answer), SecureAggregation(threshold=3, neighbours=5), 1, 7, nodes)
    try:
        receivers = rnd.prepare()
    except SecAggAborted:
        return
    assert set(receivers) <= set(nodes) and len(receivers) >= 3
    for node in receivers:
        assert rnd.public_keys[node] == tuple(keys[node][0]) or node in liars
        content = rnd.collect_content(node)
        assert all(src in receivers for src in content.get("sources", []))


def test_a_reply_from_a_node_outside_the_round_is_ignored():
    nodes = [2, 3, 4]
    keys = {n: _honest_keys() for n in nodes}

    def answer(stage, node, msg):
        return _setup_reply(*keys[node], msg) if stage == "setup" else {}

    class Impostor(ScriptedGrid):
        def send_and_receive(self, messages, *, timeout=None):
            for reply in super().send_and_receive(messages, timeout=timeout):
                reply.metadata.__dict__["_src_node_id"] = 99  # claims to be another node
                yield reply

    with pytest.raises(SecAggAborted):
        SecAggRound(Impostor(answer), SecureAggregation(threshold=2, neighbours=3), 1, 7, nodes).prepare()


RUN, ROUND, NID, PEERS, T = 1, 1, 2, [2, 3, 4, 5, 6], 3  # this node (2) and its neighbours (k = 5, t = 3)
IDENTITIES = {j: generate_key_pairs()[0] for j in PEERS}
PK1 = {j: public_key_to_bytes(generate_key_pairs()[1]) for j in PEERS}
SURVIVORS = [2, 3, 4, 5, 9]  # node 6 dropped; node 9 is not a neighbour
SIGNED = {j: sign_message(IDENTITIES[j], survivors_transcript(RUN, ROUND, PK1[j], SURVIVORS)) for j in SURVIVORS if j in PK1}
HONEST_REVEAL = {"seed-owners": [2, 3, 4, 5], "seed-shares": [b"b2", b"b3", b"b4", b"b5"], "key-owners": [6],
                 "key-shares": [b"c6"]}


def _node_state(**changes):
    """Node 2's state after collect (its neighbours 3-6 shared keys with it), and after it signed SURVIVORS."""
    state = {"round": ROUND, "nid": NID, "threshold": T, "pk1": PK1[NID], "peers": PEERS,
             "peer-pk1": [PK1[j] for j in PEERS],
             "peer-identity": [public_key_to_bytes(IDENTITIES[j].public_key()) for j in PEERS], "owners": PEERS,
             "seed-shares": [b"b%d" % j for j in PEERS], "key-shares": [b"c%d" % j for j in PEERS],
             "survivors": SURVIVORS}
    return {**state, **changes}


def _honest_unmask():
    return {"active": [2, 3, 4, 5], "dropped": [6], "signers": sorted(SIGNED), "signatures": [SIGNED[j] for j in sorted(SIGNED)]}


def test_a_client_reveals_for_its_signed_survivor_set_only_with_threshold_signatures_on_it():
    assert secagg._unmask(_node_state(), _honest_unmask(), RUN) == HONEST_REVEAL
    for lie, match in [({"active": [2, 3, 4, 5, 6], "dropped": []}, "not the signed survivor set"),  # 6 survived?
                       ({"active": [2, 3, 4], "dropped": [5, 6]}, "not the signed survivor set"),  # 5 dropped?
                       ({"active": [3, 4, 5], "dropped": [2, 6]}, "not the signed survivor set"),  # itself dropped
                       ({"active": [2, 3, 4, 5], "dropped": [5, 6]}, "not the signed survivor set"),  # both secrets of 5
                       ({"signers": [3, 4], "signatures": [SIGNED[3], SIGNED[4]]}, "2 neighbours signed"),
                       ({"signers": [2, 2, 3], "signatures": [SIGNED[2]] * 2 + [SIGNED[3]]}, "2 neighbours signed"),
                       ({"signers": [2, 3, 4], "signatures": [SIGNED[3], SIGNED[2], SIGNED[4]]}, "1 neighbours signed")]:
        with pytest.raises(ValueError, match=match):
            secagg._unmask(_node_state(), {**_honest_unmask(), **lie}, RUN)
    other = [2, 3, 4, 5, 6]  # the neighbours' signatures over another survivor set
    signatures = [sign_message(IDENTITIES[j], survivors_transcript(RUN, ROUND, PK1[j], other)) for j in other]
    with pytest.raises(ValueError, match="0 neighbours signed"):
        secagg._unmask(_node_state(), {**_honest_unmask(), "signers": other, "signatures": signatures}, RUN)


def test_a_client_signs_a_survivor_set_only_with_itself_and_threshold_neighbours_in_it():
    identity = IDENTITIES[NID]
    state = _node_state(survivors=None)
    out = secagg._consistency(state, {"survivors": SURVIVORS}, RUN, identity)
    assert state["survivors"] == SURVIVORS and out["signature"]
    for lie, match in [([3, 4, 5, 6], "itself"), ([2, 3, 9], "fewer than threshold"), ([2, 2, 3, 4], "distinct"),
                       ([2, 3, 7, 9], "fewer than threshold"), ("2,3,4", "distinct")]:
        with pytest.raises(ValueError, match=match):
            secagg._consistency(_node_state(survivors=None), {"survivors": lie}, RUN, identity)


UNMASK_VALUES = st.one_of(VALUES, st.lists(st.sampled_from([2, 3, 4, 5, 6, 9, -1]), max_size=6),
                          st.lists(st.sampled_from(sorted(SIGNED.values())), max_size=5))


@settings(max_examples=200, deadline=None)
@given(crafted=st.dictionaries(st.sampled_from(["active", "dropped", "signers", "signatures", "x"]), UNMASK_VALUES,
                               max_size=4))
def test_a_crafted_unmask_message_is_refused_or_reveals_exactly_the_signed_sets_shares(crafted):
    try:
        out = secagg._unmask(_node_state(), {**_honest_unmask(), **crafted}, RUN)
    except ValueError:
        return
    assert out == HONEST_REVEAL  # never another share, never both of one node


@settings(max_examples=200, deadline=None)
@given(survivors=st.one_of(VALUES, st.lists(st.sampled_from([2, 3, 4, 5, 6, 9, True]), max_size=7)))
def test_a_crafted_consistency_message_is_refused_or_signs_a_set_with_the_node_and_threshold_neighbours(survivors):
    state = _node_state(survivors=None)
    try:
        out = secagg._consistency(state, {"survivors": survivors}, RUN, IDENTITIES[NID])
    except ValueError:
        return
    assert NID in survivors and len(set(survivors) & set(PEERS)) >= T and state["survivors"] == sorted(survivors)
    assert verify_signature(IDENTITIES[NID].public_key(), survivors_transcript(RUN, ROUND, PK1[NID], survivors),
                            out["signature"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(liars=st.sets(st.integers(2, 7), max_size=6), crafted=st.dictionaries(
    st.sampled_from(["signature", "seed-owners", "seed-shares", "key-owners", "key-shares"]), VALUES, max_size=4))
def test_crafted_consistency_and_unmask_replies_only_drop_their_senders_or_abort(liars, crafted):
    nodes = list(range(2, 8))
    keys = {n: _honest_keys() for n in nodes}

    def answer(stage, node, msg):
        if stage == "setup":
            return _setup_reply(*keys[node], msg)
        if stage == "share-keys":
            return {"destinations": [], "ciphertexts": []}
        if node in liars:
            return crafted
        if stage == "consistency":
            survivors = msg.content.config_records[SECAGG]["survivors"]
            return {"signature": sign_message(keys[node][1], survivors_transcript(
                msg.metadata.run_id, 1, keys[node][0][0], survivors))}
        return {}

    rnd = SecAggRound(ScriptedGrid(answer), SecureAggregation(threshold=3, neighbours=5), 1, 7, nodes)
    rnd.prepare()
    try:
        masks = rnd.unmask(nodes, SIZE)
    except SecAggAborted:
        return
    assert masks.dtype == np.uint32 and masks.shape == (SIZE,)  # liars' shares can only corrupt the sum, never crash
    assert set(rnd.signatures) == set(nodes) - liars  # a crafted signature never verifies
