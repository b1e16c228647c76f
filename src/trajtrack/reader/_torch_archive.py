"""torch's zip container and its pickle, checked before anything is unpickled.

The archive layout ``torch.save`` writes, parsed from its end records and central directory
(every offset and size bounds-checked), and the pickle's opcodes scanned: the checks of
:mod:`trajtrack.reader._fast_load` that need no unpickler. Anything else raises
:class:`Declined`.
"""

from __future__ import annotations

import pickle
import struct
import threading
from typing import Final

__all__ = [
    "Declined",
    "archive_pickle",
    "archive_records",
    "check_opcodes",
    "member",
    "member_start",
]


class Declined(Exception):
    """Not for the fast loader: ``torch.load`` decides."""


def archive_records(data: bytes) -> tuple[dict[str, tuple[int, int]], str, int]:
    """``(records, prefix, limit)`` of the torch archive *data*: each record's local header
    offset and length by name, the records' folder (``"archive/"``), and where the central
    directory starts (no record's data goes past it)."""
    records, limit = _records(data)
    prefix = next(iter(records)).partition("/")[0] + "/"
    _check_records(data, records, prefix, limit)
    return records, prefix, limit


def archive_pickle(data: bytes) -> bytes:
    """The pickle of the torch archive *data*, its first record, without parsing the others.

    Declined unless that record is ``<folder>/data.pkl`` and the only one of the central
    directory whose name holds ``/data.pkl`` in any letter case: it is then the record
    torch's reader looks up (``<first record's folder>/data.pkl``, ASCII case ignored),
    whatever the other records are.
    """
    cd_offset, cd_end, _ = _directory(data)
    if data[cd_offset:cd_end].lower().count(b"/data.pkl") != 1:
        raise Declined
    local, size, name, _ = _central_entry(data, cd_offset, cd_end)
    folder, _, tail = name.partition("/")
    if not folder or tail != "data.pkl" or local >= cd_offset:
        raise Declined
    start = member_start(data, local, size, cd_offset)
    return data[start : start + size]


_END: Final = struct.Struct("<IHHHHIIH")
# The fields read of a central directory entry and of a local header (the rest skipped).
_CENTRAL: Final = struct.Struct("<I4xHH8xIIHHHHHII")
_CENTRAL_SIZE: Final = 46
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
    data: bytes, records: dict[str, tuple[int, int]], prefix: str, limit: int
) -> None:
    """Decline unless the archive holds exactly the records ``torch.save`` writes, the
    constant ones with the values it writes (torch's reader checks some of them: anything
    else may be an archive it refuses)."""
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
        if member(data, records, prefix + tail, limit) != value:
            raise Declined
    identifier = member(data, records, prefix + _SERIALIZATION_ID, limit)
    if not (identifier.isdigit() and identifier.isascii()):
        raise Declined


def check_opcodes(pickled: bytes, names: list[bytes] | None = None) -> None:
    """Decline a pickle with an opcode torch's weights-only unpickler does not implement, or
    a memo index beyond its length: the C unpickler sizes its memo by the largest index, so
    one ``LONG_BINPUT`` could make it allocate gigabytes (torch's keeps a dict).

    *names*: where to collect the argument of each ``GLOBAL`` (``b"module\\nname\\n"``), the
    only opcode of the set that names a global.

    A pickle that matches one already scanned in every byte the scan looks at (the dumps of a
    run differ in their numbers and strings, rarely in their structure) takes that scan's
    verdict (:class:`_Skeletons`): one comparison instead of a walk over its opcodes.
    """
    found = _SKELETONS.match(pickled)
    if found is None:
        kept = None if _SKELETONS.full else bytearray(len(pickled))
        found = _scan(pickled, kept)
        if kept is not None:
            _SKELETONS.add(pickled, kept, found)
    if names is not None:
        names.extend(found)


def _scan(pickled: bytes, kept: bytearray | None) -> tuple[bytes, ...]:
    """The ``GLOBAL`` arguments of *pickled* (declined as :func:`check_opcodes` says); in
    *kept* (if given: zeros, as long as *pickled*), 255 for each byte the walk depends on:
    every opcode, length prefix, ``GLOBAL`` argument and memo index, not the numbers and the
    strings' contents it skips."""
    size = len(pickled)
    names: list[bytes] = []
    at = 0
    while at < size:
        opcode = pickled[at]
        if kept is not None:
            kept[at] = 255
        if opcode in _ONE_BYTE_ARG:  # the most common ones first (BINPUT after every object)
            at += 2
            continue
        arg = _ARGS.get(opcode)
        if arg is None:
            raise Declined
        at += 1
        if arg == _NO_ARG:
            if opcode == _STOP:
                return tuple(names)
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


_ALL_KEPT: Final = b"\xff"


class _Skeletons:
    """The verdicts of pickles scanned so far, each as the bytes its walk depended on.

    A pickle of the same length that has the same bytes wherever a scanned one's walk looked
    is walked the same way by :func:`_scan`: each opcode, length and memo index it reads is
    the same, so are the ``GLOBAL`` lines, and what differs (a number, a string's contents)
    is skipped unread. It gets the same verdict and names. Bounded: up to :attr:`LIMIT`
    skeletons, the first ones seen; thread-safe.
    """

    LIMIT: Final = 64

    def __init__(self) -> None:
        self._by_length: dict[int, list[tuple[int, int, tuple[bytes, ...]]]] = {}
        self._count = 0
        self._lock = threading.Lock()

    @property
    def full(self) -> bool:
        return self._count >= self.LIMIT

    def match(self, pickled: bytes) -> tuple[bytes, ...] | None:
        """The names of a scanned pickle *pickled* matches, or ``None``."""
        candidates = self._by_length.get(len(pickled))
        if not candidates:
            return None
        value = int.from_bytes(pickled, "little")
        for keep, kept_value, names in candidates:
            if value & keep == kept_value:
                return names
        return None

    def add(self, pickled: bytes, kept: bytearray, names: tuple[bytes, ...]) -> None:
        """Remember the verdict of *pickled* (scanned: no ``Declined``)."""
        keep = int.from_bytes(kept, "little")
        entry = (keep, int.from_bytes(pickled, "little") & keep, names)
        with self._lock:
            if self._count < self.LIMIT:
                self._by_length.setdefault(len(pickled), []).append(entry)
                self._count += 1

    def clear(self) -> None:
        with self._lock:
            self._by_length, self._count = {}, 0


_SKELETONS: Final = _Skeletons()


def _records(data: bytes) -> tuple[dict[str, tuple[int, int]], int]:
    """``name -> (local header offset, length)`` of each record of the zip archive *data*,
    and where its central directory starts."""
    cd_offset, cd_end, total = _directory(data)
    records: dict[str, tuple[int, int]] = {}
    position = cd_offset
    for _ in range(total):
        local, size, key, position = _central_entry(data, position, cd_end)
        if local >= cd_offset or key in records:
            raise Declined  # a record twice: which one torch's reader would take is not ours
        records[key] = (local, size)
    if len({key.lower() for key in records}) != len(records):
        raise Declined  # names that differ in case only (zip readers may match either)
    return records, cd_offset


def _directory(data: bytes) -> tuple[int, int, int]:
    """Where the central directory of the zip archive *data* starts and ends, and its number
    of records, as the end records say (checked against each other and the data's length)."""
    end = len(data) - _END.size
    if end < 0:
        raise Declined
    signature, disk, cd_disk, on_disk, total, cd_size, cd_offset, comment = _END.unpack_from(
        data, end
    )
    if signature != _END_SIGNATURE or comment or disk or cd_disk or on_disk != total:
        raise Declined
    cd_end = cd_offset + cd_size
    if not total or cd_end > end or cd_size < total * _CENTRAL_SIZE:
        raise Declined
    _check_zip64_end(data, end, total, cd_size, cd_offset)
    return cd_offset, cd_end, total


def _central_entry(data: bytes, position: int, cd_end: int) -> tuple[int, int, str, int]:
    """``(local header offset, length, name, where the next entry starts)`` of the central
    directory entry at *position*."""
    fixed = _CENTRAL.size
    if position + fixed > cd_end:
        raise Declined
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
    return local, size, data[position + fixed : name_end].decode(), name_end


def _check_zip64_end(data: bytes, end: int, total: int, cd_size: int, cd_offset: int) -> None:
    """Decline unless the zip64 end records, if any (torch's writer always adds them, and
    torch's reader then takes the directory's place from them), say what the classic one
    says, for one disk."""
    at = end - _ZIP64_LOCATOR.size
    if at < 0 or _ZIP64_LOCATOR.unpack_from(data, at)[0] != _ZIP64_LOCATOR_SIGNATURE:
        return
    _, record_disk, record_offset, disks = _ZIP64_LOCATOR.unpack_from(data, at)
    if record_disk or disks != 1 or record_offset + _ZIP64_END.size > at:
        raise Declined
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


def member_start(data: bytes, local: int, size: int, limit: int) -> int:
    """Where the data of the record whose local header is at *local* starts."""
    if local + _LOCAL.size > limit:
        raise Declined
    signature, flags, method, name_len, extra_len = _LOCAL.unpack_from(data, local)
    if signature != _LOCAL_SIGNATURE or method or flags & ~_FLAGS:
        raise Declined
    start: int = local + _LOCAL.size + name_len + extra_len
    if start + size > limit:
        raise Declined
    return start


def member(data: bytes, records: dict[str, tuple[int, int]], name: str, limit: int) -> bytes:
    found = records.get(name)
    if found is None:
        raise Declined
    local, size = found
    start = member_start(data, local, size, limit)
    return data[start : start + size]


# The opcodes torch's weights-only unpickler implements, with their argument: a fixed size, a
# length prefix (negative: its size), two text lines, or none.
_NO_ARG: Final = 0
_LINES: Final = 100
_STOP: Final = pickle.STOP[0]
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
