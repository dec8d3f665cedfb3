"""The loop every role runs (`RoleLoop`): stop, failures and backoff, the poll wait."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
from sqlalchemy.exc import OperationalError

from outbox_inbox.backoff import Backoff
from outbox_inbox.config import Settings
from outbox_inbox.errors import BrokerConnectionError
from outbox_inbox.role_loop import RoleLoop

SETTINGS = Settings(reconnect_initial=0.01, reconnect_max=0.02)
log = logging.getLogger("outbox_inbox.tests.role_loop")


class Steps:
    """A step that plays a script: ints are returned, exceptions raised; stops at its end."""

    def __init__(self, stop: threading.Event, *script: int | Exception) -> None:
        self.stop = stop
        self.script = list(script)
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        item = self.script.pop(0)
        if not self.script:
            self.stop.set()
        if isinstance(item, Exception):
            raise item
        return item


def test_a_full_step_is_followed_at_once_and_a_short_one_after_the_poll_wait() -> None:
    stop = threading.Event()
    idles: list[float] = []
    loop = RoleLoop("role", SETTINGS, log, full=10, poll_interval=0.2)
    steps = Steps(stop, 10, 10, 3, 10)
    started = time.monotonic()
    loop.run(stop, steps, idle=lambda: idles.append(time.monotonic() - started))
    elapsed = time.monotonic() - started
    assert steps.calls == 4
    assert len(idles) == 1  # after the short step only
    assert 0.2 <= elapsed < 1.0


def test_a_set_stop_ends_the_poll_wait_at_once() -> None:
    stop = threading.Event()
    loop = RoleLoop("role", SETTINGS, log, full=10, poll_interval=30.0)
    threading.Timer(0.1, stop.set).start()
    started = time.monotonic()
    loop.run(stop, lambda: 0)
    assert time.monotonic() - started < 5.0


def test_an_unavailable_server_is_recovered_backed_off_and_logged_once_per_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stop = threading.Event()
    recovered: list[Exception] = []
    db_down = OperationalError("select 1", {}, Exception("server closed the connection\nSQL"))
    steps = Steps(stop, BrokerConnectionError("no node answers"), db_down, 5)
    loop = RoleLoop("relay of orders", SETTINGS, log, full=1, poll_interval=0.0)
    with caplog.at_level(logging.DEBUG, logger=log.name):
        loop.run(stop, steps, recover=recovered.append)
    assert steps.calls == 3
    assert [type(e) for e in recovered] == [BrokerConnectionError, OperationalError]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "relay of orders: broker unavailable: no node answers; "
        "retrying every 0.0 s at most until it answers"
    ]
    assert any("working again after" in r.getMessage() for r in caplog.records)
    assert loop.backoff.outages == 1 and loop.backoff._since is None  # the outage is over


def test_an_error_the_role_does_not_retry_ends_the_run() -> None:
    stop = threading.Event()
    loop = RoleLoop("worker w", SETTINGS, log, retried=(OperationalError,))
    with pytest.raises(ZeroDivisionError):
        loop.run(stop, Steps(stop, ZeroDivisionError(), 1))


def test_an_unexpected_error_a_role_retries_is_logged_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stop = threading.Event()
    loop = RoleLoop("receiver of billing", SETTINGS, log, retried=(Exception,))
    with caplog.at_level(logging.ERROR, logger=log.name):
        loop.run(stop, Steps(stop, KeyError("x"), 1))
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.getMessage() == "receiver of billing: unexpected error"
    assert record.exc_info is not None and record.exc_info[0] is KeyError


def test_the_async_loop_awaits_its_step_and_recover_and_waits_off_the_event_loop() -> None:
    stop = threading.Event()
    recovered: list[Exception] = []
    script: list[int | Exception] = [OperationalError("x", {}, Exception("down")), 2, 0]
    ticks = 0

    async def step() -> int:
        item = script.pop(0)
        if not script:
            stop.set()
        if isinstance(item, Exception):
            raise item
        return item

    async def recover(exc: Exception) -> None:
        recovered.append(exc)

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    async def main() -> None:
        loop = RoleLoop("asyncio worker w", SETTINGS, log, full=5, poll_interval=0.2)
        tick = asyncio.create_task(ticker())
        await loop.run_async(stop, step, recover=recover)
        await tick

    asyncio.run(main())
    assert len(recovered) == 1
    assert ticks >= 5  # the loop ran on during the poll wait after the short step


def test_a_failure_soon_after_an_outage_ends_continues_it_and_a_later_one_is_a_new_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On a full disk a read works between two writes that do not: fail, succeed, fail within
    the backoff's cap is one outage, one warning. Past the cap, a failure is a new outage."""
    stop = threading.Event()
    backoff = Backoff(0.0, 0.2, what="worker w", logger=log)
    with caplog.at_level(logging.DEBUG, logger=log.name):
        backoff.failed("database unavailable: disk full", stop)
        backoff.succeeded()
        backoff.failed("database unavailable: disk full", stop)  # at once: the same outage
        backoff.succeeded()
        time.sleep(0.3)
        backoff.failed("database unavailable: refused", stop)  # past the cap: a new one
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w.split(": ", 2)[2].split(";")[0] for w in warnings] == ["disk full", "refused"]
    assert backoff.outages == 2
