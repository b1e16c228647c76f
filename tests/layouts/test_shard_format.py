"""The shard format (layouts/shards.py): headers as tarfile writes them, index from headers."""

from __future__ import annotations

import io
import tarfile

import pytest

from trajtrack.layouts.shards import (
    END_OF_ARCHIVE,
    ShardFormatError,
    header_size,
    is_shard_path,
    member_header,
    padding,
    scan_members,
    shard_path,
)


def _tarfile_header(name: str, size: int, mtime: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, mtime, 0o644
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


@pytest.mark.parametrize(
    "name",
    ["a.pth", "step3/sample12.pth", "x" * 99, "y" * 100, "d/" * 60 + "z.pth", "ünï/cödé.pth"],
)
@pytest.mark.parametrize("size", [0, 1, 511, 512, 4096, 123_456_789, (8 << 30) - 1])
def test_headers_are_what_tarfile_writes(name: str, size: int) -> None:
    assert member_header(name, size, 1_796_112_888.7) == _tarfile_header(name, size, 1_796_112_888)
    assert len(member_header(name, size, 0)) == header_size(name)


def test_a_member_of_8_gib_is_refused() -> None:
    with pytest.raises(ShardFormatError, match="8 GiB"):
        member_header("big.pth", 8 << 30, 0)


def test_members_are_found_again_from_the_headers() -> None:
    shard = io.BytesIO()
    expected = []
    for name, body in [("a.pth", b"x" * 10), ("n" * 150 + ".pth", b"y" * 600), ("e.pth", b"")]:
        header = member_header(name, len(body), 0)
        expected.append((name, shard.tell() + len(header), len(body)))
        shard.write(header + body + padding(len(body)))
    shard.write(END_OF_ARCHIVE)
    data = shard.getvalue()
    assert [(m.name, m.offset, m.size) for m in scan_members(data)] == expected
    assert [m.name for m in scan_members(data[: expected[1][1] + 100])] == ["a.pth"]  # cut


def test_shard_names_never_look_like_a_dump() -> None:
    path = shard_path("host-1-2-abc", 7)
    assert path == ".trajtrack/shards/host-1-2-abc-000007.tar"
    assert is_shard_path(path)
    assert not is_shard_path("step1/sample0.tar")  # where a dump's file could be
    assert not is_shard_path(".trajtrack/shards/.shard.tmp~h~1~ab")
    assert not is_shard_path(".trajtrack/shards/sub/x.tar")
