"""The shard format (layouts/shards.py): headers as tarfile writes them, index from headers."""

from __future__ import annotations

import io
import tarfile

import pytest

from trajtrack.layouts.shards import (
    END_OF_ARCHIVE,
    PAX_HEADER_MAX,
    ShardFormatError,
    ShardHeaderError,
    header_size,
    index_members,
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
    # Cut short inside a member, or before the end-of-archive blocks: refused, with the
    # complete members before the cut (a shard is renamed into place whole: this is damage).
    names = [name for name, *_ in expected]
    for cut, before in (
        (expected[1][1] + 100, names[:1]),
        (len(data) - len(END_OF_ARCHIVE), names),
    ):
        with pytest.raises(ShardHeaderError, match=f"cut short at byte {cut}") as caught:
            scan_members(data[:cut])
        assert [m.name for m in caught.value.members] == before


def test_shard_names_never_look_like_a_dump() -> None:
    path = shard_path("host-1-2-abc", 7)
    assert path == ".trajtrack/shards/host-1-2-abc-000007.tar"
    assert is_shard_path(path)
    assert not is_shard_path("step1/sample0.tar")  # where a dump's file could be
    assert not is_shard_path(".trajtrack/shards/.shard.tmp~h~1~ab")
    assert not is_shard_path(".trajtrack/shards/sub/x.tar")


def _tar(tar_format: int, entries: list[tuple[str, bytes | None]]) -> bytes:
    """A tar archive as stdlib ``tarfile`` writes it: a file per ``(name, bytes)``, a
    directory for ``(name, None)``, and a symbolic link after each file."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tar_format) as archive:
        for name, body in entries:
            info = tarfile.TarInfo(name)
            if body is None:
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
                continue
            info.size = len(body)
            archive.addfile(info, io.BytesIO(body))
            link = tarfile.TarInfo(name + ".link")
            link.type = tarfile.SYMTYPE
            link.linkname = "x" * (50 if tar_format == tarfile.USTAR_FORMAT else 150)
            archive.addfile(link)
    return out.getvalue()


@pytest.mark.parametrize(
    "tar_format", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT]
)
def test_the_index_is_what_tarfile_reads(tar_format: int) -> None:
    long = "p" * 90 + "/" + "q" * 90 + ".pth"  # ustar: a prefix and a name
    entries = [("a.pth", b"x" * 10), ("dir", None), (long, b"y" * 600), ("e.pth", b"")]
    if tar_format != tarfile.USTAR_FORMAT:
        entries += [("n" * 150 + ".pth", b"z" * 513), ("ünï/cödé.pth", b"w" * 3)]
    data = _tar(tar_format, entries)
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        expected = [(m.name, m.offset_data, m.size) for m in archive if m.isreg()]
    assert [(m.name, m.offset, m.size) for m in scan_members(data)] == expected
    reads: list[tuple[int, int]] = []

    def read(offset: int, length: int) -> bytes:
        reads.append((offset, length))
        return data[offset : offset + length]

    assert [(m.name, m.offset, m.size) for m in index_members(read, len(data))] == expected
    assert sum(length for _, length in reads) <= len(data)


def test_a_large_shard_is_indexed_by_its_headers_alone() -> None:
    body = b"\x00" * (3 << 20)  # a member far larger than a window
    data = _tar(tarfile.PAX_FORMAT, [("a.pth", body), ("b.pth", body)])
    reads: list[int] = []

    def read(offset: int, length: int) -> bytes:
        reads.append(length)
        return data[offset : offset + length]

    assert [m.name for m in index_members(read, len(data))] == ["a.pth", "b.pth"]
    assert sum(reads) < 4 * (64 << 10)  # two windows of headers, never the members' data


def _pax_shard(records: bytes) -> bytes:
    """A shard whose first member has a pax header holding *records*."""
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = tarfile.XHDTYPE, len(records)
    member = member_header("a.pth", 3, 0) + b"abc" + padding(3)
    header = info.tobuf(tarfile.USTAR_FORMAT) + records + padding(len(records))
    return header + member + END_OF_ARCHIVE


def test_an_oversized_pax_header_is_refused_without_parsing_it() -> None:
    # CVE-2024-6232: tarfile's header parsing is quadratic on a pax header of digits.
    records = b"9" * (PAX_HEADER_MAX + 1)
    with pytest.raises(ShardHeaderError, match="tar header of") as caught:
        scan_members(member_header("z.pth", 1, 0) + b"z" + padding(1) + _pax_shard(records))
    assert [m.name for m in caught.value.members] == ["z.pth"]  # what came before it


@pytest.mark.parametrize(
    "records",
    [b"9" * 60_000, b"12 path=a\n", b"99 path=a.pth\n", b"0 x\n", b"11 pathabc\n"],
)
def test_a_malformed_pax_header_is_refused(records: bytes) -> None:
    with pytest.raises(ShardHeaderError, match="malformed"):
        scan_members(_pax_shard(records))


def test_a_pax_header_names_and_sizes_the_next_member() -> None:
    records = b"20 path=renamed.pth\n"
    assert [(m.name, m.size) for m in scan_members(_pax_shard(records))] == [("renamed.pth", 3)]
    with pytest.raises(ShardHeaderError, match="pax size"):
        scan_members(_pax_shard(b"11 size=-1\n"))


def test_a_corrupt_header_is_refused_with_the_members_before_it() -> None:
    # A zero block ends the archive; any other block that is not a header is damage.
    first = member_header("a.pth", 3, 0) + b"abc" + padding(3)
    second = bytearray(member_header("b.pth", 3, 0) + b"def" + padding(3))
    second[0] ^= 0xFF
    with pytest.raises(ShardHeaderError, match="corrupt tar header at 1024") as caught:
        scan_members(first + bytes(second) + END_OF_ARCHIVE)
    assert [m.name for m in caught.value.members] == ["a.pth"]
    with pytest.raises(ShardHeaderError, match="corrupt tar header at 0") as caught:
        scan_members(bytes(second) + END_OF_ARCHIVE)
    assert caught.value.members == []
