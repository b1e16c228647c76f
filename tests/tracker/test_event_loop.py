"""Nothing the tracker does may block the event loop while dumping."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path
from typing import BinaryIO

import anyio
import torch

from trajtrack import Tracker


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor


async def test_dumping_makes_no_blocking_call_on_the_loop(tmp_path: Path) -> None:
    # tests/conftest.py runs blockbuster around every async test: a blocking call that the
    # tracker makes on the event loop (file I/O, sleeps, socket waits) raises BlockingError.
    async with Tracker(tmp_path, record_interval=0.05) as tracker:
        handles = []
        for i in range(50):
            handles.append(await tracker.dump({"x": torch.randn(64)}, f"small/{i}"))
            handles.append(await tracker.dump(Batch(torch.ones(4)), f"obj/{i}"))
        handles.append(await tracker.dump({"big": torch.zeros(1 << 19)}, "big"))  # 2 MB
        await tracker.flush()
        for handle in handles:
            await handle
    assert len(list(tmp_path.glob("*/*.pth"))) == 100


async def test_the_event_loop_runs_while_large_dumps_serialize(tmp_path: Path) -> None:
    """The loop keeps running *during* serialization, not merely between dumps.

    The serializer itself waits, in its worker thread, until a ticker task on the loop has
    ticked three times. Were serialization done on the loop, the ticker could not tick and
    the dump would fail after the hang guard (no timing is asserted).
    """
    ticks = 0
    ticked = threading.Event()
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            await anyio.sleep(0.001)
            ticks += 1
            if ticks >= 3:
                ticked.set()

    def waiting_save(obj: object, out: BinaryIO) -> None:
        ticked.clear()
        if not ticked.wait(timeout=30):  # a hang guard only
            raise RuntimeError("the event loop did not run while the dump was serialized")
        torch.save(obj, out)

    payload = {"weights": torch.randn(16 << 20)}  # 64 MB: serialized in a worker thread
    async with anyio.create_task_group() as group:
        group.start_soon(ticker)
        async with Tracker(tmp_path, workers=2, serializer=waiting_save) as tracker:
            handles = [await tracker.dump(payload, f"big{i}") for i in range(3)]
            await tracker.flush(timeout=120)
            for handle in handles:
                await handle
        done.set()
    assert len(list(tmp_path.glob("big*.pth"))) == 3


_FIRST_USE = """
import asyncio, sys, threading
import torch
import trajtrack
from trajtrack import Tracker, open_run

loop_thread = None
imported_on_the_loop = []

class Watch:  # asked first for every module not imported yet; finds none itself
    def find_spec(self, name, path=None, target=None):
        if threading.get_ident() == loop_thread:
            imported_on_the_loop.append(name)
        return None

async def main(root):
    global loop_thread
    loop_thread = threading.get_ident()
    async with Tracker(root) as tracker:
        await tracker.dump({"x": torch.ones(1000)}, "small")
        await tracker.dump({"x": torch.ones(1 << 18)}, "copied")  # 1 MiB: the caller's copy
        await tracker.dump({"x": torch.ones(5 << 18)}, "spooled")  # 5 MiB: a spool file
        await tracker.flush()
    async with open_run(root) as run:
        assert len(await run.list()) == 3
    loop_thread = None

sys.meta_path.insert(0, Watch())
asyncio.run(main(sys.argv[1]))
print(sorted(set(imported_on_the_loop)))
"""


def test_a_first_tracker_imports_nothing_on_the_event_loop(tmp_path: Path) -> None:
    """An import on the loop's thread is a stall of the loop: anyio's asyncio backend, which
    anyio loads on its first use in a running loop, is loaded in a worker thread by the first
    ``start``; everything else is imported with trajtrack."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _FIRST_USE, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.strip() == "[]", done.stdout


async def test_a_producer_that_awaits_only_dump_lets_the_uploads_run(tmp_path: Path) -> None:
    """dump() yields to the loop now and then when the producer awaits nothing else.

    The upload workers' thread results come back through the loop: without that yield, a
    producer dumping in a tight loop would commit nothing until it stopped.
    """
    # A queue that never fills: a full one would make dump() wait on the loop.
    async with Tracker(tmp_path, max_pending_items=10**6, max_pending_bytes=1 << 34) as tracker:
        deadline = time.monotonic() + 5
        while tracker.statistics().committed == 0 and time.monotonic() < deadline:
            await tracker.dump({"x": torch.arange(16)}, f"d{tracker.statistics().enqueued}")
        committed_while_dumping = tracker.statistics().committed
    assert committed_while_dumping > 0


async def test_dump_does_not_yield_when_the_producer_lets_the_loop_run(tmp_path: Path) -> None:
    """A producer that awaits other things between dumps gets each dump() without a yield.

    A yield there would make each dump wait for the upload workers' turn on the loop. A
    callback scheduled before the dump shows whether the loop ran during it.
    """
    loop = asyncio.get_running_loop()
    async with Tracker(tmp_path) as tracker:
        ran_during_dump = []
        for i in range(20):
            await asyncio.sleep(0.002)  # the producer's other work: the loop runs
            ran: list[int] = []
            loop.call_soon(ran.append, i)
            await tracker.dump({"x": torch.arange(16)}, f"d{i}")
            ran_during_dump.append(bool(ran))
        await tracker.flush()
    assert not any(ran_during_dump)
