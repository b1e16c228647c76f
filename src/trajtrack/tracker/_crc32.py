"""CRC-32 arithmetic: the CRC of a concatenation from the CRCs of its parts.

``crc32(A + B) == crc32_combine(crc32(A), crc32(B), len(B))``, so a file's CRC follows from
the CRCs of its pieces without reading them again (the archive writer computes each tensor's
CRC once, for its zip record, and derives the whole file's from it).

The math (the same as zlib's ``crc32_combine``): in CRC-32's bit-reflected representation a
32-bit value is a polynomial over GF(2) of degree < 32, and appending *n* bytes to a message
multiplies its register by ``x^(8n)`` modulo the CRC polynomial P; the initial and final
inversions cancel out. So ``crc(A + B) = crc(A) * x^(8 len(B)) mod P  xor  crc(B)``, and
``x^(8n) = prod over the set bits k of n of x^(8 * 2^k)``. Multiplying by a fixed polynomial is
GF(2)-linear, so it is precomputed per k as four 256-entry tables (one per byte of the
operand); a combine then costs four table look-ups per set bit of ``len(B)``: O(log n), a few
microseconds in Python for any length.
"""

from __future__ import annotations

from typing import Final

__all__ = ["crc32_combine", "crc32_shift"]

_POLY: Final = 0xEDB88320  # CRC-32 (IEEE 802.3), bit-reflected
_ONE: Final = 0x80000000  # the polynomial 1 (x^0) in the reflected representation
_MAX_BITS: Final = 64  # lengths below 2**64 bytes

# _x8n[k] = x^(8 * 2^k) mod P: appending 2^k bytes.
_x8n: list[int] = []
# _tables[k]: the multiplication by _x8n[k] as four tables of 256, built on first use.
_tables: list[tuple[list[int], list[int], list[int], list[int]] | None] = []


def _multmodp(a: int, b: int) -> int:
    """a * b mod P, both reflected polynomials (bit 31 is x^0)."""
    product = 0
    mask = _ONE
    while a:
        if a & mask:
            product ^= b
            a ^= mask
        mask >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _init() -> None:
    power = _ONE >> 8  # x^8: appending one byte
    for _ in range(_MAX_BITS):
        _x8n.append(power)
        _tables.append(None)
        power = _multmodp(power, power)


def _table(k: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """The byte tables of the multiplication by ``_x8n[k]`` (built once, then cached)."""
    cached = _tables[k]
    if cached is not None:
        return cached
    factor = _x8n[k]
    parts: list[list[int]] = []
    for byte in range(4):
        images = [_multmodp(1 << (8 * byte + bit), factor) for bit in range(8)]
        table = [0] * 256
        for value in range(1, 256):
            low = value & -value  # by linearity: table[v] = table[v without its low bit] ^ ...
            table[value] = table[value ^ low] ^ images[low.bit_length() - 1]
        parts.append(table)
    built = (parts[0], parts[1], parts[2], parts[3])
    _tables[k] = built  # a race builds the same tables twice; either result is right
    return built


def crc32_shift(crc: int, length: int) -> int:
    """The CRC register *crc* advanced over *length* zero bytes, without the inversions.

    That is ``crc * x^(8 length) mod P``: the part of ``crc32(A + B)`` that comes from A.
    """
    if length < 0:
        raise ValueError("length must be >= 0")
    if length >> _MAX_BITS:
        raise ValueError("length must be below 2**64")
    while length:
        low = length & -length  # one step per set bit of the length
        length ^= low
        t0, t1, t2, t3 = _table(low.bit_length() - 1)
        crc = t0[crc & 0xFF] ^ t1[(crc >> 8) & 0xFF] ^ t2[(crc >> 16) & 0xFF] ^ t3[crc >> 24]
    return crc


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)``, ``len(b)``."""
    return crc32_shift(crc1, length2) ^ crc2


_init()
