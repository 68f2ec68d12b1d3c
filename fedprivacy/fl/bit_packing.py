r"""The wire format of a masked SecAgg+ upload: ``n`` values of ``b`` bits each, packed back to back, little-endian,
into :math:`\lceil n b / 8 \rceil` bytes (value ``i`` holds bits :math:`[ib, (i+1)b)` of the stream; the unused bits
of the last byte are zero).

Uploads live modulo :math:`2^b`: ``b`` bits per coordinate is the communication cost that secure aggregation with
discrete noise is designed around (Kairouz et al. 2021; Agarwal et al. 2021); uint32 would cost ``32/b`` times that.
Eight values fill exactly ``b`` bytes, so each of the eight positions in a group is one vectorised shift into (or
out of) an unaligned little-endian 64-bit word at a fixed byte offset: a value of at most 32 bits, shifted by at
most 7, spans at most 5 of its 8 bytes.
"""

from __future__ import annotations

import numpy as np

MIN_PACKED_BITS = 8
"""The narrowest width packed: below a byte, the 64-bit words of two groups would overlap."""


def packed_size(size: int, bits: int) -> int:
    """The bytes of ``size`` values of ``bits`` bits: :math:`\\lceil \\mathrm{size} \\cdot b / 8 \\rceil`."""
    return -(-size * bits // 8)


def _words(buffer: np.ndarray, position: int, bits: int, groups: int) -> np.ndarray:
    """The little-endian 64-bit word holding position ``position`` (0..7) of each group, as a strided view
    (``buffer`` holds ``groups * bits + 8`` bytes, ``groups >= 1``)."""
    return np.ndarray((groups,), "<u8", buffer=buffer, offset=position * bits // 8, strides=(bits,))


def _check(bits: int) -> None:
    if not MIN_PACKED_BITS <= bits <= 32:
        raise ValueError(f"bit packing needs {MIN_PACKED_BITS} <= bits <= 32, got {bits}")


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """``values`` (unsigned, each below ``2^bits``) packed into :func:`packed_size` bytes (uint8)."""
    _check(bits)
    if values.size and int(values.max()) >> bits:
        raise ValueError(f"a value does not fit in {bits} bits: {int(values.max())}")
    groups = max(1, -(-values.size // 8))
    wide = np.zeros((groups, 8), np.uint64)
    wide.reshape(-1)[: values.size] = values.reshape(-1)
    out = np.zeros(groups * bits + 8, np.uint8)
    for position in range(8):
        words = _words(out, position, bits, groups)
        np.bitwise_or(words, wide[:, position] << np.uint64(position * bits % 8), out=words)
    return out[: packed_size(values.size, bits)]


def unpack_bits(data: np.ndarray, size: int, bits: int) -> np.ndarray:
    """The ``size`` values (uint32) that :func:`pack_bits` packed into ``data`` (uint8 of :func:`packed_size`
    bytes; the caller checks the length)."""
    _check(bits)
    groups = max(1, -(-size // 8))
    buffer = np.zeros(groups * bits + 8, np.uint8)
    buffer[: data.size] = data
    out = np.empty((groups, 8), np.uint32)
    mask = np.uint64((1 << bits) - 1)
    for position in range(8):
        out[:, position] = (_words(buffer, position, bits, groups) >> np.uint64(position * bits % 8)) & mask
    return out.reshape(-1)[:size]


def padding_is_zero(data: np.ndarray, size: int, bits: int) -> bool:
    """Whether the bits after the last value (in the last byte) are zero, as :func:`pack_bits` leaves them."""
    used = size * bits % 8
    return used == 0 or data.size == 0 or int(data[-1]) >> used == 0
