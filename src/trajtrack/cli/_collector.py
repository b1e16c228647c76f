"""Garbage collection while a command runs: a full collection every few seconds, not every
700 allocations.

A command over a large run holds tens of thousands of objects (two listings, their pairs, the
results) and allocates more for every dump. CPython's collector runs whenever allocations
outnumber deallocations by 700, and walks every object that survived again and again, a cost
that grows with the run (``benchmarks/bench_small_reads.py`` times a ``diff``). The commands' own
objects form no reference cycles (a ``diff`` of 20,000 differing pairs with the collector off left 0
unreachable objects), so the automatic collector only costs time. It is switched off for the
command, what the process holds at the start (imports, the parser) is frozen out of every
collection (:func:`gc.freeze`), and a thread collects everything every
:data:`INTERVAL` seconds, for cycles that code outside trajtrack may make (a ``--unsafe`` load
runs the dump's own code). Everything is put back when the command ends.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator
from typing import Final

__all__ = ["INTERVAL", "collected_every"]

INTERVAL: Final = 5.0
"""Seconds between full collections while a command runs."""


@contextlib.contextmanager
def collected_every(interval: float = INTERVAL) -> Iterator[None]:
    """The automatic collector off inside, and a full collection every *interval* seconds
    or more (by a thread started here and joined on the way out: every 50 times as long as
    the last collection took, if that is longer); the collector's state and the frozen
    objects are put back after."""
    was_enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    stop = threading.Event()
    collector = threading.Thread(
        target=_collect_every, args=(interval, stop), name="trajtrack-gc", daemon=True
    )
    collector.start()
    try:
        yield
    finally:
        stop.set()
        collector.join(timeout=10.0)  # one collection at most is in progress
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def _collect_every(interval: float, stop: threading.Event) -> None:
    wait = interval
    while not stop.wait(wait):
        start = time.monotonic()
        gc.collect()
        # A heap so large that a collection takes long is collected less often: at most
        # about 2% of the time goes to it.
        wait = max(interval, 50 * (time.monotonic() - start))
