"""Retries of transient storage failures: bounded exponential backoff with jitter, one deadline."""

from __future__ import annotations

import random
from dataclasses import dataclass

from trajtrack._exceptions import ConfigurationError

__all__ = ["RetryPolicy"]


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
