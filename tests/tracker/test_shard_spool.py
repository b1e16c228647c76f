"""A shard's spool file: pieces written in order with writev, short writes and all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trajtrack.backends import WRITE_PIECE
from trajtrack.tracker import _shard_spool as shard_spool


def _pieces(count: int) -> list[bytes | memoryview]:
    return [
        bytes([i % 251]) * (1 + i % 7) if i % 2 else memoryview(bytes([i % 13]) * 5)
        for i in range(count)
    ]


def test_short_writes_go_on_where_they_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.writev
    calls = []

    def short(fd: int, buffers: list[bytes | memoryview]) -> int:
        calls.append(len(buffers))
        if len(calls) > 10_000:
            raise AssertionError("no progress")
        data = b"".join(bytes(b) for b in buffers)[:3]  # at most 3 bytes a call
        return real(fd, [data])

    monkeypatch.setattr(os, "writev", short)
    pieces = _pieces(40)
    expected = b"".join(bytes(p) for p in pieces)
    with open(tmp_path / "spool", "wb") as file:
        shard_spool._write_all(file.fileno(), list(pieces))
    assert (tmp_path / "spool").read_bytes() == expected
    assert len(calls) == -(-len(expected) // 3)


def test_more_pieces_than_one_writev_takes(tmp_path: Path) -> None:
    pieces = _pieces(3 * shard_spool._IOV_MAX + 5)
    with open(tmp_path / "spool", "wb") as file:
        shard_spool._write_all(file.fileno(), list(pieces))
    assert (tmp_path / "spool").read_bytes() == b"".join(bytes(p) for p in pieces)


def test_a_last_piece_with_nothing_to_write_ends_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A member whose size is a multiple of 512 bytes needs no padding: its last piece is empty.
    real = os.writev
    calls = []

    def counted(fd: int, buffers: list[bytes | memoryview]) -> int:
        calls.append(len(buffers))
        if len(calls) > 100:
            raise AssertionError("no progress")
        return real(fd, buffers)

    monkeypatch.setattr(os, "writev", counted)
    pieces: list[bytes | memoryview] = [b"h" * 512, b"d" * 1024, b""]
    with open(tmp_path / "spool", "wb") as file:
        shard_spool._write_all(file.fileno(), list(pieces))
    assert (tmp_path / "spool").read_bytes() == b"h" * 512 + b"d" * 1024


def test_no_writev_takes_more_than_a_piece(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.writev
    sizes = []

    def counted(fd: int, buffers: list[bytes | memoryview]) -> int:
        sizes.append(sum(len(memoryview(b).cast("B")) for b in buffers))
        return real(fd, buffers)

    monkeypatch.setattr(os, "writev", counted)
    pieces: list[bytes | memoryview] = [b"h" * 512, os.urandom(3 * WRITE_PIECE + 5), b"t" * 7]
    with open(tmp_path / "spool", "wb") as file:
        shard_spool._write_all(file.fileno(), list(pieces))
    assert (tmp_path / "spool").read_bytes() == b"".join(pieces)
    assert max(sizes) <= WRITE_PIECE
