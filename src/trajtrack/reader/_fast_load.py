"""Loading plain tensor dumps without ``torch.load``'s per-call cost; anything else is declined.

``torch.load(weights_only=True)`` of a 4 KB dump costs ~340 us here, ~200 us of it in torch's
pure-Python restricted unpickler (one ``read`` per opcode byte); a diff of two runs of small
dumps is that per dump. This module loads the common case, torch's zip archive of plain CPU
tensors in containers and scalars, in ~20 us, and *declines* (:data:`DECLINED`) everything else,
which then goes to ``torch.load(weights_only=True)`` as before. It is an accelerator in front of
torch's loader, never a second opinion: what it accepts uses only globals of torch's default
weights-only allow-list, and it builds the objects torch builds.

How, with public, documented APIs only:

* **The zip container** is parsed by :mod:`trajtrack.reader._torch_archive` from its end records
  and central directory (``struct``, every offset and size bounds-checked). Only the layout
  ``torch.save`` writes is taken: exactly its records (``data.pkl`` first, the constant ones
  with the values it writes: ``byteorder`` ``little`` on a little-endian machine, ``version``
  3...), stored uncompressed, one disk, zip64 end records agreeing with the classic one, no
  record marked a directory, no names differing in case only. Anything else declines: torch's
  own reader refuses some of it, and which of two records it would take is not this module's to
  guess.
* **The pickle's opcodes** are scanned first, by the same module: only those torch's
  weights-only unpickler implements (protocol 2's subset), and no memo index beyond the
  pickle's length (the C unpickler sizes its memo by the largest index: one ``LONG_BINPUT``
  could make it allocate gigabytes; torch's keeps a dict).
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
  and return an inert record (:class:`TensorRef`: no ``__setstate__``, no item assignment,
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
import sys
from collections import OrderedDict
from typing import Any, Final, NamedTuple

import torch

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
from trajtrack.tracker._archive import REBUILD_V2, REBUILD_V3, V2_STORAGES

__all__ = [
    "ATOMS",
    "DECLINED",
    "DECLINES",
    "StorageRecord",
    "Records",
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
        return _load(data)
    except DECLINES:
        return DECLINED


def only_default_globals(data: bytes) -> bool:
    """Whether torch archive *data* is one whose pickle names only globals of the table (all
    on torch's default weights-only list): a scan of its opcodes, nothing unpickled or built.

    ``False`` says nothing (a name outside the table, an opcode outside torch's set, an
    archive this module does not parse): torch's own static check must then decide. ``diff``
    asks it of byte-identical pairs, which need no loading, only the refusal a load would
    give.

    An archive equal to one already answered in every byte the answer read (its directory and
    headers but their CRC-32s, the pickle's opcodes, lengths and global names, not its numbers
    and the tensors' data) takes that answer (:data:`_ANSWERS`): a run's dumps rarely differ
    in those bytes (1.1 instead of 3.1 us for a 4 KB dump).
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


def _load(data: bytes) -> Any:
    found = unpickled(data)
    if not found.tensors:
        return found.obj
    return _Resolver(data).resolve(found.obj)


class Unpickled(NamedTuple):
    """A torch archive unpickled by :func:`unpickled`.

    Attributes:
        obj: The object, each tensor still a :class:`TensorRef`.
        pickle: The archive's pickle (``data.pkl``).
        tensors: How many tensors the pickle names.
        storages: Each storage record by its key in the archive (``data/<key>``).
    """

    obj: Any
    pickle: bytes
    tensors: int
    storages: dict[str, StorageRecord]


def unpickled(data: bytes) -> Unpickled:
    """Torch archive *data*'s object with each tensor still a :class:`TensorRef` (blocking;
    raises :class:`Declined` and the errors of :data:`DECLINES` for what the fast loader
    declines)."""
    pickled, (records, prefix, limit) = archive_data_pickle(data)
    check_opcodes(pickled)
    unpickler = _Unpickler(io.BytesIO(pickled))
    unpickler.data, unpickler.records = data, (records, prefix, limit)
    unpickler.storages, unpickler.tensors = {}, 0
    obj = unpickler.load()
    return Unpickled(obj, pickled, unpickler.tensors, unpickler.storages)


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
    pickle.UnpicklingError,
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


class _StorageType:
    """A typed storage class named in a pickle (never the class itself): its dtype."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype  # None: torch.UntypedStorage (bytes; the tensor names its dtype)


class StorageRecord:
    """One storage record of the archive: its key (``data/<key>``), where its bytes are, and
    as which dtype."""

    __slots__ = ("dtype", "key", "length", "start")

    def __init__(self, key: str, dtype: torch.dtype | None, start: int, length: int) -> None:
        self.key, self.dtype, self.start, self.length = key, dtype, start, length


class TensorRef(tuple):  # type: ignore[type-arg]
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
    records: Records
    storages: dict[str, StorageRecord]
    tensors: int

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise Declined
        if found is _rebuild_v2 or found is _rebuild_v3:
            self.tensors += 1
        return found

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage":
            raise Declined
        _, kind, key, location, numel = pid
        if type(kind) is not _StorageType or type(key) is not str or type(location) is not str:
            raise Declined
        if type(numel) is not int or numel < 0:
            raise Declined
        itemsize = 1 if kind.dtype is None else kind.dtype.itemsize
        known = self.storages.get(key)
        if known is not None:
            if known.dtype is not kind.dtype or known.length != numel * itemsize:
                raise Declined
            return known
        length = numel * itemsize
        start = storage_start(self.data, self.records, key, length)
        record = self.storages[key] = StorageRecord(key, kind.dtype, start, length)
        return record


def _checked_geometry(offset: Any, size: Any, stride: Any, requires_grad: Any) -> None:
    if type(offset) is not int or type(requires_grad) is not bool:
        raise Declined
    if type(size) is not tuple or type(stride) is not tuple or len(size) != len(stride):
        raise Declined
    if not _INTS.issuperset(map(type, size)) or not _INTS.issuperset(map(type, stride)):
        raise Declined


_INTS: Final = frozenset({int})


def _checked_extras(hooks: Any, metadata: Any) -> None:
    if type(hooks) is not OrderedDict or hooks or hooks.__dict__:
        raise Declined  # backward hooks are never saved; a non-empty dict is not torch's
    if metadata is not None and (type(metadata) is not dict or metadata):
        raise Declined  # neg / conj bits: torch's loader sets them


def _rebuild_v2(*args: Any) -> TensorRef:
    """torch's rebuild over a typed storage: ``(storage, offset, size, stride, requires_grad,
    hooks[, metadata])``."""
    if len(args) not in (6, 7) or type(args[0]) is not StorageRecord or args[0].dtype is None:
        raise Declined
    return _ref(args[0].dtype, args[:6], args[6] if len(args) == 7 else None)


def _rebuild_v3(*args: Any) -> TensorRef:
    """torch's rebuild over an untyped storage: ``(storage, offset, size, stride,
    requires_grad, hooks, dtype[, metadata])``."""
    if len(args) not in (7, 8) or type(args[0]) is not StorageRecord or args[0].dtype is not None:
        raise Declined
    if type(args[6]) is not torch.dtype:
        raise Declined
    return _ref(args[6], args[:6], args[7] if len(args) == 8 else None)


def _ref(dtype: torch.dtype, common: tuple[Any, ...], metadata: Any) -> TensorRef:
    """The tensor record for both rebuilds; *common*: their first six arguments."""
    storage, offset, size, stride, requires_grad, hooks = common
    _checked_geometry(offset, size, stride, requires_grad)
    _checked_extras(hooks, metadata)
    return TensorRef((dtype, offset, requires_grad, size, storage, stride))


def _encode(text: Any, encoding: Any) -> bytes:
    """``bytes`` as pickle protocol 2 writes them: ``_codecs.encode(text, "latin1")``."""
    if type(text) is not str or encoding != "latin1":
        raise Declined
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
_GLOBAL_LINES: Final = frozenset(f"{module}\n{name}\n".encode() for module, name in _GLOBALS)
ATOMS: Final = frozenset(
    {str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size}
)
_IN_PROGRESS: Final = object()


class _Resolver:
    """Replaces each :class:`TensorRef` in an unpickled object by its tensor."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.memo: dict[int, Any] = {}
        self.storages: dict[int, torch.UntypedStorage] = {}

    def resolve(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in ATOMS:
            return obj
        known = self.memo.get(id(obj))
        if known is not None:
            if known is _IN_PROGRESS:
                raise Declined  # a cycle through a tuple or frozenset
            return known
        if kind is TensorRef:
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
        raise Declined

    def _mapping(self, obj: dict[Any, Any]) -> dict[Any, Any]:
        if type(obj) is OrderedDict and obj.__dict__:
            raise Declined  # attributes set by BUILD: torch keeps them; rare enough to decline
        self.memo[id(obj)] = obj
        items = [(self.resolve(key), self.resolve(value)) for key, value in obj.items()]
        obj.clear()
        obj.update(items)
        return obj

    def _tensor(self, ref: TensorRef) -> torch.Tensor:
        dtype, offset, requires_grad, size, record, stride = ref
        storage = self.storages.get(id(record))
        if storage is None and record.length and not record.length % dtype.itemsize:
            # The storage as a tensor of the tensor's dtype: one frombuffer (3.5 us here,
            # against 11.5 us for a storage, an empty tensor and set_), then set_ only where
            # the tensor is not all of its storage, row-major (a view, a slice).
            tensor = torch.frombuffer(self._bytes(record), dtype=dtype)
            storage = self.storages[id(record)] = tensor.untyped_storage()
            if offset or tensor.shape != size or tensor.stride() != stride:
                tensor.set_(storage, offset, size, stride)  # in place
        else:
            if storage is None:
                if record.length:
                    made = torch.frombuffer(self._bytes(record), dtype=torch.uint8)
                    storage = made.untyped_storage()
                else:
                    storage = torch.empty(0, dtype=torch.uint8).untyped_storage()
                self.storages[id(record)] = storage
            tensor = torch.empty((0,), dtype=dtype)
            tensor.set_(storage, offset, size, stride)
        if requires_grad:
            tensor.requires_grad_(True)
        return tensor

    def _bytes(self, record: StorageRecord) -> bytearray:
        """A private, writable copy of *record*'s bytes (the tensors' memory)."""
        return bytearray(self.data[record.start : record.start + record.length])
