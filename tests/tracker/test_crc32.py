"""CRC-32 of a concatenation from its parts' CRCs, against zlib."""

from __future__ import annotations

import importlib
import random
import zlib
from collections.abc import Callable
from types import ModuleType

import pytest

from trajtrack.tracker import _crc32
from trajtrack.tracker._crc32 import crc32_big, crc32_combine, crc32_shift

# The combine in use (isal's where installed) and the pure-Python fallback: both against zlib.
COMBINES = pytest.mark.parametrize(
    "combine", [crc32_combine, _crc32._crc32_combine_fallback], ids=["in_use", "fallback"]
)


@COMBINES
@pytest.mark.parametrize("length", [0, 1, 2, 3, 511, 4000, 4096, 65537, 2**20 + 3])
def test_crc32_combine_matches_zlib(combine: Callable[[int, int, int], int], length: int) -> None:
    rng = random.Random(length)
    for prefix_length in (0, 1, 7, 1000):
        prefix = rng.randbytes(prefix_length)
        data = rng.randbytes(length)
        combined = combine(zlib.crc32(prefix), zlib.crc32(data), length)
        assert combined == zlib.crc32(prefix + data)


@COMBINES
def test_crc32_combine_of_many_pieces(combine: Callable[[int, int, int], int]) -> None:
    rng = random.Random(1)
    pieces = [rng.randbytes(rng.randrange(0, 3000)) for _ in range(50)]
    crc = 0
    for piece in pieces:
        crc = combine(crc, zlib.crc32(piece), len(piece))
    assert crc == zlib.crc32(b"".join(pieces))


def test_crc32_shift_bounds() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        crc32_shift(1, -1)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        crc32_shift(1, 2**64)
    assert crc32_shift(0x12345678, 0) == 0x12345678


def test_crc32_big_is_zlibs() -> None:
    data = random.Random(2).randbytes(100_003)
    assert crc32_big(data) == zlib.crc32(data)
    assert crc32_big(memoryview(data)[7:]) == zlib.crc32(data[7:])


def test_crc32_big_is_isa_ls_where_isal_is_installed() -> None:
    isal_zlib = pytest.importorskip("isal.isal_zlib")
    assert crc32_big is isal_zlib.crc32
    assert crc32_combine is isal_zlib.crc32_combine


def test_without_isal_both_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = importlib.import_module

    def no_isal(name: str, package: str | None = None) -> ModuleType:
        if name.startswith("isal"):
            raise ImportError(name)
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", no_isal)
    big, combine = _crc32._implementations()
    assert big is zlib.crc32
    assert combine is _crc32._crc32_combine_fallback
