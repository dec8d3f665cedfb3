"""Capped, jittered backoff for reconnect loops, and the log lines of an outage."""

from __future__ import annotations

import logging
import random
import threading
import time

from .errors import first_line


class Backoff:
    """Delays initial, 2 * initial, … up to maximum, each shortened by up to half at random. The cap
    is small by default (``reconnect_max``, a few seconds) so a role is back within a few seconds of
    its server, and the jitter keeps many roles from retrying in step. Call `failed()` on each
    failed try and `succeeded()` once it works: an outage is logged as one warning when it starts
    and one info line, with its duration, when it ends; the tries in between at debug level, and
    a failure within `maximum` seconds of its end (a read worked on a full disk, a write not)."""

    def __init__(
        self,
        initial: float,
        maximum: float,
        *,
        what: str = "",
        logger: logging.Logger | None = None,
    ) -> None:
        self._initial, self._maximum = initial, maximum
        self._next = initial
        self._what = what
        self._log = logger or logging.getLogger(__name__)
        self._since: float | None = None
        self._ended = -maximum  # when the last outage ended (monotonic)
        self.outages = 0

    def sleep(self, stop: threading.Event) -> None:
        """Wait the next delay, or less if `stop` is set."""
        stop.wait(self._next * random.uniform(0.5, 1.0))
        self._next = min(self._next * 2, self._maximum)

    def failed(self, reason: object, stop: threading.Event) -> None:
        """Record a failed try (`reason`: the error, or why) and wait before the next one."""
        if self._since is None and time.monotonic() - self._ended < self._maximum:
            self._since = self._ended  # the same outage, after a try that worked
        if self._since is None:
            self._since = time.monotonic()
            self.outages += 1
            self._log.warning(
                "%s: %s; retrying every %.1f s at most until it answers",
                self._what,
                first_line(reason),
                self._maximum,
            )
        else:
            self._log.debug("%s: still failing: %s", self._what, first_line(reason))
        self.sleep(stop)

    def succeeded(self) -> None:
        """Record a success: the end of an outage, if one was going on."""
        if self._since is not None:
            self._log.info(
                "%s: working again after %.1f s", self._what, time.monotonic() - self._since
            )
            self._since, self._ended = None, time.monotonic()
        self._next = self._initial
