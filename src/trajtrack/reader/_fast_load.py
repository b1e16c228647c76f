"""The fast path of the safe loader: torch's decision, for what it is sure of, without torch.load.

``torch.load(weights_only=True)`` runs a pure-Python unpickler (one ``read`` per opcode byte):
several times the cost of the C unpickler, per dump. This module loads torch's zip archive of
plain CPU tensors in containers and scalars, and trajtrack's own rollout records, with Python's
C unpickler, and *declines* (:data:`DECLINED`) everything it is not sure torch would load the
same way; that then goes to ``torch.load(weights_only=True)``. It is an accelerator in front
of torch's loader, never a second opinion. How it knows, with public, documented APIs only:

* **The zip container** is parsed by :mod:`trajtrack.reader._torch_archive` from its end records
  and central directory (``struct``, every offset and size bounds-checked). Only the layout
  ``torch.save`` writes is taken (exactly its records, stored, one disk, no record marked a
  directory, no names differing in case only).
* **The pickle's opcodes** are scanned first: only those torch's weights-only unpickler
  implements, no ``BUILD`` (it sets attributes on whatever it is handed; ``torch.save`` writes
  none for this data), no memo index beyond the pickle's length.
* **The unpickler** is restricted as the :mod:`pickle` documentation describes ("Restricting
  Globals"): :meth:`pickle.Unpickler.find_class` answers from a fixed table of immutable values
  (torch's dtypes, ``torch.Size``, ``torch.device``, ``OrderedDict``, ``set``, ``complex``,
  bytes as protocol 2 writes them) and, for calls, hands out handlers made for this one load
  (torch's two tensor rebuilds, trajtrack's record rebuilds): nothing a pickle can reach is
  shared between loads. The tensor handlers check the storage record, dtype and geometry
  (every element inside the record's bytes) and build the tensor from a private copy of them.
* **Agreement by construction**: after unpickling, the object graph is pickled again by the
  same C pickler (protocol 2, as ``torch.save``), each object a handler built reduced to the
  very call that built it, each storage to its persistent id. The load is accepted only if
  that reproduces ``data.pkl`` byte for byte. A pickle is then the canonical serialization
  of calls of allow-listed functions over plain data, written with only the opcodes a pickler
  emits: torch's unpickler executes the same calls on the same arguments. Everything else
  (an item assignment into a list, a bare persistent id, a global stored as a value where
  torch refuses it, a tensor built and dropped, shared references a pickler would not write)
  differs from its re-pickling and is declined. Which operations the two unpicklers perform,
  on which types, depends only on the pickle's *skeleton* (its opcodes, memo indices, lengths
  and ``GLOBAL`` lines; :class:`~trajtrack.reader._torch_archive.Skeleton`), not on its
  numbers and strings, which both decode alike: so a pickle of a skeleton already found
  canonical needs no re-pickling (a run's dumps mostly share a few skeletons).
* **Every storage reference is a call's argument**: each persistent id the pickle loads is
  consumed by exactly one tensor rebuild (a canonical pickle never memoizes one).

Whatever fails on the way (a malformed archive, a name outside the table, a storage of the
wrong length, nesting deeper than Python's recursion limit) declines; torch's loader then
gives the authoritative answer, its refusal included. ``tests/reader/test_load_agreement.py``
checks the agreement on mutated archives (bit flips, truncations, opcode swaps, record edits).
"""

from __future__ import annotations

import io
import pickle
import sys
from collections import OrderedDict
from typing import Any, Final, NamedTuple

import torch

from trajtrack.layouts.torch_format import PROTOCOL, REBUILD_V2, REBUILD_V3, V2_STORAGES
from trajtrack.reader._remembered import Remembered
from trajtrack.reader._torch_archive import (
    Declined,
    archive_pickle,
    archive_records,
    check_opcodes,
    member,
    member_start,
    scan_opcodes,
)
from trajtrack.rollout import RECORD_REBUILDS as REBUILDS

__all__ = [
    "ATOMS",
    "DECLINED",
    "DECLINES",
    "Records",
    "StorageRecord",
    "TensorRef",
    "Unpickled",
    "archive_data_pickle",
    "fast_load",
    "only_default_globals",
    "storage_start",
    "unpickled",
]

DECLINED: Final = object()
"""What :func:`fast_load` returns for what it does not load (``torch.load`` must)."""


_LITTLE: Final = sys.byteorder == "little"


def fast_load(data: bytes) -> Any:
    """The object in torch archive *data*, or :data:`DECLINED` (blocking; thread-safe)."""
    try:
        return unpickled(data, build=True).obj
    except DECLINES:
        return DECLINED


def only_default_globals(data: bytes) -> bool:
    """Whether torch archive *data* is one whose pickle names only globals of the table that
    torch's default weights-only list has: a scan of its opcodes, nothing unpickled or built.

    ``False`` says nothing (a name outside the table, an opcode outside torch's set, an
    archive this module does not parse): torch's own static check must then decide. ``diff``
    asks it of byte-identical pairs, which need no loading, only the refusal a load would
    give.

    An archive equal to one already answered in every byte the answer read (its directory and
    headers but their CRC-32s, the pickle's opcodes, lengths and global names, not its numbers
    and the tensors' data) takes that answer (:data:`_ANSWERS`): a run's dumps rarely differ
    in those bytes.
    """
    if not _LITTLE:
        return False
    known = _ANSWERS.match(data)
    if known is not None:
        return known
    kept = None if _ANSWERS.full else bytearray(len(data))
    try:
        start, end = archive_pickle(data, kept)
        names = scan_opcodes(data[start:end], None if kept is None else memoryview(kept)[start:end])
    except DECLINES:
        return False
    answer = _GLOBAL_LINES.issuperset(names)
    if kept is not None:
        _ANSWERS.add(data, kept, answer)
    return answer


_ANSWERS: Final[Remembered[bool]] = Remembered()
""":func:`only_default_globals`' answers by the bytes they read (what :func:`archive_pickle`
and :func:`scan_opcodes` mark)."""


class Unpickled(NamedTuple):
    """A torch archive unpickled by :func:`unpickled`.

    Attributes:
        obj: The object (tensors built, or each still a :class:`TensorRef`).
        pickle: The archive's pickle (``data.pkl``).
        tensors: How many tensors the pickle names.
        storages: Each storage record by its key in the archive (``data/<key>``).
    """

    obj: Any
    pickle: bytes
    tensors: int
    storages: dict[str, StorageRecord]


def unpickled(data: bytes, *, build: bool = False) -> Unpickled:
    """Torch archive *data*'s object, checked as the module says (blocking; raises
    :class:`Declined` and the errors of :data:`DECLINES` for what the fast path declines).

    Args:
        data: The archive's bytes.
        build: Build the tensors (and trajtrack's records); otherwise each tensor stays an
            inert :class:`TensorRef` (no memory of its own) and records are declined.
    """
    pickled, records = archive_data_pickle(data)
    skeleton = check_opcodes(pickled)
    unpickler = _Unpickler(io.BytesIO(pickled))
    unpickler.data, unpickler.records, unpickler.build = data, records, build
    unpickler.storages, unpickler.made, unpickler.storage_loads = {}, {}, 0
    unpickler.memory = {}
    obj = unpickler.load()
    tensors = sum(1 for fn, _, _ in unpickler.made.values() if fn in _TENSOR_REBUILDS)
    if tensors != unpickler.storage_loads:
        raise Declined  # a storage loaded and not given to exactly one tensor
    if not skeleton.canonical:
        if _repickled(obj, unpickler.made) != pickled:
            raise Declined  # not what a pickler writes for what was built: torch decides
        skeleton.canonical = True  # for every pickle of this skeleton (see the module)
    return Unpickled(obj, pickled, tensors, unpickler.storages)


Records = tuple[dict[str, tuple[int, int]], str, int]  # archive_records(): by name, folder, limit


def archive_data_pickle(data: bytes) -> tuple[bytes, Records]:
    """Torch archive *data*'s pickle (``<folder>/data.pkl``) and its records (raises as
    :func:`unpickled` does)."""
    if not _LITTLE:
        raise Declined
    records = archive_records(data)
    _, prefix, limit = records
    return member(data, records[0], prefix + "data.pkl", limit), records


def storage_start(data: bytes, records: Records, key: str, length: int) -> int:
    """Where storage *key* of *length* bytes starts in archive *data* (declined unless its
    record has exactly that length)."""
    by_name, prefix, limit = records
    found = by_name.get(prefix + "data/" + key)
    if found is None or found[1] != length:
        raise Declined
    return member_start(data, found[0], found[1], limit)


DECLINES: Final = (
    Declined,
    pickle.PickleError,  # UnpicklingError, and PicklingError from the second pickling
    EOFError,
    ValueError,  # UnicodeDecodeError included
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    OverflowError,
    RuntimeError,  # RecursionError (deep nesting), torch's bounds checks
    MemoryError,  # a length in a damaged pickle too large to allocate
)


class _StorageType(NamedTuple):
    """A typed storage class named in a pickle (immutable; never the class's own object)."""

    dtype: torch.dtype | None  # None: torch.UntypedStorage (the tensor names its dtype)
    cls: Any  # the class, only to be named again when the pickle is checked


class StorageRecord(NamedTuple):
    """One storage record of the archive (immutable): its key (``data/<key>``), as which
    dtype, where its bytes are, and the persistent id that named it."""

    key: str
    dtype: torch.dtype | None
    start: int
    length: int
    pid: tuple[Any, ...]  # as loaded, the storage class in place of its table entry


class TensorRef(tuple):  # type: ignore[type-arg]
    """A tensor not built: ``(dtype, offset, requires_grad, size, storage, stride)``.

    Equal and hashed by identity, as tensors are: two equal views stay two keys of a dict.
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    __hash__ = object.__hash__


class _Handler(NamedTuple):
    """A table entry for a global the pickle calls: the real function and what it builds."""

    real: Any  # the function the global names (only called for trajtrack's records)
    kind: str  # "v2", "v3" (a tensor), "record" (a rollout record), "bytes"


class _Call:
    """The callable :meth:`_Unpickler.find_class` hands out for a :class:`_Handler`: made for
    one load, so that nothing a pickle can reach is shared between loads."""

    __slots__ = ("handler", "load")

    def __init__(self, load: _Unpickler, handler: _Handler) -> None:
        self.load, self.handler = load, handler

    def __call__(self, *args: Any) -> Any:
        return self.load.call(self.handler, args)


class _Unpickler(pickle.Unpickler):
    """The C unpickler, restricted to :data:`_GLOBALS`; storages resolved from the archive."""

    data: bytes
    records: Records
    build: bool
    storages: dict[str, StorageRecord]
    made: dict[int, tuple[Any, tuple[Any, ...], Any]]  # id -> (function, args, the object)
    storage_loads: int
    memory: dict[str, torch.UntypedStorage]  # the storages built, by key

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise Declined
        return _Call(self, found) if type(found) is _Handler else found

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage":
            raise Declined
        tag, kind, key, location, numel = pid
        if type(kind) is not _StorageType or type(key) is not str or type(location) is not str:
            raise Declined
        if type(numel) is not int or numel < 0 or type(tag) is not str:
            raise Declined
        self.storage_loads += 1
        itemsize = 1 if kind.dtype is None else kind.dtype.itemsize
        known = self.storages.get(key)
        if known is not None:
            if known.dtype is not kind.dtype or known.length != numel * itemsize:
                raise Declined
            return known
        length = numel * itemsize
        start = storage_start(self.data, self.records, key, length)
        record = StorageRecord(
            key, kind.dtype, start, length, (tag, kind.cls, key, location, numel)
        )
        self.storages[key] = record
        return record

    def call(self, handler: _Handler, args: tuple[Any, ...]) -> Any:
        """What the pickle's call of *handler*'s global gives (recorded for the check)."""
        if handler.kind == "bytes":
            return _encode(*args)
        if handler.kind == "record":
            if not self.build:
                raise Declined
            obj = handler.real(*args)
        else:
            obj = self._tensor(*_tensor_args(handler.kind, args))
        self.made[id(obj)] = (handler.real, args, obj)
        return obj

    def _tensor(
        self, record: StorageRecord, dtype: torch.dtype, geometry: tuple[Any, ...]
    ) -> torch.Tensor | TensorRef:
        offset, size, stride, requires_grad = geometry
        if not self.build:
            return TensorRef((dtype, offset, requires_grad, size, record, stride))
        storage = self.memory.get(record.key)
        if storage is None and record.length and not record.length % dtype.itemsize:
            # The storage as a tensor of the tensor's dtype (one call), then set_ only where
            # the tensor is not all of its storage, row-major (a view, a slice).
            tensor = torch.frombuffer(self._bytes(record), dtype=dtype)
            storage = self.memory[record.key] = tensor.untyped_storage()
            if offset or tensor.shape != size or tensor.stride() != stride:
                tensor.set_(storage, offset, size, stride)
        else:
            if storage is None:
                storage = self.memory[record.key] = (
                    torch.frombuffer(self._bytes(record), dtype=torch.uint8).untyped_storage()
                    if record.length
                    else torch.empty(0, dtype=torch.uint8).untyped_storage()
                )
            tensor = torch.empty((0,), dtype=dtype)
            tensor.set_(storage, offset, size, stride)
        if requires_grad:
            tensor.requires_grad_(True)
        return tensor

    def _bytes(self, record: StorageRecord) -> bytearray:
        """A private, writable copy of *record*'s bytes (the tensors' memory)."""
        return bytearray(self.data[record.start : record.start + record.length])


def _tensor_args(
    kind: str, args: tuple[Any, ...]
) -> tuple[StorageRecord, torch.dtype, tuple[Any, ...]]:
    """``(record, dtype, (offset, size, stride, requires_grad))`` of a tensor rebuild's
    arguments, checked: v2 ``(storage, offset, size, stride, requires_grad, hooks[,
    metadata])`` over a typed storage, v3 the same with the dtype before the metadata, over
    an untyped one; every element inside the storage record's bytes."""
    v3 = kind == "v3"
    if len(args) not in ((7, 8) if v3 else (6, 7)) or type(args[0]) is not StorageRecord:
        raise Declined
    record, offset, size, stride, requires_grad, hooks = args[:6]
    dtype = args[6] if v3 else record.dtype
    if type(dtype) is not torch.dtype or (record.dtype is None) is not v3:
        raise Declined
    metadata = args[-1] if len(args) == (8 if v3 else 7) else None
    if type(hooks) is not OrderedDict or hooks or (metadata is not None and metadata != {}):
        raise Declined  # backward hooks are never saved; neg / conj bits: torch's loader
    if type(offset) is not int or type(requires_grad) is not bool:
        raise Declined
    if type(size) is not tuple or type(stride) is not tuple or len(size) != len(stride):
        raise Declined
    if not _INTS.issuperset(map(type, size)) or not _INTS.issuperset(map(type, stride)):
        raise Declined
    if offset < 0 or min(size, default=0) < 0 or min(stride, default=0) < 0:
        raise Declined
    last = 0 if 0 in size else 1 + sum((n - 1) * step for n, step in zip(size, stride, strict=True))
    if (offset + last) * dtype.itemsize > record.length:
        raise Declined  # torch refuses it (its storages are not resizable): its message
    return record, dtype, (offset, size, stride, requires_grad)


_INTS: Final = frozenset({int})


def _encode(*args: Any) -> bytes:
    """``bytes`` as pickle protocol 2 writes them: ``_codecs.encode(text, "latin1")``."""
    if len(args) != 2 or type(args[0]) is not str or args[1] != "latin1":
        raise Declined
    return args[0].encode("latin1")


class _Repickler(pickle.Pickler):
    """The C pickler as ``torch.save`` runs it, each built object reduced to its call."""

    made: dict[int, tuple[Any, tuple[Any, ...], Any]]

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is StorageRecord:
            tag, cls, key, location, numel = obj.pid
            return (tag, cls, key, location, numel)  # a fresh tuple each time, as torch's
        return None

    def reducer_override(self, obj: Any) -> Any:
        made = self.made.get(id(obj))
        if made is not None:
            return made[0], made[1]
        if type(obj) is OrderedDict:
            # What OrderedDict.__reduce__ gives one without attributes (no BUILD: none has
            # any here), without its per-call lookup of slot names (every tensor has one).
            return OrderedDict, (), None, None, iter(obj.items())
        if type(obj) in _NEVER_PICKLED:
            raise Declined  # something of this module's own, left where the pickle put it
        return NotImplemented


def _repickled(obj: Any, made: dict[int, tuple[Any, tuple[Any, ...], Any]]) -> bytes:
    buffer = io.BytesIO()
    pickler = _Repickler(buffer, PROTOCOL)
    pickler.made = made
    pickler.dump(obj)
    return buffer.getvalue()


def _globals() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): OrderedDict,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("_codecs", "encode"): _Handler(None, "bytes"),
    }
    for builtin in (set, complex):
        for module in ("builtins", "__builtin__"):  # protocol 2 writes Python 2's name
            table[(module, builtin.__name__)] = builtin
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            table[("torch", str(value).removeprefix("torch."))] = value
    for dtype, storage_class in V2_STORAGES.items():
        table[(storage_class.__module__, storage_class.__name__)] = _StorageType(
            dtype, storage_class
        )
    untyped = torch.UntypedStorage
    table[(untyped.__module__, untyped.__name__)] = _StorageType(None, untyped)
    for rebuild, kind in ((REBUILD_V2, "v2"), (REBUILD_V3, "v3")):
        if rebuild is not None:
            table[(rebuild.__module__, rebuild.__name__)] = _Handler(rebuild, kind)
    return table


def _record_globals() -> dict[tuple[str, str], _Handler]:
    return {(fn.__module__, fn.__qualname__): _Handler(fn, "record") for fn in REBUILDS}


_DEFAULT_GLOBALS: Final = _globals()  # all on torch's default weights-only list
_GLOBALS: Final = {**_DEFAULT_GLOBALS, **_record_globals()}
_GLOBAL_LINES: Final = frozenset(
    f"{module}\n{name}\n".encode() for module, name in _DEFAULT_GLOBALS
)
_TENSOR_REBUILDS: Final = frozenset(r for r in (REBUILD_V2, REBUILD_V3) if r is not None)
_NEVER_PICKLED: Final = frozenset({torch.Tensor, TensorRef, _Call, _StorageType, _Handler})
ATOMS: Final = frozenset(
    {str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size}
)
