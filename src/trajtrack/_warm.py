"""What anyio would import the first time it is used inside a running event loop, imported with
trajtrack instead.

anyio loads its asyncio backend lazily, on the first anyio call made in a running loop: for a
rollouter, inside its first ``await tracker.dump(...)``, on the event loop's own thread. That
import executes anyio's whole asyncio backend and may read it from disk: a stall of the loop
right where trajtrack promises none (``benchmarks/bench_core.py``'s event-loop lag showed it in
the first repetition of every process). Importing it with trajtrack moves that cost to the
caller's ``import``, which happens before any loop runs. The module's name is anyio's own
layout (stable since anyio 3), not an API: if it moves, nothing breaks but the warm-up.
"""

from __future__ import annotations

import contextlib
import importlib

__all__ = ["LAZY_MODULES"]

LAZY_MODULES = ("anyio._backends._asyncio",)

for _name in LAZY_MODULES:
    with contextlib.suppress(ImportError):
        importlib.import_module(_name)
