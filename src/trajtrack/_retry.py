"""Retries of transient storage failures: bounded exponential backoff with jitter, one deadline.

The one retry mechanism of the project: :func:`retry_async` for the tracker's uploads and
:func:`retry_sync` for blocking code already in a worker thread (a backend's ``prepare``).
Both retry only errors that say so (``StorageError.retryable``, i.e.
:class:`StorageUnavailableError`) and give up with a :class:`StorageUnavailableError` that
names the attempts and the time spent, chained to the last failure.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio

from trajtrack._exceptions import ConfigurationError, StorageError, StorageUnavailableError

__all__ = ["RetryPolicy", "retry_async", "retry_sync"]

T = TypeVar("T")

OnRetry = Callable[[int, float, StorageError], None]
"""``on_retry(attempt, delay, error)``: called before sleeping for retry number *attempt*."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How the tracker retries :class:`StorageUnavailableError` (and other retryable errors).

    Attributes:
        initial_backoff: Delay before the first retry, seconds.
        max_backoff: Cap on one delay, seconds.
        multiplier: Growth of the delay per attempt.
        deadline: Give up once this many seconds passed since the first attempt. The default
            (5 minutes) rides out a NameNode restart and its safe mode.
        jitter: Fraction of each delay randomised ("full jitter" when 1.0) so that many writers
            do not retry in lockstep.
    """

    initial_backoff: float = 0.2
    max_backoff: float = 15.0
    multiplier: float = 2.0
    deadline: float = 300.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.initial_backoff < 0 or self.max_backoff < 0 or self.deadline < 0:
            raise ConfigurationError("retry delays and deadline must be >= 0")
        if self.multiplier < 1:
            raise ConfigurationError("retry multiplier must be >= 1")
        if not 0 <= self.jitter <= 1:
            raise ConfigurationError("retry jitter must be between 0 and 1")

    def backoff(self, attempt: int) -> float:
        """The delay before retry number *attempt* (0-based)."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier**attempt)
        return base * (1 - self.jitter * random.random())  # jitter, not cryptography

    @classmethod
    def none(cls) -> RetryPolicy:
        """Never retry."""
        return cls(deadline=0.0)


class _Attempts:
    """The attempts at one operation: counts them, decides on each failure."""

    def __init__(self, policy: RetryPolicy, what: str, on_retry: OnRetry | None) -> None:
        self._policy = policy
        self._what = what
        self._on_retry = on_retry
        self._started = time.monotonic()
        self._count = 0

    def failed(self, exc: StorageError) -> float:
        """The delay before the next attempt, or raise: not retryable, or past the deadline."""
        if not exc.retryable:
            raise exc
        delay = self._policy.backoff(self._count)
        waited = time.monotonic() - self._started
        self._count += 1
        if waited + delay > self._policy.deadline:
            raise StorageUnavailableError(
                f"gave up {self._what} after {self._count} attempts over {waited:.1f} s "
                f"(retry deadline {self._policy.deadline} s): {exc}",
                remote_exception=exc.remote_exception,
            ) from exc
        if self._on_retry is not None:
            self._on_retry(self._count, delay, exc)
        return delay


async def retry_async(
    policy: RetryPolicy,
    call: Callable[[], Awaitable[T]],
    *,
    what: str,
    on_retry: OnRetry | None = None,
) -> T:
    """``await call()``, retrying retryable storage errors under *policy*.

    Args:
        policy: Backoff and deadline.
        call: Makes one attempt.
        what: The operation, for the give-up message (``"writing 'x.pth'"``).
        on_retry: Told about each retry before its delay.
    """
    attempts = _Attempts(policy, what, on_retry)
    while True:
        try:
            return await call()
        except StorageError as exc:
            delay = attempts.failed(exc)
        await anyio.sleep(delay)


def retry_sync(
    policy: RetryPolicy,
    call: Callable[[], T],
    *,
    what: str,
    on_retry: OnRetry | None = None,
) -> T:
    """:func:`retry_async` for blocking code that already runs in a worker thread."""
    attempts = _Attempts(policy, what, on_retry)
    while True:
        try:
            return call()
        except StorageError as exc:
            delay = attempts.failed(exc)
        time.sleep(delay)  # a worker thread, never the event loop
