"""Two runs, dump by dump: :func:`diff_runs`.

:func:`diff_runs` pairs two runs' dumps by name, reads them in parallel (each file once), loads
and compares each pair (:func:`trajtrack.reader._compare.compare`), and returns the
comparisons sorted in dump order (commit time relative to the run's first dump, then name), so
the first divergence is the first entry that is not equal.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import anyio.to_thread

from trajtrack._exceptions import DumpLoadError, TrajtrackError, UnsafeLoadError
from trajtrack.reader._compare import Difference, Tolerance, compare
from trajtrack.reader._dumps import DumpInfo
from trajtrack.reader._gather import gather_bounded
from trajtrack.reader._run import Run
from trajtrack.reader._safe_load import check_loadable, load_dump_bytes

__all__ = ["DumpComparison", "RunDiff", "diff_runs"]

Status = Literal["equal", "different", "only_in_a", "only_in_b", "error"]


@dataclass(frozen=True, slots=True)
class DumpComparison:
    """The comparison of one dump name across two runs.

    Attributes:
        name: The dump name.
        status: ``equal``, ``different``, ``only_in_a``, ``only_in_b`` or ``error``.
        a: The dump in run A (``None`` when absent).
        b: The dump in run B (``None`` when absent).
        differences: What differs (at most the per-dump limit).
        error: Why the dump could not be compared (``status == "error"``).
        order: Commit time relative to its run's first dump (dump order across both runs).
    """

    name: str
    status: Status
    a: DumpInfo | None
    b: DumpInfo | None
    differences: tuple[Difference, ...] = ()
    error: str | None = None
    order: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        return {
            "name": self.name,
            "status": self.status,
            "path_a": self.a.path if self.a else None,
            "path_b": self.b.path if self.b else None,
            "order": self.order,
            "error": self.error,
            "differences": [d.to_json() for d in self.differences],
        }


@dataclass(frozen=True, slots=True)
class RunDiff:
    """The comparison of two runs, dumps in dump order.

    Attributes:
        url_a: Run A.
        url_b: Run B.
        tolerance: The tolerance used.
        comparisons: One entry per dump name present in either run.
    """

    url_a: str
    url_b: str
    tolerance: Tolerance
    comparisons: tuple[DumpComparison, ...]

    @property
    def equal(self) -> bool:
        """True when every dump exists in both runs and is equal within tolerance."""
        return all(c.status == "equal" for c in self.comparisons)

    @property
    def exit_code(self) -> int:
        """0 equal, 1 different (or missing dumps), 2 some dump could not be compared."""
        if any(c.status == "error" for c in self.comparisons):
            return 2
        return 0 if self.equal else 1

    def counts(self) -> dict[str, int]:
        """Number of dumps per status."""
        out = dict.fromkeys(("equal", "different", "only_in_a", "only_in_b", "error"), 0)
        for c in self.comparisons:
            out[c.status] += 1
        return out

    def first_divergence(self) -> DumpComparison | None:
        """The first dump, in dump order, that is not equal."""
        return next((c for c in self.comparisons if c.status != "equal"), None)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        first = self.first_divergence()
        return {
            "a": self.url_a,
            "b": self.url_b,
            "tolerance": dataclasses.asdict(self.tolerance),
            "equal": self.equal,
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "first_divergence": first.name if first else None,
            "dumps": [c.to_json() for c in self.comparisons],
        }


async def diff_runs(
    run_a: Run,
    run_b: Run,
    *,
    names: str | None = None,
    tolerance: Tolerance | None = None,
    unsafe: bool = False,
    limit_per_dump: int = 20,
    on_progress: Callable[[int, int], None] | None = None,
) -> RunDiff:
    """Compare two runs dump by dump (paired by name), reading each file once, in parallel.

    Args:
        run_a: The first run.
        run_b: The second run (the reference for relative differences).
        names: Only dump names (or paths) matching this glob.
        tolerance: Numeric tolerance and NaN policy.
        unsafe: Allow full unpickling (runs code from the dumps).
        limit_per_dump: At most this many differences per dump.
        on_progress: Called with ``(done, total)`` as pairs finish.

    Raises:
        StorageError: Listing a run failed (per-dump read failures become ``error`` entries).
    """
    tol = tolerance or Tolerance()
    listed_a, listed_b = await _list_both(run_a, run_b, names)
    dumps_a = {d.name: d for d in listed_a}
    dumps_b = {d.name: d for d in listed_b}
    start_a = _first_time(dumps_a.values())
    start_b = _first_time(dumps_b.values())

    def order(info: DumpInfo, start: float) -> float:
        return (info.time - start) if info.time is not None else math.inf

    pairs: list[tuple[str, DumpInfo | None, DumpInfo | None, float]] = []
    for name in dumps_a.keys() | dumps_b.keys():
        a, b = dumps_a.get(name), dumps_b.get(name)
        rank = order(a, start_a) if a is not None else order(b, start_b)  # type: ignore[arg-type]
        pairs.append((name, a, b, rank))
    total = len(pairs)

    async def one(pair: tuple[str, DumpInfo | None, DumpInfo | None, float]) -> DumpComparison:
        name, a, b, rank = pair
        if a is None or b is None:
            status: Status = "only_in_b" if a is None else "only_in_a"
            return DumpComparison(name, status, a, b, order=rank)
        try:
            data_a, data_b = await _read_pair(run_a, run_b, a, b)
            found = await anyio.to_thread.run_sync(
                _load_and_compare,
                data_a,
                data_b,
                name,
                tol,
                unsafe,
                limit_per_dump,
                limiter=cpu,
            )
        except (TrajtrackError, OSError) as exc:
            return DumpComparison(name, "error", a, b, error=_message(exc), order=rank)
        status = "different" if found else "equal"
        return DumpComparison(name, status, a, b, tuple(found), order=rank)

    progress = (lambda done: on_progress(done, total)) if on_progress else None
    limit = max(1, min(run_a.concurrency, run_b.concurrency))
    # Loading and comparing is CPU work: more threads than cores only contend for the GIL,
    # the caches and the cores the reads need (measured: not faster, often slower).
    cpu = anyio.CapacityLimiter(min(limit, os.cpu_count() or 1))
    results = await gather_bounded(pairs, one, limit=limit, on_done=progress)
    results.sort(key=lambda c: (c.order, c.name))
    return RunDiff(run_a.url, run_b.url, tol, tuple(results))


async def _list_both(
    run_a: Run, run_b: Run, names: str | None
) -> tuple[list[DumpInfo], list[DumpInfo]]:
    """Both listings at once; a failure raises as ``run_a.list()`` / ``run_b.list()`` would."""
    listed: dict[int, list[DumpInfo] | Exception] = {}

    async def listing(key: int, run: Run) -> None:
        try:
            listed[key] = await run.list(names)
        except Exception as exc:  # re-raised below, unwrapped, A's first
            listed[key] = exc

    async with anyio.create_task_group() as group:
        group.start_soon(listing, 0, run_a)
        group.start_soon(listing, 1, run_b)
    for key in (0, 1):
        failure = listed[key]
        if isinstance(failure, Exception):
            raise failure
    return listed[0], listed[1]  # type: ignore[return-value]  # no exceptions left


async def _read_pair(run_a: Run, run_b: Run, a: DumpInfo, b: DumpInfo) -> tuple[bytes, bytes]:
    for info in (a, b):
        if not info.present:
            raise DumpLoadError(f"{info.path} is recorded but missing from the storage")
    # One after the other: the parallelism is across pairs (a task group per pair would cost
    # more than it saves when every pair is in flight at once).
    return await run_a.read_bytes(a), await run_b.read_bytes(b)


def _load_and_compare(
    data_a: bytes, data_b: bytes, name: str, tol: Tolerance, unsafe: bool, limit: int
) -> list[Difference]:
    if tol.equal_nan and data_a == data_b:
        # Same bytes, same object: nothing to compare, but a dump the loader would refuse is
        # refused here too (a static scan of its pickle; the tensors are not loaded).
        check_loadable(data_a, unsafe=unsafe, where=f"A:{name}")
        return []
    # The objects are only compared, never written to or returned: their tensors may use the
    # read bytes' memory (no copy, no fresh pages).
    obj_a = load_dump_bytes(data_a, unsafe=unsafe, where=f"A:{name}", share_memory=True)
    obj_b = load_dump_bytes(data_b, unsafe=unsafe, where=f"B:{name}", share_memory=True)
    found: list[Difference] = compare(obj_a, obj_b, tol, limit=limit)
    return found


def _first_time(dumps: Any) -> float:
    times = [d.time for d in dumps if d.time is not None]
    return min(times) if times else 0.0


def _message(exc: BaseException) -> str:
    if isinstance(exc, UnsafeLoadError | DumpLoadError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
