"""Functions the adapter tests run as Ray tasks (imported by name in the worker processes)."""

from __future__ import annotations

import os
from typing import Any

import torch

import trajtrack.ray as tr


def payload(i: int) -> dict[str, Any]:
    """What task *i* dumps: deterministic, so the test can rebuild it."""
    generator = torch.Generator().manual_seed(1000 + i)
    return {"obs": torch.randn(10, 20, generator=generator), "step": i}


def dump_one(i: int) -> int:
    """Dump ``process_{i}_obs`` like verl's demo; return this worker's pid."""
    tr.dump_data(payload(i), f"process_{i}_obs")
    return os.getpid()


class GateActor:
    """Stands in for the tracker actor: holds every batch until :meth:`open` (tests only).

    The real actor cannot be made to stall on demand; this one lets the tests keep pipelined
    dumps in flight for as long as they need. Created under the tracker's name, so the client
    finds it like the real one.
    """

    def __init__(self, destination: str) -> None:
        import asyncio

        self._destination = destination
        self._gate = asyncio.Event()
        self._names: list[str] = []

    async def ready(self) -> dict[str, Any]:
        return {"destination": self._destination, "pid": os.getpid(), "host": "", "token": "gate"}

    async def dump_many(self, data: list[bytes], names: list[str], who: Any) -> list[Any]:
        await self._gate.wait()
        self._names.extend(names)
        return []

    async def open(self) -> None:
        self._gate.set()

    async def received(self) -> list[str]:
        return list(self._names)

    async def flush(self, timeout: float | None = None) -> None:
        return None

    async def close(self, timeout: float | None = None) -> None:
        return None
