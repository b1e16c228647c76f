"""torch's zip container and its pickle, checked before anything is unpickled.

The archive layout ``torch.save`` writes, parsed from its end records and central directory
(every offset and size bounds-checked, the first record's header at the first byte), and the
pickle's opcodes scanned: the checks of :mod:`trajtrack.reader._fast_load` that need no
unpickler. Anything else raises :class:`Declined`.
"""

from __future__ import annotations

import pickle
import struct
from typing import Final

from trajtrack.reader._remembered import KEPT, Remembered

__all__ = [
    "Declined",
    "Skeleton",
    "archive_pickle",
    "archive_records",
    "check_opcodes",
    "member",
    "member_start",
    "scan_opcodes",
]


class Declined(Exception):
    """Not for the fast loader: ``torch.load`` decides."""


def archive_records(data: bytes) -> tuple[dict[str, tuple[int, int]], str, int]:
    """``(records, prefix, limit)`` of the torch archive *data*: each record's local header
    offset and length by name (shared: not to be changed), the records' folder
    (``"archive/"``), and where the central directory starts (no record's data goes past it).

    An archive equal to one already parsed in every byte the parse read (the dumps of a run
    differ in their data, their pickles and their checksums, rarely in their layout) takes
    that parse's result (:data:`_LAYOUTS`): one comparison instead of the parse.
    """
    found = _LAYOUTS.match(data)
    if found is not None:
        records, prefix, limit, (start, end) = found
        if not _is_identifier(data[start:end]):
            raise Declined
        return records, prefix, limit
    kept = None if _LAYOUTS.full else bytearray(len(data))
    records, limit = _records(data, kept)
    prefix = next(iter(records)).partition("/")[0] + "/"
    identifier = _check_records(data, records, prefix, limit, kept)
    if kept is not None:
        _LAYOUTS.add(data, kept, (records, prefix, limit, identifier))
    return records, prefix, limit


_Layout = tuple[dict[str, tuple[int, int]], str, int, tuple[int, int]]
_LAYOUTS: Final[Remembered[_Layout]] = Remembered()
""":func:`archive_records`' results by the bytes the parse read: the end records, each central
directory entry but its CRC-32, each local header the checks open but its CRC-32, the first
four bytes, and the constant records' contents. Not the serialization id's digits (they change
with every save: checked again at each match), nor the data, the pickle and the data
descriptors after them."""


def _keep(kept: bytearray | None, start: int, end: int) -> None:
    """Mark *kept*'s bytes *start* to *end* as read (if there is a *kept*)."""
    if kept is not None:
        kept[start:end] = _ALL_KEPT * (end - start)


def _is_identifier(value: bytes) -> bool:
    return value.isdigit() and value.isascii()


def archive_pickle(data: bytes, kept: bytearray | None = None) -> tuple[int, int]:
    """Where the pickle of the torch archive *data*, its first record, starts and ends.

    Declined unless that record is ``<folder>/data.pkl`` and the only one of the central
    directory whose name holds ``/data.pkl`` in any letter case: it is then the record
    torch's reader looks up (``<first record's folder>/data.pkl``, ASCII case ignored),
    whatever the other records are. The directory is parsed as :func:`archive_records` parses
    it (a record twice, names differing in case only: declined); *kept* (if given: zeros, as
    long as *data*) is marked where the parse read, the CRC-32s excepted.
    """
    records, cd_offset = _records(data, kept)
    first = next(iter(records))
    folder, _, tail = first.partition("/")
    if not folder or tail != "data.pkl":
        raise Declined
    if sum(name.lower().count("/data.pkl") for name in records) != 1:
        raise Declined
    local, size = records[first]
    start = member_start(data, local, size, cd_offset, kept)
    return start, start + size


_END: Final = struct.Struct("<IHHHHIIH")
# The fields read of a central directory entry and of a local header (the rest skipped).
_CENTRAL: Final = struct.Struct("<I4xHH8xIIHHHHHII")
_CENTRAL_SIZE: Final = 46
_CENTRAL_CRC: Final = 16  # where an entry's CRC-32 is (4 bytes), and a local header's:
_LOCAL_CRC: Final = 14
_ZIP64_LOCATOR: Final = struct.Struct("<IIQI")
_ZIP64_END: Final = struct.Struct("<IQ4xIIQQQQ")
_ZIP64_LOCATOR_SIGNATURE: Final = 0x07064B50
_ZIP64_END_SIGNATURE: Final = 0x06064B50
_LOCAL: Final = struct.Struct("<I2xHH16xHH")
_END_SIGNATURE: Final = 0x06054B50
_CENTRAL_SIGNATURE: Final = 0x02014B50
_LOCAL_SIGNATURE: Final = 0x04034B50
_CONSTANT_RECORDS: Final = {  # as torch.save (and trajtrack's writer) write them
    ".format_version": b"1",
    ".storage_alignment": b"64",
    "byteorder": b"little",
    "version": b"3\n",
}
_SERIALIZATION_ID: Final = ".data/serialization_id"
_FLAGS: Final = 0x0808  # the flags allowed: UTF-8 names (11), sizes after the data (3)
_DOS_DIRECTORY: Final = 0x10


def _check_records(
    data: bytes,
    records: dict[str, tuple[int, int]],
    prefix: str,
    limit: int,
    kept: bytearray | None,
) -> tuple[int, int]:
    """Decline unless the archive holds exactly the records ``torch.save`` writes, the
    constant ones with the values it writes (torch's reader checks some of them: anything
    else may be an archive it refuses). Returns where the serialization id's digits are."""
    names = iter(records)
    if next(names) != prefix + "data.pkl":
        raise Declined
    for name in names:
        tail = name[len(prefix) :]
        if not name.startswith(prefix) or (
            tail not in _CONSTANT_RECORDS
            and tail != _SERIALIZATION_ID
            and not (tail.startswith("data/") and tail[5:].isdigit() and tail[5:].isascii())
        ):
            raise Declined
    for tail, value in _CONSTANT_RECORDS.items():
        if member(data, records, prefix + tail, limit, kept) != value:
            raise Declined
    found = records.get(prefix + _SERIALIZATION_ID)
    if found is None:
        raise Declined
    local, size = found
    start = member_start(data, local, size, limit, kept)
    if not _is_identifier(data[start : start + size]):
        raise Declined
    return start, start + size


class Skeleton:
    """What the opcode scan found in a pickle, shared by every pickle of the same skeleton
    (the same opcodes, memo indices, lengths and ``GLOBAL`` lines: only numbers and the
    strings' contents may differ).

    Attributes:
        names: The ``GLOBAL`` arguments, in order.
        builds: Whether it has a ``BUILD``.
        canonical: Whether a pickle of this skeleton was found to be what the C pickler
            writes for what it builds (``None``: not known yet; only ``True`` is kept).
    """

    __slots__ = ("builds", "canonical", "names")

    def __init__(self, names: tuple[bytes, ...], builds: bool) -> None:
        self.names, self.builds = names, builds
        self.canonical: bool | None = None


def check_opcodes(pickled: bytes, names: list[bytes] | None = None) -> Skeleton:
    """Decline a pickle the fast loader does not unpickle: an opcode torch's weights-only
    unpickler does not implement, a ``BUILD`` (it sets attributes of whatever it is given, a
    global of the loader's table included, and ``torch.save`` writes none for plain tensor
    data: such a pickle is torch's to load), or a memo index beyond its length (the C
    unpickler sizes its memo by the largest index, so one ``LONG_BINPUT`` could make it
    allocate gigabytes; torch's keeps a dict). Returns its :class:`Skeleton`.

    *names*: where to collect the argument of each ``GLOBAL`` (``b"module\\nname\\n"``), the
    only opcode of the set that names a global.

    A pickle that matches one already scanned in every byte the scan looks at (the dumps of a
    run differ in their numbers and strings, rarely in their structure) takes that scan's
    :class:`Skeleton` (:data:`_SKELETONS`): one comparison instead of a walk over its opcodes.
    """
    found = _SKELETONS.match(pickled)
    if found is None:
        kept = None if _SKELETONS.full else bytearray(len(pickled))
        builds: list[int] = []
        found = Skeleton(scan_opcodes(pickled, kept, builds), bool(builds))
        if kept is not None:
            _SKELETONS.add(pickled, kept, found)
    if found.builds:
        raise Declined
    if names is not None:
        names.extend(found.names)
    return found


def scan_opcodes(
    pickled: bytes, kept: bytearray | memoryview | None, builds: list[int] | None = None
) -> tuple[bytes, ...]:
    """The ``GLOBAL`` arguments of *pickled* (declined as :func:`check_opcodes` says, but for
    ``BUILD``: where each one is goes to *builds*, if given); in *kept* (if given: zeros, as
    long as *pickled*), 255 for each byte the walk depends on: every opcode, length prefix,
    ``GLOBAL`` argument, memo index and the protocol, not the numbers and the strings'
    contents it skips."""
    size = len(pickled)
    names: list[bytes] = []
    at = 0
    while at < size:
        opcode = pickled[at]
        if kept is not None:
            kept[at] = 255
        if opcode in _ONE_BYTE_ARG:  # the most common ones first (BINPUT after every object)
            if kept is not None and opcode in _STRUCTURE:
                kept[at + 1 : at + 2] = _ALL_KEPT  # a memo index or the protocol, not a number
            at += 2
            continue
        arg = _ARGS.get(opcode)
        if arg is None:
            raise Declined
        at += 1
        if arg == _NO_ARG:
            if opcode == _STOP:
                return tuple(names)
            if opcode == _BUILD and builds is not None:
                builds.append(at - 1)
        elif arg == _LINES:  # GLOBAL: module and name, each up to a newline
            end = pickled.index(b"\n", pickled.index(b"\n", at) + 1) + 1
            names.append(pickled[at:end])
            if kept is not None:
                kept[at:end] = _ALL_KEPT * (end - at)
            at = end
        elif arg < 0:  # a length of -arg bytes, then that many bytes
            if kept is not None:
                kept[at : at - arg] = _ALL_KEPT * -arg
            at += -arg + int.from_bytes(pickled[at : at - arg], "little")
        else:
            if opcode in _MEMO:
                if kept is not None:
                    kept[at : at + arg] = _ALL_KEPT * arg
                if int.from_bytes(pickled[at : at + arg], "little") > size:
                    raise Declined
            at += arg
    raise Declined  # no STOP


_ALL_KEPT: Final = bytes([KEPT])

_SKELETONS: Final[Remembered[Skeleton]] = Remembered()
"""The scan's verdicts (:class:`Skeleton`), by the bytes the walk looked at: a pickle of the same
length equal to a scanned one in every opcode, length prefix, ``GLOBAL`` line, memo index and
protocol is walked the same way, and builds the same containers and calls in the same order;
what differs (a number, a string's contents) is skipped unread."""


def _records(data: bytes, kept: bytearray | None) -> tuple[dict[str, tuple[int, int]], int]:
    """``name -> (local header offset, length)`` of each record of the zip archive *data*,
    and where its central directory starts."""
    cd_offset, cd_end, total = _directory(data, kept)
    records: dict[str, tuple[int, int]] = {}
    position = cd_offset
    for _ in range(total):
        local, size, key, position = _central_entry(data, position, cd_end, kept)
        if local >= cd_offset or key in records:
            raise Declined  # a record twice: which one torch's reader would take is not ours
        records[key] = (local, size)
    if len({key.lower() for key in records}) != len(records):
        raise Declined  # names that differ in case only (zip readers may match either)
    _check_start(data, next(iter(records.values()))[0], kept)
    return records, cd_offset


def _check_start(data: bytes, first_local: int, kept: bytearray | None) -> None:
    """Decline unless *data* opens with a local header's signature, the first record's.

    The end records say nothing of the start, but ``torch.load`` does: it takes bytes for its
    zip format only if they start with that signature (``_is_zipfile``), and otherwise reads
    them as its legacy pickle stream from the first byte, whatever archive follows. Its zip
    reader then parses from the end, as here. ``torch.save`` puts the first record at offset
    0: requiring that too leaves no bytes before the archive that no check has read. The
    signature is marked in *kept*: a remembered verdict must not skip this check."""
    _keep(kept, 0, 4)
    if first_local or int.from_bytes(data[:4], "little") != _LOCAL_SIGNATURE:
        raise Declined


def _directory(data: bytes, kept: bytearray | None = None) -> tuple[int, int, int]:
    """Where the central directory of the zip archive *data* starts and ends, and its number
    of records, as the end records say (checked against each other and the data's length)."""
    end = len(data) - _END.size
    if end < 0:
        raise Declined
    _keep(kept, end, len(data))
    signature, disk, cd_disk, on_disk, total, cd_size, cd_offset, comment = _END.unpack_from(
        data, end
    )
    if signature != _END_SIGNATURE or comment or disk or cd_disk or on_disk != total:
        raise Declined
    cd_end = cd_offset + cd_size
    if not total or cd_end > end or cd_size < total * _CENTRAL_SIZE:
        raise Declined
    _check_zip64_end(data, end, total, cd_size, cd_offset, kept)
    return cd_offset, cd_end, total


def _central_entry(
    data: bytes, position: int, cd_end: int, kept: bytearray | None = None
) -> tuple[int, int, str, int]:
    """``(local header offset, length, name, where the next entry starts)`` of the central
    directory entry at *position*."""
    fixed = _CENTRAL.size
    if position + fixed > cd_end:
        raise Declined
    _keep(kept, position, position + _CENTRAL_CRC)  # the CRC-32 is not read
    _keep(kept, position + _CENTRAL_CRC + 4, position + fixed)
    fields = _CENTRAL.unpack_from(data, position)
    signature, flags, method, packed, size, name_len, extra_len, comment_len = fields[:8]
    start_disk, external, local = fields[8], fields[10], fields[11]
    if signature != _CENTRAL_SIGNATURE or method or flags & ~_FLAGS or packed != size:
        raise Declined  # compressed, encrypted, or sizes in a zip64 field
    if start_disk or extra_len or comment_len or external & _DOS_DIRECTORY:
        raise Declined  # a record marked as a directory: zip readers take it for one
    name_end = position + fixed + name_len
    if name_end > cd_end:
        raise Declined
    _keep(kept, position + fixed, name_end)
    return local, size, data[position + fixed : name_end].decode(), name_end


def _check_zip64_end(
    data: bytes, end: int, total: int, cd_size: int, cd_offset: int, kept: bytearray | None
) -> None:
    """Decline unless the zip64 end records, if any (torch's writer always adds them, and
    torch's reader then takes the directory's place from them), say what the classic one
    says, for one disk."""
    at = end - _ZIP64_LOCATOR.size
    if at < 0:
        return
    _keep(kept, at, end)
    if _ZIP64_LOCATOR.unpack_from(data, at)[0] != _ZIP64_LOCATOR_SIGNATURE:
        return
    _, record_disk, record_offset, disks = _ZIP64_LOCATOR.unpack_from(data, at)
    if record_disk or disks != 1 or record_offset + _ZIP64_END.size > at:
        raise Declined
    _keep(kept, record_offset, record_offset + _ZIP64_END.size)
    fields = _ZIP64_END.unpack_from(data, record_offset)
    signature, record_size, this_disk, cd_disk, on_disk, entries, size, offset = fields
    if signature != _ZIP64_END_SIGNATURE or record_size < _ZIP64_END.size - 12:
        raise Declined
    if (
        this_disk
        or cd_disk
        or (on_disk, entries, size, offset) != (total, total, cd_size, cd_offset)
    ):
        raise Declined


def member_start(
    data: bytes, local: int, size: int, limit: int, kept: bytearray | None = None
) -> int:
    """Where the data of the record whose local header is at *local* starts."""
    if local + _LOCAL.size > limit:
        raise Declined
    _keep(kept, local, local + _LOCAL_CRC)  # the CRC-32 is not read
    _keep(kept, local + _LOCAL_CRC + 4, local + _LOCAL.size)
    signature, flags, method, name_len, extra_len = _LOCAL.unpack_from(data, local)
    if signature != _LOCAL_SIGNATURE or method or flags & ~_FLAGS:
        raise Declined
    start: int = local + _LOCAL.size + name_len + extra_len
    if start + size > limit:
        raise Declined
    return start


def member(
    data: bytes,
    records: dict[str, tuple[int, int]],
    name: str,
    limit: int,
    kept: bytearray | None = None,
) -> bytes:
    found = records.get(name)
    if found is None:
        raise Declined
    local, size = found
    start = member_start(data, local, size, limit, kept)
    _keep(kept, start, start + size)
    return data[start : start + size]


# The opcodes torch's weights-only unpickler implements, with their argument: a fixed size, a
# length prefix (negative: its size), two text lines, or none.
_NO_ARG: Final = 0
_LINES: Final = 100
_STOP: Final = pickle.STOP[0]
_BUILD: Final = pickle.BUILD[0]
_ARGS: Final[dict[int, int]] = {
    **dict.fromkeys(
        (
            op[0]
            for op in (
                pickle.APPEND,
                pickle.APPENDS,
                pickle.BINPERSID,
                pickle.BUILD,
                pickle.EMPTY_DICT,
                pickle.EMPTY_LIST,
                pickle.EMPTY_SET,
                pickle.EMPTY_TUPLE,
                pickle.MARK,
                pickle.NEWFALSE,
                pickle.NEWOBJ,
                pickle.NEWTRUE,
                pickle.NONE,
                pickle.REDUCE,
                pickle.SETITEM,
                pickle.SETITEMS,
                pickle.STOP,
                pickle.TUPLE,
                pickle.TUPLE1,
                pickle.TUPLE2,
                pickle.TUPLE3,
            )
        ),
        _NO_ARG,
    ),
    pickle.PROTO[0]: 1,
    pickle.BININT1[0]: 1,
    pickle.BINPUT[0]: 1,
    pickle.BINGET[0]: 1,
    pickle.BININT2[0]: 2,
    pickle.BININT[0]: 4,
    pickle.LONG_BINPUT[0]: 4,
    pickle.LONG_BINGET[0]: 4,
    pickle.BINFLOAT[0]: 8,
    pickle.LONG1[0]: -1,
    pickle.SHORT_BINSTRING[0]: -1,
    pickle.BINUNICODE[0]: -4,
    pickle.GLOBAL[0]: _LINES,
}
_MEMO: Final = frozenset({pickle.LONG_BINPUT[0]})  # a one-byte index is harmless
_ONE_BYTE_ARG: Final = frozenset(op for op, arg in _ARGS.items() if arg == 1)
_STRUCTURE: Final = frozenset({pickle.BINPUT[0], pickle.BINGET[0], pickle.PROTO[0]})
