"""Waking a loop on PostgreSQL NOTIFY, with polling as the fallback."""

from __future__ import annotations

import contextlib
import logging
import threading

import psycopg
from psycopg import sql
from sqlalchemy.engine import URL

log = logging.getLogger(__name__)


def notify_channel(schema: str, table: str) -> str:
    """The channel the insert trigger of `schema.table` notifies (see the migrations)."""
    return f"{schema}.{table}"


def psycopg_conninfo(url: URL) -> str:
    """A libpq connection string for a SQLAlchemy URL of the psycopg dialect."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


class Waker:
    """Waits until a NOTIFY arrives on `channel`, `timeout` passes, or `stop` is set.

    Owns one autocommit connection used only for LISTEN; if it breaks, waiting degrades to
    polling and the connection is opened again on the next wait. Not thread-safe: one per loop.
    """

    def __init__(self, conninfo: str, channel: str, stop: threading.Event) -> None:
        self._conninfo = conninfo
        self._channel = channel
        self._stop = stop
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None

    def _connect(self) -> psycopg.Connection[tuple[object, ...]] | None:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        try:
            conn = psycopg.connect(self._conninfo, autocommit=True, connect_timeout=5)
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
        except psycopg.Error as exc:
            # The error text of libpq names host and port, never the password.
            log.warning("cannot LISTEN on %s, polling instead: %s", self._channel, exc)
            return None
        self._conn = conn
        return conn

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds; True if a notification arrived."""
        if self._stop.is_set():
            return False
        conn = self._connect()
        if conn is None:
            self._stop.wait(timeout)
            return False
        remaining = timeout
        try:
            # Wait in slices so that a stop request is seen within a fraction of a second.
            while remaining > 0 and not self._stop.is_set():
                slice_ = min(remaining, 0.25)
                # An open notifies() generator holds the connection's lock: close it before
                # draining what else is queued, so that one burst wakes the loop once.
                with contextlib.closing(conn.notifies(timeout=slice_, stop_after=1)) as stream:
                    arrived = next(stream, None) is not None
                if arrived:
                    for _ in conn.notifies(timeout=0.001):
                        pass
                    return True
                remaining -= slice_
        except psycopg.Error as exc:
            log.warning("LISTEN connection lost: %s", exc)
            self.close()
        return False

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None
