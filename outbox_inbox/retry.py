"""Retry policy: what becomes of a message whose handler failed, and when it is handled again."""

from __future__ import annotations

import random
from dataclasses import dataclass

from .errors import ConfigurationError, Reject, Retry

#: The dead reason of a message whose last allowed attempt failed.
MAX_ATTEMPTS = "max_attempts"


@dataclass(frozen=True)
class Later:
    """Handle the message again in `delay` seconds."""

    delay: float


@dataclass(frozen=True)
class Dead:
    """Handle the message no more: dead, with `reason` (the inbox row's ``dead_reason``)."""

    reason: str


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Exponential backoff: ``delay(n) = min(initial * multiplier ** (n - 1), max_interval)``. `n`
    is the number of the failed attempt (1 for the first failure). `max_attempts` counts every
    handling, the first included; `max_attempts=1` or ``0`` means the first failure is final (``0``
    reads "no retry"). `jitter` spreads each delay uniformly by up to that fraction (0.1 = ±10 %),
    so messages that failed together do not come back together."""

    initial: float = 1.0
    multiplier: float = 2.0
    max_interval: float = 300.0
    max_attempts: int = 10
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if self.initial < 0 or self.max_interval < 0:
            raise ConfigurationError("RetryPolicy intervals must be >= 0")
        if self.multiplier < 1:
            raise ConfigurationError("RetryPolicy.multiplier must be >= 1")
        if self.max_attempts < 0:
            raise ConfigurationError("RetryPolicy.max_attempts must be >= 0")
        if not 0 <= self.jitter < 1:
            raise ConfigurationError("RetryPolicy.jitter must be in [0, 1)")

    def delay(self, failed_attempt: int) -> float:
        """Seconds to wait after failed attempt number `failed_attempt` (1-based)."""
        n = max(failed_attempt, 1)
        base = min(self.initial * self.multiplier ** (n - 1), self.max_interval)
        if self.jitter:
            base *= 1 + random.uniform(-self.jitter, self.jitter)
        return max(base, 0.0)

    def gives_up_after(self, failed_attempt: int) -> bool:
        """True when attempt number `failed_attempt` was the last one allowed."""
        return failed_attempt >= max(self.max_attempts, 1)

    def decide(self, exc: BaseException, failed_attempt: int) -> Later | Dead:
        """What becomes of a message whose attempt number `failed_attempt` raised `exc`:
        `Reject` ends it at once with its ``dead_reason``; past the last attempt it is dead
        (`MAX_ATTEMPTS`); else it is handled again after `Retry`'s delay, or this policy's."""
        if isinstance(exc, Reject):
            return Dead(exc.dead_reason)
        if self.gives_up_after(failed_attempt):
            return Dead(MAX_ATTEMPTS)
        if isinstance(exc, Retry) and exc.delay is not None:
            return Later(exc.delay)
        return Later(self.delay(failed_attempt))
