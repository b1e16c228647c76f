"""Large buffers go to the file in pieces of at most ``WRITE_PIECE`` bytes, every byte once.

One ``write`` call of many megabytes is paused by the kernel's dirty-page throttling far longer
than the same bytes in pieces (see ``trajtrack.backends.WRITE_PIECE``): the archive writer and
the local storage's writes of ready bytes both hand a file at most that much at a time.
"""

from __future__ import annotations

import io
import os
import zlib
from pathlib import Path

import pytest
import torch

from trajtrack.backends import WRITE_PIECE, BytesPayload, write_all
from trajtrack.backends.local import LocalStorage
from trajtrack.tracker._serialize import serialize_plain

MIB = 1 << 20


class _Recording(io.BytesIO):
    """A BytesIO that remembers the size of every ``write`` and takes at most *accept* bytes."""

    def __init__(self, accept: int | None = None) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self._accept = accept

    def write(self, data: bytes | memoryview, /) -> int:  # type: ignore[override]
        self.sizes.append(len(memoryview(data).cast("B")))
        if self._accept is not None:
            data = memoryview(data).cast("B")[: self._accept]
        return super().write(data)


def test_write_all_writes_every_byte_in_pieces_and_resumes_partial_writes() -> None:
    data = os.urandom(3 * MIB + 12345)
    out = _Recording(accept=300_000)  # a raw file that takes part of each call
    write_all(out.write, data)
    assert zlib.crc32(out.getvalue()) == zlib.crc32(data)
    assert max(out.sizes) <= MIB


def test_write_all_to_a_writer_that_does_not_count() -> None:
    pieces: list[bytes] = []
    data = os.urandom(2 * MIB + 7)
    write_all(lambda piece: pieces.append(bytes(piece)), data)  # returns None: took it all
    assert [len(p) for p in pieces] == [MIB, MIB, 7]
    assert b"".join(pieces) == data


def test_write_all_refuses_an_output_that_takes_nothing() -> None:
    with pytest.raises(OSError, match="accepted no more bytes"):
        write_all(lambda piece: 0, b"abc")


def test_the_archive_writer_hands_a_big_tensor_over_in_pieces() -> None:
    obj = {"weights": torch.randn(6 * MIB // 4), "step": 3}  # one 6 MiB storage
    out = _Recording()
    size, checksum = serialize_plain(obj, out) or (0, "")
    assert max(out.sizes) <= WRITE_PIECE == MIB
    data = out.getvalue()
    assert (size, checksum) == (len(data), f"crc32:{zlib.crc32(data):08x}")
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert torch.equal(loaded["weights"], obj["weights"]) and loaded["step"] == 3


async def test_the_local_storage_writes_ready_bytes_in_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int] = []
    real_write = os.write

    def recording_write(fd: int, data: bytes | memoryview) -> int:
        sizes.append(len(memoryview(data).cast("B")))
        return real_write(fd, data)

    data = os.urandom(3 * MIB + 1)
    storage = LocalStorage(str(tmp_path))
    await storage.prepare()
    monkeypatch.setattr(os, "write", recording_write)
    await storage.write_atomic("big.bin", BytesPayload(data), overwrite=True)
    monkeypatch.undo()
    assert zlib.crc32((tmp_path / "big.bin").read_bytes()) == zlib.crc32(data)
    assert sizes and max(sizes) <= MIB


def test_ready_bytes_reach_any_file_in_pieces() -> None:
    # The path of bytes from the Ray adapter into a shard or a WebHDFS spool.
    data = os.urandom(2 * MIB + 3)
    out = _Recording(accept=700_000)
    BytesPayload(data).write_to(out)
    assert zlib.crc32(out.getvalue()) == zlib.crc32(data)
    assert max(out.sizes) <= MIB
