"""CRC-32 arithmetic: of big buffers, and of a concatenation from the CRCs of its parts.

``crc32(A + B) == crc32_combine(crc32(A), crc32(B), len(B))``, so a file's CRC follows from
the CRCs of its pieces without reading them again (the archive writer computes each tensor's
CRC once, for its zip record, and derives the whole file's from it).

Both come from ``isal.isal_zlib`` (python-isal, a dependency where it has wheels: x86-64 and
ARM64 CPython). Without it, :func:`crc32_big` is zlib's and :func:`crc32_extend` reads the piece
again with zlib: the standard library's zlib has a ``crc32_combine`` only from Python 3.15
(gh-134635), and a platform without isal's wheels is rare enough not to need a home-made one.
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable
from typing import TypeAlias, cast

__all__ = ["crc32_big", "crc32_combine", "crc32_extend"]

_Crc32: TypeAlias = "Callable[[memoryview | bytes], int]"
_Combine: TypeAlias = "Callable[[int, int, int], int]"


def _implementations() -> tuple[_Crc32, _Combine | None]:
    try:
        module = importlib.import_module("isal.isal_zlib")
    except ImportError:
        return zlib.crc32, None
    return cast("_Crc32", module.crc32), cast("_Combine", module.crc32_combine)


crc32_big, crc32_combine = _implementations()
"""``crc32_big(data)``: the CRC-32 for big buffers; ``crc32_combine(crc1, crc2, length2)``:
``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)``, ``length2 = len(b)``
(``None`` without isal).

Both CRC-32s release the GIL. ISA-L's uses carry-less multiplication and outruns zlib's several
times over, which matters because a big dump's archive is written only as fast as its CRC is
computed: ``benchmarks/bench_core.py``'s 256 MB case, against a raw write of the same bytes,
measures it.
"""


def crc32_extend(crc: int, piece: memoryview | bytes, piece_crc: int, size: int) -> int:
    """``zlib.crc32(piece, crc)``, given ``piece_crc == zlib.crc32(piece)`` and its *size* in
    bytes: combined without reading *piece* again where isal is installed."""
    if crc32_combine is None:
        return zlib.crc32(piece, crc)
    return crc32_combine(crc, piece_crc, size)
