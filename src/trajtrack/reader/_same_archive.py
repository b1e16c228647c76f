"""Two ``torch.save`` archives that hold the same records apart from torch's per-save id.

``torch.save`` writes a ``.data/serialization_id`` record into every archive; where it varies
from one save to the next, a rerun that dumps the very same object writes files that differ
in those bytes only. :func:`same_apart_from_serialization_id` says so without loading anything
(the content may be one a safe load refuses): both zip directories read with the standard
library's :mod:`zipfile`, the same members in the same order, every member stored (not
compressed: no inflating of what a run claims), and every member's bytes equal except that
record's. Reads are bounded by the files themselves: members whose sizes add up to more than
the archive are not compared.
"""

from __future__ import annotations

import io
import os
import zipfile
from typing import IO

__all__ = ["same_apart_from_serialization_id"]

_ID_RECORD = ".data/serialization_id"
_CHUNK = 1 << 20


def same_apart_from_serialization_id(
    a: bytes | str | os.PathLike[str], b: bytes | str | os.PathLike[str]
) -> bool:
    """Whether archives *a* and *b* (bytes or local paths) are torch archives equal in every
    member but ``<root>/.data/serialization_id`` (blocking; ``False`` for anything else)."""
    try:
        with (
            _open(a) as file_a,
            _open(b) as file_b,
            zipfile.ZipFile(file_a) as zip_a,
            zipfile.ZipFile(file_b) as zip_b,
        ):
            members = _paired(zip_a, zip_b, _size(file_a), _size(file_b))
            if members is None:
                return False
            return all(_same_member(zip_a, zip_b, x, y) for x, y in members)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError):
        return False
    except (NotImplementedError, RuntimeError):  # encrypted or otherwise unreadable members
        return False


def _open(source: bytes | str | os.PathLike[str]) -> IO[bytes]:
    if isinstance(source, bytes):
        return io.BytesIO(source)
    return open(source, "rb")  # closed by the caller's with


def _size(file: IO[bytes]) -> int:
    return file.seek(0, os.SEEK_END)


def _paired(
    zip_a: zipfile.ZipFile, zip_b: zipfile.ZipFile, size_a: int, size_b: int
) -> list[tuple[zipfile.ZipInfo, zipfile.ZipInfo]] | None:
    """The members to compare, or ``None`` when the directories already differ (or are not
    a torch archive's, or claim more bytes than the files hold)."""
    infos_a, infos_b = zip_a.infolist(), zip_b.infolist()
    if len(infos_a) != len(infos_b) or not infos_a:
        return None
    if infos_a[0].header_offset or infos_b[0].header_offset:
        # Bytes before the first record: ``zipfile`` skips them, torch reads them as its
        # legacy format (see ``_torch_archive._check_start``), so the archives are not the
        # dumps torch would load. Opening the first member checks its header's signature.
        return None
    pairs, has_id = [], False
    for x, y in zip(infos_a, infos_b, strict=True):
        if x.filename != y.filename or x.compress_type != zipfile.ZIP_STORED:
            return None
        if y.compress_type != zipfile.ZIP_STORED:
            return None
        if x.filename.partition("/")[2] == _ID_RECORD:
            has_id = True
            continue
        if x.file_size != y.file_size or x.CRC != y.CRC:
            return None
        pairs.append((x, y))
    claimed = sum(x.file_size for x, _ in pairs)
    if not has_id or claimed > size_a or claimed > size_b:
        return None
    return pairs


def _same_member(
    zip_a: zipfile.ZipFile, zip_b: zipfile.ZipFile, x: zipfile.ZipInfo, y: zipfile.ZipInfo
) -> bool:
    with zip_a.open(x) as member_a, zip_b.open(y) as member_b:
        while True:
            chunk = member_a.read(_CHUNK)
            if chunk != member_b.read(_CHUNK):
                return False
            if not chunk:
                return True
