"""The worker in this process, on the real servers: what commits together, who may claim what.

A handler's effect and the processed mark of its message commit in one transaction or not at
all; two workers never hold one row; a live worker's claims are its own for the whole lease,
while those of a worker whose connection died are free at once; and a connection that dies
inside a handler is a fault of the connection, not of the message.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pika
import pytest
from sqlalchemy import Connection, create_engine, event, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

from helpers import make_service, rows, running, scalar, wait_until
from outbox_inbox import Message, Service
from outbox_inbox.listener import Listener
from outbox_inbox.queries import roles
from outbox_inbox.testing import make_retries_due
from outbox_inbox.worker import Worker

INBOX = "outbox_inbox.inbox_messages"
Handler = Callable[[Message, Any], None]

REFUSE_PROCESSED = """
CREATE FUNCTION refuse_processed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'processed' THEN
        RAISE EXCEPTION 'test trigger: marking % processed is refused', NEW.message_id;
    END IF;
    RETURN NEW;
END $$
"""
# Fires when the transaction commits: the mark fails after every statement succeeded.
AT_COMMIT = (
    f"CREATE CONSTRAINT TRIGGER refuse_processed AFTER UPDATE ON {INBOX}"
    " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_processed()"
)
# Fires in the UPDATE that marks the rows: the mark statement itself fails.
AT_ONCE = (
    f"CREATE TRIGGER refuse_processed BEFORE UPDATE ON {INBOX}"
    " FOR EACH ROW EXECUTE FUNCTION refuse_processed()"
)


def _effect(session: Any, message: Message) -> None:
    session.execute(
        text("INSERT INTO effects (message_id, type) VALUES (:m, :t)"),
        {"m": str(message.message_id), "t": message.type},
    )


def _billing(db_url: str, mq_url: str, handler: Handler, **settings: Any) -> Service:
    """billing, migrated, with `handler` on command job.run and its topology declared."""
    service = make_service("billing", db_url, mq_url, **settings)
    service.on_command("job.run")(handler)
    service.declare_topology()
    return service


def _store(service: Service, mq_url: str, count: int) -> list[str]:
    """Publish `count` job.run commands to billing and have its receiver store them."""
    message_ids = [str(uuid.uuid4()) for _ in range(count)]
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for n, message_id in enumerate(message_ids):
            channel.basic_publish(
                "commands",
                "billing.job.run",
                json.dumps({"n": n}).encode(),
                pika.BasicProperties(message_id=message_id, delivery_mode=2),
            )
    finally:
        connection.close()
    receiver = service.receiver()
    with running(receiver):
        wait_until(lambda: receiver.stored == count, timeout=20, what=f"{count} stored")
    return message_ids


@contextlib.contextmanager
def _connected(worker: Worker) -> Iterator[Connection]:
    """`worker.connect()` for the block; the connection is closed for good afterwards."""
    conn = worker.connect()
    try:
        yield conn
    finally:
        _cut(conn)


def _cut(conn: Connection) -> None:
    """Close `conn`'s database connection itself (not back to the pool): its session ends."""
    with contextlib.suppress(SQLAlchemyError):
        conn.invalidate()
    conn.close()


def _pending(db_url: str) -> int:
    return int(scalar(db_url, f"SELECT count(*) FROM {INBOX} WHERE status = 'pending'"))


def _work_until_done(worker: Worker, conn: Connection, db_url: str, timeout: float) -> None:
    """Call `work_once` until no row is pending; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while _pending(db_url):
        assert time.monotonic() < deadline, f"rows still pending after {timeout}s"
        if not worker.work_once(conn):
            time.sleep(0.05)


def _states(db_url: str) -> list[tuple[Any, ...]]:
    return [
        tuple(r)
        for r in rows(
            db_url,
            f"SELECT status, attempts, finished, count(*) FROM {INBOX} GROUP BY 1, 2, 3"
            " ORDER BY 1, 2, 3",
        )
    ]


def _effects(db_url: str) -> list[str]:
    return sorted(m for (m,) in rows(db_url, "SELECT message_id FROM effects"))


def _backend_gone(db_url: str, pid: int) -> bool:
    return not scalar(db_url, "SELECT count(*) FROM pg_stat_activity WHERE pid = :p", p=pid)


# --- the effect and the mark commit together ---------------------------------------------------


def _check_refused_mark_rolls_back_the_effect(
    db_url: str, mq_url: str, trigger: str, timed: bool
) -> None:
    """`timed`: the worker handled a batch before, so it marks the next one before running
    its handlers (`Worker._run_batch`); else it marks after them."""
    calls: list[str] = []

    def handle(message: Message, session: Any) -> None:
        calls.append(str(message.message_id))
        _effect(session, message)

    billing = _billing(db_url, mq_url, handle)
    worker = billing.worker()
    with _connected(worker) as conn, contextlib.suppress(SQLAlchemyError):
        if timed:
            done = _store(billing, mq_url, 2)
            _work_until_done(worker, conn, db_url, timeout=15)
            calls.clear()
        message_ids = _store(billing, mq_url, 3)
        with billing.engine.begin() as setup:
            setup.execute(text(REFUSE_PROCESSED))
            setup.execute(text(trigger))
        worker.work_once(conn)  # may raise the database's refusal, or deal with it itself
    # Every handler ran, and its effect went with the refused mark.
    assert sorted(set(calls)) == sorted(message_ids)
    assert _effects(db_url) == (sorted(done) if timed else [])
    pending = rows(db_url, f"SELECT message_id::text FROM {INBOX} WHERE status = 'pending'")
    assert sorted(m for (m,) in pending) == sorted(message_ids)
    if timed:
        message_ids += done

    with billing.engine.begin() as conn:
        conn.execute(text(f"DROP TRIGGER refuse_processed ON {INBOX}"))
        make_retries_due(conn, billing.tables)  # in case it was counted as a failure
    calls.clear()
    worker = billing.worker()
    with _connected(worker) as conn:
        _work_until_done(worker, conn, db_url, timeout=15)
    assert _effects(db_url) == sorted(message_ids)
    assert rows(db_url, f"SELECT DISTINCT status FROM {INBOX}") == [("processed",)]
    billing.close()


@pytest.mark.parametrize("timed", [False, True], ids=["first-batch", "marked-first"])
def test_a_mark_that_fails_at_commit_after_the_handler_ran_rolls_back_the_effect(
    db_url: str, mq_url: str, timed: bool
) -> None:
    _check_refused_mark_rolls_back_the_effect(db_url, mq_url, AT_COMMIT, timed)


@pytest.mark.parametrize("timed", [False, True], ids=["first-batch", "marked-first"])
def test_a_mark_that_fails_in_its_statement_after_the_handler_ran_rolls_back_the_effect(
    db_url: str, mq_url: str, timed: bool
) -> None:
    _check_refused_mark_rolls_back_the_effect(db_url, mq_url, AT_ONCE, timed)


def test_a_batch_marked_before_its_handlers_run_takes_back_the_marks_of_a_failed_handler(
    db_url: str, mq_url: str
) -> None:
    """Once the worker has timed its handlers it marks a batch processed before they run, in
    their transaction, with no lock statement: a handler that raises takes the marks back
    with the effects, the batch runs again one message at a time (locked first), and only the
    failed message waits for its retry."""
    failing: set[str] = set()

    def handle(message: Message, session: Any) -> None:
        if str(message.message_id) in failing:
            raise RuntimeError("refused by the test")
        _effect(session, message)

    billing = _billing(db_url, mq_url, handle, worker_batch_size=10)
    statements: list[str] = []
    worker = billing.worker()
    with _connected(worker) as conn:
        first = _store(billing, mq_url, 3)
        _work_until_done(worker, conn, db_url, timeout=15)
        batch = _store(billing, mq_url, 5)
        failing.add(batch[1])

        def seen(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            statements.append(statement)

        event.listen(billing.engine, "before_cursor_execute", seen)
        worker.work_once(conn)
        event.remove(billing.engine, "before_cursor_execute", seen)
    locks = [s for s in statements if s.startswith("SELECT") and s.endswith("FOR UPDATE")]
    assert len(locks) == 1, "the batch's first run locked its rows with a statement of its own"
    assert _effects(db_url) == sorted(first + [m for m in batch if m != batch[1]])
    states = rows(db_url, f"SELECT message_id::text, status, finished FROM {INBOX}")
    assert {m: (st, f) for m, st, f in states if m in batch} == {
        m: ("pending", 1) if m == batch[1] else ("processed", 1) for m in batch
    }
    billing.close()


def test_a_stop_during_a_batch_marked_before_its_handlers_run_lets_the_batch_finish(
    db_url: str, mq_url: str
) -> None:
    """The rows of a batch marked processed before its handlers run all run, even when the
    worker is asked to stop in its middle: none is left marked without its effect."""
    stop = threading.Event()
    batch: list[str] = []

    def handle(message: Message, session: Any) -> None:
        _effect(session, message)
        if str(message.message_id) in batch[1:2]:
            stop.set()

    billing = _billing(db_url, mq_url, handle, worker_batch_size=10)
    worker = billing.worker()
    first = _store(billing, mq_url, 3)
    warm = threading.Event()
    thread = threading.Thread(target=worker.run, args=(warm,))
    thread.start()
    wait_until(lambda: len(_effects(db_url)) == 3, timeout=15, what="the first batch")
    warm.set()
    thread.join(timeout=15)
    batch += _store(billing, mq_url, 5)
    worker.run(stop)  # returns once stopped
    assert _effects(db_url) == sorted(first + batch)
    assert _states(db_url) == [("processed", 1, 1, 8)]
    assert scalar(db_url, f"SELECT count(*) FROM {INBOX} WHERE locked_by IS NOT NULL") == 0
    billing.close()


# --- who may claim what -------------------------------------------------------------------------


def test_two_workers_claiming_on_two_open_connections_get_disjoint_rows(
    db_url: str, mq_url: str
) -> None:
    handled: list[tuple[str, str]] = []  # (thread, message id)
    both_in_a_batch = threading.Barrier(2, timeout=10)
    local = threading.local()

    def handle(message: Message, session: Any) -> None:
        if not getattr(local, "met", False):  # each thread's first call waits for the other's
            local.met = True
            both_in_a_batch.wait()
        handled.append((threading.current_thread().name, str(message.message_id)))
        _effect(session, message)

    billing = _billing(db_url, mq_url, handle, worker_batch_size=10)
    message_ids = _store(billing, mq_url, 20)
    all_ids = sorted(r for (r,) in rows(db_url, f"SELECT id FROM {INBOX}"))
    lease = timedelta(seconds=billing.settings.lease)
    a, b = billing.worker(), billing.worker()

    # Both claims inside transactions that stay open until both have claimed.
    with _connected(a) as conn_a, _connected(b) as conn_b:
        claim_a = conn_a.begin()
        claimed_a = roles.claim_inbox(conn_a, billing.tables, a.claimant, 10, lease)
        claim_b = conn_b.begin()
        claimed_b = roles.claim_inbox(conn_b, billing.tables, b.claimant, 10, lease)
        ids_a, ids_b = {r["id"] for r in claimed_a}, {r["id"] for r in claimed_b}
        claim_b.rollback()
        claim_a.rollback()
    assert len(ids_a) == len(ids_b) == 10
    assert not ids_a & ids_b
    assert sorted(ids_a | ids_b) == all_ids

    # Now both workers at once, each inside its batch while the other claims.
    claimed: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def work(worker: Worker) -> None:
        try:
            with _connected(worker) as conn:
                claimed[threading.current_thread().name] = [worker.work_once(conn)]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,), name=f"w{n}") for n, w in enumerate((a, b))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert claimed == {"w0": [10], "w1": [10]}
    assert not both_in_a_batch.broken
    per_message = Counter(m for _, m in handled)
    assert sorted(per_message) == sorted(message_ids)
    assert set(per_message.values()) == {1}
    assert {t for t, _ in handled} == {"w0", "w1"}
    assert _effects(db_url) == sorted(message_ids)
    assert _states(db_url) == [("processed", 1, 1, 20)]
    billing.close()


def _claim_and_hold(billing: Service, worker: Worker, conn: Connection) -> list[int]:
    """Claim every due row for `worker` on its connection and commit, without handling them."""
    lease = timedelta(seconds=billing.settings.lease)
    with conn.begin():
        claimed = roles.claim_inbox(conn, billing.tables, worker.claimant, 50, lease)
    return [r["id"] for r in claimed]


def test_rows_claimed_by_a_live_worker_are_not_taken_by_another(db_url: str, mq_url: str) -> None:
    calls: list[str] = []

    def handle(message: Message, session: Any) -> None:
        calls.append(str(message.message_id))
        _effect(session, message)

    billing = _billing(db_url, mq_url, handle)
    assert billing.settings.lease == 60
    _store(billing, mq_url, 5)
    a, b = billing.worker(), billing.worker()
    with _connected(a) as conn_a, _connected(b) as conn_b:
        assert len(_claim_and_hold(billing, a, conn_a)) == 5
        assert a.claimant != b.claimant
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            assert b.work_once(conn_b) == 0
            time.sleep(0.2)
        assert rows(db_url, f"SELECT DISTINCT locked_by FROM {INBOX}") == [(a.claimant,)]
    assert calls == []
    assert _effects(db_url) == []
    billing.close()


@pytest.mark.parametrize("how", ["closed", "terminated"])
def test_claims_of_a_worker_whose_connection_died_are_taken_at_once(
    db_url: str, mq_url: str, how: str
) -> None:
    calls: list[str] = []

    def handle(message: Message, session: Any) -> None:
        calls.append(str(message.message_id))
        _effect(session, message)

    billing = _billing(db_url, mq_url, handle)
    assert billing.settings.lease == 60
    message_ids = _store(billing, mq_url, 5)
    a, b = billing.worker(), billing.worker()
    killer = create_engine(db_url, poolclass=NullPool)
    conn_a = a.connect()
    try:
        pid_a = conn_a.execute(text("SELECT pg_backend_pid()")).scalar_one()
        conn_a.rollback()
        assert len(_claim_and_hold(billing, a, conn_a)) == 5
        if how == "closed":
            _cut(conn_a)
        else:
            with killer.connect() as conn:
                assert conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid_a}).scalar()
        cut_at = time.monotonic()
        with _connected(b) as conn_b:
            _work_until_done(b, conn_b, db_url, timeout=5)
        took = time.monotonic() - cut_at
    finally:
        _cut(conn_a)
        killer.dispose()
    assert took < 5  # the lease is 60 s
    assert sorted(calls) == sorted(message_ids)
    assert _effects(db_url) == sorted(message_ids)
    assert _states(db_url) == [("processed", 2, 1, 5)]
    billing.close()


# --- a connection cut inside a handler ----------------------------------------------------------


class Outcomes(Listener):
    def __init__(self) -> None:
        self.handled_messages: list[str] = []
        self.failures: list[tuple[str, BaseException, bool]] = []

    def handled(self, message: Message) -> None:
        self.handled_messages.append(str(message.message_id))

    def failed(self, message: Message, error: BaseException, *, dead: bool) -> None:
        self.failures.append((str(message.message_id), error, dead))


def test_a_connection_cut_inside_a_handler_is_not_a_handler_failure(
    db_url: str, mq_url: str
) -> None:
    outcomes = Outcomes()
    killer = create_engine(db_url, poolclass=NullPool)
    cut: list[int] = []  # the pid of the backend the first handler call terminated

    def handle(message: Message, session: Any) -> None:
        if not cut:
            pid = session.execute(text("SELECT pg_backend_pid()")).scalar_one()
            cut.append(pid)
            with killer.connect() as conn:
                conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            wait_until(lambda: _backend_gone(db_url, pid), timeout=10, what="the backend to end")
        _effect(session, message)  # on the first call: the connection is gone

    billing = _billing(db_url, mq_url, handle, listener=outcomes)
    assert billing.settings.lease == 60
    message_ids = _store(billing, mq_url, 3)
    worker = billing.worker()
    try:
        with running(worker):
            wait_until(lambda: _pending(db_url) == 0, timeout=15, what="every row finished")
    finally:
        killer.dispose()
    assert len(cut) == 1
    assert outcomes.failures == []
    assert sorted(set(outcomes.handled_messages)) == sorted(message_ids)
    assert _effects(db_url) == sorted(message_ids)
    # The cut was not counted as a finished attempt and left no error: no mark_retry ran.
    assert _states(db_url) == [("processed", 2, 1, 3)]
    assert rows(db_url, f"SELECT count(*) FROM {INBOX} WHERE last_error IS NOT NULL") == [(0,)]
    billing.close()


# --- one transaction per batch ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["thread", "asyncio"])
def test_a_batch_commits_with_the_claim_of_the_next_and_a_stopping_worker_gives_that_back(
    db_url: str, mq_url: str, kind: str
) -> None:
    """The transaction that marks a batch also claims the next one (counted when it commits,
    before its handlers run); a worker that stops before that batch gives its claims back
    uncounted, so they never look like the claims of a worker that died. The thread worker
    and the asyncio worker alike."""
    billing = _billing(db_url, mq_url, lambda m, s: _effect(s, m), worker_batch_size=50)
    _store(billing, mq_url, 120)
    stop = threading.Event()
    claimed_when_committed: list[int] = []

    class StopAfterFirstBatch(Listener):
        def handled(self, message: Message) -> None:  # after the batch's commit
            if not stop.is_set():
                claimed_when_committed.append(
                    scalar(
                        db_url,
                        f"SELECT count(*) FROM {INBOX} WHERE status = 'pending'"
                        " AND locked_by IS NOT NULL AND attempts = 1",
                    )
                )
                stop.set()

    billing.listener = StopAfterFirstBatch()
    if kind == "thread":
        billing.worker().run(stop)
    else:
        billing.async_worker().run_in_thread(stop)
    assert claimed_when_committed == [50]
    assert _states(db_url) == [("pending", 0, 0, 70), ("processed", 1, 1, 50)]
    assert scalar(db_url, f"SELECT count(*) FROM {INBOX} WHERE locked_by IS NOT NULL") == 0
    billing.close()


# --- a session the server ends is an outage, not a crash ----------------------------------------


def _terminate_others(db_url: str) -> int:
    """pg_terminate_backend every other session of the test's database; how many."""
    return int(
        scalar(
            db_url,
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
    )


def test_a_session_ended_by_the_server_is_an_outage_of_the_worker_never_a_crash(
    db_url: str, mq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    billing = _billing(db_url, mq_url, lambda message, session: _effect(session, message))
    # Limits set by each transaction's `begin` hook, as behind a pooler in transaction mode
    # (no session to hold a liveness lock): the hook runs on the raw driver connection.
    worker = Worker(
        engine=billing.engine,
        tables=billing.tables,
        handlers=billing.handlers,
        settings=billing.settings,
        liveness_url=lambda: None,
    )
    conn = worker.connect()
    try:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        conn.commit()
        assert _terminate_others(db_url) >= 1
        wait_until(lambda: _backend_gone(db_url, pid), timeout=10, what="the backend to end")
        # What the hook meets is the database error every role retries, the connection
        # marked gone: not the driver's own AdminShutdown, which no role expects.
        with pytest.raises(SQLAlchemyError) as raised:
            worker.work_once(conn)
        assert getattr(raised.value, "connection_invalidated", False), raised.value
    finally:
        _cut(conn)

    # The role: five rounds of terminated sessions, then work; one line per outage, no
    # traceback, no error, and everything handled.
    caplog.set_level(logging.INFO, logger="outbox_inbox")
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,))
    thread.start()
    try:
        for _ in range(5):
            time.sleep(0.5)
            _terminate_others(db_url)
        message_ids = _store(billing, mq_url, 20)
        wait_until(lambda: _pending(db_url) == 0, timeout=30, what="every row handled")
        assert thread.is_alive()
    finally:
        stop.set()
        thread.join(30)
    assert _effects(db_url) == sorted(message_ids)
    mine = [r for r in caplog.records if r.name.startswith("outbox_inbox")]
    assert [r.getMessage() for r in mine if r.exc_info or r.levelno >= logging.ERROR] == []
    outages = [r for r in mine if r.levelno == logging.WARNING]
    assert 1 <= len(outages) <= 5, [r.getMessage() for r in outages]
    assert all("database unavailable" in r.getMessage() for r in outages), outages
    billing.close()
