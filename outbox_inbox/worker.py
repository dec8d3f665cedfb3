"""The worker: runs handlers on inbox rows, each in the transaction that marks it processed."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import NamedTuple

import psycopg
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from .config import Settings
from .database import client_bounds
from .errors import Reject, database_unreachable, first_line
from .faults import send_fault
from .fingerprint import fingerprint
from .handlers import Calls, Found, Handlers, Subscription, run_writes
from .instances import Instances
from .listener import Listener, call
from .messages import Message, message_from_row
from .outbox import Outbox
from .queries import roles
from .queries.roles import Claimed
from .retry import Dead, Later
from .role_loop import DRIVER_OUTAGES, RoleLoop
from .tables import Tables
from .tracing import Tracing
from .waker import Waker

log = logging.getLogger(__name__)

#: Seconds of handler work a batch is sized to, from the last batch's time per message (up to
#: ``worker_batch_size``): a message that arrives while a batch runs waits for it and for the
#: next one, claimed with its marks, so slow handlers get short batches and fast ones full ones.
BATCH_WORK = 0.05

#: Dead reasons the worker writes from a claim alone (and the handlers': `retry.Dead`);
#: INTERRUPTED: a ``one_attempt`` row claimed again after an attempt that never finished.
NO_HANDLER, EXPIRED, ABANDONED, INTERRUPTED = "no_handler", "expired", "abandoned", "interrupted"


def worker_name() -> str:
    """A name unique to this thread of this process on this host."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class ConnectionLost(SQLAlchemyError):
    """The worker's database connection broke, or the database could not work
    (`errors.database_unreachable`), while the worker was handling a batch. Not a handler
    failure: nothing is counted against the messages and no listener hook runs; the worker
    reconnects, its claims given back uncounted first when the connection still works."""


class _HandlerFailed(Exception):
    """A handler of the optimistic batch raised `error` on the row with id `row_id`."""

    def __init__(self, row_id: int, error: Exception) -> None:
        super().__init__(row_id, error)
        self.row_id, self.error = row_id, error


class _Job(NamedTuple):
    """A claimed row, mapped once to the message its handlers get, and the handlers that take
    it, looked up once."""

    id: int
    row: Claimed
    message: Message
    handlers: Found


@dataclass
class _Batch:
    """What one claim decided: rows to run, and rows that end dead without running."""

    run: list[_Job] = field(default_factory=list)
    #: (job, dead reason, finished: whether the attempt counts as finished).
    dead: list[tuple[_Job, str, bool]] = field(default_factory=list)
    #: Rows no handler of this worker takes (their routing key or version): left for a live
    #: instance that has one (`instances.Instances.leave`), or dead.
    away: list[_Job] = field(default_factory=list)
    #: The dead reasons marked by the last transaction that tried.
    marked: list[str] = field(default_factory=list)
    #: ``at_most_once`` rows: marked processed before they run (`Worker._settle`).
    settled: list[_Job] = field(default_factory=list)
    #: Rows of at-most-once handlers are here: no handler is run twice (one savepoint each).
    once: bool = False

    @property
    def jobs(self) -> list[_Job]:
        return [*self.run, *(d[0] for d in self.dead), *self.away, *self.settled]

    @property
    def since(self) -> datetime | None:
        """The earliest receipt of the batch's rows: their partitions start there."""
        return min((j.row["received_at"] for j in self.jobs), default=None)


class Worker:
    """Claims due inbox rows and handles them. Run several, in threads or processes. A batch's
    handler effects and processed marks commit in one transaction; when a handler fails, the batch
    is run again with a savepoint per message. Leases, the liveness lock and the redo:
    docs/concepts.md ("Leases and row locks", "Liveness", "Handlers run in batches"). A row claimed
    before without finishing (a suspect: it may have killed its worker) is run alone, one suspect
    per claim, so a poison message cannot take its batch-mates to ``abandoned`` with it."""

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
        tracing: Tracing | None = None,
        liveness_url: Callable[[], str | None] | None = None,
        service: str | None = None,
        outbox: Outbox | None = None,
        helpers: str | None = None,
    ) -> None:
        #: Where the faults of dead rows go (outbox_inbox.faults); None sends none.
        self._outbox = outbox
        #: The channel on which a claim that took a whole batch wakes the other workers (those
        #: its waker does not lead: `waker.Waker`); None wakes none.
        self._helpers, self._woke = helpers, -float("inf")
        self._listener, self._tracing = listener, tracing or Tracing("")
        self._engine, self._tables, self._handlers = engine, tables, handlers
        self._settings = settings
        self.name = name or worker_name()
        self._connections = itertools.count(1)
        #: What this worker writes into ``locked_by``: its name and its connection's number.
        self.claimant = f"{self.name}/0"
        self._waker_factory = waker_factory
        #: Where the liveness lock's session goes (a SQLAlchemy URL, or None for no lock);
        #: by default the engine's own database (PostgreSQL only).
        self._liveness_url = liveness_url or (
            (lambda: engine.url.render_as_string(hide_password=False))
            if engine.dialect.name == "postgresql"
            else None
        )
        self._liveness_engine: Engine | None = None
        self._liveness_conn: Connection | None = None
        self._stop = threading.Event()
        #: This worker's handlers in the instances table of `service` (rolling deploys).
        self._instances = Instances(tables, handlers, settings, service, self.name)
        #: Rows the last batch's transaction claimed for the next batch (see `_run_batch`).
        self._next: list[Claimed] = []
        #: The soonest retry a batch of this worker scheduled, in seconds (the tenants fleet's).
        self.retry_soonest: float | None = None
        #: The routing key and tenant of the last row claimed (`roles.claim_inbox`'s `after`).
        self._served: tuple[str, str] | None = None
        #: Seconds the handlers took per message in the last batch (`_claim`); None before one.
        self._per_message: float | None = None
        self._full = False  # the last claim took all it asked for
        self._waker: Waker | None = None  # the current run's (`role_loop`)
        #: Whether a short batch's transaction claims the next batch too (not in the tenants fleet).
        self.claims_after_short = True
        self.processed = 0

    def connect(self, opened: Connection | None = None) -> Connection:
        """Open a connection for `work_once`, with this worker's liveness and hang limit. `opened`:
        a connection to prepare instead of a new one from the engine (the asyncio worker passes the
        sync face of its AsyncConnection); it is closed if this fails. Each call takes a new
        `claimant` name (`_hold_liveness`), so the claims of an earlier connection of this worker
        are free to every worker at once. The hang limit (`roles.limit_worker`) is set once on a
        session that is the worker's own, else by each transaction (``SET LOCAL``: a pooler passes
        nothing on to its other clients). Raises SQLAlchemyError if the database cannot be
        reached."""
        conn = self._engine.connect() if opened is None else opened
        self._next = []  # claims of an earlier connection are free with its liveness lock
        try:
            claimant, own_session = self._hold_liveness(conn)
            if conn.dialect.name == "postgresql":
                lease = self._settings.lease
                if own_session:  # never back in a pool: set once, a round trip saved
                    with conn.begin():
                        roles.limit_worker(conn.connection.dbapi_connection, lease, local=False)
                else:
                    event.listen(conn, "begin", _limit_each_transaction(lease))
        except BaseException:
            conn.close()
            raise
        self.claimant = claimant
        return conn

    def _hold_liveness(self, conn: Connection) -> tuple[str, bool]:
        """A new claimant name, its liveness lock held (if anywhere) for as long as `conn`,
        and whether `conn` holds it: when the liveness URL is the engine's own, `conn` is
        detached from the pool and holds it; else (a ``listen_url`` past a pooler in
        transaction mode) a session connection of its own does."""
        self.close_liveness()
        claimant = f"{self.name}/{next(self._connections)}"
        url = self._liveness_url() if self._liveness_url is not None else None
        if url is None:
            if conn.dialect.name != "postgresql":
                return claimant, False  # SQLite: one process, claims judge leases only
            # No session to hold a lock: say so in the name, or claims would take this
            # worker's leased rows for a dead worker's.
            return claimant + roles.LEASE_ONLY, False
        holder = conn
        if make_url(url) == self._engine.url:
            conn.detach()  # the session's lock must not reach another user of the pool
        else:
            if self._liveness_engine is None or self._liveness_engine.url != make_url(url):
                # One session per worker, opened and closed with it: no pool. Bounded as the
                # service's engine is (a listen_url past a pooler in transaction mode).
                self._liveness_engine = create_engine(
                    url, poolclass=NullPool, connect_args=client_bounds(url)
                )
            holder = self._liveness_engine.connect()
            self._liveness_conn = holder
        roles.keep_liveness_session_alive(holder)
        while not roles.hold_claimant_lock(holder, claimant):
            claimant = f"{self.name}/{next(self._connections)}"
        holder.commit()
        return claimant, holder is conn

    def close_liveness(self) -> None:
        """Close the liveness session: the current claimant's rows are free to every worker."""
        if self._liveness_conn is not None:
            with contextlib.suppress(SQLAlchemyError):
                self._liveness_conn.close()
            self._liveness_conn = None

    def run(self, stop: threading.Event, *, on_started: Callable[[], None] | None = None) -> None:
        """Handle messages until `stop` is set; the batch in hand is finished first, the
        claims of a next batch not yet begun are given back, uncounted. Waits between batches
        and outages are the `RoleLoop`'s; a database error drops the connection (and with it
        the liveness lock), and the next batch opens another one."""
        self._stop = stop
        conn: Connection | None = None
        full = self._settings.worker_batch_size

        def step() -> int:
            nonlocal conn
            if conn is None:
                conn = self.connect()
            count = self.work_once(conn)
            return full if self.claimed_next else count  # a next batch in hand: no poll wait

        def recover(_exc: Exception) -> None:
            nonlocal conn
            if conn is not None:
                _discard(conn)
                conn = None

        if on_started:
            on_started()
        try:
            self.role_loop("worker").run(stop, step, recover=recover)
        finally:
            if conn is not None:
                self.give_back(conn)
                self.retire(conn)
                conn.close()
            self.close_liveness()

    def role_loop(self, kind: str) -> RoleLoop:
        """The loop a run of this worker goes round (`kind` names it in the log lines)."""
        s, factory = self._settings, self._waker_factory

        def waker(stop: threading.Event) -> Waker | None:
            self._waker = factory(stop) if factory else None
            return self._waker

        return RoleLoop(
            f"{kind} {self.name}",
            s,
            log,
            full=s.worker_batch_size,
            poll_interval=s.worker_poll_interval,
            waker_factory=waker,
            retried=(SQLAlchemyError, *DRIVER_OUTAGES),
        )

    def work_once(self, conn: Connection) -> int:
        """Handle one batch on `conn` (from `connect()`); return how many rows it claimed. The batch
        is the one the last batch's transaction claimed for it (`_run_batch`), else one claimed now.
        Below ``worker_batch_size``: nothing more was due (after giving suspects back, at least
        ``worker_batch_size``: they are due). Raises `ConnectionLost` or another SQLAlchemyError
        when the database fails; handler errors never escape."""
        s = self._settings
        self._instances.advertise(conn)
        rows, self._next = self._next, []
        if not rows:
            with conn.begin():  # without a flush wait: a claim a crash undoes is claimed again
                rows = self._claim(conn, flush_wait=False)
        if not rows:
            return 0
        suspects = [r for r in rows if r["attempts"] - r["finished"] > 1]
        if suspects:
            # Run the first suspect alone and give the rest back uncounted: a row's count
            # grows only while it runs alone, so only a row that kills its worker alone counts
            # towards "abandoned". The rows given back are due: claim again at once.
            alone = suspects[0]
            with conn.begin():
                roles.release_claims(
                    conn, self._tables, [r["id"] for r in rows if r is not alone], self.claimant
                )
            self._work(conn, [alone], claim_next=False)
            return max(len(rows), s.worker_batch_size) if len(rows) > 1 else 1
        full = self._full  # of this batch's claim: more was waiting
        # A helper (woken by NOTIFY, its waker not leading) claims on with its marks only
        # while its claims come full: the lead keeps up with what is left, the helper waits.
        w = self._waker
        helping = w is not None and w.listening is True and not w.leading
        self._work(conn, rows, claim_next=full or (self.claims_after_short and not helping))
        return s.worker_batch_size if full else len(rows)

    def _claim(self, conn: Connection, *, flush_wait: bool = True) -> list[Claimed]:
        s = self._settings
        lease = timedelta(seconds=s.lease)
        limit = s.worker_batch_size
        if self._per_message:  # a batch of about BATCH_WORK seconds of handlers, at least one
            limit = max(1, min(limit, round(BATCH_WORK / self._per_message)))
        rows = roles.claim_inbox(
            conn,
            self._tables,
            self.claimant,
            limit,
            lease,
            fair=s.fair_claims,
            after=self._served,
            caps=self._handlers.per_key("max_concurrency"),
            rates=self._handlers.per_key("rate"),
            weights=self._handlers.per_key("weight"),
            tenant_weights=s.tenant_weights,
            flush_wait=flush_wait,
        )
        if rows and s.fair_claims:  # the next claim's turn starts after the last type served
            self._served = (rows[-1]["routing_key"], rows[-1]["tenant"])
        # More may be due: wake the others, unless done a moment ago (they claim on still).
        self._full = full = len(rows) >= limit
        if self._helpers is not None and full and time.monotonic() - self._woke > 0.1:
            roles.notify(conn, self._helpers, "")
            self._woke = time.monotonic()
        return rows

    @property
    def claimed_next(self) -> bool:
        """Whether the last batch's transaction claimed a next batch, which `work_once` handles
        next (so the role loop should not wait before it)."""
        return bool(self._next)

    def give_back(self, conn: Connection) -> None:
        """Give back, uncounted, the claims of a next batch that will not be handled (the
        worker stops); a database error is only logged (`_release`)."""
        rows, self._next = self._next, []
        self._release(conn, [r["id"] for r in rows])

    def _release(self, conn: Connection, ids: list[int]) -> None:
        """`roles.release_claims` of `ids` in a transaction of its own, if `conn` still works;
        a database error is only logged (the claims are then free with the liveness lock)."""
        if not ids or conn.invalidated or conn.closed:
            return
        try:
            with conn.begin():
                roles.release_claims(conn, self._tables, ids, self.claimant)
        except SQLAlchemyError as exc:
            log.debug("worker %s: giving back %d claims failed: %s", self.name, len(ids), exc)

    def retire(self, conn: Connection) -> None:
        """Delete this worker's row of the instances table (`Instances.retire`): it stops."""
        self._instances.retire(conn)

    def _work(self, conn: Connection, rows: list[Claimed], *, claim_next: bool) -> None:
        """Handle claimed rows: all in one transaction, or one savepoint each on a failure;
        `claim_next`: the batch's transaction also claims the next batch (`_run_batch`)."""
        batch = self._plan(rows)
        try:
            try:
                if batch.settled:
                    self._settle(conn, batch)
                handled = self._run_batch(conn, batch, claim_next=claim_next, one_by_one=batch.once)
            except ConnectionLost:
                raise
            except Exception as exc:
                if batch.once:
                    raise  # not again one by one: a handler that ran would run twice
                cause = exc.error if isinstance(exc, _HandlerFailed) else exc
                _raise_if_outage(conn, cause)
                # A handler, or the batch's flush or commit, failed: redo message by message;
                # the failing handler is not run again, its error is recorded as raised.
                log.debug("worker %s: batch failed (%r), one by one", self.name, cause)
                failed = exc if isinstance(exc, _HandlerFailed) else None
                handled = self._run_batch(conn, batch, one_by_one=True, failed=failed)
        except ConnectionLost:  # the database is there but cannot work: given back uncounted,
            # but for rows of one attempt, which may have run: counted, they end `INTERRUPTED`
            self._release(conn, [j.id for j in batch.jobs if j.handlers.delivery != "one_attempt"])
            raise
        self.processed += len(handled)
        if self._listener is not None:
            for message in handled:
                call(self._listener, "handled", message)
            for reason, count in Counter(batch.marked).items():
                call(self._listener, "dead", reason, count)

    def _plan(self, rows: list[Claimed]) -> _Batch:
        """Decide, from the claimed rows alone, which run and which end dead without running."""
        batch = _Batch()
        for row in rows:
            handlers = self._handlers.find(row["kind"], row["routing_key"], row["version"])
            job = _Job(row["id"], row, message_from_row(row), handlers)
            unfinished = row["attempts"] - row["finished"]
            if unfinished > self._settings.abandon_after:
                log.error(
                    "worker: message %s was claimed %d times without finishing; dead (abandoned)",
                    row["message_id"],
                    unfinished - 1,
                )
                batch.dead.append((job, ABANDONED, False))  # keeps its last error
            elif row["expires_at"] is not None and row["expires_at"] <= row["claimed_at"]:
                batch.dead.append((job, EXPIRED, True))
            elif not handlers.every:
                batch.away.append(job)  # decided in the batch's transaction: _mark_dead_rows
            else:
                batch.run.append(job)
        if any(s.options.delivery != "exactly_once" for s in self._handlers.subscriptions):
            self._plan_delivery(batch)  # one check per batch
        return batch

    def _plan_delivery(self, batch: _Batch) -> None:
        """Set apart the rows to run whose handlers run at most once (docs/concepts.md)."""
        run, batch.run = batch.run, []
        for job in run:
            delivery = job.handlers.delivery
            batch.once = batch.once or delivery != "exactly_once"
            if delivery == "at_most_once":  # a claimed row never ran: its mark comes first
                batch.settled.append(job)
            elif delivery == "one_attempt" and job.row["attempts"] - job.row["finished"] > 1:
                log.error("worker: %s dead: its one attempt was cut short", job.message.message_id)
                batch.dead.append((job, INTERRUPTED, False))  # its attempt is counted
            else:
                batch.run.append(job)

    def _settle(self, conn: Connection, batch: _Batch) -> None:
        """Mark the batch's ``at_most_once`` rows still leased here processed, committed before
        their handlers run (`_run_batch`): a crash or an error then loses them, never reruns."""
        with conn.begin():
            ids = [j.id for j in batch.settled]
            mine = roles.lock_claimed(conn, self._tables, ids, self.claimant, batch.since)
            batch.settled = [j for j in batch.settled if j.id in mine]
            roles.mark_processed(conn, self._tables, [j.id for j in batch.settled], batch.since)

    def _run_batch(
        self,
        conn: Connection,
        batch: _Batch,
        *,
        claim_next: bool = False,
        one_by_one: bool = False,
        failed: _HandlerFailed | None = None,
    ) -> list[Message]:
        """Run every handler of the batch in one transaction; raise if any of them fails.
        `one_by_one`: each message in a savepoint of its own, each failure recorded, and the
        row that `failed` names not run again (its error is recorded as it was). With
        `claim_next`, the same transaction claims the next batch (`_next`) after the marks,
        unless the worker is stopping (the rest are then unrun, given back uncounted)."""
        handled: list[Message] = []
        processed: list[int] = []
        unrun: list[int] = []
        # A batch whose rows all run, sized by the handlers' time (`_claim`): marked before
        # they run, which row-locks them (no lock statement; a failing handler rolls the mark
        # back), and a stop lets it finish.
        first = not (one_by_one or batch.dead or batch.away) and self._per_message is not None
        with conn.begin():
            ids = [j.id for j in batch.jobs]
            if first:
                mine = roles.mark_processed(
                    conn, self._tables, ids, batch.since, claimant=self.claimant
                )
            else:
                mine = roles.lock_claimed(conn, self._tables, ids, self.claimant, batch.since)
            self._mark_dead_rows(conn, batch, mine)
            jobs = self._to_run(batch.run, mine, None if first else unrun)
            if one_by_one:
                for job in batch.settled:  # processed already: run once, not marked
                    if self._handle_alone(conn, job):
                        handled.append(job.message)
                for job in jobs:
                    if failed is not None and job.id == failed.row_id:
                        self._record_failure(conn, job, failed.error)
                    elif self._handle_alone(conn, job):
                        handled.append(job.message)
                        processed.append(job.id)
            else:
                # join_transaction_mode="rollback_only": a handler's session.commit() only
                # flushes; this transaction is the worker's to commit.
                session = Session(bind=conn, join_transaction_mode="rollback_only")
                started = time.perf_counter()
                try:
                    self._handle(jobs, session, handled, processed)
                    session.flush()
                    run_writes(session)
                finally:
                    session.close()
                if processed:
                    self._per_message = (time.perf_counter() - started) / len(processed)
            if not first:
                roles.mark_processed(conn, self._tables, processed, batch.since)
            roles.release_claims(conn, self._tables, unrun, self.claimant)
            claimed = self._claim(conn) if claim_next and not self._stop.is_set() else []
        if claim_next:
            self._next = claimed  # once committed
        return handled

    def _to_run(self, jobs: list[_Job], mine: set[int], unrun: list[int] | None) -> Iterator[_Job]:
        """The rows still leased here (`mine`), one at a time, until the worker is stopping:
        the rest go to `unrun` (None: marked already, every one runs)."""
        for job in jobs:
            if job.id not in mine:
                continue  # lease lost to another worker in the meantime
            if unrun is not None and self._stop.is_set():
                unrun.append(job.id)
                continue
            yield job

    def _handle(
        self, jobs: Iterator[_Job], session: Session, handled: list[Message], processed: list[int]
    ) -> None:
        """Run the handlers of `jobs` with `session`, filling the lists: per-message handlers
        at once, each batch handler once at the end with all its messages. Raises
        `_HandlerFailed` (a per-message handler), or what a batch handler raised."""
        calls = self._calls()
        batches: dict[int, tuple[Subscription, list[Message]]] = {}
        for job in jobs:
            if job.handlers.single:
                try:
                    calls.each(job.message, job.handlers.single, session)
                except Exception as exc:
                    raise _HandlerFailed(job.id, exc) from exc
            for subscription in job.handlers.batch:
                batches.setdefault(id(subscription), (subscription, []))[1].append(job.message)
            handled.append(job.message)
            processed.append(job.id)
        for subscription, messages in batches.values():
            calls.batch(subscription, messages, session)

    def _calls(self) -> Calls:
        return Calls(self._settings, self._tracing.service, self._tracing.tracer(), self._listener)

    def _mark_dead_rows(self, conn: Connection, batch: _Batch, mine: set[int]) -> None:
        """Mark the batch's dead ends in its transaction: the rows its plan ended, and the
        rows no handler here takes that no live instance takes either (`Instances.leave`)."""
        batch.marked = []  # told to the listener once the transaction committed
        away = {j.id: j for j in batch.away if j.id in mine}
        dead: list[tuple[_Job, str, str | None, bool]]
        dead = [(j, reason, None, done) for j, reason, done in batch.dead if j.id in mine]
        left = self._instances.leave(conn, [j.row for j in away.values()], self.claimant)
        dead += [(away[row["id"]], NO_HANDLER, why, True) for row, why in left]
        for job, reason, error, finished in dead:
            self._mark_dead(conn, job, reason, error, finished=finished)
            batch.marked.append(reason)

    def _mark_dead(
        self,
        conn: Connection,
        job: _Job,
        reason: str,
        error: str | None,
        *,
        finished: bool,
        cause: BaseException | None = None,
    ) -> None:
        """Mark `job`'s row dead, in the caller's transaction: the one way every dead end of
        the worker goes. `cause`: the handler's exception, when one ended it. The fault back
        to the sender is written in the same transaction (outbox_inbox.faults)."""
        cause_print = fingerprint(reason, cause)
        roles.mark_dead(
            conn, self._tables, job.id, reason, error, finished=finished, fingerprint=cause_print
        )
        if self._outbox is not None:
            events = self._settings.event_faults
            send_fault(conn, self._outbox, job.message, reason, error, cause, events=events)

    def _handle_alone(self, conn: Connection, job: _Job) -> bool:
        """Run the handlers of `job` in a savepoint; True if it is to be processed."""
        session = Session(bind=conn, join_transaction_mode="create_savepoint")
        try:
            self._calls().each(job.message, job.handlers.every, session)
            session.flush()
            run_writes(session)
            session.commit()  # releases the savepoint; the outer transaction commits later
            return True
        except Exception as exc:
            _raise_if_outage(conn, exc)
            session.rollback()
            self._record_failure(conn, job, exc)
            return False
        finally:
            session.close()

    def _record_failure(self, conn: Connection, job: _Job, exc: Exception) -> None:
        """A handler of `job` raised `exc`: retried later or dead, as the policy decides (its
        handlers' own, else the service's: `RetryPolicy.decide`); lost when it was processed
        before it ran (``at_most_once``: `_settle`)."""
        message, attempt = job.message, job.row["finished"] + 1
        policy = job.handlers.retry or self._settings.retry
        error = exc.reason if isinstance(exc, Reject) else "".join(traceback.format_exception(exc))
        settled = job.handlers.delivery == "at_most_once"
        level, outcome = logging.ERROR, "lost: processed before it ran (at_most_once)"
        match None if settled else policy.decide(exc, attempt):
            case Later(delay):
                level, outcome = logging.WARNING, f"retrying in {delay:.1f}s"
                due = timedelta(seconds=delay)
                roles.mark_retry(conn, self._tables, job.id, error[-8000:], due)
                self.retry_soonest = min(delay, self.retry_soonest or delay)
                call(self._listener, "failed", message, exc, dead=False)
            case Dead(reason):
                level = logging.WARNING if isinstance(exc, Reject) else level
                outcome = f"dead ({reason})"
                self._mark_dead(conn, job, reason, error[-8000:], finished=True, cause=exc)
                call(self._listener, "failed", message, exc, dead=True)
                call(self._listener, "dead", reason, 1)
            case None:  # settled before it ran: not retried, and no row is dead
                call(self._listener, "failed", message, exc, dead=True)
                call(self._listener, "dead", "lost", 1)
        args = (message.message_id, attempt, outcome, exc)
        log.log(level, "worker: %s failed on attempt %d, %s: %r", *args)


def _limit_each_transaction(lease: float) -> Callable[[Connection], None]:
    """A ``begin`` hook that sets the worker's limits for the transaction (``SET LOCAL``).
    SQLAlchemy does not wrap what a begin hook raises: a driver error is raised as the
    DBAPIError a statement's would be, the connection invalidated when the session is gone."""

    def limit(conn: Connection) -> None:
        dbapi = conn.connection.dbapi_connection
        try:
            roles.limit_worker(dbapi, lease, local=True)
        except DRIVER_OUTAGES as exc:
            gone = conn.dialect.is_disconnect(exc, dbapi, None)  # type: ignore[arg-type]
            raise DBAPIError.instance(
                "SET LOCAL (worker limits)", None, exc, psycopg.Error, connection_invalidated=gone
            ) from exc

    return limit


def _discard(conn: Connection) -> None:
    """Close the worker's connection for good: its session, and the liveness lock it holds,
    end now. `Connection.invalidate()` alone only forgets a detached connection (the one that
    holds the lock): its session would live on, and keep its claims leased, until the garbage
    collector closes it."""
    raw = None
    with contextlib.suppress(SQLAlchemyError):
        raw = None if conn.invalidated else conn.connection.dbapi_connection
    conn.invalidate()
    conn.close()
    if raw is not None:
        try:
            raw.close()
        except Exception as exc:  # the driver's error, whichever database it is
            log.debug("closing a broken worker connection: %s", exc)


def _raise_if_outage(conn: Connection, exc: BaseException) -> None:
    """Raise `ConnectionLost` when `exc`, raised while handling, is the database's and not a
    handler's: the connection is gone, or `errors.database_unreachable`. A driver error a
    handler raised from a connection of its own is the handler's."""
    invalidated = isinstance(exc, DBAPIError) and exc.connection_invalidated
    if conn.invalidated or conn.closed or invalidated:
        raise ConnectionLost(f"connection lost while handling: {first_line(exc)}") from exc
    if isinstance(exc, DBAPIError) and database_unreachable(exc):
        raise ConnectionLost(f"handling a batch: {first_line(exc)}") from exc
