"""Snapshots: what ``dump()`` takes from the caller before it returns.

Once ``dump()`` returns, the caller may mutate or free its objects; what is stored must not
change. Two ways to get there, chosen per object:

* **Plain data** — nested ``dict``/``list``/``tuple`` of tensors, numpy arrays and immutable
  scalars (what trajectories usually are): the containers are rebuilt and the tensors copied
  (:func:`_copy_tensor`: small CPU ones through numpy, CUDA ones asynchronously). Serialization
  then happens later, in an upload worker, straight into the destination's temporary file.
  Copying a 4 KB tensor dict costs far less than ``torch.save``'s per-call setup
  (``benchmarks/bench_core.py``: 4 KB latency against synchronous ``torch.save``).
* **Anything else** (dataclasses, custom objects, object arrays): serialized once, in a worker
  thread, into a spool (memory up to a limit, then a temporary file, so large objects never
  hold the GIL for a big in-memory copy); the bytes are the snapshot.

Serialization is ``torch.save`` by default, with every tensor moved to the CPU so that dumps
load on machines without GPUs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch

from trajtrack._exceptions import SerializationError
from trajtrack.tracker._forkgate import FORK_GATE
from trajtrack.tracker._payloads import RELEASING_COPY_MIN_BYTES, ObjectPayload

__all__ = [
    "NUMPY_DTYPES",
    "NotPlainError",
    "has_cuda_tensor",
    "measure_plain",
    "snapshot_plain",
]

_IMMUTABLE: Final = (str, bytes, int, float, bool, complex, type(None), np.generic, torch.dtype)
_MAX_DEPTH: Final = 64
_PER_ITEM_OVERHEAD: Final = 64  # bytes the budget counts for each container entry


class NotPlainError(Exception):
    """Internal: the object holds something the plain copier does not handle."""


def measure_plain(obj: Any, depth: int = 0) -> int:
    """Bytes a plain snapshot of *obj* needs; raises :class:`NotPlainError` if it is not plain."""
    if depth > _MAX_DEPTH:
        raise NotPlainError("nesting too deep")
    kind = type(obj)
    if kind is torch.Tensor:
        if obj.layout is not torch.strided or obj.is_quantized or obj.is_meta:
            raise NotPlainError("special tensor")
        return int(obj.nbytes) + _PER_ITEM_OVERHEAD
    if kind is np.ndarray:
        if obj.dtype.hasobject:
            raise NotPlainError("object array")
        return int(obj.nbytes) + _PER_ITEM_OVERHEAD
    if kind is dict:
        total = _PER_ITEM_OVERHEAD
        for key, value in obj.items():
            if not isinstance(key, _IMMUTABLE):
                raise NotPlainError("unusual key")
            total += measure_plain(value, depth + 1)
        return total
    if kind is list or kind is tuple:
        return _PER_ITEM_OVERHEAD + sum(measure_plain(v, depth + 1) for v in obj)
    if isinstance(obj, _IMMUTABLE):
        return len(obj) if isinstance(obj, str | bytes) else _PER_ITEM_OVERHEAD
    raise NotPlainError(type(obj).__name__)


def has_cuda_tensor(obj: Any, depth: int = 0) -> bool:
    """True if plain data *obj* holds a CUDA tensor (call after :func:`measure_plain`)."""
    kind = type(obj)
    if kind is torch.Tensor:
        return bool(obj.is_cuda)
    if depth > _MAX_DEPTH:
        return False
    if kind is dict:
        return any(has_cuda_tensor(v, depth + 1) for v in obj.values())
    if kind is list or kind is tuple:
        return any(has_cuda_tensor(v, depth + 1) for v in obj)
    return False


@dataclass
class _CopyState:
    memo: dict[int, Any] = field(default_factory=dict)
    cuda_events: list[Any] = field(default_factory=list)


def snapshot_plain(obj: Any, nbytes: int | None = None) -> ObjectPayload:
    """Copy plain data (see :func:`measure_plain`) so that later mutation cannot reach it.

    *nbytes*: ``measure_plain(obj)`` when the caller already has it (it is not measured again).
    """
    state = _CopyState()
    try:
        copy = _copy(obj, state)
    except RuntimeError as exc:  # e.g. a tensor on a device that is gone
        raise SerializationError(f"could not copy a tensor for the snapshot: {exc}") from exc
    size = measure_plain(obj) if nbytes is None else nbytes
    return ObjectPayload(copy, size, cuda_events=state.cuda_events)


def _copy(obj: Any, state: _CopyState) -> Any:
    kind = type(obj)
    if kind is torch.Tensor:
        # One copy per tensor object keeps aliasing (the same tensor twice stays shared).
        seen = state.memo.get(id(obj))
        if seen is None:
            seen = state.memo[id(obj)] = _copy_tensor(obj, state)
        return seen
    if kind is np.ndarray:
        return obj.copy()
    if kind is dict:
        return {key: _copy(value, state) for key, value in obj.items()}
    if kind is list:
        return [_copy(value, state) for value in obj]
    if kind is tuple:
        return tuple(_copy(value, state) for value in obj)
    return obj  # immutable scalar


def _copy_tensor(tensor: torch.Tensor, state: _CopyState) -> torch.Tensor:
    # Outside the fork gate (which is for locks held inside torch ops: clone, device copies):
    # the numpy copy takes none, and most dumps are small CPU tensors, whose every step the
    # caller waits for (benchmarks/bench_ray.py: await Tracker.dump, calls spaced apart).
    copy = _small_copy(tensor) if tensor.is_cpu and not tensor.requires_grad else None
    if copy is not None:
        return copy
    with FORK_GATE.torch_work():
        # detach() gives the GIL up (a torch op): only a tensor that requires grad needs it.
        source = tensor.detach() if tensor.requires_grad else tensor
        if source.is_cpu:  # numpy's copy was tried above unless the tensor requires grad
            copy = _small_copy(source) if tensor.requires_grad else None
            if copy is None:
                copy = source.clone(memory_format=torch.contiguous_format)
        elif source.is_cuda:
            copy = _copy_cuda(source, state)
        else:
            copy = source.to("cpu", copy=True)
        if tensor.requires_grad:
            copy.requires_grad_(True)
    return copy


SMALL_COPY_MAX_BYTES: Final = 4 << 20
"""CPU tensors up to this size are copied through numpy, not by a torch op (:func:`_small_copy`).

As large as the default ``inline_snapshot_bytes``: with the upload workers busy, ``clone`` of a
1 MB tensor costs the caller more than a copy that holds the GIL (``benchmarks/bench_core.py``
and ``benchmarks/bench_snapshot.py``: 1 MB dumps against the inline loop)."""


def _small_copy(source: torch.Tensor) -> torch.Tensor | None:
    """Copy a contiguous CPU tensor through numpy; ``None`` when it does not apply.

    ``Tensor.clone`` (like every torch op, even ``view``) releases the GIL. In a process where
    other threads want it (Ray's, the upload workers', an event loop's), each release can cost
    the caller a whole switch interval (5 ms by default) before it gets the GIL back, far
    longer than copying a small tensor takes. numpy's view of the tensor and ``bytes`` copies
    of its memory never release it; a copy of at least :data:`RELEASING_COPY_MIN_BYTES`
    releases it on purpose, while the bytes move.
    """
    nbytes = source.nbytes
    if (
        source.dtype not in NUMPY_DTYPES
        or nbytes > SMALL_COPY_MAX_BYTES
        or not source.is_contiguous()
        or source.is_conj()
        or source.is_neg()
    ):
        return None
    view = source.numpy()  # shares memory; holds the GIL
    if nbytes >= RELEASING_COPY_MIN_BYTES:
        copy = np.empty_like(view, order="C")
        np.copyto(copy, view)  # without the GIL, the page faults of the fresh memory included
    else:
        # One copy, holding the GIL, and an array made over it in one call. Through a
        # memoryview: bytearray() of a 0-d integer array would take its value as a length.
        copy = np.ndarray(view.shape, view.dtype, bytearray(view.data))
    return torch.from_numpy(copy)


NUMPY_DTYPES: Final = frozenset(  # torch dtypes whose tensors have a numpy view
    {
        torch.float16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    }
)

_side_streams: dict[int, Any] = {}
_side_streams_lock = threading.Lock()


def _copy_cuda(source: torch.Tensor, state: _CopyState) -> torch.Tensor:
    """Snapshot a CUDA tensor without making the CPU (or the compute stream) wait for PCIe.

    A device-to-device clone on the *current* stream orders the snapshot before any later
    in-place write by the caller (it costs microseconds at HBM bandwidth). The slow
    device-to-host copy then runs on a side stream into pinned memory; the upload worker waits
    on its CUDA event, in a thread, before serializing.
    """
    device = source.device
    current = torch.cuda.current_stream(device)
    staged = source.clone(memory_format=torch.contiguous_format)
    with _side_streams_lock:
        side = _side_streams.get(device.index or 0)
        if side is None:
            side = _side_streams[device.index or 0] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(current)
    with torch.cuda.stream(side):
        host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
        host.copy_(staged, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(side)
    # The caching allocator must not hand `staged` to someone else before the side stream
    # has read it.
    staged.record_stream(side)
    state.cuda_events.append(done)
    return host
