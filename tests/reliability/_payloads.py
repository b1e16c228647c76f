"""Deterministic payloads derived from a dump name, so a parent can recompute what a child wrote.

Imported both by the tests and by the child scripts (which run with this folder on ``sys.path``),
so it depends on nothing but torch and the standard library.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

KIB = 1024
MIB = 1024 * 1024


def seed_of(name: str) -> int:
    """A stable 32-bit seed for *name* (``hash()`` is salted per process; crc32 is not)."""
    return zlib.crc32(name.encode())


def size_for(name: str, low: int = KIB, high: int = 2 * MIB) -> int:
    """A size between *low* and *high*, log-uniformly spread, chosen by the name."""
    seed = seed_of(name)
    # mix small and large: a quarter of the dumps are large, the rest small to medium
    if seed % 4 == 0:
        return high - seed % max(1, high // 4)
    return low + seed % max(1, (high - low) // 16)


def pattern(seed: int, size: int) -> torch.Tensor:
    """``size`` pseudo-random bytes fixed by ``seed`` (numpy's generator: ~1 GB/s)."""
    data = bytearray(np.random.default_rng(seed).bytes(size))
    return torch.frombuffer(data, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)


def payload_for(name: str, low: int = KIB, high: int = 2 * MIB) -> dict[str, Any]:
    """What a child dumps under *name*: plain data (a dict of tensors and scalars)."""
    seed = seed_of(name)
    return {"name": name, "seed": seed, "data": pattern(seed, size_for(name, low, high))}


def check_file(path: Path, name: str, low: int = KIB, high: int = 2 * MIB) -> None:
    """Load a dump safely and assert it equals :func:`payload_for` of *name*."""
    loaded = torch.load(path, weights_only=True)
    expected = payload_for(name, low, high)
    assert loaded["name"] == expected["name"], (path, loaded["name"])
    assert loaded["seed"] == expected["seed"], path
    assert torch.equal(loaded["data"], expected["data"]), path
