"""Wire-format and round-trip tests for the TensorFlow-free tf.train.Example codec."""

from __future__ import annotations

import pytest

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
