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
record (a crash between the rename and the record), :func:`index_members` rebuilds the index
from the tar headers, parsed here with bounds (``tarfile`` only ever writes headers).
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

from trajtrack._exceptions import DumpLoadError
from trajtrack.layouts.names import RECORDS_DIR

__all__ = [
    "BLOCK",
    "END_OF_ARCHIVE",
    "SHARDS_DIR",
    "PAX_HEADER_MAX",
    "Member",
    "ReadRange",
    "ShardFormatError",
    "ShardHeaderError",
    "header_size",
    "index_members",
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
    """The regular-file members of a shard's bytes, read from its tar headers
    (:func:`index_members` of bytes in memory).

    Raises:
        ShardHeaderError: As :func:`index_members`.
    """
    return index_members(lambda offset, length: data[offset : offset + length], len(data))


ReadRange = Callable[[int, int], bytes]
"""``read(offset, length)``: the bytes of a shard from *offset*, *length* of them (fewer only
at its end)."""

PAX_HEADER_MAX: Final = 64 << 10
"""The longest pax extended header (or GNU long name) :func:`index_members` reads: what a
tracker writes holds a path and a size (a few hundred bytes); a longer one is refused."""

_WINDOW: Final = 64 << 10  # bytes read at a time: the headers of a run of small members


class ShardHeaderError(DumpLoadError):
    """A shard's tar headers cannot be indexed (a corrupt header, an oversized or malformed pax
    header, or the shard cut short).

    Attributes:
        members: The members found before the header refused (or the cut).
    """

    def __init__(self, message: str, members: list[Member]) -> None:
        super().__init__(message)
        self.members = members


def index_members(read: ReadRange, size: int) -> list[Member]:
    """The regular-file members of a shard of *size* bytes, from its tar headers alone.

    A shard no record describes (a crash between its rename and its record) is untrusted: it
    is indexed by reading its headers (a window of 64 KiB at a time), never its members'
    data, so its size never sizes memory; and parsed here, in linear time, not by stdlib
    ``tarfile`` (quadratic on a pax header of digits before CPython 3.12.6 and 3.11.10:
    CVE-2024-6232). Stops at the end of the archive.

    Raises:
        ShardHeaderError: A header block that is not a valid tar header (its checksum or a
            number wrong), or a pax header (or GNU long name) longer than
            :data:`PAX_HEADER_MAX`, or malformed; or the shard ends before its end-of-archive
            blocks (the members before the cut are in the error: the caller reports the cut).
    """
    members: list[Member] = []
    window = _Window(read, size)
    extended: dict[str, str] = {}
    offset = 0
    while True:
        block = window.read(offset, BLOCK) if offset + BLOCK <= size else b""
        if block == bytes(BLOCK):  # the end of the archive
            return members
        if len(block) < BLOCK:
            raise _cut_short(offset, size, members)
        header = _header(block)
        if header is None:
            # Damage, not an end: a shard with a final name is complete, so the members
            # after this block exist but cannot be found; the caller must say so.
            raise ShardHeaderError(f"a corrupt tar header at {offset}", members)
        name, kind, length = header
        start = offset + BLOCK
        if kind in _EXTENDED:
            if length > PAX_HEADER_MAX:
                raise ShardHeaderError(
                    f"a tar header of {length} bytes at {offset} (more than {PAX_HEADER_MAX})",
                    members,
                )
            if start + length > size:
                raise _cut_short(offset, size, members)
            body = window.read(start, length)
            if kind == b"L":  # a GNU long name for the next member
                extended = {"path": body.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")}
            elif kind == b"x":  # pax: for the next member only
                extended = _pax_records(body, offset, members)
        else:
            name = extended.get("path", name)
            length = _pax_size(extended, length, offset, members)
            extended = {}
            if start + length > size:
                raise _cut_short(offset, size, members)
            if kind in _REGULAR:
                members.append(Member(name, start, length))
        offset = start + length + (-length % BLOCK)


def _cut_short(offset: int, size: int, members: list[Member]) -> ShardHeaderError:
    """A shard that ends (at *size*) before the header or member at *offset* does, or before
    its end-of-archive blocks: a shard is renamed into place complete, so it was damaged."""
    return ShardHeaderError(
        f"the shard is cut short at byte {size} (at the entry at {offset})", members
    )


_REGULAR: Final = (b"0", b"\0", b"7")  # a regular file, as old tars write it, contiguous
_EXTENDED: Final = (b"x", b"g", b"L")  # pax for the next member, pax global, GNU long name


class _Window:
    """:data:`ReadRange` through a window of :data:`_WINDOW` bytes."""

    def __init__(self, read: ReadRange, size: int) -> None:
        self._read = read
        self._size = size
        self._start = 0
        self._data = b""

    def read(self, offset: int, length: int) -> bytes:
        end = offset + length
        if not (self._start <= offset and end <= self._start + len(self._data)):
            if length > _WINDOW:
                return self._read(offset, length)
            self._start = offset
            self._data = self._read(offset, min(_WINDOW, self._size - offset))
        return self._data[offset - self._start : end - self._start]


def _header(block: bytes) -> tuple[str, bytes, int] | None:
    """A header block's name, type flag and data length; ``None`` for a block that is not a
    valid header (checksum, numbers)."""
    stored = _number(block[148:156])
    unsigned = sum(block[:148]) + 8 * 0x20 + sum(block[156:])
    signed = unsigned - 256 * sum(b >= 0x80 for b in block[:148] + block[156:])
    size = _number(block[124:136])
    if stored is None or stored not in (unsigned, signed) or size is None:
        return None
    name = block[:100].split(b"\0", 1)[0]
    if block[257:263] in (b"ustar\x00", b"ustar "):  # POSIX ustar, GNU: a prefix
        prefix = block[345:500].split(b"\0", 1)[0]
        if prefix and block[257:263] == b"ustar\x00":
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape"), block[156:157], size


def _number(field: bytes) -> int | None:
    """A numeric header field: octal digits, or base-256 (GNU, first byte ``0x80``);
    ``None`` if it is neither (a negative base-256 number included)."""
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\0", 1)[0].strip(b" ")
    if not digits:
        return 0
    if not all(48 <= b <= 55 for b in digits):  # only 0-7
        return None
    return int(digits, 8)


def _pax_records(body: bytes, offset: int, members: list[Member]) -> dict[str, str]:
    """The ``"%d %s=%s\\n"`` records of a pax header, parsed in one pass."""
    records: dict[str, str] = {}
    at = 0
    while at < len(body) and body[at] != 0:
        space = body.find(b" ", at, at + 20)  # a record's length: up to 19 digits
        digits = body[at:space] if space > at else b""
        length = int(digits) if digits.isdigit() else 0
        end = at + length
        if length <= 0 or end > len(body) or body[end - 1 : end] != b"\n":
            raise ShardHeaderError(f"a malformed pax header at {offset}", members)
        key, equals, value = body[space + 1 : end - 1].partition(b"=")
        if not equals:
            raise ShardHeaderError(f"a malformed pax header at {offset}", members)
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        at = end
    return records


def _pax_size(extended: dict[str, str], length: int, offset: int, members: list[Member]) -> int:
    """The member's data length: a pax ``size`` record's, if any, else its header's."""
    size = extended.get("size")
    if size is None:
        return length
    if not (size.isascii() and size.isdigit() and len(size) <= 19):
        raise ShardHeaderError(f"a malformed pax size at {offset}", members)
    return int(size)
