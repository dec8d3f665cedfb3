"""Bounded exponential backoff for reconnect loops."""

from __future__ import annotations

import threading


class Backoff:
    """Delays initial, 2 * initial, … up to maximum; `reset()` after a success."""

    def __init__(self, initial: float, maximum: float) -> None:
        self._initial = initial
        self._maximum = maximum
        self._next = initial

    def sleep(self, stop: threading.Event) -> None:
        """Wait the next delay, or less if `stop` is set."""
        stop.wait(self._next)
        self._next = min(self._next * 2, self._maximum)

    def reset(self) -> None:
        self._next = self._initial
