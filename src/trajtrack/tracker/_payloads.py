"""Payloads: a snapshot in the form the upload worker writes it to the storage.

* :class:`ObjectPayload` -- copied plain data, serialized by the worker straight into the
  storage's file (:class:`DeferredPayload`: made by the worker from received buffers);
* :class:`BytesPayload` -- bytes serialized elsewhere (the Ray adapter's callers);
* :class:`SpoolPayload` -- an object serialized once, in a thread, into a spooled temporary
  file (memory, then disk): the snapshot of anything that is not plain data;
* :class:`FilePayload` -- large plain data serialized into a named spool file, which a local
  destination renames into place.

Every payload writes the same bytes each time (a retry rewrites them).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any, BinaryIO, Final

from trajtrack._exceptions import SerializationError, StorageError
from trajtrack.backends import BytesPayload, ChecksumWriter, WriteResult
from trajtrack.tracker._archive import NotArchivable, archive_plan
from trajtrack.tracker._forkgate import FORK_GATE
from trajtrack.tracker._serialize import Serializer, serialize_plain, torch_save

__all__ = [
    "BytesPayload",
    "DeferredPayload",
    "FilePayload",
    "RELEASING_COPY_MIN_BYTES",
    "ObjectPayload",
    "SerializedPayload",
    "release_spool",
    "serialize_small",
    "serialize_to_file",
    "serialize_to_spool",
]

RELEASING_COPY_MIN_BYTES: Final = 256 << 10
"""From this size on, a copy into memory releases the GIL while it runs (``numpy.copyto``):
a snapshot's copy of a tensor (:mod:`~trajtrack.tracker._snapshot`).

A copy into fresh memory takes a page fault every 4 KiB, so a big copy is long; holding the
GIL through it starves the upload workers, which then commit little while the caller dumps and
the rest only in ``flush()`` (``benchmarks/bench_snapshot.py``: "committed while dumping" and
the caller's time per dump). Smaller copies hold it: for them, waiting to get the GIL back (up
to a switch interval) could cost more than the copy."""

SPOOL_MEMORY_LIMIT: Final = 8 << 20  # beyond this a serialized snapshot spills to a temp file
_COPY_CHUNK: Final = 1 << 20


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
        self.nbytes = nbytes
        self.serializer = serializer
        self._cuda_events = cuda_events or []

    def materialize(self) -> Any:
        """The copied object, once any device-to-host copy into it has completed."""
        for event in self._cuda_events:
            event.synchronize()  # the pinned host copy is complete after this
        self._cuda_events = []
        return self.obj

    def write_counted(self, out: BinaryIO) -> WriteResult | None:
        """With the default serializer, write torch's format with the archive writer.

        It computes each tensor's CRC-32 once and the file's from those, and skips
        ``torch.save``'s per-call setup (see :mod:`trajtrack.tracker._archive`). ``None``
        (nothing written) for a custom serializer, or an object only ``torch.save`` writes.
        """
        self.materialize()
        if self.serializer is not torch_save:
            return None
        with FORK_GATE.torch_work():
            written = serialize_plain(self.obj, out)
        return None if written is None else WriteResult(*written)

    def write_to(self, out: BinaryIO) -> None:
        if self.write_counted(out) is not None:
            return  # the same bytes, whichever way a backend asks for them
        try:
            with FORK_GATE.torch_work():
                self.serializer(self.obj, out)
        except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as exc:
            raise SerializationError(f"could not serialize the dump: {exc}") from exc


class SerializedPayload(BytesPayload):
    """A small dump already serialized at ``dump()`` time, with its size and CRC-32.

    For small plain data dumped into shards, one pass (the archive writer) is both the snapshot
    and the serialization, and gives the bytes the shard lays out on the event loop; the
    storage does not compute the checksum again (:meth:`write_counted`).
    """

    def __init__(self, data: bytes | bytearray | memoryview, checksum: str) -> None:
        super().__init__(data)
        self._result = WriteResult(self.data.nbytes, checksum)

    def write_counted(self, out: BinaryIO) -> WriteResult:
        out.write(self.data)
        return self._result

    def counted(self) -> WriteResult:
        return self._result


def serialize_small(obj: Any) -> SerializedPayload | None:
    """Small plain data serialized now with the archive writer, or ``None`` (then copy it).

    ``None`` also when a tensor is a view of part of a storage: ``torch.save`` would write
    the whole storage (which may be large) where a copy keeps only the view.
    """
    try:
        with FORK_GATE.torch_work():
            plan = archive_plan(obj)
            if plan.part_views:
                return None
            buffer = io.BytesIO()
            written = plan.write_to(buffer)
    except NotArchivable:
        return None
    except RuntimeError as exc:  # e.g. a tensor whose memory cannot be read any more
        raise SerializationError(f"could not read a tensor for the dump: {exc}") from exc
    return SerializedPayload(buffer.getbuffer(), written[1])


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


class SpoolPayload:
    """A snapshot serialized into a spooled temporary file (memory, then disk)."""

    def __init__(self, spool: tempfile.SpooledTemporaryFile[bytes], nbytes: int) -> None:
        self._spool = spool
        self.nbytes = nbytes
        self._lock = threading.Lock()

    def write_to(self, out: BinaryIO) -> None:
        with self._lock:  # retries of one payload never overlap, but be explicit about it
            self._spool.seek(0)
            shutil.copyfileobj(self._spool, out, _COPY_CHUNK)

    def __del__(self) -> None:
        self._spool.close()


class FilePayload:
    """A snapshot serialized into a named spool file (large plain payloads).

    Serializing a big tensor dict straight into a file is faster than copying it in memory
    (a copy faults in a fresh page every 4 KiB; a file's writes go to the page cache, whose
    pages the kernel reuses; ``benchmarks/bench_core.py``'s 16 MB and 256 MB throughput) and
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

    def move_to(self, name: str, directory: int) -> bool:
        """Rename the spool file to *name* in the directory open as *directory* (a descriptor).

        Returns False if that is not possible (another filesystem): then copy it instead.
        """
        with self._lock:
            try:
                os.replace(self.path, name, dst_dir_fd=directory)
            except OSError:
                return False
            self.path = ""
            return True

    def open_for_reading(self) -> tuple[BinaryIO, WriteResult] | None:
        """Its file, open for reading, with its size and checksum (``""`` when the maker did
        not compute one); None once moved or released. A backend that would copy the bytes
        into a spool of its own (WebHDFS, for retries) reads this file instead: it stays
        readable through the open descriptor after :meth:`release` deletes its name."""
        with self._lock:
            if not self.path:
                return None
            file = open(self.path, "rb")  # noqa: SIM115  (the caller closes it)
        return file, WriteResult(self.size, self.checksum)

    def release(self) -> None:
        with self._lock:
            path, self.path = self.path, ""
        if path:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def __del__(self) -> None:
        self.release()


def release_spool(payload: object) -> None:
    """Delete *payload*'s spool file now, if it has one (blocking: an unlink).

    Called where blocking is allowed, before the dump's outcome is reported: then neither
    the caller finds the file still there, nor a garbage collection on the event loop
    deletes it.
    """
    if isinstance(payload, FilePayload):
        payload.release()


def serialize_to_file(obj: Any, serializer: Serializer, path: str) -> FilePayload:
    """Serialize *obj* now (blocking; call it in a worker thread) into a new file at *path*."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        with os.fdopen(os.open(path, flags, 0o600), "wb", buffering=_COPY_CHUNK) as handle:
            written = _serialize_counted(obj, serializer, handle)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(path)
        if isinstance(exc, SerializationError | StorageError) or not isinstance(exc, Exception):
            raise
        raise _serialize_error(obj, exc, path) from exc
    return FilePayload(path, *written)


def _serialize_error(obj: Any, exc: Exception, spool: str) -> Exception:
    """What a failure to serialize *obj* into the *spool* file is: an ``OSError`` of the
    operating system's (it set ``errno``: disk full, no permission) is the spool's
    :class:`StorageError`, anything else the object's :class:`SerializationError`."""
    if isinstance(exc, OSError) and exc.errno is not None:
        reason = "no space left on the device" if exc.errno == errno.ENOSPC else exc.strerror
        return StorageError(f"could not spool the dump to {spool}: {reason or exc}")
    return SerializationError(f"could not serialize {type(obj).__name__} for the dump: {exc}")


def _serialize_counted(obj: Any, serializer: Serializer, out: BinaryIO) -> tuple[int, str]:
    with FORK_GATE.torch_work():
        if serializer is torch_save:  # the archive writer counts as it writes: one CRC pass
            written = serialize_plain(obj, out)
            if written is not None:
                return written
        writer = ChecksumWriter(out)
        serializer(obj, writer)  # type: ignore[arg-type]  # a minimal BinaryIO
    return writer.size, writer.checksum


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
        if isinstance(exc, SerializationError | StorageError):
            raise
        raise _serialize_error(obj, exc, spool_dir or tempfile.gettempdir()) from exc
    return SpoolPayload(spool, size)
