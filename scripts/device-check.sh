#!/usr/bin/env bash
# The GPU checks, as one short script for a machine with a CUDA device: the CUDA snapshot tests
# and a measurement of how long dump() holds the caller and the compute stream for GPU tensors.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e . pytest pytest-timeout blockbuster 2>&1 | tail -1 || true
python3 -m pytest -q -p no:cacheprovider tests/tracker/test_cuda.py
python3 - <<'PY'
import asyncio, time, torch, tempfile
from trajtrack import Tracker

async def main():
    x = torch.randn(64 << 20, device="cuda")
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        async with Tracker(d) as t:
            for _ in range(3):
                s = time.perf_counter(); h = await t.dump({"x": x}, "x"); caller = time.perf_counter() - s
                s = time.perf_counter(); x.mul_(1.0); torch.cuda.synchronize(); stream = time.perf_counter() - s
                await h
                print(f"256 MB CUDA dump: caller {caller*1e3:.2f} ms, next kernel + sync {stream*1e3:.2f} ms")
asyncio.run(main())
PY
