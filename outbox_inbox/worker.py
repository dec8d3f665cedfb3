"""The worker: runs handlers on inbox rows, each in the transaction that marks it processed."""

from __future__ import annotations

import logging
import os
import socket
import threading
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import RowMapping
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from . import queries
from .backoff import Backoff
from .config import Settings
from .context import handling
from .errors import Reject, Retry
from .handlers import Handlers, Subscription
from .listener import Listener, call
from .messages import message_from_row
from .retry import RetryPolicy
from .tables import Tables
from .waker import Waker

log = logging.getLogger(__name__)

#: Dead reasons the worker writes.
NO_HANDLER, EXPIRED, ABANDONED, MAX_ATTEMPTS, REJECTED = (
    "no_handler",
    "expired",
    "abandoned",
    "max_attempts",
    "rejected",
)


def worker_name() -> str:
    """A name unique to this thread of this process on this host."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Worker:
    """Claims due inbox rows and handles them. Run several, in threads or processes.

    A batch is claimed in a short transaction that leases the rows (``locked_until`` on the
    database clock) and counts the claim. A second transaction row-locks them and runs each
    handler in a savepoint, with a Session the handler writes its effects through; the row is
    marked processed in the same transaction, so the effect and the mark commit together or
    not at all. A failing handler's savepoint is rolled back and the row is retried or dead.
    A crash leaves the rows leased; when the lease ends another worker claims them again.
    """

    def __init__(
        self,
        *,
        engine: Engine,
        tables: Tables,
        handlers: Handlers,
        settings: Settings,
        name: str | None = None,
        waker_factory: Callable[[threading.Event], Waker | None] | None = None,
        listener: Listener | None = None,
    ) -> None:
        self._listener = listener
        self._engine = engine
        self._tables = tables
        self._handlers = handlers
        self._settings = settings
        self.name = name or worker_name()
        self._waker_factory = waker_factory
        self._stop = threading.Event()
        self.processed = 0

    def run(self, stop: threading.Event, *, on_started: Callable[[], None] | None = None) -> None:
        """Handle messages until `stop` is set; the message in hand is finished first."""
        self._stop = stop
        s = self._settings
        waker = self._waker_factory(stop) if self._waker_factory else None
        backoff = Backoff(s.reconnect_initial, s.reconnect_max)
        conn: Connection | None = None
        if on_started:
            on_started()
        try:
            while not stop.is_set():
                try:
                    if conn is None:
                        conn = self._engine.connect()
                        queries.set_idle_timeout(conn, s.lease)
                        conn.commit()
                    count = self.work_once(conn)
                    backoff.reset()
                except SQLAlchemyError as exc:
                    log.warning(
                        "worker %s: database error, reconnecting: %s", self.name, _short(exc)
                    )
                    if conn is not None:
                        conn.invalidate()
                        conn.close()
                        conn = None
                    backoff.sleep(stop)
                    continue
                if count < s.worker_batch_size:
                    if waker is not None:
                        waker.wait(s.worker_poll_interval)
                    else:
                        stop.wait(s.worker_poll_interval)
        finally:
            if conn is not None:
                conn.close()
            if waker is not None:
                waker.close()

    def work_once(self, conn: Connection) -> int:
        """Claim and handle one batch on `conn`; return how many rows were claimed."""
        s = self._settings
        lease = timedelta(seconds=s.lease)
        with conn.begin():
            rows = queries.claim_inbox(conn, self._tables, self.name, s.worker_batch_size, lease)
        if not rows:
            return 0
        suspects = [r for r in rows if r["attempts"] - r["finished"] > 1]
        if suspects:
            # A row claimed before without finishing may be what killed that worker. Handle it
            # alone, so a poison message cannot drag its batch-mates to "abandoned" with it.
            with conn.begin():
                queries.release_claims(
                    conn, self._tables, [r["id"] for r in rows if r is not suspects[0]], self.name
                )
            rows = suspects[:1]
        with conn.begin():
            mine = queries.lock_claimed(conn, self._tables, [r["id"] for r in rows], self.name)
            processed: list[int] = []
            unrun: list[int] = []
            for row in rows:
                if row["id"] not in mine:
                    continue  # lease lost to another worker in the meantime
                if self._stop.is_set():
                    unrun.append(row["id"])
                    continue
                if self._handle(conn, row):
                    processed.append(row["id"])
            queries.mark_processed(conn, self._tables, processed)
            queries.release_claims(conn, self._tables, unrun, self.name)
        self.processed += len(processed)
        return len(rows)

    def _handle(self, conn: Connection, row: RowMapping) -> bool:
        """Run the handlers of one row in a savepoint; True if it is to be marked processed."""
        message = message_from_row(row)
        row_id = row["id"]
        if row["attempts"] - row["finished"] > self._settings.abandon_after:
            log.error(
                "worker: message %s was claimed %d times without finishing; dead (abandoned)",
                message.message_id,
                row["attempts"] - row["finished"] - 1,
            )
            queries.mark_dead(
                conn, self._tables, row_id, ABANDONED, row["last_error"], finished=False
            )
            return False
        if message.expires_at is not None and message.expires_at <= row["claimed_at"]:
            queries.mark_dead(conn, self._tables, row_id, EXPIRED, None, finished=True)
            return False
        subscriptions = self._handlers.find(message.kind, message.type)
        if not subscriptions:
            log.error("worker: no handler for %s %s; dead", message.kind, message.type)
            queries.mark_dead(
                conn,
                self._tables,
                row_id,
                NO_HANDLER,
                f"no handler for {message.type}",
                finished=True,
            )
            return False
        session = Session(bind=conn, join_transaction_mode="create_savepoint")
        try:
            with handling(message):
                for subscription in subscriptions:
                    subscription.handler(message, session)
            session.flush()
            session.commit()  # releases the savepoint; the outer transaction commits later
            call(self._listener, "handled", message)
            return True
        except Reject as exc:
            session.rollback()
            log.warning("worker: %s rejected: %s", message.message_id, exc.reason)
            queries.mark_dead(conn, self._tables, row_id, REJECTED, exc.reason, finished=True)
            call(self._listener, "failed", message, exc, dead=True)
            return False
        except Exception as exc:
            session.rollback()
            dead = self._failed(conn, row, subscriptions, exc)
            call(self._listener, "failed", message, exc, dead=dead)
            return False
        finally:
            session.close()

    def _failed(
        self, conn: Connection, row: RowMapping, subscriptions: list[Subscription], exc: Exception
    ) -> bool:
        """Record a handler failure: retry later, or dead past the policy. True if dead."""
        policy = _policy(subscriptions, self._settings.retry)
        attempt = row["finished"] + 1
        error = "".join(traceback.format_exception(exc))[-8000:]
        if isinstance(exc, Retry) and exc.delay is not None:
            delay = exc.delay
        else:
            delay = policy.delay(attempt)
        if policy.gives_up_after(attempt):
            log.error(
                "worker: %s failed on attempt %d, giving up: %r", row["message_id"], attempt, exc
            )
            queries.mark_dead(conn, self._tables, row["id"], MAX_ATTEMPTS, error, finished=True)
            return True
        log.warning(
            "worker: %s failed on attempt %d, retrying in %.1fs: %r",
            row["message_id"],
            attempt,
            delay,
            exc,
        )
        queries.mark_retry(conn, self._tables, row["id"], error, timedelta(seconds=delay))
        return False


def _policy(subscriptions: list[Subscription], default: RetryPolicy) -> RetryPolicy:
    for subscription in subscriptions:
        if subscription.retry is not None:
            return subscription.retry
    return default


def _short(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else repr(exc)
