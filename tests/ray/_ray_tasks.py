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
