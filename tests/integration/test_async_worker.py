"""The asyncio worker on the real servers: the worker's contract, with ``async def`` handlers.

The twin of test_receive_and_handle.py and test_worker_atomicity.py for handlers that await an
AsyncSession: the effect and the processed mark commit together or not at all (a mark refused
by the database after the handler ran takes the effect with it), failures are retried then
dead, a Reject is dead at once, a failing message in a batch costs only itself, an ordering key
is handled in order, what a handler sends carries the handled message's ids, and a connection
cut inside a handler is not a handler failure. Every handler here really awaits the async
driver: each checks that its session is an AsyncSession on psycopg's async connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.pool import NullPool

from helpers import make_service, rows, running, scalar, wait_until
from outbox_inbox import Message, Reject, RetryPolicy, Service
from outbox_inbox.aio import AsyncWorker
from outbox_inbox.listener import Listener

INBOX = "outbox_inbox.inbox_messages"

REFUSE_PROCESSED = """
CREATE FUNCTION refuse_processed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'processed' THEN
        RAISE EXCEPTION 'test trigger: marking % processed is refused', NEW.message_id;
    END IF;
    RETURN NEW;
END $$
"""
#: Advisory locks held by other sessions of this database (a worker's liveness lock).
HELD_LOCKS = (
    "SELECT a.pid, a.state, a.query, a.backend_start FROM pg_locks l"
    " JOIN pg_stat_activity a USING (pid)"
    " WHERE l.locktype = 'advisory' AND a.datname = current_database()"
    " AND a.pid <> pg_backend_pid()"
)
AT_COMMIT = (
    f"CREATE CONSTRAINT TRIGGER refuse_processed AFTER UPDATE ON {INBOX}"
    " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_processed()"
)
AT_ONCE = (
    f"CREATE TRIGGER refuse_processed BEFORE UPDATE ON {INBOX}"
    " FOR EACH ROW EXECUTE FUNCTION refuse_processed()"
)


async def _effect(session: AsyncSession, message: Message, info: str = "") -> None:
    """Insert the message's effect through the AsyncSession, on the async driver."""
    assert isinstance(session, AsyncSession)
    conn = await session.connection()
    raw = await conn.get_raw_connection()
    # The DB-API connection is SQLAlchemy's adapter of psycopg's AsyncConnection.
    assert isinstance(raw.dbapi_connection.driver_connection, psycopg.AsyncConnection)
    await session.execute(
        text("INSERT INTO effects (message_id, type, info) VALUES (:m, :t, :i)"),
        {"m": str(message.message_id), "t": message.type, "i": info},
    )


def _store(service: Service, mq_url: str, payloads: list[dict[str, Any]], **props: Any) -> None:
    """Publish job.run commands to `service` with plain pika and have its receiver store them."""
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for payload in payloads:
            channel.basic_publish(
                "commands",
                f"{service.name}.job.run",
                json.dumps(payload).encode(),
                pika.BasicProperties(message_id=str(uuid.uuid4()), delivery_mode=2, **props),
            )
    finally:
        connection.close()
    receiver = service.receiver()
    with running(receiver):
        wait_until(lambda: receiver.stored == len(payloads), what=f"{len(payloads)} stored")


@contextlib.contextmanager
def _running(worker: AsyncWorker) -> Iterator[None]:
    """The asyncio worker in a thread of its own (its own event loop) for the block."""
    stop = threading.Event()
    thread = threading.Thread(target=worker.run_in_thread, args=(stop,))
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(20)
        assert not thread.is_alive()


def _pending(db_url: str) -> int:
    return int(scalar(db_url, f"SELECT count(*) FROM {INBOX} WHERE status = 'pending'"))


def _effects(db_url: str) -> list[str]:
    return sorted(m for (m,) in rows(db_url, "SELECT info FROM effects"))


def _billing(db_url: str, mq_url: str, **settings: Any) -> Service:
    service = make_service("billing", db_url, mq_url, **settings)
    return service


def test_async_handler_effect_commits_with_the_mark_and_failed_attempts_roll_back(
    db_url: str, mq_url: str
) -> None:
    billing = _billing(db_url, mq_url)
    calls: list[int] = []

    @billing.on_command("job.run", retry=RetryPolicy(initial=0.1, max_attempts=5))
    async def run(message: Message, session: AsyncSession) -> None:
        calls.append(message.attempt)
        await _effect(session, message, f"attempt {message.attempt}")
        await asyncio.sleep(0)  # a real suspension point between the effect and the mark
        if message.attempt < 3:
            raise RuntimeError("flaky downstream")

    billing.declare_topology()
    _store(billing, mq_url, [{"n": 1}])
    worker = billing.async_worker()
    with _running(worker):
        wait_until(lambda: worker.processed == 1, what="processed after retries")
    assert calls == [1, 2, 3]
    assert _effects(db_url) == ["attempt 3"]
    assert rows(db_url, f"SELECT status, attempts, finished, last_error FROM {INBOX}") == [
        ("processed", 3, 3, None)
    ]
    billing.close()


@pytest.mark.parametrize("trigger", [AT_COMMIT, AT_ONCE], ids=["at_commit", "in_statement"])
def test_a_refused_mark_after_an_async_handler_ran_rolls_back_its_effect(
    db_url: str, mq_url: str, trigger: str
) -> None:
    billing = _billing(db_url, mq_url)
    calls: list[int] = []

    @billing.on_command("job.run")
    async def run(message: Message, session: AsyncSession) -> None:
        calls.append(message.payload["n"])
        await _effect(session, message, str(message.payload["n"]))

    billing.declare_topology()
    _store(billing, mq_url, [{"n": n} for n in range(3)])
    with billing.engine.begin() as conn:
        conn.execute(text(REFUSE_PROCESSED))
        conn.execute(text(trigger))

    async def one_batch() -> None:
        worker = billing.async_worker()
        conn = await worker.connect()
        try:
            with contextlib.suppress(Exception):  # the refusal, or a failure it recorded
                await worker.work_once(conn)
        finally:
            await conn.close()
            await worker.close()

    asyncio.run(one_batch())
    assert sorted(set(calls)) == [0, 1, 2]  # every handler ran ...
    assert _effects(db_url) == []  # ... and its effect went with the refused mark
    assert rows(db_url, f"SELECT DISTINCT status FROM {INBOX}") == [("pending",)]
    # The closed worker's session is gone at once, and its liveness lock with it: its claims
    # are free now, not when the garbage collector closes the connection.
    assert rows(db_url, HELD_LOCKS) == []

    with billing.engine.begin() as conn:
        conn.execute(text(f"DROP TRIGGER refuse_processed ON {INBOX}"))
        conn.execute(text(f"UPDATE {INBOX} SET next_attempt_at = now()"))
    worker = billing.async_worker()
    with _running(worker):
        wait_until(lambda: _pending(db_url) == 0, what="all processed once the mark is allowed")
    assert _effects(db_url) == ["0", "1", "2"]
    billing.close()


def test_a_failing_async_handler_in_a_batch_costs_only_its_own_message(
    db_url: str, mq_url: str
) -> None:
    billing = _billing(db_url, mq_url, worker_batch_size=10)

    @billing.on_command("job.run", retry=RetryPolicy(initial=30, max_attempts=5))
    async def run(message: Message, session: AsyncSession) -> None:
        await _effect(session, message, str(message.payload["n"]))
        if message.payload["n"] == 2:
            raise ValueError("bad job")

    billing.declare_topology()
    _store(billing, mq_url, [{"n": n} for n in range(5)])
    worker = billing.async_worker()
    with _running(worker):
        wait_until(lambda: worker.processed == 4, what="the four good ones processed")
    assert _effects(db_url) == ["0", "1", "3", "4"]
    states = rows(db_url, f"SELECT status, finished, last_error FROM {INBOX}")
    assert sorted(r[0] for r in states) == ["pending"] + ["processed"] * 4
    failed = [r for r in states if r[0] == "pending"]
    assert failed[0][:2] == ("pending", 1)
    assert "ValueError: bad job" in failed[0][2]
    billing.close()


def test_async_reject_is_dead_at_once_and_max_attempts_is_dead_with_the_error(
    db_url: str, mq_url: str
) -> None:
    billing = _billing(db_url, mq_url)

    @billing.on_command("job.run", retry=RetryPolicy(initial=0.05, max_attempts=2))
    async def run(message: Message, session: AsyncSession) -> None:
        await _effect(session, message, str(message.payload["n"]))
        if message.payload["n"] == 0:
            raise Reject("no such job")
        raise ValueError("cannot run")

    billing.declare_topology()
    _store(billing, mq_url, [{"n": 0}, {"n": 1}])
    with _running(billing.async_worker()):
        wait_until(lambda: _pending(db_url) == 0, what="both dead")
    dead = dict(
        (r[0]["n"], r[1:])
        for r in rows(db_url, f"SELECT payload, dead_reason, attempts, last_error FROM {INBOX}")
    )
    assert dead[0][:2] == ("rejected", 1)
    assert dead[1][:2] == ("max_attempts", 2)
    assert "ValueError: cannot run" in dead[1][2]
    assert _effects(db_url) == []
    billing.close()


def test_what_an_async_handler_sends_carries_causation_and_correlation(
    db_url: str, mq_url: str
) -> None:
    billing = _billing(db_url, mq_url)

    @billing.on_command("job.run")
    async def run(message: Message, session: AsyncSession) -> None:
        await billing.outbox.publish_async(session, "job.done", {"n": message.payload["n"]})

    billing.declare_topology()
    _store(billing, mq_url, [{"n": 7}], correlation_id="checkout-42")
    worker = billing.async_worker()
    with _running(worker):
        wait_until(lambda: worker.processed == 1)
    (inbox_id,) = rows(db_url, f"SELECT message_id FROM {INBOX}")[0]
    sent = rows(
        db_url,
        "SELECT routing_key, causation_id, correlation_id, payload"
        " FROM outbox_inbox.outbox_messages",
    )
    assert sent == [("billing.job.done", str(inbox_id), "checkout-42", {"n": 7})]
    billing.close()


def test_async_messages_of_one_key_are_handled_in_order(db_url: str, mq_url: str) -> None:
    billing = _billing(db_url, mq_url, worker_batch_size=10)
    seen: list[int] = []

    @billing.on_command("job.run")
    async def run(message: Message, session: AsyncSession) -> None:
        await _effect(session, message, str(message.payload["n"]))
        seen.append(message.payload["n"])

    billing.declare_topology()
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for n in range(6):
            channel.basic_publish(
                "commands",
                "billing.job.run",
                json.dumps({"n": n}).encode(),
                pika.BasicProperties(
                    message_id=str(uuid.uuid4()), delivery_mode=2, headers={"x-key": "a"}
                ),
            )
    finally:
        connection.close()
    receiver = billing.receiver()
    with running(receiver):
        wait_until(lambda: receiver.stored == 6)
    workers = [billing.async_worker(), billing.async_worker()]
    with _running(workers[0]), _running(workers[1]):
        wait_until(lambda: sum(w.processed for w in workers) == 6)
    assert seen == list(range(6))
    billing.close()


class Outcomes(Listener):
    def __init__(self) -> None:
        self.handled_messages: list[str] = []
        self.failures: list[tuple[str, BaseException, bool]] = []

    def handled(self, message: Message) -> None:
        self.handled_messages.append(str(message.message_id))

    def failed(self, message: Message, error: BaseException, *, dead: bool) -> None:
        self.failures.append((str(message.message_id), error, dead))


def test_a_connection_cut_inside_an_async_handler_is_not_a_handler_failure(
    db_url: str, mq_url: str
) -> None:
    outcomes = Outcomes()
    killer = create_engine(db_url, poolclass=NullPool)
    cut: list[int] = []
    billing = _billing(db_url, mq_url, listener=outcomes)

    @billing.on_command("job.run")
    async def run(message: Message, session: AsyncSession) -> None:
        if not cut:
            pid = (await session.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            cut.append(pid)
            with killer.connect() as conn:
                conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            await asyncio.sleep(0.5)
        await _effect(session, message, str(message.payload["n"]))

    billing.declare_topology()
    _store(billing, mq_url, [{"n": n} for n in range(3)])
    try:
        with _running(billing.async_worker()):
            wait_until(lambda: _pending(db_url) == 0, timeout=15, what="every row finished")
    finally:
        killer.dispose()
    assert len(cut) == 1
    assert outcomes.failures == []
    assert _effects(db_url) == ["0", "1", "2"]
    assert rows(
        db_url, f"SELECT status, attempts, finished, count(*) FROM {INBOX} GROUP BY 1, 2, 3"
    ) == [("processed", 2, 1, 3)]
    billing.close()
