"""The loop every role (relay, receiver, worker) runs: its own step again and again until
`stop` is set, after the step in hand. A step that raises one of the role's `retried` errors
is followed by its `recover` and a `Backoff` wait (which logs the outage), one outside
`UNAVAILABLE` logged with its traceback first; what a role does not retry ends its `run`. A
step that found less than a full batch is followed by `idle` and a poll wait, cut short by a
NOTIFY (`Waker`) or by `stop`; a full batch by the next step at once."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import psycopg
from sqlalchemy.exc import SQLAlchemyError

from .backoff import Backoff
from .config import Settings
from .errors import BrokerError, first_line
from .waker import Waker

#: The errors of a database that cannot be reached as the driver raises them, from code that
#: runs on the raw connection outside SQLAlchemy's wrapping (a ``begin`` hook, a kept cursor):
#: a terminated session, a lost connection.
DRIVER_OUTAGES: tuple[type[Exception], ...] = (psycopg.OperationalError, psycopg.InterfaceError)
#: The errors of a server that cannot be reached: retried by every role.
UNAVAILABLE: tuple[type[Exception], ...] = (BrokerError, SQLAlchemyError, *DRIVER_OUTAGES)


@dataclass
class RoleLoop:
    """How one role repeats its step; one per `run` of the role (it keeps the outage). `what`
    names the role in the log lines; `full`: the rows of a full step; `poll_interval` None: no
    poll wait (the step waits itself, as the receiver's fetch does); `waker_factory` None:
    poll only; `retried`: the errors after which the role backs off and tries again."""

    what: str
    settings: Settings
    logger: logging.Logger
    full: int = 1
    poll_interval: float | None = None
    waker_factory: Callable[[threading.Event], Waker | None] | None = None
    retried: tuple[type[Exception], ...] = UNAVAILABLE

    def __post_init__(self) -> None:
        s = self.settings
        self.backoff = Backoff(
            s.reconnect_initial, s.reconnect_max, what=self.what, logger=self.logger
        )

    def run(
        self,
        stop: threading.Event,
        step: Callable[[], int],
        *,
        recover: Callable[[Exception], None] | None = None,
        idle: Callable[[], None] | None = None,
    ) -> None:
        """Run `step` until `stop` is set (see the module documentation). `step` returns how
        many rows it found; `recover` is called with a retried error before the backoff wait;
        `idle` before each poll wait."""
        waker = self._listening(stop)
        try:
            while not stop.is_set():
                try:
                    count = step()
                except self.retried as exc:
                    self._failed(exc, recover)
                    self.backoff.failed(self._reason(exc), stop)
                    continue
                self.backoff.succeeded()
                if self._waits_after(count):
                    if idle is not None:
                        idle()
                    self._wait(waker, stop)
        finally:
            if waker is not None:
                waker.close()

    async def run_async(
        self,
        stop: threading.Event,
        step: Callable[[], Awaitable[int]],
        *,
        recover: Callable[[Exception], Awaitable[None]] | None = None,
    ) -> None:
        """`run` for an async `step` and `recover`, on the running event loop; the waits
        (backoff, poll, the waker's LISTEN connection) run in a thread. `stop` stays a
        threading.Event, so that any thread may set it."""
        waker = await asyncio.to_thread(self._listening, stop)
        try:
            while not stop.is_set():
                try:
                    count = await step()
                except self.retried as exc:
                    self._failed(exc, None)
                    if recover is not None:
                        await recover(exc)
                    await asyncio.to_thread(self.backoff.failed, self._reason(exc), stop)
                    continue
                self.backoff.succeeded()
                if self._waits_after(count):
                    await asyncio.to_thread(self._wait, waker, stop)
        finally:
            if waker is not None:
                waker.close()

    def _listening(self, stop: threading.Event) -> Waker | None:
        """The run's waker, listening before the first step: a row committed after the first
        claim looked must wake the loop, not wait for a poll."""
        waker = self.waker_factory(stop) if self.waker_factory else None
        if waker is not None:
            waker.check()
        return waker

    def _waits_after(self, count: int) -> bool:
        return self.poll_interval is not None and count < self.full

    def _wait(self, waker: Waker | None, stop: threading.Event) -> None:
        assert self.poll_interval is not None
        if waker is not None:
            waker.wait(self.poll_interval)
        else:
            stop.wait(self.poll_interval)

    def _failed(self, exc: Exception, recover: Callable[[Exception], None] | None) -> None:
        if not isinstance(exc, UNAVAILABLE):
            # A fault of the role itself, retried: its traceback is the only trace of it.
            self.logger.exception("%s: unexpected error", self.what)
        if recover is not None:
            recover(exc)

    @staticmethod
    def _reason(exc: Exception) -> str:
        if isinstance(exc, BrokerError):
            return f"broker unavailable: {first_line(exc)}"
        if isinstance(exc, (SQLAlchemyError, *DRIVER_OUTAGES)):
            return f"database unavailable: {first_line(exc)}"
        return first_line(exc)
