"""The tracker runs on asyncio only, and says so where another event loop runs it."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from trajtrack import Tracker, TrackerStateError


def test_a_tracker_under_trio_fails_clearly_and_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "run"

    async def main() -> None:
        async with Tracker(root) as tracker:
            await tracker.dump({"x": 1}, "d0")

    with pytest.raises(TrackerStateError, match="runs on asyncio") as caught:
        trio.run(main)
    assert "SyncTracker" in str(caught.value)
    assert not root.exists()  # failed before opening the storage
