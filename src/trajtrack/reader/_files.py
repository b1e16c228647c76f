"""Two local dump files compared byte for byte without reading them into memory.

``diff`` asks first whether a pair is byte-identical (then nothing is loaded). For local files
that is answered on memory maps of the two files: the page cache is compared in place (numpy,
as 8-byte words, in chunks; numpy releases the GIL while it compares and while the pages fault
in), with no copy into a fresh ``bytes`` object and no allocation per file.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

__all__ = ["FilePair", "compare_files"]

_ZIP_MAGIC = b"PK\x03\x04"  # a torch.save archive is a zip file
_WORDS = 1 << 15  # 8-byte words compared per numpy call: 256 KiB, and a 32 KiB mask


@dataclass(frozen=True, slots=True)
class FilePair:
    """What :func:`compare_files` found.

    Attributes:
        equal: The two files hold the same bytes.
        zip_a: File A starts like a zip archive (a ``torch.save`` file: it can be mapped).
        zip_b: File B starts like a zip archive.
    """

    equal: bool
    zip_a: bool
    zip_b: bool


def compare_files(path_a: str, path_b: str) -> FilePair:
    """Compare two files' contents (blocking).

    A file truncated by someone else while it is compared kills the process (``SIGBUS``), as
    with any memory map; trajtrack's writers never truncate a published file (they rename).

    Raises:
        OSError: A file cannot be opened or mapped.
    """
    with open(path_a, "rb", buffering=0) as file_a, open(path_b, "rb", buffering=0) as file_b:
        size_a, size_b = os.fstat(file_a.fileno()).st_size, os.fstat(file_b.fileno()).st_size
        with _mapped(file_a, size_a) as a, _mapped(file_b, size_b) as b:
            zip_a, zip_b = a[:4] == _ZIP_MAGIC, b[:4] == _ZIP_MAGIC
            equal = size_a == size_b and _same_bytes(a, b, size_a)
    return FilePair(equal, zip_a, zip_b)


@contextlib.contextmanager
def _mapped(file: BinaryIO, size: int) -> Iterator[mmap.mmap | bytes]:
    if size == 0:  # an empty file cannot be mapped
        yield b""
        return
    with mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ) as mapped:
        yield mapped


def _same_bytes(a: mmap.mmap | bytes, b: mmap.mmap | bytes, size: int) -> bool:
    whole = size // 8 * 8
    words_a = np.frombuffer(a, dtype=np.uint64, count=whole // 8)
    words_b = np.frombuffer(b, dtype=np.uint64, count=whole // 8)
    try:
        for start in range(0, words_a.size, _WORDS):
            end = start + _WORDS
            if not np.array_equal(words_a[start:end], words_b[start:end]):
                return False
        return a[whole:size] == b[whole:size]
    finally:
        del words_a, words_b  # the maps cannot close while an array views them
