"""The default serializer: ``torch.save`` with every tensor moved to the CPU.

Dumps must load on machines without GPUs, so a CUDA tensor is stored as its CPU copy.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

from trajtrack.tracker._archive import NotArchivable, Writable, archive_plan

__all__ = ["Serializer", "serialize_plain", "torch_save"]

Serializer = Callable[[Any, BinaryIO], None]
"""``serializer(obj, binary_file)``: writes *obj* into the file."""


class _CpuPickler(pickle.Pickler):
    """Pickler for ``torch.save`` that stores every non-CPU tensor as its CPU copy."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            return obj.detach().cpu().__reduce_ex__(pickle.DEFAULT_PROTOCOL)  # type: ignore[no-untyped-call]
        return NotImplemented


class _CpuPickleModule:
    """The ``pickle_module`` argument ``torch.save`` wants: only ``Pickler`` is used."""

    Pickler = _CpuPickler
    Unpickler = pickle.Unpickler
    dump = staticmethod(pickle.dump)
    load = staticmethod(pickle.load)


def torch_save(obj: Any, out: BinaryIO) -> None:
    """The default serializer: ``torch.save`` with tensors moved to the CPU."""
    torch.save(obj, out, pickle_module=_CpuPickleModule)


def serialize_plain(obj: Any, out: Writable) -> tuple[int, str] | None:
    """Write *obj* in torch's format without ``torch.save``: ``(size, "crc32:<8 hex>")``.

    ``None`` when the archive writer cannot reproduce ``torch.save`` for *obj* (a CUDA tensor,
    a tensor subclass, ...; see :mod:`trajtrack.tracker._archive`): nothing was written then,
    and the caller serializes with :func:`torch_save` instead.
    """
    try:
        plan = archive_plan(obj)
    except NotArchivable:
        return None
    return plan.write_to(out)
