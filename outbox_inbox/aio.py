"""The asyncio side: the worker on the async driver, and the roles in an event loop. `AsyncWorker`
runs the very same `Worker.work_once` through `AsyncConnection.run_sync`: claim, transaction, redo
and liveness lock are the sync worker's (docs/async-services.md, "How the asyncio worker gives it
that transaction"). The relay and the receiver keep their threads."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from .database import postgres_engine
from .errors import ConfigurationError
from .worker import Worker

log = logging.getLogger(__name__)


def async_url(url: str | URL) -> URL:
    """`url`'s PostgreSQL database on psycopg's async driver (``postgresql+psycopg``, which
    serves sync and async engines alike); ConfigurationError for another database or driver."""
    parsed = make_url(url)
    drivers = ("psycopg", "psycopg2")  # psycopg2: the driver name of a bare postgresql://
    if parsed.get_backend_name() != "postgresql" or parsed.get_driver_name() not in drivers:
        raise ConfigurationError(
            "async handlers and the asyncio worker need PostgreSQL through psycopg 3"
            f" (postgresql+psycopg://), not {parsed.drivername}://"
        )
    return parsed.set(drivername="postgresql+psycopg")


def worker_engine(url: str | URL, *, prepare_threshold: int | str | None = "auto") -> AsyncEngine:
    """An async engine for one asyncio worker (`database.postgres_engine`): NullPool, since the
    worker keeps its one connection, and pooled connections belong to the loop that made them."""
    return postgres_engine(
        create_async_engine, async_url(url), prepare_threshold, poolclass=NullPool
    )


class AsyncWorker:
    """A worker whose transactions run on an `AsyncConnection`, in an event loop: the contract
    of the `Worker` it drives (docs/async-services.md, "What differs"). One task at a time may
    use an AsyncWorker; several may run in one loop, each on its own connection."""

    def __init__(self, worker: Worker, engine: AsyncEngine) -> None:
        self.worker, self._engine = worker, engine
        #: The driver's connection under each `connect()`'s, closed by `close` (see `_discard`).
        self._sessions: list[Any] = []

    @property
    def processed(self) -> int:
        """Messages handled so far."""
        return self.worker.processed

    async def connect(self) -> AsyncConnection:
        """Open the worker's connection: `Worker.connect` (liveness lock, session limits) on
        the async driver. Raises SQLAlchemyError if the database cannot be reached."""
        conn = await self._engine.connect()
        try:
            await conn.run_sync(self.worker.connect)
            # (A detached connection has no `driver_connection`: ask the dialect.)
            adapted = (await conn.get_raw_connection()).dbapi_connection
            assert adapted is not None  # a connection just opened and not closed
            raw = self._engine.dialect.get_driver_connection(adapted)
        except BaseException:
            await conn.close()
            raise
        self._sessions = [s for s in self._sessions if not s.closed] + [raw]
        return conn

    async def work_once(self, conn: AsyncConnection) -> int:
        """`Worker.work_once` on `conn` (from `connect()`): what it returns and raises.
        Cancelling the task inside the batch rolls the batch back; its rows return to the
        queue when the connection closes, as after a crash of the thread worker."""
        return await conn.run_sync(self.worker.work_once)

    async def run(
        self, stop: threading.Event, *, on_started: Callable[[], None] | None = None
    ) -> None:
        """Handle messages until `stop` is set (from any thread), finishing the batch in hand."""
        self.worker._stop = stop
        conn: AsyncConnection | None = None
        loop = self.worker.role_loop("asyncio worker")  # woken as the worker is

        async def step() -> int:
            nonlocal conn
            if conn is None:
                conn = await self.connect()
            count = await self.work_once(conn)
            return loop.full if self.worker.claimed_next else count  # a next batch in hand

        async def recover(_exc: Exception) -> None:
            nonlocal conn
            if conn is not None:
                await _discard(conn)
                await self._close_sessions()
                conn = None

        if on_started:
            on_started()
        try:
            await loop.run_async(stop, step, recover=recover)
        finally:
            if conn is not None:
                with contextlib.suppress(SQLAlchemyError):  # a broken one: freed with its session
                    await conn.run_sync(self.worker.give_back)  # the next batch, uncounted
                    await conn.run_sync(self.worker.retire)  # out of the instances table
                await _discard(conn)
            await self._close_sessions()
            self.worker.close_liveness()

    async def close(self) -> None:
        """Release the worker's engine, its liveness session and every connection `connect`
        gave (after `run` returned, or after `connect` and `work_once` used without `run`,
        whether or not the caller closed them): its claims are free at once."""
        self.worker.close_liveness()
        await self._close_sessions()
        await self._engine.dispose()

    async def _close_sessions(self) -> None:
        """Close the driver's connections of `connect`. The connection holding the liveness
        lock is detached from its pool, and SQLAlchemy closes a detached connection of an
        asyncio driver without ``terminate`` (psycopg's) only when it is garbage-collected:
        until then its session, the lock and the claims under it would live on."""
        sessions, self._sessions = self._sessions, []
        for raw in sessions:
            try:
                await raw.close()
            except Exception as exc:  # the driver's error: the session is gone either way
                log.debug("closing a worker session: %s", exc)

    def run_in_thread(
        self, stop: threading.Event, *, on_started: Callable[[], None] | None = None
    ) -> None:
        """`run` in a new event loop of this thread (how `Service.start()` runs it)."""

        async def main() -> None:
            try:
                await self.run(stop, on_started=on_started)
            finally:
                await self.close()

        asyncio.run(main())


async def _discard(conn: AsyncConnection) -> None:
    """Close the worker's connection for good: its session (and liveness lock) ends."""
    for end in (conn.invalidate, conn.close):
        try:
            await end()
        except SQLAlchemyError as exc:
            log.debug("closing a broken worker connection: %s", exc)
