"""Nothing the tracker does may block the event loop while dumping."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import torch
from blockbuster import BlockBuster, blockbuster_ctx

from trajtrack import Tracker


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor


@pytest.fixture
def blockbuster() -> Iterator[BlockBuster]:
    # Raises BlockingError for blocking calls (file I/O, sleeps, socket waits, ...) made on the
    # event loop thread; worker threads are allowed to block.
    with blockbuster_ctx("trajtrack") as bb:
        yield bb


async def test_dumping_makes_no_blocking_call_on_the_loop(
    tmp_path: Path, blockbuster: BlockBuster
) -> None:
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


async def test_event_loop_keeps_ticking_during_large_dumps(tmp_path: Path) -> None:
    """A guard, not a benchmark: the bound is ten times what the benchmark measures."""
    lags: list[float] = []
    done = anyio.Event()

    async def ticker() -> None:
        while not done.is_set():
            start = time.perf_counter()
            await anyio.sleep(0.001)
            lags.append(time.perf_counter() - start - 0.001)

    payload = {"weights": torch.randn(16 << 20)}  # 64 MB
    async with anyio.create_task_group() as group:
        group.start_soon(ticker)
        async with Tracker(tmp_path, workers=2) as tracker:
            for i in range(3):
                await tracker.dump(payload, f"big{i}")
            await tracker.flush()
        done.set()
    assert len(list(tmp_path.glob("big*.pth"))) == 3
    assert max(lags) < 0.5, f"the event loop stalled for {max(lags):.3f} s"
