"""CRC-32 arithmetic: the CRC of a concatenation from the CRCs of its parts, and of big buffers.

``crc32(A + B) == crc32_combine(crc32(A), crc32(B), len(B))``, so a file's CRC follows from
the CRCs of its pieces without reading them again (the archive writer computes each tensor's
CRC once, for its zip record, and derives the whole file's from it).

Both functions are ``isal.isal_zlib``'s (python-isal, a dependency where it has wheels: x86-64
and ARM64 CPython) when it imports. Where it does not, :func:`crc32_big` is zlib's and
:func:`crc32_combine` the pure-Python fallback below: the standard library's zlib module has a
``crc32_combine`` only from Python 3.15 (gh-134635), so the fallback can become zlib's once this
package requires 3.15.

The fallback's math (the same as zlib's ``crc32_combine``): in CRC-32's bit-reflected
representation a 32-bit value is a polynomial over GF(2) of degree < 32, and appending *n* bytes
to a message multiplies its register by ``x^(8n)`` modulo the CRC polynomial P; the initial and
final inversions cancel out. So ``crc(A + B) = crc(A) * x^(8 len(B)) mod P  xor  crc(B)``, and
``x^(8n)`` is the product of ``x^(8 d 16^j)`` over the hexadecimal digits d (at positions j)
of n, each computed from a table of ``x^(8 * 2^k) mod P`` by squaring. Multiplying by a fixed
polynomial is GF(2)-linear, so each of those factors is precomputed once, on first use, as
four 256-entry tables (one per byte of the operand); a combine then costs four table look-ups
per non-zero hex digit of ``len(B)``: O(log n).
"""

from __future__ import annotations

import importlib
import zlib
from array import array
from collections.abc import Callable
from typing import Final, TypeAlias, cast

__all__ = ["crc32_big", "crc32_combine", "crc32_shift"]

_POLY: Final = 0xEDB88320  # CRC-32 (IEEE 802.3), bit-reflected
_ONE: Final = 0x80000000  # the polynomial 1 (x^0) in the reflected representation
_MAX_BITS: Final = 64  # lengths below 2**64 bytes

# _x8n[k] = x^(8 * 2^k) mod P: appending 2^k bytes.
_x8n: list[int] = []
# The multiplication by x^(8 * d * 16^j) (appending d * 16^j bytes), for each hex digit d of
# a length at position j, as four tables of 256 (one per byte of the operand), built on first
# use: at most 15 per position, 4 KiB each.
_Tables: TypeAlias = "tuple[array[int], array[int], array[int], array[int]]"
_tables: dict[int, _Tables] = {}


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
        power = _multmodp(power, power)


def _build(key: int) -> _Tables:
    """The byte tables of the multiplication by x^(8 * digit * 16^position); key = both."""
    factor = _ONE
    exponent = (key & 15) << (4 * (key >> 4))  # the number of bytes it appends
    for k in range(_MAX_BITS):
        if exponent >> k & 1:
            factor = _multmodp(factor, _x8n[k])
    parts: list[array[int]] = []
    for byte in range(4):
        images = [_multmodp(1 << (8 * byte + bit), factor) for bit in range(8)]
        table = array("I", bytes(4 * 256))
        for value in range(1, 256):
            low = value & -value  # by linearity: table[v] = table[v without its low bit] ^ ...
            table[value] = table[value ^ low] ^ images[low.bit_length() - 1]
        parts.append(table)
    built = (parts[0], parts[1], parts[2], parts[3])
    _tables[key] = built  # a race builds the same tables twice; either result is right
    return built


def crc32_shift(crc: int, length: int) -> int:
    """The CRC register *crc* advanced over *length* zero bytes, without the inversions.

    That is ``crc * x^(8 length) mod P``: the part of ``crc32(A + B)`` that comes from A.
    """
    if length < 0:
        raise ValueError("length must be >= 0")
    if length >> _MAX_BITS:
        raise ValueError("length must be below 2**64")
    key = 0  # 16 * position + digit
    while length:
        if length & 15:  # one step per non-zero hex digit of the length
            tables = _tables.get(key | (length & 15)) or _build(key | (length & 15))
            t0, t1, t2, t3 = tables
            crc = t0[crc & 0xFF] ^ t1[(crc >> 8) & 0xFF] ^ t2[(crc >> 16) & 0xFF] ^ t3[crc >> 24]
        length >>= 4
        key += 16
    return crc


def _crc32_combine_fallback(crc1: int, crc2: int, length2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)``, ``len(b)``."""
    return crc32_shift(crc1, length2) ^ crc2


_init()

_Crc32: TypeAlias = "Callable[[memoryview | bytes], int]"
_Combine: TypeAlias = "Callable[[int, int, int], int]"


def _implementations() -> tuple[_Crc32, _Combine]:
    try:
        module = importlib.import_module("isal.isal_zlib")
    except ImportError:
        return zlib.crc32, _crc32_combine_fallback
    return cast("_Crc32", module.crc32), cast("_Combine", module.crc32_combine)


crc32_big, crc32_combine = _implementations()
"""``crc32_big(data)``: the CRC-32 for big buffers; ``crc32_combine(crc1, crc2, length2)``:
``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)``, ``length2 = len(b)``
(``0 <= length2 < 2**63``).

Both CRC-32s release the GIL. ISA-L's uses carry-less multiplication and outruns zlib's several
times over, which matters because a big dump's archive is written only as fast as its CRC is
computed: ``benchmarks/bench_core.py``'s 256 MB case, against a raw write of the same bytes,
measures it.
"""
