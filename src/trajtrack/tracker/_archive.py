"""A writer of torch's zip checkpoint format for tensor data, without ``torch.save``'s overheads.

``torch.save``'s per-call setup dominates the cost of a 4 KB dump, and for big tensors it
computes a CRC-32 of every zip record, after which the tracker computes its own CRC-32 of the
whole file again: every byte is read twice besides the write, so big dumps are written well
below the speed of a raw ``write()`` (``benchmarks/bench_archive.py`` measures this module
against ``torch.save`` and a raw write of the same bytes). This module writes the same format
itself, reading each storage once for the CRC-32s (:mod:`~trajtrack.tracker._torchzip`).

The bytes are those ``torch.save(obj, file_object)`` of torch 2.13 writes, record for record
(``archive/data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``,
``data/<key>`` per storage, ``version``, ``.data/serialization_id``; data aligned to 64 bytes
by a padding extra field; sizes and CRC-32s in data descriptors after the data, so nothing is
ever patched and the output needs no ``seek``) with one exception: the serialization id, which
``torch.save`` draws at random, is derived from the content so that the same object always
gives the same bytes (a retried upload must rewrite identical bytes). torch only logs it.

Objects are pickled by the same C pickler ``torch.save`` uses, with the same protocol, so
everything but a tensor is reduced exactly as ``torch.save`` reduces it; tensors get the reduce
``torch.Tensor.__reduce_ex__`` would give them (``_rebuild_tensor_v2`` or ``_v3`` over one
record per storage, so views and repeated tensors keep their aliasing). What this cannot
reproduce exactly raises :class:`NotArchivable`, always before the first byte is written, so
the caller can fall back to ``torch.save``: tensor subclasses (``nn.Parameter`` included),
tensors that are not CPU strided ones (CUDA, meta, sparse, quantized, nested), tensors with
Python attributes, torch storages, views of one memory with two dtypes, archives of 4 GiB or
more (which would need zip64 records). Anything else (a dataclass holding tensors, a set) is
accepted, as its pickle is ``torch.save``'s byte for byte.

Building the plan never releases the GIL: it reads tensor attributes and makes numpy views of
storage memory, and calls no torch operator (those release it; see ``_snapshot._small_copy``
for what that costs a caller in a busy process). Writing releases it in ``write`` and
``zlib.crc32``, as any file write does.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from typing import Any, Final

import numpy as np
import torch

from trajtrack.layouts.torch_format import (
    PROTOCOL,
    REBUILD_V2,
    REBUILD_V3,
    V2_STORAGES,
    V3_DTYPES,
)
from trajtrack.tracker._torchzip import ArchivePlan, NotArchivable, Writable

__all__ = ["ArchivePlan", "NotArchivable", "Writable", "archive_plan", "write_archive"]

# The format's own facts, shared with the reader (trajtrack.layouts.torch_format).
_PROTOCOL: Final = PROTOCOL
_V2_STORAGES: Final = V2_STORAGES
_REBUILD_V2: Final = REBUILD_V2
_REBUILD_V3: Final = REBUILD_V3
_V3_DTYPES: Final = V3_DTYPES
_HAS_NAMES: Final = hasattr(torch.Tensor, "has_names")  # named tensors (2.4 has them, 2.13 not)
_REFUSED: Final = (torch.Tensor, torch.storage.TypedStorage, torch.UntypedStorage)


class _Memory:
    """The memory of a storage, exported through numpy's array interface (no copy).

    Views of it keep the storage alive (a writer may hold on to what it was given).
    """

    __slots__ = ("__array_interface__", "_storage")

    def __init__(self, storage: torch.UntypedStorage, pointer: int, nbytes: int) -> None:
        self._storage = storage
        self.__array_interface__ = {
            "data": (pointer, True),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


def _plain_cpu(tensor: torch.Tensor) -> bool:
    """A CPU strided tensor that is not nested, quantized, named, and has no Python attributes
    (torch pickles those with ``_rebuild_from_type_v2``): what this module writes."""
    return not (
        tensor.layout is not torch.strided
        or not tensor.is_cpu
        or tensor.is_nested
        or tensor.is_quantized
        or tensor.__dict__
        or (_HAS_NAMES and tensor.has_names())  # type: ignore[attr-defined]
    )


class _StorageRef:
    """A storage in the pickle: its persistent id (torch's), and its bytes."""

    __slots__ = ("key", "numel", "storage_type", "view")

    key: str
    numel: int
    storage_type: Any
    view: memoryview | bytes


class _Hooks:
    """The empty ``OrderedDict`` of backward hooks torch pickles with each tensor.

    One placeholder per tensor, reduced like a fresh ``OrderedDict()`` (torch makes one per
    tensor, and the pickler memoizes objects by identity), but faster to pickle.
    """

    __slots__ = ()


_HOOKS_REDUCE: Final = (OrderedDict, ())


class _Pickler(pickle.Pickler):
    """``torch.save``'s pickling, with tensors reduced here (checked, storages collected)."""

    # Set by archive_plan (a Python __init__ would cost more than the C pickler's own).
    refs: dict[int, _StorageRef]  # by id() of the storage object, which the ref keeps alive
    dtypes: dict[int, torch.dtype]  # torch.save's check: one dtype per memory
    part_views: bool  # a tensor seen first holds only part of its storage

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is _StorageRef:  # a fresh tuple each time, as torch.save makes
            return ("storage", obj.storage_type, obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is torch.Tensor:
            return self._reduce_tensor(obj)
        if kind is _Hooks:
            return _HOOKS_REDUCE
        if isinstance(obj, _REFUSED):
            raise NotArchivable(f"a {kind.__name__}")
        return NotImplemented  # the default reduction, as in torch.save's pickler

    def _reduce_tensor(self, tensor: torch.Tensor) -> Any:
        """What ``Tensor.__reduce_ex__`` returns for a plain CPU tensor, storage collected."""
        if not _plain_cpu(tensor):
            raise NotArchivable("a tensor that is not a plain CPU strided one")
        dtype = tensor.dtype
        storage_type = _V2_STORAGES.get(dtype)
        if storage_type is None and dtype not in _V3_DTYPES:
            raise NotArchivable(f"a tensor of dtype {dtype}")
        try:
            # The same Python object for every tensor on one storage (torch preserves it).
            storage = tensor.untyped_storage()
        except RuntimeError as exc:  # a tensor without storage (functorch wrappers, ...)
            raise NotArchivable(str(exc)) from exc
        ref = self.refs.get(id(storage))
        if ref is None:
            ref = self._add_storage(storage, tensor, storage_type)
        pointer = storage.data_ptr()
        if pointer:  # torch.save refuses one memory viewed as two dtypes (uint8 if untyped)
            checked = dtype if storage_type is not None else torch.uint8
            if self.dtypes.setdefault(pointer, checked) is not checked:
                raise NotArchivable("one memory viewed with two dtypes")
        args: tuple[Any, ...] = (
            ref,
            tensor.storage_offset(),
            tuple(tensor.size()),
            tensor.stride(),
            tensor.requires_grad,
            _Hooks(),
        )
        if storage_type is None:
            args += (dtype,)
        if tensor.is_neg() or tensor.is_conj():  # torch._utils.get_tensor_metadata, in its order
            metadata = {"neg": True} if tensor.is_neg() else {}
            if tensor.is_conj():
                metadata["conj"] = True
            args += (metadata,)
        return (_REBUILD_V3 if storage_type is None else _REBUILD_V2, args)

    def _add_storage(
        self, storage: torch.UntypedStorage, tensor: torch.Tensor, storage_type: Any
    ) -> _StorageRef:
        nbytes = storage.nbytes()
        if nbytes > tensor.numel() * tensor.element_size():
            self.part_views = True
        ref = _StorageRef()
        ref.key = str(len(self.refs))  # torch's keys: "0", "1", ... in order of appearance
        if storage_type is None:
            ref.storage_type, ref.numel = torch.UntypedStorage, nbytes
        else:
            ref.storage_type, ref.numel = storage_type, nbytes // tensor.element_size()
        if not nbytes:
            ref.view = b""
        elif storage.data_ptr():
            ref.view = np.asarray(_Memory(storage, storage.data_ptr(), nbytes)).data
        else:
            raise NotArchivable("a storage without memory (a zero tensor?)")
        self.refs[id(storage)] = ref
        return ref


def archive_plan(obj: Any, *, serialization_id: str | None = None) -> ArchivePlan:
    """Pickle *obj* and lay out its archive; raises :class:`NotArchivable` (nothing written).

    *serialization_id*: the ``.data/serialization_id`` record (ASCII); by default 40 digits
    derived from the file's content (its CRC-32 up to that record, and its size).
    """
    flat = _flat_tensors(obj)
    if flat is not None:
        pickled = _PICKLES.get(flat[0])
        if pickled is not None:  # this layout of tensors was pickled before: the same bytes
            return ArchivePlan(pickled, flat[1], serialization_id)
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, _PROTOCOL)
    pickler.refs = {}
    pickler.dtypes = {}
    pickler.part_views = False
    try:
        pickler.dump(obj)
    except NotArchivable:
        raise
    except Exception as exc:  # torch_save then raises the real error, if there is one
        raise NotArchivable(f"{type(exc).__name__}: {exc}") from exc
    views = [ref.view for ref in pickler.refs.values()]
    plan = ArchivePlan(buffer.getvalue(), views, serialization_id)
    plan.part_views = pickler.part_views
    if flat is not None and not plan.part_views:
        if len(_PICKLES) >= _PICKLES_KEPT:
            _PICKLES.clear()  # layouts that never repeat: keep the cache small
        _PICKLES[flat[0]] = plan.pickled
    return plan


# A dict of whole tensors (the typical per-sample dump) pickles to the same bytes whenever its
# names, dtypes, shapes, strides and requires_grad are the same (its data is not in the pickle;
# storage keys are "0", "1", ... in order): such a pickle is kept by that layout, and the next
# dump of it only reads its tensors' attributes. Tests check the bytes against fresh pickles.
_PICKLES: Final[dict[tuple[Any, ...], bytes]] = {}
_PICKLES_KEPT: Final = 64
_FLAT_MAX: Final = 32  # tensors in a dict kept this way


def _flat_tensors(obj: Any) -> tuple[tuple[Any, ...], list[memoryview]] | None:
    """``(layout, views)`` of a dict of str to whole, distinct, plain CPU tensors; or None."""
    if type(obj) is not dict or not obj or len(obj) > _FLAT_MAX:
        return None
    layout: list[Any] = []
    views: list[memoryview] = []
    pointers: set[int] = set()
    for name, tensor in obj.items():
        if type(name) is not str or type(tensor) is not torch.Tensor:
            return None
        if not _plain_cpu(tensor) or tensor.storage_offset() or tensor.is_neg() or tensor.is_conj():
            return None
        dtype = tensor.dtype
        if dtype not in _V2_STORAGES:
            return None
        try:
            storage = tensor.untyped_storage()
            nbytes, pointer = storage.nbytes(), storage.data_ptr()
        except RuntimeError:  # no storage, or an invalid one: the pickler says what
            return None
        if not pointer or pointer in pointers or nbytes != tensor.numel() * tensor.element_size():
            return None  # no memory, shared memory, or a part of it: the pickler's business
        pointers.add(pointer)
        layout.append((name, dtype, tuple(tensor.size()), tensor.stride(), tensor.requires_grad))
        views.append(np.asarray(_Memory(storage, pointer, nbytes)).data)
    return tuple(layout), views


def write_archive(
    obj: Any, out: Writable, *, serialization_id: str | None = None
) -> tuple[int, str]:
    """Write *obj* in torch's format to *out*: ``(size, "crc32:<8 hex>")`` of what was written."""
    return archive_plan(obj, serialization_id=serialization_id).write_to(out)
