"""A large dump that cannot be spooled to local disk fails with a typed error from ``dump()``.

Large plain data and anything not plain is serialized by ``dump()`` into a local spool (a file
or a spooled temporary file). When the operating system refuses that file (the disk is full,
the spool directory is not a directory), the caller gets a :class:`StorageError` -- the
spool's failure, not the object's -- and nothing is queued; a failure of the object itself
stays a :class:`SerializationError`. A full disk is made by a serializer that fails the way a
write to a full disk does (``ENOSPC``), since the suite cannot fill a real disk safely.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import torch

from trajtrack import Tracker
from trajtrack._exceptions import SerializationError, StorageError

pytestmark = pytest.mark.anyio

LARGE = {"x": torch.zeros(4096)}  # 16 KiB: above the inline_snapshot_bytes used below


@dataclass
class NotPlain:
    """Not plain data: serialized at once into a spooled temporary file."""

    value: int


def disk_full(obj: Any, out: BinaryIO) -> None:
    out.write(b"partial")
    raise OSError(errno.ENOSPC, "No space left on device")


def broken_object(obj: Any, out: BinaryIO) -> None:
    raise ValueError("this object cannot be pickled")


async def test_a_spool_directory_that_is_a_file_is_a_storage_error(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "spool"
    not_a_dir.write_bytes(b"the user's file")
    async with Tracker(
        "memory://spool-not-dir", spool_dir=str(not_a_dir), inline_snapshot_bytes=1024
    ) as tracker:
        with pytest.raises(StorageError, match="could not spool the dump") as caught:
            await tracker.dump(LARGE, "big")
        assert not isinstance(caught.value, SerializationError)
        await (await tracker.dump({"x": torch.ones(4)}, "small")).wait(10)
        assert tracker.statistics().committed == 1  # the failed dump queued nothing
    assert not_a_dir.read_bytes() == b"the user's file"


@pytest.mark.parametrize("obj", [LARGE, NotPlain(3)], ids=["spool file", "spooled in memory"])
async def test_a_full_disk_while_spooling_is_a_storage_error(tmp_path: Path, obj: Any) -> None:
    async with Tracker(
        tmp_path / "run", serializer=disk_full, inline_snapshot_bytes=1024
    ) as tracker:
        with pytest.raises(StorageError, match="no space left on the device"):
            await tracker.dump(obj, "big")
    left = [p.name for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert not [name for name in left if "spool" in name]  # the partial spool is gone


@pytest.mark.parametrize("obj", [LARGE, NotPlain(3)], ids=["spool file", "spooled in memory"])
async def test_an_object_that_fails_to_serialize_stays_a_serialization_error(
    tmp_path: Path, obj: Any
) -> None:
    async with Tracker(
        tmp_path / "run", serializer=broken_object, inline_snapshot_bytes=1024
    ) as tracker:
        with pytest.raises(SerializationError, match="cannot be pickled"):
            await tracker.dump(obj, "big")
