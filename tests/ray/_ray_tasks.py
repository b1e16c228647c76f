"""Functions the adapter tests run as Ray tasks (imported by name in the worker processes)."""

from __future__ import annotations

import collections
import os
import time
from typing import Any

import torch

import trajtrack.ray as tr


def wait_until_gone(pid: int, timeout: float = 30.0) -> None:
    """Return once process *pid* (a killed actor's, on this machine) has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the killed actor's process {pid} is still alive after {timeout} s")


def payload(i: int) -> dict[str, Any]:
    """What task *i* dumps: deterministic, so the test can rebuild it."""
    generator = torch.Generator().manual_seed(1000 + i)
    return {"obs": torch.randn(10, 20, generator=generator), "step": i}


def dump_one(i: int) -> int:
    """Dump ``process_{i}_obs`` like verl's demo; return this worker's pid."""
    tr.dump_data(payload(i), f"process_{i}_obs")
    return os.getpid()


def shard_payloads(i: int) -> dict[str, Any]:
    """What task *i* dumps in the shards tests, by name: deterministic, so tests rebuild it.

    Two plain dicts (they cross the channel as raw tensor bytes) and an ``OrderedDict``, which
    is not plain data: it goes as ``torch.save`` bytes made in the caller.
    """
    generator = torch.Generator().manual_seed(2000 + i)
    return {
        f"task{i}/obs": {"obs": torch.randn(4, 8, generator=generator), "step": i},
        f"task{i}/ids": {"ids": torch.arange(i, i + 16), "mask": torch.arange(16) % 3 == 0},
        f"task{i}/ordered": collections.OrderedDict(x=torch.full((3,), float(i)), i=i),
    }


def dump_shard_payloads(i: int, wait: bool) -> int:
    """Dump :func:`shard_payloads` acknowledged (*wait*) or pipelined; return this pid."""
    for name, obj in shard_payloads(i).items():
        tr.dump_data(obj, name, wait=wait)
    if not wait:
        tr.wait_for_own_dumps(timeout=60)  # the actor has them before the task returns
    return os.getpid()


class GateActor:
    """Stands in for the tracker actor: holds every batch until :meth:`open` (tests only).

    The real actor cannot be made to stall on demand; this one lets the tests keep pipelined
    dumps in flight for as long as they need. Created under the tracker's name, so the client
    finds it like the real one.
    """

    def __init__(self, destination: str, hold_ready: bool = False) -> None:
        import asyncio

        self._destination = destination
        self._gate = asyncio.Event()
        self._hold_ready = hold_ready  # ready() too waits for open(): an actor slow to start
        self._names: list[str] = []

    async def ready(self) -> dict[str, Any]:
        if self._hold_ready:
            await self._gate.wait()
        return {"destination": self._destination, "pid": os.getpid(), "host": "", "token": "gate"}

    async def dump(self, data: bytes, name: str, who: Any = None) -> None:
        await self._gate.wait()
        self._names.append(name)

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


def start_gate(name: str, destination: str, *, hold_ready: bool = False) -> Any:
    """A :class:`GateActor` under the tracker's *name*, started (its gate still closed)."""
    import ray

    gate = (
        ray.remote(GateActor)
        .options(name=name, namespace=tr.DEFAULT_NAMESPACE)
        .remote(destination, hold_ready=hold_ready)
    )
    ray.get(gate.received.remote(), timeout=90)  # answers even while ready() is held
    return gate


def dump_and_tell_the_channel(i: int) -> tuple[str, bool]:
    """Dump ``node/ack{i}`` acknowledged and ``node/pipe{i}`` pipelined; return this worker's
    Ray node and whether it has a channel to the actor (else its dumps went as Ray calls)."""
    import ray

    from trajtrack.ray import _discovery

    tr.dump_data({"i": torch.tensor(i)}, f"node/ack{i}")
    tr.dump_data({"i": torch.tensor(100 + i)}, f"node/pipe{i}", wait=False)
    tr.wait_for_own_dumps(timeout=60)
    return ray.get_runtime_context().get_node_id(), _discovery.current().channel is not None
