"""CRC-32 of a concatenation from its parts' CRCs, against zlib, with isal and without."""

from __future__ import annotations

import importlib
import io
import random
import zlib
from types import ModuleType

import pytest
import torch

from trajtrack.tracker import _crc32
from trajtrack.tracker._archive import write_archive
from trajtrack.tracker._crc32 import crc32_big, crc32_extend

# The combine in use (isal's where installed) and the re-reading one used without isal.
WITH_AND_WITHOUT_ISAL = pytest.mark.parametrize("isal", [True, False], ids=["isal", "no_isal"])


def _use_isal(monkeypatch: pytest.MonkeyPatch, isal: bool) -> None:
    if isal:
        pytest.importorskip("isal.isal_zlib")
    else:
        monkeypatch.setattr(_crc32, "crc32_combine", None)


@WITH_AND_WITHOUT_ISAL
@pytest.mark.parametrize("length", [0, 1, 3, 4096, 65537, 2**20 + 3])
def test_crc32_extend_matches_zlib(
    monkeypatch: pytest.MonkeyPatch, isal: bool, length: int
) -> None:
    _use_isal(monkeypatch, isal)
    rng = random.Random(length)
    for prefix_length in (0, 1, 7, 1000):
        prefix = rng.randbytes(prefix_length)
        data = rng.randbytes(length)
        extended = crc32_extend(zlib.crc32(prefix), data, zlib.crc32(data), length)
        assert extended == zlib.crc32(prefix + data)


@WITH_AND_WITHOUT_ISAL
def test_archive_crc_is_the_files_crc(monkeypatch: pytest.MonkeyPatch, isal: bool) -> None:
    """Big storages (combined, not read again where isal is installed) and a big pickle."""
    _use_isal(monkeypatch, isal)
    generator = torch.Generator().manual_seed(3)
    obj = {
        "big": torch.randn(3 << 20, generator=generator),  # past the parallel-CRC size
        "mid": torch.randn(100_000, generator=generator),
        "keys": {f"k{i}": i for i in range(20_000)},  # a pickle of more than 64 KiB
    }
    out = io.BytesIO()
    size, checksum = write_archive(obj, out)
    data = out.getvalue()
    assert size == len(data)
    assert checksum == f"crc32:{zlib.crc32(data):08x}"
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert torch.equal(loaded["big"], obj["big"]) and loaded["keys"] == obj["keys"]


def test_crc32_big_is_zlibs() -> None:
    data = random.Random(2).randbytes(100_003)
    assert crc32_big(data) == zlib.crc32(data)
    assert crc32_big(memoryview(data)[7:]) == zlib.crc32(data[7:])


def test_crc32_big_is_isa_ls_where_isal_is_installed() -> None:
    isal_zlib = pytest.importorskip("isal.isal_zlib")
    assert crc32_big is isal_zlib.crc32
    assert _crc32.crc32_combine is isal_zlib.crc32_combine


def test_without_isal_zlib_and_no_combine(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = importlib.import_module

    def no_isal(name: str, package: str | None = None) -> ModuleType:
        if name.startswith("isal"):
            raise ImportError(name)
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", no_isal)
    assert _crc32._implementations() == (zlib.crc32, None)
