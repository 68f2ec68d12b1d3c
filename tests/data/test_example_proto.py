"""Wire-format and round-trip tests for the TensorFlow-free tf.train.Example codec."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedprivacy.data.example_proto import decode_example, encode_example

# Example{features: Features{feature: {"a": int64 [1], "b": bytes ["x"], "c": float [1.0]}}}
# assembled by hand from the proto wire format (tag byte = field_number << 3 | wire_type):
#   Int64List  value=1 packed  : 0a 01 01
#   Feature    int64_list=3    : 1a 03 <3>
#   BytesList  value=1         : 0a 01 78
#   Feature    bytes_list=1    : 0a 03 <3>
#   FloatList  value=1 packed  : 0a 04 0000803f        (1.0f little-endian)
#   Feature    float_list=2    : 12 06 <6>
#   map entry  key=1 value=2   : 0a 01 <key> 12 <len> <feature>
#   Features   feature=1       : 0a <len> <entry>  (one per key, sorted)
#   Example    features=1      : 0a <len> <features>
_ENTRY_A = bytes.fromhex("0a0161" "1205" "1a03" "0a0101")
_ENTRY_B = bytes.fromhex("0a0162" "1205" "0a03" "0a0178")
_ENTRY_C = bytes.fromhex("0a0163" "1208" "1206" "0a040000803f")
_FEATURES = b"".join(bytes([0x0A, len(e)]) + e for e in (_ENTRY_A, _ENTRY_B, _ENTRY_C))
EXPECTED = bytes([0x0A, len(_FEATURES)]) + _FEATURES


def test_wire_format_matches_hand_computed_bytes() -> None:
    assert encode_example({"a": 1, "b": "x", "c": 1.0}) == EXPECTED
    assert EXPECTED.hex() == ("0a27" "0a0a0a016112051a030a0101" "0a0a0a016212050a030a0178"
                              "0a0d0a0163120812060a040000803f")


def test_int64_list_is_packed() -> None:
    # Packed: one length-delimited run "0a 02 01 02"; unpacked would be "08 01 08 02".
    blob = encode_example({"n": [1, 2]})
    assert blob == bytes.fromhex("0a0d" "0a0b" "0a016e" "1206" "1a04" "0a020102")


def test_decodes_hand_computed_bytes() -> None:
    assert decode_example(EXPECTED) == {"a": [1], "b": [b"x"], "c": [1.0]}


def test_round_trip_of_all_kinds() -> None:
    features = {
        "tokens": "how do i sort a list",
        "raw": b"\x00\xffbytes",
        "score": -3,
        "many": [1, 2**40, -(2**63)],
        "floats": [0.5, -2.25],
        "strings": ["a", b"b"],
        "flag": True,
    }
    decoded = decode_example(encode_example(features))
    assert decoded == {
        "tokens": [b"how do i sort a list"],
        "raw": [b"\x00\xffbytes"],
        "score": [-3],
        "many": [1, 2**40, -(2**63)],
        "floats": [0.5, -2.25],
        "strings": [b"a", b"b"],
        "flag": [1],
    }
    assert all(isinstance(v, int) for v in decoded["many"])
    assert all(isinstance(v, float) for v in decoded["floats"])


def test_serialization_is_independent_of_insertion_order() -> None:
    assert encode_example({"b": "x", "c": 1.0, "a": 1}) == EXPECTED


@pytest.mark.parametrize("bad", [{"e": []}, {"m": [1, "x"]}, {"o": object()}, {"z": 1j}])
def test_encode_rejects_untypable_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        encode_example(bad)


def test_encode_error_names_the_feature() -> None:
    with pytest.raises(ValueError, match="'mixed'"):
        encode_example({"mixed": [1, "x"]})


@pytest.mark.parametrize("blob", [b"not a proto \xff", b"\xff\xff", EXPECTED[:-3]])
def test_decode_rejects_garbage_with_clear_message(blob: bytes) -> None:
    with pytest.raises(ValueError, match="tf.train.Example"):
        decode_example(blob)


# --- decoding a subset of the features: same acceptance, same values ------------------------------

_NAMES = st.sampled_from(["tokens", "title", "tags", "score", "a", ""])
_VALUES = st.one_of(st.binary(max_size=8), st.text(max_size=8), st.integers(-(2**63), 2**63 - 1),
                    st.floats(width=32, allow_nan=False),
                    st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=3),
                    st.lists(st.binary(max_size=4), min_size=1, max_size=3))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _crafted(valid: bytes, cut: int, tag: int, length: int, junk: bytes) -> list[bytes]:
    """Damaged variants of a valid blob: truncated, a field of the wrong wire type or a lying length
    appended (at the Example and at the Features level), a truncated varint, raw junk."""
    inner = valid[2:] if len(valid) > 1 and valid[1] < 0x80 else b""
    return [valid[:cut], valid + bytes([tag]) + junk,
            valid + b"\x0a" + _varint(length) + junk,  # length-delimited field 1 claiming `length` bytes
            b"\x0a" + _varint(len(inner) + 2) + inner + b"\x0a\x80",  # Features entry with a truncated varint
            b"\x0a" + _varint(len(inner) + 3) + inner + bytes([0x08 | (tag & 7)]) + junk[:1],  # wrong wire type
            junk]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_NAMES, _VALUES, max_size=5), st.lists(_NAMES, max_size=4),
       st.integers(0, 40), st.integers(0, 255), st.integers(0, 300), st.binary(max_size=12))
def test_decoding_a_subset_equals_the_full_decode_restricted(features, wanted, cut, tag, length, junk):
    """``decode_example(blob, names)`` refuses exactly the blobs the full decode refuses and otherwise
    returns the full decode's values of the names present, on valid and crafted (truncated, wrong wire
    type, lying length, truncated varint) blobs."""
    valid = encode_example(features) if features else b""
    for blob in [valid, *_crafted(valid, cut, tag, length, junk)]:
        try:
            full = decode_example(blob)
        except ValueError:
            with pytest.raises(ValueError, match="tf.train.Example"):
                decode_example(blob, wanted)
            continue
        assert decode_example(blob, wanted) == {name: full[name] for name in wanted if name in full}


def test_decoding_a_subset_keeps_only_the_named_features() -> None:
    assert decode_example(EXPECTED, ["c", "a", "missing"]) == {"c": [1.0], "a": [1]}
    assert decode_example(EXPECTED, []) == {}
