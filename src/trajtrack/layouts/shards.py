"""The shards layout's file format: plain POSIX tar files of dumps.

A shard is a tar archive (POSIX.1-2001 pax, as Python's ``tarfile`` writes it) whose members
are named exactly as the files layout would name the dumps' files (``step3/sample0.pth``) and
hold exactly the bytes it would write, so ``tar tf``, ``tarfile`` and WebDataset read a shard
as it is and ``tar xf`` restores the files layout. Each member is a header (512 bytes, plus a
pax extended header for names that ustar cannot hold), the data, and zero padding to a multiple
of 512 bytes; two zero blocks end the archive. Only a complete shard -- end blocks written,
renamed into place -- ever carries a final name.

Shards live below the destination in ``.trajtrack/shards/``, named ``<writer>-<sequence>.tar``:
a dump name cannot start a segment with ``.``, so no shard name can collide with a dump's file.
The record (:mod:`trajtrack.layouts.records`) indexes every member: shard, offset of the
member's data, length, CRC-32; a reader then fetches one dump with one ranged read. Without a
record (a crash between the rename and the record), :func:`scan_members` rebuilds the index
from the tar headers.
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

from trajtrack.layouts.names import RECORDS_DIR

__all__ = [
    "BLOCK",
    "END_OF_ARCHIVE",
    "SHARDS_DIR",
    "Member",
    "ShardFormatError",
    "header_size",
    "is_shard_path",
    "member_header",
    "padding",
    "scan_members",
    "shard_path",
]

SHARDS_DIR: Final = f"{RECORDS_DIR}/shards"
BLOCK: Final = tarfile.BLOCKSIZE  # 512
END_OF_ARCHIVE: Final = bytes(2 * BLOCK)
_MEMBER_MODE: Final = 0o644


class ShardFormatError(ValueError):
    """A member cannot be written in the shard format (e.g. 8 GiB or more)."""


@dataclass(frozen=True, slots=True)
class Member:
    """One member of a shard: its name and where its data is."""

    name: str
    offset: int
    size: int


def shard_path(writer: str, sequence: int) -> str:
    """The path of a writer's shard number *sequence*, relative to the destination."""
    return f"{SHARDS_DIR}/{writer}-{sequence:06d}.tar"


def is_shard_path(path: str) -> bool:
    """Whether *path* names a shard (not a temporary file, not anything nested deeper)."""
    head, _, base = path.rpartition("/")
    return head == SHARDS_DIR and base.endswith(".tar") and not base.startswith(".")


def member_header(name: str, size: int, mtime: float) -> bytes:
    """The header blocks of a member *name* of *size* bytes (pax where ustar does not fit).

    Raises:
        ShardFormatError: *size* needs more than ustar's 11 octal digits (8 GiB or more), which
            would make the header longer than :func:`header_size` promised.
    """
    if size >= 8 << 30:
        raise ShardFormatError(
            f"{name}: {size} bytes; a shard member must stay below 8 GiB (use layout='files')"
        )
    if len(name) < 100 and name.isascii():  # the common case: one ustar block, built here
        return _ustar_header(name.encode("ascii"), size, int(mtime))
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = int(mtime)
    info.mode = _MEMBER_MODE
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


_USTAR_TAIL: Final = b"ustar\x0000" + bytes(32 + 32 + 8 + 8 + 155 + 12)  # devs empty, as tarfile


def _ustar_header(name: bytes, size: int, mtime: int) -> bytes:
    """One ustar block for a regular file, as ``tarfile`` writes it for a short ASCII name.

    Fields (POSIX.1-1988): name 100, mode 8, uid 8, gid 8, size 12, mtime 12, chksum 8,
    typeflag 1, linkname 100, then magic ``ustar\0`` and version ``00``, uname 32, gname 32,
    devmajor 8, devminor 8 (empty for a regular file), prefix 155, and padding to 512. The
    checksum is the sum of the block's bytes with the checksum field read as eight spaces.
    """
    head = b"".join(
        (
            name.ljust(100, b"\x00"),
            b"%07o\x00" % _MEMBER_MODE,
            b"0000000\x00",
            b"0000000\x00",
            b"%011o\x00" % size,
            b"%011o\x00" % mtime,
            b"        ",
            b"0",  # REGTYPE
            bytes(100),
        )
    )
    block = head + _USTAR_TAIL
    checksum = b"%06o\x00 " % sum(block)
    return block[:148] + checksum + block[156:]


@lru_cache(maxsize=4096)
def header_size(name: str) -> int:
    """How many bytes :func:`member_header` writes for *name* (whatever the size below 8 GiB)."""
    return len(member_header(name, 0, 0))


def padding(size: int) -> bytes:
    """The zero bytes that follow *size* bytes of data to end its last block."""
    return bytes(-size % BLOCK)


def scan_members(data: bytes) -> list[Member]:
    """The regular-file members of a shard's bytes, read from its tar headers.

    Stops at the end of the archive, or at a truncated or corrupt header (what complete
    members come before it are returned: a shard with a final name is always complete).
    """
    members: list[Member] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
            for info in archive:
                if info.isreg() and info.offset_data + info.size <= len(data):
                    members.append(Member(info.name, info.offset_data, info.size))
    except tarfile.TarError:
        pass  # a damaged tail: keep the members before it
    return members
