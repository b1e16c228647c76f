"""Snapshots: what ``dump()`` takes from the caller before it returns.

Once ``dump()`` returns, the caller may mutate or free its objects; what is stored must not
change. Two ways to get there, chosen per object:

* **Plain data** — nested ``dict``/``list``/``tuple`` of tensors, numpy arrays and immutable
  scalars (what trajectories usually are): the containers are rebuilt and the tensors copied
  (CPU ``clone``, or for CUDA a device clone on the current stream followed by an asynchronous
  copy into pinned host memory on a side stream). Serialization then happens later, in an
  upload worker, straight into the destination's temporary file. A 4 KB tensor dict costs a few
  microseconds here instead of ~120 us of ``torch.save``.
* **Anything else** (dataclasses, custom objects, object arrays): serialized once, in a worker
  thread, into a spool (memory up to a limit, then a temporary file, so large objects never
  hold the GIL for a big in-memory copy); the bytes are the snapshot.

Serialization is ``torch.save`` by default, with every tensor moved to the CPU so that dumps
load on machines without GPUs.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Final

import numpy as np
import torch

from trajtrack._exceptions import SerializationError

__all__ = [
    "BytesPayload",
    "FilePayload",
    "ObjectPayload",
    "has_cuda_tensor",
    "Serializer",
    "SpoolPayload",
    "measure_plain",
    "serialize_to_file",
    "serialize_to_spool",
    "snapshot_plain",
    "torch_save",
]

Serializer = Callable[[Any, BinaryIO], None]

_IMMUTABLE: Final = (str, bytes, int, float, bool, complex, type(None), np.generic, torch.dtype)
_MAX_DEPTH: Final = 64
_PER_ITEM_OVERHEAD: Final = 64  # bytes the budget counts for each container entry
SPOOL_MEMORY_LIMIT: Final = 8 << 20  # beyond this a serialized snapshot spills to a temp file
_COPY_CHUNK: Final = 1 << 20


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


# --------------------------------------------------------------------------- plain snapshots


class NotPlainError(Exception):
    """Internal: the object holds something the plain copier does not handle."""


def measure_plain(obj: Any, depth: int = 0) -> int:
    """Bytes a plain snapshot of *obj* needs; raises :class:`NotPlainError` if it is not plain."""
    if depth > _MAX_DEPTH:
        raise NotPlainError("nesting too deep")
    kind = type(obj)
    if kind is torch.Tensor:
        if obj.layout is not torch.strided or obj.is_quantized or obj.device.type == "meta":
            raise NotPlainError("special tensor")
        return int(obj.numel() * obj.element_size()) + _PER_ITEM_OVERHEAD
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
        with FORK_GATE.torch_work():
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
    source = tensor.detach()
    if source.device.type == "cpu":
        copy = _small_copy(source)
        if copy is None:
            copy = source.clone(memory_format=torch.contiguous_format)
    elif source.device.type == "cuda":
        copy = _copy_cuda(source, state)
    else:
        copy = source.to("cpu", copy=True)
    if tensor.requires_grad:
        copy.requires_grad_(True)
    return copy


SMALL_COPY_MAX_BYTES: Final = 256 << 10
"""CPU tensors up to this size are copied without releasing the GIL (see :func:`_small_copy`)."""


def _small_copy(source: torch.Tensor) -> torch.Tensor | None:
    """Copy a small contiguous CPU tensor while holding the GIL; ``None`` when it does not apply.

    ``Tensor.clone`` (like every torch op, even ``view``) releases the GIL. In a process where
    other threads want it (Ray's, the upload workers', an event loop's), each release can cost
    the caller a whole switch interval (5 ms) before it gets the GIL back; measured here with
    one busy thread: 10 ms p50 for ``clone`` of 4 KB against 2 us for this path. numpy's view
    of the tensor and ``bytes`` copies of its memory never release it.
    """
    nbytes = source.numel() * source.element_size()
    if (
        nbytes > SMALL_COPY_MAX_BYTES
        or not source.is_contiguous()
        or source.is_conj()
        or source.is_neg()
        or source.dtype not in NUMPY_DTYPES
    ):
        return None
    view = source.numpy()  # shares memory; holds the GIL
    # One copy. Through a memoryview: bytearray() of a 0-d integer array would take its value
    # as a length.
    copy = np.frombuffer(bytearray(view.data), dtype=view.dtype).reshape(view.shape)
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


# --------------------------------------------------------------------------- payloads


class ObjectPayload:
    """A snapshot held as (copied) objects, serialized when the upload worker writes it."""

    def __init__(
        self,
        obj: Any,
        nbytes: int,
        *,
        serializer: Serializer = torch_save,
        cuda_events: list[Any] | None = None,
    ) -> None:
        self.obj = obj
        self._nbytes = nbytes
        self.serializer = serializer
        self._cuda_events = cuda_events or []

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def materialize(self) -> Any:
        """The copied object, once any device-to-host copy into it has completed."""
        for event in self._cuda_events:
            event.synchronize()  # the pinned host copy is complete after this
        self._cuda_events = []
        return self.obj

    def write_to(self, out: BinaryIO) -> None:
        self.materialize()
        try:
            with FORK_GATE.torch_work():
                self.serializer(self.obj, out)
        except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as exc:
            raise SerializationError(f"could not serialize the dump: {exc}") from exc


class DeferredPayload(ObjectPayload):
    """An object made only when the upload worker writes it (in its thread, off the loop).

    The Ray actor admits plain data it received with this: making the tensors is a torch call
    per tensor, and the caller is waiting for the admission.
    """

    def __init__(
        self, make: Callable[[], Any], nbytes: int, *, serializer: Serializer = torch_save
    ) -> None:
        super().__init__(None, nbytes, serializer=serializer)
        self._make: Callable[[], Any] | None = make

    def materialize(self) -> Any:
        if self._make is not None:
            try:
                self.obj = self._make()
            except (ValueError, RuntimeError, MemoryError) as exc:
                raise SerializationError(f"could not rebuild the dump: {exc}") from exc
            self._make = None
        return self.obj


class BytesPayload:
    """A snapshot that is already bytes."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.data = memoryview(data)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def write_to(self, out: BinaryIO) -> None:
        out.write(self.data)


class SpoolPayload:
    """A snapshot serialized into a spooled temporary file (memory, then disk)."""

    def __init__(self, spool: tempfile.SpooledTemporaryFile[bytes], nbytes: int) -> None:
        self._spool = spool
        self._nbytes = nbytes
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def write_to(self, out: BinaryIO) -> None:
        with self._lock:  # retries of one payload never overlap, but be explicit about it
            self._spool.seek(0)
            shutil.copyfileobj(self._spool, out, _COPY_CHUNK)

    def getvalue(self) -> bytes:
        """The serialized bytes (reads a spilled file back into memory)."""
        buffer = io.BytesIO()
        self.write_to(buffer)
        return buffer.getvalue()

    def close(self) -> None:
        self._spool.close()

    def __del__(self) -> None:
        self._spool.close()


class FilePayload:
    """A snapshot serialized into a named spool file (large plain payloads).

    Serializing a big tensor dict straight into a file is faster than copying it in memory
    (fresh pages fault in at ~450 MB/s here; ``torch.save`` to a file runs at ~900 MB/s) and
    holds no RAM. A backend on the same filesystem can :meth:`move_to` the file into place
    instead of copying it; the others stream it with :meth:`write_to`. The file is deleted
    when the payload is released or garbage-collected.
    """

    def __init__(self, path: str, size: int, checksum: str) -> None:
        self.path = path
        self.size = size
        self.checksum = checksum
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.size

    def write_to(self, out: BinaryIO) -> None:
        with self._lock, open(self.path, "rb") as handle:
            shutil.copyfileobj(handle, out, _COPY_CHUNK)

    def move_to(self, target: str) -> bool:
        """Rename the spool file to *target*; False if not possible (other filesystem)."""
        with self._lock:
            try:
                os.replace(self.path, target)
            except OSError:
                return False
            self.path = ""
            return True

    def release(self) -> None:
        with self._lock:
            path, self.path = self.path, ""
        if path:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def __del__(self) -> None:
        self.release()


def serialize_to_file(obj: Any, serializer: Serializer, path: str) -> FilePayload:
    """Serialize *obj* now (blocking; call it in a worker thread) into a new file at *path*."""
    from trajtrack.backends._protocol import ChecksumWriter

    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        with os.fdopen(os.open(path, flags, 0o600), "wb", buffering=_COPY_CHUNK) as handle:
            writer = ChecksumWriter(handle)
            with FORK_GATE.torch_work():
                serializer(obj, writer)  # type: ignore[arg-type]  # a minimal BinaryIO
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(path)
        if isinstance(exc, OSError | SerializationError) or not isinstance(exc, Exception):
            raise
        raise SerializationError(
            f"could not serialize {type(obj).__name__} for the dump: {exc}"
        ) from exc
    return FilePayload(path, writer.size, writer.checksum)


def serialize_to_spool(
    obj: Any, serializer: Serializer, spool_dir: str | None = None
) -> SpoolPayload:
    """Serialize *obj* now (blocking; call it in a worker thread) into a spool."""
    # Not a `with` block: on success the spool outlives this function inside the payload.
    spool: tempfile.SpooledTemporaryFile[bytes] = tempfile.SpooledTemporaryFile(  # noqa: SIM115
        max_size=SPOOL_MEMORY_LIMIT, dir=spool_dir, prefix="trajtrack-spool-"
    )
    try:
        with FORK_GATE.torch_work():
            serializer(obj, spool)  # type: ignore[arg-type]  # a SpooledTemporaryFile
        size = spool.tell()
    except Exception as exc:
        spool.close()
        raise SerializationError(
            f"could not serialize {type(obj).__name__} for the dump: {exc}"
        ) from exc
    return SpoolPayload(spool, size)


# --------------------------------------------------------------------------- fork safety

FORK_WAIT: Final = 2.0  # seconds fork() waits for our threads to leave torch


class _ForkGate:
    """Keeps ``fork()`` from happening while one of our threads is inside torch.

    A child inherits every lock held at the moment of the fork, but none of the threads that
    would release them: if an upload thread is in the middle of ``torch.save`` (or a snapshot
    copy) when the user's code forks, torch locks it held stay locked forever in the child.
    Before a fork, this gate stops new torch work by trajtrack's threads and waits (at most
    :data:`FORK_WAIT` seconds, so a fork is never blocked for long) for the current work to end.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._forking = False

    @contextlib.contextmanager
    def torch_work(self) -> Iterator[None]:
        with self._cond:
            while self._forking:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if not self._active:
                    self._cond.notify_all()

    def before_fork(self) -> None:
        self._cond.acquire()  # held across the fork: no torch work starts meanwhile
        self._forking = True
        deadline = time.monotonic() + FORK_WAIT
        while self._active:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._cond.wait(remaining)

    def after_fork_in_parent(self) -> None:
        self._forking = False
        self._cond.notify_all()
        self._cond.release()

    def after_fork_in_child(self) -> None:
        self.__init__()  # type: ignore[misc]  # the child has none of the parent's threads


FORK_GATE = _ForkGate()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=FORK_GATE.before_fork,
        after_in_parent=FORK_GATE.after_fork_in_parent,
        after_in_child=FORK_GATE.after_fork_in_child,
    )
