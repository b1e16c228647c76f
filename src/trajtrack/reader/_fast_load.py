"""Loading plain tensor dumps without ``torch.load``'s per-call cost; anything else is declined.

``torch.load(weights_only=True)`` of a 4 KB dump costs ~340 us here, ~200 us of it in torch's
pure-Python restricted unpickler (one ``read`` per opcode byte); a diff of two runs of small
dumps is that per dump. This module loads the common case, torch's zip archive of plain CPU
tensors in containers and scalars, in ~20 us, and *declines* (:data:`DECLINED`) everything else,
which then goes to ``torch.load(weights_only=True)`` as before. It is an accelerator in front of
torch's loader, never a second opinion: what it accepts uses only globals of torch's default
weights-only allow-list, and it builds the objects torch builds.

How, with public, documented APIs only:

* **The zip container** is parsed here from its end records and central directory
  (``struct``, every offset and size bounds-checked). Only the layout ``torch.save`` writes is
  taken: exactly its records (``data.pkl`` first, the constant ones with the values it writes:
  ``byteorder`` ``little`` on a little-endian machine, ``version`` 3...), stored uncompressed,
  one disk, zip64 end records agreeing with the classic one, no record marked a directory,
  no names differing in case only. Anything else declines: torch's own reader refuses some of
  it, and which of two records it would take is not this module's to guess.
* **The pickle's opcodes** are scanned first: only those torch's weights-only unpickler
  implements (protocol 2's subset), and no memo index beyond the pickle's length (the C
  unpickler sizes its memo by the largest index: one ``LONG_BINPUT`` could make it allocate
  gigabytes; torch's keeps a dict).
* **The pickle** is read by Python's C unpickler restricted as the :mod:`pickle` documentation
  describes ("Restricting Globals"): :meth:`pickle.Unpickler.find_class` answers from a fixed
  table and declines every other name, so no global outside the table is ever imported or
  called. The table: ``collections.OrderedDict``, torch's dtypes, ``torch.Size``,
  ``torch.device``, ``set``, ``complex``, ``bytes`` as protocol 2 pickles them
  (``_codecs.encode(text, "latin1")``, checked), torch's typed storage classes and its two
  tensor rebuild functions (named as torch's public pickling protocol names them,
  :mod:`trajtrack.tracker._archive`; never imported or called: the names map to this module's
  own handlers). All of these are on torch's default weights-only list.
* **Tensors** are never exposed to the unpickler. The rebuild handlers check their arguments
  and return an inert record (:class:`_TensorRef`: no ``__setstate__``, no item assignment,
  no attributes to set), so that no pickle opcode (``BUILD``, ``SETITEM``...) can act on a
  tensor. After the pickle is read, the records are replaced by tensors, one storage per
  storage record (views keep sharing it, as with ``torch.load``), built with
  ``torch.frombuffer`` and ``Tensor.set_`` over ``Tensor.untyped_storage()``, which check
  offsets, sizes and strides against the storage's length.

Whatever fails on the way (a malformed archive, a name outside the table, a storage of the
wrong length, a cycle through a tuple, nesting deeper than Python's recursion limit) declines;
torch's loader then gives the authoritative answer, its refusal included. What is left
between the two loaders: for a pickle ``torch.save`` never writes, the C unpickler accepts a few
operations on containers that torch's refuses (an item assignment into a list); only the
table's globals can appear in it either way. ``tests/reader/test_fast_load.py`` flips random
bits of an archive and checks that whatever this module loads, torch loads the same.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
from collections import OrderedDict
from typing import Any, Final

import torch

from trajtrack.tracker._archive import REBUILD_V2, REBUILD_V3, V2_STORAGES

__all__ = ["DECLINED", "fast_load"]

DECLINED: Final = object()
"""What :func:`fast_load` returns for what it does not load (``torch.load`` must)."""

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
_LITTLE: Final = sys.byteorder == "little"
_CONSTANT_RECORDS: Final = {  # as torch.save (and trajtrack's writer) write them
    ".format_version": b"1",
    ".storage_alignment": b"64",
    "byteorder": b"little",
    "version": b"3\n",
}
_SERIALIZATION_ID: Final = ".data/serialization_id"
_FLAGS: Final = 0x0808  # the flags allowed: UTF-8 names (11), sizes after the data (3)
_DOS_DIRECTORY: Final = 0x10


class _Declined(Exception):
    """Not for this loader: ``torch.load`` decides."""


def fast_load(data: bytes, *, build: bool = True) -> Any:
    """The object in torch archive *data*, or :data:`DECLINED` (blocking; thread-safe).

    Args:
        data: The bytes of a ``torch.save`` archive.
        build: Build the tensors (false: only check that the archive would load here; the
            return value is then ``None`` or :data:`DECLINED`).
    """
    try:
        return _load(data, build)
    except (_Declined, pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError):
        return DECLINED
    except (RuntimeError, AttributeError, IndexError, OverflowError, MemoryError):
        return DECLINED  # e.g. RecursionError (deep nesting), torch's bounds checks, a length
        # in a damaged pickle too large to allocate


def _load(data: bytes, build: bool) -> Any:
    if not _LITTLE:
        raise _Declined
    records = _records(data)
    limit = _END.unpack_from(data, len(data) - _END.size)[6]  # the central directory's start
    prefix = next(iter(records)).partition("/")[0] + "/"
    _check_records(data, records, prefix, limit)
    pickled = _member(data, records, prefix + "data.pkl", limit)
    _check_opcodes(pickled)
    unpickler = _Unpickler(io.BytesIO(pickled))
    unpickler.data, unpickler.records, unpickler.prefix = data, records, prefix + "data/"
    unpickler.limit = limit
    unpickler.storages, unpickler.tensors = {}, 0
    obj = unpickler.load()
    if not build:
        return None
    if not unpickler.tensors:
        return obj
    return _Resolver(data).resolve(obj)


def _check_records(
    data: bytes, records: dict[str, tuple[int, int]], prefix: str, limit: int
) -> None:
    """Decline unless the archive holds exactly the records ``torch.save`` writes, the
    constant ones with the values it writes (torch's reader checks some of them: anything
    else may be an archive it refuses)."""
    names = iter(records)
    if next(names) != prefix + "data.pkl":
        raise _Declined
    for name in names:
        tail = name[len(prefix) :]
        if not name.startswith(prefix) or (
            tail not in _CONSTANT_RECORDS
            and tail != _SERIALIZATION_ID
            and not (tail.startswith("data/") and tail[5:].isdigit() and tail[5:].isascii())
        ):
            raise _Declined
    for tail, value in _CONSTANT_RECORDS.items():
        if _member(data, records, prefix + tail, limit) != value:
            raise _Declined
    identifier = _member(data, records, prefix + _SERIALIZATION_ID, limit)
    if not (identifier.isdigit() and identifier.isascii()):
        raise _Declined


def _check_opcodes(pickled: bytes) -> None:
    """Decline a pickle with an opcode torch's weights-only unpickler does not implement, or
    a memo index beyond its length: the C unpickler sizes its memo by the largest index, so
    one ``LONG_BINPUT`` could make it allocate gigabytes (torch's keeps a dict)."""
    size = len(pickled)
    at = 0
    while at < size:
        opcode = pickled[at]
        if opcode in _ONE_BYTE_ARG:  # the most common ones first (BINPUT after every object)
            at += 2
            continue
        arg = _ARGS.get(opcode)
        if arg is None:
            raise _Declined
        at += 1
        if arg == _NO_ARG:
            if opcode == _STOP:
                return
        elif arg == _LINES:  # GLOBAL: module and name, each up to a newline
            at = pickled.index(b"\n", pickled.index(b"\n", at) + 1) + 1
        elif arg < 0:  # a length of -arg bytes, then that many bytes
            at += -arg + int.from_bytes(pickled[at : at - arg], "little")
        else:
            if opcode in _MEMO and int.from_bytes(pickled[at : at + arg], "little") > size:
                raise _Declined
            at += arg
    raise _Declined  # no STOP


def _records(data: bytes) -> dict[str, tuple[int, int]]:
    """``name -> (local header offset, length)`` of each record of the zip archive *data*."""
    end = len(data) - _END.size
    if end < 0:
        raise _Declined
    signature, disk, cd_disk, on_disk, total, cd_size, cd_offset, comment = _END.unpack_from(
        data, end
    )
    if signature != _END_SIGNATURE or comment or disk or cd_disk or on_disk != total:
        raise _Declined
    cd_end = cd_offset + cd_size
    if not total or cd_end > end or cd_size < total * _CENTRAL_SIZE:
        raise _Declined
    _check_zip64_end(data, end, total, cd_size, cd_offset)
    records: dict[str, tuple[int, int]] = {}
    position = cd_offset
    unpack, fixed = _CENTRAL.unpack_from, _CENTRAL.size
    for _ in range(total):
        if position + fixed > cd_end:
            raise _Declined
        fields = unpack(data, position)
        signature, flags, method, packed, size, name_len, extra_len, comment_len = fields[:8]
        start_disk, external, local = fields[8], fields[10], fields[11]
        if signature != _CENTRAL_SIGNATURE or method or flags & ~_FLAGS or packed != size:
            raise _Declined  # compressed, encrypted, or sizes in a zip64 field
        if start_disk or extra_len or comment_len or external & _DOS_DIRECTORY:
            raise _Declined  # a record marked as a directory: zip readers take it for one
        name = data[position + fixed : position + fixed + name_len]
        position += fixed + name_len + extra_len + comment_len
        key = name.decode()
        if local >= cd_offset or key in records:
            raise _Declined  # a record twice: which one torch's reader would take is not ours
        records[key] = (local, size)
    if len({key.lower() for key in records}) != len(records):
        raise _Declined  # names that differ in case only (zip readers may match either)
    return records


def _check_zip64_end(data: bytes, end: int, total: int, cd_size: int, cd_offset: int) -> None:
    """Decline unless the zip64 end records, if any (torch's writer always adds them, and
    torch's reader then takes the directory's place from them), say what the classic one
    says, for one disk."""
    at = end - _ZIP64_LOCATOR.size
    if at < 0 or _ZIP64_LOCATOR.unpack_from(data, at)[0] != _ZIP64_LOCATOR_SIGNATURE:
        return
    _, record_disk, record_offset, disks = _ZIP64_LOCATOR.unpack_from(data, at)
    if record_disk or disks != 1 or record_offset + _ZIP64_END.size > at:
        raise _Declined
    fields = _ZIP64_END.unpack_from(data, record_offset)
    signature, record_size, this_disk, cd_disk, on_disk, entries, size, offset = fields
    if signature != _ZIP64_END_SIGNATURE or record_size < _ZIP64_END.size - 12:
        raise _Declined
    if (
        this_disk
        or cd_disk
        or (on_disk, entries, size, offset) != (total, total, cd_size, cd_offset)
    ):
        raise _Declined


def _member_start(data: bytes, local: int, size: int, limit: int) -> int:
    """Where the data of the record whose local header is at *local* starts."""
    if local + _LOCAL.size > limit:
        raise _Declined
    signature, flags, method, name_len, extra_len = _LOCAL.unpack_from(data, local)
    if signature != _LOCAL_SIGNATURE or method or flags & ~_FLAGS:
        raise _Declined
    start: int = local + _LOCAL.size + name_len + extra_len
    if start + size > limit:
        raise _Declined
    return start


def _member(data: bytes, records: dict[str, tuple[int, int]], name: str, limit: int) -> bytes:
    found = records.get(name)
    if found is None:
        raise _Declined
    local, size = found
    start = _member_start(data, local, size, limit)
    return data[start : start + size]


class _StorageType:
    """A typed storage class named in a pickle (never the class itself): its dtype."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype  # None: torch.UntypedStorage (bytes; the tensor names its dtype)


class _StorageRecord:
    """One storage record of the archive: where its bytes are, and as which dtype."""

    __slots__ = ("dtype", "length", "start")

    def __init__(self, dtype: torch.dtype | None, start: int, length: int) -> None:
        self.dtype, self.start, self.length = dtype, start, length


class _TensorRef(tuple):  # type: ignore[type-arg]
    """A tensor still to build: ``(dtype, offset, requires_grad, size, storage, stride)``.

    Inert to every pickle opcode: a tuple (no item assignment, no ``append``) with no
    ``__dict__`` and no ``__setstate__``, so ``BUILD`` fails on it. Equal and hashed by
    identity, as tensors are: two equal views stay two keys of a dict.
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    __hash__ = object.__hash__


class _Unpickler(pickle.Unpickler):
    """The C unpickler, restricted to :data:`_GLOBALS`; storages resolved from the archive."""

    data: bytes
    records: dict[str, tuple[int, int]]
    prefix: str
    limit: int
    storages: dict[str, _StorageRecord]
    tensors: int

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise _Declined
        if found is _rebuild_v2 or found is _rebuild_v3:
            self.tensors += 1
        return found

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage":
            raise _Declined
        _, kind, key, location, numel = pid
        if type(kind) is not _StorageType or type(key) is not str or type(location) is not str:
            raise _Declined
        if type(numel) is not int or numel < 0:
            raise _Declined
        itemsize = 1 if kind.dtype is None else kind.dtype.itemsize
        known = self.storages.get(key)
        if known is not None:
            if known.dtype is not kind.dtype or known.length != numel * itemsize:
                raise _Declined
            return known
        found = self.records.get(self.prefix + key)
        if found is None or found[1] != numel * itemsize:
            raise _Declined
        start = _member_start(self.data, found[0], found[1], self.limit)
        record = self.storages[key] = _StorageRecord(kind.dtype, start, found[1])
        return record


def _checked_geometry(offset: Any, size: Any, stride: Any, requires_grad: Any) -> None:
    if type(offset) is not int or type(requires_grad) is not bool:
        raise _Declined
    if type(size) is not tuple or type(stride) is not tuple or len(size) != len(stride):
        raise _Declined
    if not _INTS.issuperset(map(type, size)) or not _INTS.issuperset(map(type, stride)):
        raise _Declined


_INTS: Final = frozenset({int})


def _checked_extras(hooks: Any, metadata: Any) -> None:
    if type(hooks) is not OrderedDict or hooks or hooks.__dict__:
        raise _Declined  # backward hooks are never saved; a non-empty dict is not torch's
    if metadata is not None and (type(metadata) is not dict or metadata):
        raise _Declined  # neg / conj bits: torch's loader sets them


def _rebuild_v2(
    storage: Any,
    offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    metadata: Any = None,
) -> _TensorRef:
    if type(storage) is not _StorageRecord or storage.dtype is None:
        raise _Declined
    _checked_geometry(offset, size, stride, requires_grad)
    _checked_extras(hooks, metadata)
    return _TensorRef((storage.dtype, offset, requires_grad, size, storage, stride))


def _rebuild_v3(
    storage: Any,
    offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> _TensorRef:
    if type(storage) is not _StorageRecord or storage.dtype is not None:
        raise _Declined
    if type(dtype) is not torch.dtype:
        raise _Declined
    _checked_geometry(offset, size, stride, requires_grad)
    _checked_extras(hooks, metadata)
    return _TensorRef((dtype, offset, requires_grad, size, storage, stride))


def _encode(text: Any, encoding: Any) -> bytes:
    """``bytes`` as pickle protocol 2 writes them: ``_codecs.encode(text, "latin1")``."""
    if type(text) is not str or encoding != "latin1":
        raise _Declined
    return text.encode("latin1")


def _globals() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): OrderedDict,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("_codecs", "encode"): _encode,
    }
    for builtin in (set, complex):
        for module in ("builtins", "__builtin__"):  # protocol 2 writes Python 2's name
            table[(module, builtin.__name__)] = builtin
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            table[("torch", str(value).removeprefix("torch."))] = value
    for dtype, storage_class in V2_STORAGES.items():
        table[(storage_class.__module__, storage_class.__name__)] = _StorageType(dtype)
    untyped = torch.UntypedStorage
    table[(untyped.__module__, untyped.__name__)] = _StorageType(None)
    for rebuild, handler in ((REBUILD_V2, _rebuild_v2), (REBUILD_V3, _rebuild_v3)):
        if rebuild is not None:
            table[(rebuild.__module__, rebuild.__name__)] = handler
    return table


_GLOBALS: Final = _globals()
_ATOMS: Final = frozenset(
    {str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size}
)
_IN_PROGRESS: Final = object()

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


class _Resolver:
    """Replaces each :class:`_TensorRef` in an unpickled object by its tensor."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.memo: dict[int, Any] = {}
        self.storages: dict[int, torch.UntypedStorage] = {}

    def resolve(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _ATOMS:
            return obj
        known = self.memo.get(id(obj))
        if known is not None:
            if known is _IN_PROGRESS:
                raise _Declined  # a cycle through a tuple or frozenset
            return known
        if kind is _TensorRef:
            tensor = self.memo[id(obj)] = self._tensor(obj)
            return tensor
        if kind is list:
            self.memo[id(obj)] = obj
            obj[:] = [self.resolve(item) for item in obj]
            return obj
        if kind is dict or kind is OrderedDict:
            return self._mapping(obj)
        if kind is tuple or kind is frozenset:
            self.memo[id(obj)] = _IN_PROGRESS
            made = kind(self.resolve(item) for item in obj)
            self.memo[id(obj)] = made
            return made
        if kind is set:
            self.memo[id(obj)] = obj
            items = [self.resolve(item) for item in obj]
            obj.clear()
            obj.update(items)
            return obj
        raise _Declined

    def _mapping(self, obj: dict[Any, Any]) -> dict[Any, Any]:
        if type(obj) is OrderedDict and obj.__dict__:
            raise _Declined  # attributes set by BUILD: torch keeps them; rare enough to decline
        self.memo[id(obj)] = obj
        items = [(self.resolve(key), self.resolve(value)) for key, value in obj.items()]
        obj.clear()
        obj.update(items)
        return obj

    def _tensor(self, ref: _TensorRef) -> torch.Tensor:
        dtype, offset, requires_grad, size, record, stride = ref
        storage = self.storages.get(id(record))
        if storage is None:
            if record.length:
                raw = bytearray(self.data[record.start : record.start + record.length])
                storage = torch.frombuffer(raw, dtype=torch.uint8).untyped_storage()
            else:
                storage = torch.empty(0, dtype=torch.uint8).untyped_storage()
            self.storages[id(record)] = storage
        tensor = torch.empty((0,), dtype=dtype)
        tensor.set_(storage, offset, size, stride)
        if requires_grad:
            tensor.requires_grad_(True)
        return tensor
