"""The read-ahead of ``diff``: every pair advised, once, in order, never too far ahead."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import pytest

import trajtrack.reader._readahead as readahead
from trajtrack.reader._readahead import ReadAhead


@pytest.fixture
def advised(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    """The pairs advised; the advice runs on the event loop here, so it can be stepped."""
    seen: list[tuple[str, str, int]] = []

    async def inline(func: Any, *args: Any, **_: Any) -> Any:
        return func(*args)

    def record(batch: Any) -> None:
        seen.extend(batch)

    monkeypatch.setattr(readahead.anyio.to_thread, "run_sync", inline)
    monkeypatch.setattr(readahead, "_advise", record)
    return seen


@pytest.mark.parametrize(("size", "most_ahead"), [(1, 64), (100 << 20, 2)])
async def test_pairs_are_advised_in_order_and_boundedly_ahead(
    advised: list[tuple[str, str, int]], size: int, most_ahead: int
) -> None:
    pairs = [(f"a{i}", f"b{i}", size) for i in range(150)]
    ahead_of = ReadAhead(pairs)
    async with anyio.create_task_group() as group:
        group.start_soon(ahead_of.run)
        for compared in range(len(pairs)):
            await anyio.wait_all_tasks_blocked()  # the read-ahead advised all it may
            assert compared < len(advised) <= compared + most_ahead
            ahead_of.finished()
        group.cancel_scope.cancel()
    assert advised == pairs  # each once, in order


async def test_the_advice_reaches_the_kernel_and_skips_missing_files(tmp_path: Path) -> None:
    present = tmp_path / "f"
    present.write_bytes(b"x" * 100)
    calls: list[int] = []
    real = os.posix_fadvise
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(readahead.os, "posix_fadvise", lambda *a: calls.append(a[3]) or real(*a))
        readahead._advise([(str(present), str(tmp_path / "absent"), 100)])
    assert calls == [os.POSIX_FADV_WILLNEED]
