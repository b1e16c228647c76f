"""The CUDA snapshot path: a device clone on the current stream, then an asynchronous copy to
pinned host memory on a side stream. Runs only where a GPU is present (see
scripts/device-check.sh for the run on a GPU machine)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from trajtrack import Tracker
from trajtrack.tracker._snapshot import has_cuda_tensor, snapshot_plain

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_has_cuda_tensor_is_false_on_cpu_data() -> None:
    assert not has_cuda_tensor({"a": [torch.ones(1), (torch.zeros(2),)], "b": 3})


@cuda
def test_snapshot_is_not_affected_by_later_kernels() -> None:
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    payload = snapshot_plain({"x": x})
    x.mul_(0)  # queued on the current stream after the device clone: must not leak in
    buffer = io.BytesIO()
    payload.write_to(buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["x"].device.type == "cpu"
    assert torch.equal(loaded["x"], torch.arange(1 << 20, dtype=torch.float32))


@cuda
async def test_cuda_dump_round_trip(tmp_path: Path) -> None:
    big = torch.randn(64 << 20, device="cuda")  # 256 MB: still the asynchronous copy path
    expected = big.cpu()
    async with Tracker(tmp_path) as tracker:
        handle = await tracker.dump({"w": big, "small": torch.ones(3, device="cuda")}, "gpu")
        big.zero_()
        record = await handle
    loaded = torch.load(tmp_path / record.path, weights_only=True)
    assert loaded["w"].device.type == "cpu"
    assert torch.equal(loaded["w"], expected)
