"""torch's zip container, laid out as ``torch.save`` lays it out and written in one pass.

The records of ``torch.save(obj, file_object)`` in torch 2.13, in its order: ``data.pkl``,
``.format_version``, ``.storage_alignment``, ``byteorder``, ``data/0`` ... (one per storage),
``version``, ``.data/serialization_id``; then the central directory, a zip64 end record and
its locator (torch's miniz always writes them) and the classic end record. Every local header
carries torch's padding extra field (``FB``, a length, ``Z`` bytes) so that each record's data
starts at a multiple of 64 (``torch.load(mmap=True)`` maps storages in place); the local
headers have zero CRC and sizes, and a data descriptor after the data carries them (general
purpose flag bit 3), except for empty records, which have neither. torch's reader, Python's
``zipfile`` and torch's older readers all accept this: it is what torch writes.

The CRC-32 of each storage is computed once (from :data:`PARALLEL_CRC_MIN` on, by a helper
thread while the writing thread writes the same memory), and the file's CRC-32 is combined from
the pieces' CRCs (:func:`crc32_extend`, where isal is installed) rather than read again. Only
headers and a pickle of up to 64 KiB are read a second time, which is cheaper than combining.
Archives of 4 GiB or more would need zip64 extra fields: they are refused (the caller falls
back to ``torch.save``).
"""

from __future__ import annotations

import struct
import sys
import threading
import zlib
from collections.abc import Sequence
from typing import Final, Protocol

from trajtrack.backends import write_all
from trajtrack.tracker._crc32 import crc32_big, crc32_extend

__all__ = ["PARALLEL_CRC_MIN", "ArchivePlan", "NotArchivable", "Writable"]

PARALLEL_CRC_MIN: Final = 8 << 20
"""Storages of at least this size get their CRC-32 from a helper thread, during the write.

Starting and joining that thread is a fixed cost, higher while the tracker's workers hold the
GIL, and the CRC-32 it takes off the caller's thread grows with the storage: below 8 MiB the
thread saves too little to be worth its start (``benchmarks/bench_archive.py``: wall and CPU
time of the archive writer at 1 MB and 256 MB)."""

_JOIN_MAX: Final = 64 << 10  # smaller storages are copied into one write with the headers
_ALIGNMENT: Final = 64  # torch.serialization._get_storage_alignment()
_PREFIX: Final = b"archive/"  # the folder torch.save uses when writing to a file object
_PICKLE_NAME: Final = _PREFIX + b"data.pkl"
_CONSTANT_HEAD: Final = (  # the records between the pickle and the storages
    (_PREFIX + b".format_version", b"1"),
    (_PREFIX + b".storage_alignment", str(_ALIGNMENT).encode()),
    (_PREFIX + b"byteorder", sys.byteorder.encode()),
)
_VERSION: Final = b"3\n"  # the "version" record of torch 2.13: file format version 3
_SERIALIZATION_ID: Final = _PREFIX + b".data/serialization_id"
_SERIALIZATION_ID_LEN: Final = 40  # what torch writes: 40 decimal digits

_LOCAL: Final = struct.Struct("<IHHHHHIIIHH")
_DESCRIPTOR: Final = struct.Struct("<IIII")
_CENTRAL: Final = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_END: Final = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR: Final = struct.Struct("<IIQI")
_END: Final = struct.Struct("<IHHHHIIH")
# General-purpose flags as torch's miniz sets them: bit 11 (UTF-8 names), and bit 3 (CRC-32
# and sizes in a data descriptor) for every record but an empty one.
_FLAGS: Final = 0x0808
_FLAGS_EMPTY: Final = 0x0800
_LIMIT: Final = 0xFFFFFFFF  # sizes and offsets from here on need zip64 extra fields
_MAX_RECORDS: Final = 0xFFFF  # as do record counts from here on


class NotArchivable(Exception):
    """Internal: the object holds something only ``torch.save`` writes correctly."""


class Writable(Protocol):
    """What :meth:`ArchivePlan.write_to` needs of its output: ``write`` (a file, a BytesIO)."""

    def write(self, data: bytes | memoryview, /) -> int | None: ...


def _local_header(name: bytes, offset: int, size: int) -> bytes:
    start = offset + _LOCAL.size + len(name) + 4  # where the data would start without padding
    pad = -start % _ALIGNMENT
    flags = _FLAGS if size else _FLAGS_EMPTY
    header = _LOCAL.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(name), pad + 4)
    return header + name + b"FB" + pad.to_bytes(2, "little") + b"Z" * pad


def _descriptor(crc: int, size: int) -> bytes:
    return _DESCRIPTOR.pack(0x08074B50, crc, size, size) if size else b""


def _central(name: bytes, offset: int, size: int, crc: int) -> bytes:
    flags = _FLAGS if size else _FLAGS_EMPTY
    entry = _CENTRAL.pack(
        0x02014B50, 0, 0, flags, 0, 0, 0, crc, size, size, len(name), 0, 0, 0, 0, 0, offset
    )
    return entry + name


_PICKLE_HEADER: Final = _local_header(_PICKLE_NAME, 0, 1)  # at offset 0, sizes in the descriptor
_PICKLE_HEADER_CRC: Final = zlib.crc32(_PICKLE_HEADER)


class _Layout:
    """Everything about an archive that depends only on the sizes of its records.

    Dumps of one training loop mostly repeat their shapes, so layouts are cached by sizes.
    """

    def __init__(self, pickle_size: int, sizes: tuple[int, ...], id_size: int) -> None:
        offset = len(_PICKLE_HEADER) + pickle_size + _DESCRIPTOR.size
        constant: list[bytes] = []
        central: list[bytes] = []
        for name, data in _CONSTANT_HEAD:
            offset = _record(name, data, offset, constant, central)
        self.after_pickle = b"".join(constant)
        self.central_head = b"".join(central)
        self.sizes = sizes
        self.names = [b"%sdata/%d" % (_PREFIX, key) for key in range(len(sizes))]
        self.offsets: list[int] = []
        self.headers: list[bytes] = []
        for name, size in zip(self.names, sizes, strict=True):
            header = _local_header(name, offset, size)
            self.offsets.append(offset)
            self.headers.append(header)
            offset += len(header) + size + (_DESCRIPTOR.size if size else 0)
        if offset >= _LIMIT:
            raise NotArchivable("4 GiB or more: an archive with zip64 fields")
        version: list[bytes] = []
        central = []
        offset = _record(_PREFIX + b"version", _VERSION, offset, version, central)
        self.version = b"".join(version)
        self.central_version = central[0]
        self.id_offset = offset
        self.id_header = _local_header(_SERIALIZATION_ID, offset, id_size)
        offset += len(self.id_header) + id_size + (_DESCRIPTOR.size if id_size else 0)
        self.end, self.nbytes = self._end_records(offset)

    def _end_records(self, central_offset: int) -> tuple[bytes, int]:
        names = [_PICKLE_NAME, *(name for name, _ in _CONSTANT_HEAD), *self.names]
        names += [_PREFIX + b"version", _SERIALIZATION_ID]
        count = len(names)
        central_size = sum(_CENTRAL.size + len(name) for name in names)
        zip64_offset = central_offset + central_size
        end = b"".join(
            (
                # The zip64 end record as miniz writes it: version made by 3.0 on Unix (0x031e),
                # needed 4.5 (0x2d), disk 0.
                _ZIP64_END.pack(
                    0x06064B50, 44, 0x031E, 0x2D, 0, 0, count, count, central_size, central_offset
                ),
                _ZIP64_LOCATOR.pack(0x07064B50, 0, zip64_offset, 1),
                _END.pack(0x06054B50, 0, 0, count, count, central_size, central_offset, 0),
            )
        )
        nbytes = zip64_offset + len(end)
        if nbytes >= _LIMIT or count >= _MAX_RECORDS:
            raise NotArchivable("4 GiB or more, or 65,535 records: an archive with zip64 fields")
        return end, nbytes


def _record(name: bytes, data: bytes, offset: int, out: list[bytes], central: list[bytes]) -> int:
    """Append a record with constant *data* at *offset* (and its central entry); next offset."""
    crc = zlib.crc32(data)
    header = _local_header(name, offset, len(data))
    out += (header, data, _descriptor(crc, len(data)))
    central.append(_central(name, offset, len(data), crc))
    return offset + len(header) + len(data) + (_DESCRIPTOR.size if data else 0)


_layouts: dict[tuple[int, tuple[int, ...], int], _Layout] = {}
_LAYOUTS_KEPT: Final = 256


def _layout(pickle_size: int, sizes: tuple[int, ...], id_size: int) -> _Layout:
    key = (pickle_size, sizes, id_size)
    layout = _layouts.get(key)
    if layout is None:
        layout = _Layout(pickle_size, sizes, id_size)
        if len(_layouts) >= _LAYOUTS_KEPT:
            _layouts.clear()  # a loop whose sizes never repeat: keep the cache small
        _layouts[key] = layout
    return layout


class ArchivePlan:
    """An archive laid out (exact size known) and ready to be written, as often as needed.

    It holds the pickle and views of the storages' memory (which it keeps alive); each
    :meth:`write_to` writes the same bytes.
    """

    def __init__(
        self, pickled: bytes, views: Sequence[memoryview | bytes], serialization_id: str | None
    ) -> None:
        self._pickled = pickled
        self._pickle_crc = zlib.crc32(pickled)
        self._views = list(views)
        self._fixed_id = serialization_id.encode("ascii") if serialization_id is not None else None
        id_size = _SERIALIZATION_ID_LEN if self._fixed_id is None else len(self._fixed_id)
        sizes = tuple(len(view) for view in self._views)
        self._layout = _layout(len(pickled), sizes, id_size)
        self.nbytes: int = self._layout.nbytes
        """The exact size of the archive."""
        self.part_views = False
        """Whether a tensor holds only part of its storage (whose every byte is written)."""

    @property
    def pickled(self) -> bytes:
        """The pickle (``archive/data.pkl``)."""
        return self._pickled

    def write_to(self, out: Writable) -> tuple[int, str]:
        """Write the archive to *out*: ``(size, "crc32:<8 hex>")`` of the bytes written.

        *out* needs only ``write`` (no ``seek``, no ``tell``); a short count from a raw file is
        written on. Each storage is read by ``write`` and by the CRC, at the same time for big
        ones, and never again.
        """
        sizes = self._layout.sizes
        big = [
            view for view, size in zip(self._views, sizes, strict=True) if size >= PARALLEL_CRC_MIN
        ]
        worker = _Crc32Worker(big) if big else None
        try:
            crc = self._write(out, worker)
        finally:
            if worker is not None:
                worker.cancel()
        return self.nbytes, f"crc32:{crc:08x}"

    def _write(self, out: Writable, worker: _Crc32Worker | None) -> int:
        layout = self._layout
        pickle_size = len(self._pickled)
        descriptor = _descriptor(self._pickle_crc, pickle_size)
        # Written together, in one call, up to the first big storage.
        pending: list[bytes | memoryview] = [
            _PICKLE_HEADER,
            self._pickled,
            descriptor,
            layout.after_pickle,
        ]
        if pickle_size <= _JOIN_MAX:  # cheaper to read a small pickle again than to combine
            crc = zlib.crc32(self._pickled, _PICKLE_HEADER_CRC)
        else:
            crc = crc32_extend(_PICKLE_HEADER_CRC, self._pickled, self._pickle_crc, pickle_size)
        crc = zlib.crc32(layout.after_pickle, zlib.crc32(descriptor, crc))
        central = [_central(_PICKLE_NAME, 0, pickle_size, self._pickle_crc), layout.central_head]
        for index, view in enumerate(self._views):
            size = layout.sizes[index]
            header = layout.headers[index]
            pending.append(header)
            crc = zlib.crc32(header, crc)
            if size <= _JOIN_MAX:
                record_crc = zlib.crc32(view)
                pending.append(view)
            else:
                write_all(out.write, b"".join(pending))
                pending = []
                if worker is not None and size >= PARALLEL_CRC_MIN:
                    write_all(out.write, view)
                    record_crc = worker.next_result()
                else:
                    record_crc = crc32_big(view)
                    write_all(out.write, view)
            if size:
                crc = crc32_extend(crc, view, record_crc, size)
                descriptor = _descriptor(record_crc, size)
                crc = zlib.crc32(descriptor, crc)
                pending.append(descriptor)
            central.append(_central(layout.names[index], layout.offsets[index], size, record_crc))
        tail, crc = self._tail(crc, central)
        pending.append(tail)
        write_all(out.write, b"".join(pending))
        return crc

    def _tail(self, crc: int, central: list[bytes]) -> tuple[bytes, int]:
        """The records after the storages, the central directory, the end records; new CRC."""
        layout = self._layout
        crc = zlib.crc32(layout.id_header, zlib.crc32(layout.version, crc))
        # Derived from everything before it, so the same content gives the same id.
        identifier = self._fixed_id
        if identifier is None:
            identifier = b"%020d%020d" % (crc, layout.nbytes)
        id_crc = zlib.crc32(identifier)
        rest = b"".join(
            (
                identifier,
                _descriptor(id_crc, len(identifier)),
                *central,
                layout.central_version,
                _central(_SERIALIZATION_ID, layout.id_offset, len(identifier), id_crc),
                layout.end,
            )
        )
        return b"".join((layout.version, layout.id_header, rest)), zlib.crc32(rest, crc)


class _Crc32Worker:
    """Computes the CRC-32s of big storages, in order, in a thread of its own.

    ``zlib.crc32`` releases the GIL, so it runs on another core while the caller's thread
    writes the same memory. A thread per archive (:data:`PARALLEL_CRC_MIN`), not a pool:
    nothing outlives the write, and a forked child inherits no half-dead pool.
    """

    def __init__(self, views: list[memoryview | bytes]) -> None:
        self._views = views
        self._results: list[int | BaseException] = []
        self._ready = threading.Condition()
        self._cancelled = False
        self._next = 0
        self._thread = threading.Thread(target=self._run, name="trajtrack-crc32", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for view in self._views:
            if self._cancelled:  # the write failed: stop reading memory nobody needs
                return
            result: int | BaseException
            try:
                result = crc32_big(view)
            except BaseException as exc:  # handed to the writing thread, raised there
                result = exc
            with self._ready:
                self._results.append(result)
                self._ready.notify()

    def next_result(self) -> int:
        """The CRC-32 of the next view, once computed."""
        with self._ready:
            self._ready.wait_for(lambda: len(self._results) > self._next)
            result = self._results[self._next]
        self._next += 1
        if isinstance(result, BaseException):
            raise result
        return result

    def cancel(self) -> None:
        self._cancelled = True
