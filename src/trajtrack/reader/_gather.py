"""Bounded concurrency for the read path: many reads in flight, never all at once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

__all__ = ["both", "gather_bounded", "group_small"]

T = TypeVar("T")
R = TypeVar("R")
S = TypeVar("S")


async def both(
    first: Callable[[], Awaitable[R]], second: Callable[[], Awaitable[S]]
) -> tuple[R, S]:
    """``(await first(), await second())``, run at the same time. The first exception either
    raises cancels the other and propagates as it is (not in an exception group)."""
    results: list[Any] = [None, None]
    failed: list[Exception] = []

    async def run(index: int, fn: Callable[[], Awaitable[Any]], group: TaskGroup) -> None:
        try:
            results[index] = await fn()
        except Exception as exc:  # re-raised below, unwrapped
            failed.append(exc)
            group.cancel_scope.cancel()

    async with anyio.create_task_group() as group:
        group.start_soon(run, 0, first, group)
        group.start_soon(run, 1, second, group)
    if failed:
        raise failed[0]
    return results[0], results[1]


async def gather_bounded(
    items: Sequence[T],
    fn: Callable[[T], Awaitable[R]],
    *,
    limit: int,
    on_done: Callable[[int], None] | None = None,
) -> list[R]:
    """``[await fn(item) for item in items]`` with at most *limit* calls in flight.

    Results keep the order of *items*; the first exception cancels the rest and propagates.
    *on_done* is called with the number of finished calls after each one.
    """
    results: list[Any] = [None] * len(items)
    semaphore = anyio.Semaphore(max(1, limit))
    done = 0

    async def one(index: int, item: T) -> None:
        nonlocal done
        async with semaphore:
            results[index] = await fn(item)
        done += 1
        if on_done is not None:
            on_done(done)

    async with anyio.create_task_group() as group:
        for index, item in enumerate(items):
            # Each task parks on the semaphore; their number is bounded by len(items), which
            # the caller already holds in memory, while the reads themselves are bounded.
            group.start_soon(one, index, item)
    return results


def group_small(
    items: Sequence[T],
    small: Callable[[T], bool],
    size: int,
    *,
    weight: Callable[[T], int] | None = None,
    max_weight: int | None = None,
) -> list[list[T]]:
    """*items* as groups, each item once: the small ones *size* at a time (in their order),
    each other one alone (where it comes, ahead of a small group still filling). With
    *weight* and *max_weight*, a group also closes once its items weigh *max_weight* (bytes
    held at once, say).

    For per-item work cheaper than a worker-thread hop, or than a request: one per group.
    """
    groups: list[list[T]] = []
    group: list[T] = []
    held = 0
    for item in items:
        if not small(item):
            groups.append([item])
            continue
        group.append(item)
        if weight is not None:
            held += weight(item)
        if len(group) == size or (max_weight is not None and held >= max_weight):
            groups.append(group)
            group, held = [], 0
    if group:
        groups.append(group)
    return groups
