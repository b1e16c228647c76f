"""The storage protocol: the handful of async primitives every backend implements.

Everything else (naming, queues, retries, records) lives in the tracker, so a new backend is a
few hundred lines at most (fsspec's lesson: a small core, the rest derived).
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO, Final, NamedTuple, Protocol, runtime_checkable

import anyio

from trajtrack._exceptions import StoragePermissionError

__all__ = [
    "BytesPayload",
    "ItemDone",
    "ChecksumWriter",
    "FileInfo",
    "Payload",
    "Storage",
    "WriteResult",
    "check_range",
    "check_relative",
    "checksum_of",
    "write_all",
    "write_each",
    "write_each_concurrently",
    "write_payload",
    "write_payload_unbuffered",
]


class Payload(Protocol):
    """Something that can write its bytes into a binary file object.

    ``write_to`` is blocking; backends call it in a worker thread, and may call it again when a
    write is retried, so it must produce the same bytes every time.

    A payload that knows its bytes' size and CRC-32 as it writes them (the tracker's archive
    writer computes each tensor's CRC once, and the file's from those) may also have
    ``write_counted(out) -> WriteResult | None``: it writes the same bytes as ``write_to`` and
    returns their size and checksum, or writes nothing and returns ``None``. Backends write
    through :func:`write_payload`, which uses it when it is there, so that nothing computes the
    checksum twice.
    """

    @property
    def nbytes(self) -> int:
        """Estimated size in bytes (what the tracker's memory budget counts)."""
        ...

    def write_to(self, out: BinaryIO) -> None:
        """Write the payload's bytes to *out*."""
        ...


class BytesPayload:
    """A payload that is already bytes (not copied)."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.data = memoryview(data)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def write_to(self, out: BinaryIO) -> None:
        write_all(out.write, self.data)

    def counted(self) -> WriteResult:
        """Size and CRC-32 of the bytes (for a backend that writes ``data`` itself)."""
        return WriteResult(self.data.nbytes, checksum_of(self.data))


class FileInfo(NamedTuple):
    """A file in a storage, relative to the storage's root (an immutable named tuple: a
    listing makes one per file, for a fifth of a frozen dataclass's cost).

    Attributes:
        path: Relative, ``/``-separated.
        size: Bytes.
        mtime: Modification time (seconds since the epoch), when known.
        outside: The path leads outside the storage's root (a symbolic link planted in a
            local destination): listed so that readers can report it, never read.
        special: Not a regular file (a FIFO, socket or device planted in a local
            destination, or a link to one): listed so that readers can report it, never
            opened (opening a FIFO to read blocks until something writes to it).
    """

    path: str
    size: int
    mtime: float | None = None
    outside: bool = False
    special: bool = False


@dataclass(frozen=True, slots=True)
class WriteResult:
    """What an atomic write committed: its size and checksum (``"crc32:<8 hex>"``)."""

    size: int
    checksum: str


ItemDone = Callable[[int, "WriteResult | Exception"], None]
"""``done(index, outcome)``: one item of :meth:`Storage.write_atomic_many` has ended."""


@runtime_checkable
class Storage(Protocol):
    """An async storage rooted at one destination; paths are relative, ``/``-separated.

    Implementations translate their own errors into :class:`trajtrack.StorageError` subclasses
    (``StorageUnavailableError`` for transient failures the tracker retries).
    """

    @property
    def url(self) -> str:
        """The destination this storage writes to, for messages and records."""
        ...

    @property
    def spool_dir(self) -> str | None:
        """A local directory on the storage's own filesystem, for spooling large payloads.

        A payload spooled there (:class:`~trajtrack.tracker._payloads.FilePayload`) is moved
        into place by rename instead of being copied. ``None`` when there is no such place
        (remote storages): the tracker then spools in the system's temporary directory.
        """
        ...

    def local_path(self, path: str) -> str | None:
        """The local filesystem path of *path* (``""``: the root), or ``None`` if not local.

        A capability, not a check: the file need not exist. Readers use it to open local
        files directly (``mmap``) and to tell a missing destination from an empty one.
        """
        ...

    async def prepare(self) -> None:
        """Check the destination is usable and create its root; called once at tracker start."""
        ...

    async def write_atomic(self, path: str, payload: Payload, *, overwrite: bool) -> WriteResult:
        """Write *payload* to *path* so that no reader ever sees a partial file there.

        Writes to a hidden temporary name in the same directory, then publishes it by rename.
        With ``overwrite=False`` an existing *path* raises :class:`trajtrack.DumpExistsError`.
        """
        ...

    async def write_atomic_many(
        self,
        items: Sequence[tuple[str, Payload]],
        *,
        overwrite: bool,
        done: ItemDone | None = None,
    ) -> list[WriteResult | Exception]:
        """:meth:`write_atomic` of each ``(path, payload)``, as cheaply as the storage can.

        Each item is written atomically on its own and fails on its own (its exception is its
        outcome, in order); a local disk writes them all in one worker-thread hop, which for
        small dumps costs less than the writes themselves. *done*, when given, is told each
        outcome as soon as it is known (possibly in a worker thread), so that an item that
        hangs holds back no other item's outcome.
        """
        ...

    async def read(self, path: str) -> bytes:
        """Return the whole content of *path* (``StorageNotFoundError`` if missing)."""
        ...

    async def read_range(self, path: str, offset: int, length: int) -> bytes:
        """Return *length* bytes of *path* from *offset* (fewer only at the end of the file).

        One request however large the file (a shard member is one ranged read).

        Raises:
            StorageNotFoundError: *path* does not exist.
            ValueError: *offset* or *length* is negative.
        """
        ...

    async def list(self, prefix: str = "") -> list[FileInfo]:
        """Every file below the directory *prefix*, recursively, temporary files included."""
        ...

    async def stat(self, path: str) -> FileInfo | None:
        """The file at *path*, or ``None`` when it does not exist."""
        ...

    async def delete(self, path: str) -> None:
        """Delete the file at *path*; a missing file is not an error."""
        ...

    async def aclose(self) -> None:
        """Release connections and threads; the storage is unusable afterwards."""
        ...


class ChecksumWriter:
    """A write-only file wrapper that counts bytes and computes the CRC-32 on the way through.

    CRC-32 rather than SHA-256: the record only has to catch truncation and bit rot, not an
    adversary, and a CRC costs a fraction of a cryptographic hash per byte (``zlib.crc32``
    releases the GIL).
    """

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._crc = 0
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        self._crc = zlib.crc32(view, self._crc)
        self.size += view.nbytes
        self._out.write(view)
        return view.nbytes

    def flush(self) -> None:
        self._out.flush()

    @property
    def checksum(self) -> str:
        return f"crc32:{self._crc:08x}"

    def result(self) -> WriteResult:
        return WriteResult(size=self.size, checksum=self.checksum)


def write_each(
    write: Callable[[str, Payload], WriteResult],
    items: Sequence[tuple[str, Payload]],
    done: ItemDone | None = None,
) -> list[WriteResult | Exception]:
    """``write_atomic_many`` as *write* of each item in turn, blocking (local storages: one
    worker-thread hop for all of them); outcomes as in :func:`write_each_concurrently`."""
    outcomes: list[WriteResult | Exception] = []
    for index, (path, payload) in enumerate(items):
        outcome: WriteResult | Exception
        try:
            outcome = write(path, payload)
        except Exception as exc:  # this item's outcome; the others go on
            outcome = exc
        outcomes.append(outcome)
        if done is not None:
            done(index, outcome)
    return outcomes


async def write_each_concurrently(
    storage: Storage,
    items: Sequence[tuple[str, Payload]],
    *,
    overwrite: bool,
    done: ItemDone | None = None,
) -> list[WriteResult | Exception]:
    """``write_atomic_many`` as ``write_atomic`` of each item, all at once (remote storages).

    Each item's outcome is its result or its exception, in order; *done* hears each as it
    ends. Concurrency is whatever the storage's own limiter lets through.
    """
    outcomes: list[WriteResult | Exception] = [RuntimeError("not written")] * len(items)

    async def one(index: int, path: str, payload: Payload) -> None:
        outcome: WriteResult | Exception
        try:
            outcome = await storage.write_atomic(path, payload, overwrite=overwrite)
        except Exception as exc:  # this item's outcome; the others go on
            outcome = exc
        outcomes[index] = outcome
        if done is not None:
            done(index, outcome)

    async with anyio.create_task_group() as group:
        for index, (path, payload) in enumerate(items):
            group.start_soon(one, index, path, payload)
    return outcomes


WRITE_PIECE: Final = 1 << 20
"""The most bytes one ``write`` call is given: a tensor's storage of many megabytes goes out in
pieces of this size. While the disk writes back earlier files, Linux pauses a writer that dirties
pages, and one call of many megabytes was paused several times longer than the same bytes in
pieces of a megabyte (``benchmarks/bench_core.py``: 16 MB and 256 MB dumps, which the raw
baseline writes in such pieces)."""


def write_all(write: Callable[[memoryview], int | None], data: bytes | memoryview) -> None:
    """Write all of *data* through *write* (a file's ``write``, or ``os.write`` bound to a
    descriptor), in pieces of at most :data:`WRITE_PIECE` bytes, resuming where a raw file took
    only part of one. A *write* that returns ``None`` (a writer that does not count) took all.
    """
    view = memoryview(data).cast("B")
    while view:
        piece = view[:WRITE_PIECE]
        written = write(piece)
        if written is None:
            written = len(piece)
        elif not written:
            raise OSError("the output accepted no more bytes")
        view = view[written:]


def write_payload(payload: Payload, out: BinaryIO) -> WriteResult:
    """Write *payload* into *out* (blocking); its size and CRC-32 (see :class:`Payload`)."""
    result = _write_counted(payload, out)
    return result if result is not None else _write_checksummed(payload, out)


def write_payload_unbuffered(payload: Payload, raw: BinaryIO, buffer_size: int) -> WriteResult:
    """:func:`write_payload` into an unbuffered file (*raw*: ``buffering=0``).

    A payload that writes its bytes in a few large pieces (``write_counted``: the archive
    writer, bytes serialized already) writes them straight into the file: no copy through a
    buffer, and no buffer to allocate (a fresh megabyte per file is 256 page faults of 4 KiB).
    Anything else is written through a buffer of *buffer_size* bytes.
    """
    result = _write_counted(payload, raw)
    if result is not None:
        return result
    buffered = io.BufferedWriter(raw, buffer_size)
    result = _write_checksummed(payload, buffered)
    buffered.flush()
    buffered.detach()  # the caller closes *raw*; collecting the buffer must not close it
    return result


def _write_counted(payload: Payload, out: BinaryIO) -> WriteResult | None:
    counted = getattr(payload, "write_counted", None)
    return None if counted is None else counted(out)


def _write_checksummed(payload: Payload, out: BinaryIO) -> WriteResult:
    writer = ChecksumWriter(out)
    payload.write_to(writer)  # type: ignore[arg-type]  # a minimal BinaryIO
    return writer.result()


def checksum_of(data: bytes | memoryview) -> str:
    """The checksum string of a whole buffer, as :class:`ChecksumWriter` computes it."""
    return f"crc32:{zlib.crc32(data):08x}"


def check_relative(path: str) -> str:
    """Return *path* if it is a relative path that stays below a storage's root.

    Backends call it on every path they are given (also their own temporary and record
    paths, which may start with ``.``): absolute paths, ``.``/``..`` and empty segments,
    backslashes and NUL bytes are refused, so no caller -- a hostile record included -- can
    make a storage reach outside its root by name.

    Raises:
        StoragePermissionError: The path could leave the root.
    """
    parts = path.split("/")
    if (
        not path
        or path.startswith("/")
        or "\\" in path
        or "\x00" in path
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise StoragePermissionError(f"refusing the path {path!r}: it could leave the storage")
    return path


def check_range(offset: int, length: int) -> None:
    """Refuse a negative offset or length (``ValueError``)."""
    if offset < 0 or length < 0:
        raise ValueError(f"a ranged read needs offset >= 0 and length >= 0, not {offset}, {length}")
