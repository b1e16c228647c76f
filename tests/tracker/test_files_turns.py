"""The files layout's workers: small local files one batch after another, larger side by side.

Small files written by several threads at once only hand the GIL back and forth; larger ones
wait on the disk and gain from writing side by side (``tracker/_files.py``'s docstring).
"""

from __future__ import annotations

import threading
import time
import zlib
from pathlib import Path
from typing import Any

import anyio
import torch

from trajtrack import RetryPolicy, StorageUnavailableError, Tracker
from trajtrack.backends.local import LocalStorage
from trajtrack.tracker._files import SMALL_BYTES


class CountingLocalStorage(LocalStorage):
    """The local backend, counting how many threads are inside a file's write at once."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self._lock = threading.Lock()
        self._inside = 0
        self.most_at_once = 0

    def _write_sync(self, path: str, payload: Any, overwrite: bool, *rest: Any) -> Any:
        with self._lock:
            self._inside += 1
            self.most_at_once = max(self.most_at_once, self._inside)
        try:
            time.sleep(0.002)  # widens the window in which another thread could be inside
            return super()._write_sync(path, payload, overwrite, *rest)
        finally:
            with self._lock:
                self._inside -= 1


async def _dump_all(dest: Path, tensors: list[torch.Tensor]) -> CountingLocalStorage:
    """Dump each tensor, check each file against it; the storage, with its count."""
    storage = CountingLocalStorage(str(dest))
    async with Tracker(dest, storage=storage, workers=4) as tracker:
        handles = [tracker.dump_nowait({"t": t}, f"d{i}") for i, t in enumerate(tensors)]
        with anyio.fail_after(120):  # a hang guard, not a timing
            await tracker.flush()
        records = [await handle for handle in handles]
    for i, (tensor, record) in enumerate(zip(tensors, records, strict=True)):
        path = dest / f"d{i}.pth"
        assert record.checksum == f"crc32:{zlib.crc32(path.read_bytes()):08x}"
        assert torch.equal(torch.load(path, weights_only=True)["t"], tensor)
    return storage


async def test_small_local_files_are_written_by_one_thread_at_a_time(tmp_path: Path) -> None:
    tensors = [torch.full((256,), float(i)) for i in range(400)]  # 1 KiB each
    storage = await _dump_all(tmp_path, tensors)
    assert storage.most_at_once == 1


async def test_larger_local_files_are_written_side_by_side(tmp_path: Path) -> None:
    count = SMALL_BYTES * 2 // 4  # float32 elements: twice the small size
    tensors = [torch.full((count,), float(i)) for i in range(40)]
    storage = await _dump_all(tmp_path, tensors)
    assert storage.most_at_once > 1


class FlakyLocalStorage(LocalStorage):
    """The local backend, whose first two writes of ``d0.pth`` fail transiently."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.failures = 0
        self.backing_off = threading.Event()  # set at the second failure: a backoff follows

    def _write_sync(self, path: str, payload: Any, overwrite: bool, *rest: Any) -> Any:
        if path == "d0.pth" and self.failures < 2:
            self.failures += 1
            if self.failures == 2:
                self.backing_off.set()
            raise StorageUnavailableError("the disk is away for a moment")
        return super()._write_sync(path, payload, overwrite, *rest)


async def test_a_retry_waits_out_its_backoff_without_holding_the_turn(tmp_path: Path) -> None:
    # Small local files are written one batch at a time; a dump that failed transiently must
    # not keep the other workers from writing while it waits to be retried.
    storage = FlakyLocalStorage(str(tmp_path))
    retry = RetryPolicy(initial_backoff=3.0, jitter=0.0, deadline=60.0)
    tensors = [torch.full((256,), float(i)) for i in range(2)]
    async with Tracker(tmp_path, storage=storage, workers=4, retry=retry) as tracker:
        first = await tracker.dump({"t": tensors[0]}, "d0")
        with anyio.fail_after(30):  # a hang guard, not a timing
            assert await anyio.to_thread.run_sync(storage.backing_off.wait, 30)
            second = await (await tracker.dump({"t": tensors[1]}, "d1"))
            assert not first.done()  # d0 is still waiting out its 3 s backoff
            await first
    assert second.path == "d1.pth"
    for i, tensor in enumerate(tensors):
        assert torch.equal(torch.load(tmp_path / f"d{i}.pth", weights_only=True)["t"], tensor)
    assert tracker.statistics().retries >= 1
