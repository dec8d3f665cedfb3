"""Batches are formed by concurrency, never by a timer: counted, not timed.

A lone message goes through each stage in one transaction, at once; messages that arrive while
a stage's transaction is in flight join its next transaction (one flush in flight, the rest
joins the next), so batches grow with the load and shrink to one when idle. The poll intervals
are a minute here: nothing below may depend on a poll.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.orm import Session

from helpers import as_prepared, make_service, rows, scalar, wait_until
from outbox_inbox import Message, Service
from outbox_inbox.queries.roles import INBOX_LOCK, LEAD_LOCK

COMMAND = "ledger.append"
ROLES = ("relay", "receiver", "worker")
OUTBOX_UNSENT = "SELECT count(*) FROM outbox_inbox.outbox_messages WHERE published_at IS NULL"


class Counted:
    """Transactions committed by each role's thread on `service`'s engine, each as the list
    of the statements it ran."""

    def __init__(self, service: Service) -> None:
        self.transactions: dict[str, list[list[str]]] = {}
        self._open: dict[str, list[str]] = {}
        self._engine = service.engine
        event.listen(self._engine, "commit", self._commit)
        event.listen(self._engine, "before_cursor_execute", self._statement)

    def _commit(self, _conn: Any) -> None:
        role = threading.current_thread().name
        self.transactions.setdefault(role, []).append(self._open.pop(role, []))

    def _statement(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        self._open.setdefault(threading.current_thread().name, []).append(statement)

    def commits(self) -> dict[str, int]:
        return {role: len(self.transactions.get(role, [])) for role in ROLES}

    def reset(self) -> None:
        self.transactions.clear()

    def close(self) -> None:
        event.remove(self._engine, "commit", self._commit)
        event.remove(self._engine, "before_cursor_execute", self._statement)


@contextmanager
def roles_running(service: Service, workers: int = 1) -> Iterator[None]:
    """The service's relay, receiver and workers, each in a thread named after its role (the
    workers after the first ``worker-2``, ``worker-3``...)."""
    stop = threading.Event()
    roles: dict[str, Any] = {"relay": service.relay(), "receiver": service.receiver()}
    for n in range(1, workers + 1):
        roles["worker" if n == 1 else f"worker-{n}"] = service.worker()
    threads = [threading.Thread(target=r.run, args=(stop,), name=n) for n, r in roles.items()]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(20)
        assert not any(t.is_alive() for t in threads)


def billing_with_effects(db_url: str, mq_url: str, **settings: Any) -> Service:
    """billing, sending `ledger.append` to itself; its handler writes one effect row, with the
    name of the thread that handled it. Polls wait a minute: only wake-ups move messages."""
    billing = make_service(
        "billing",
        db_url,
        mq_url,
        relay_poll_interval=60,
        worker_poll_interval=60,
        **settings,
    )

    @billing.on_command(COMMAND)
    def append(message: Message, session: Session) -> None:
        session.execute(
            text("INSERT INTO effects (message_id, type, info) VALUES (:m, :t, :w)"),
            {"m": str(message.message_id), "t": message.type, "w": threading.current_thread().name},
        )

    billing.declare_topology()
    return billing


def send(billing: Service, count: int, start: int = 0) -> list[str]:
    """`count` commands, each in a business transaction of its own."""
    ids = []
    for n in range(start, start + count):
        with billing.session() as session, session.begin():
            ids.append(str(billing.outbox.send(session, "billing", COMMAND, {"n": n})))
    return ids


def warm(billing: Service, db_url: str, counted: Counted | None = None) -> None:
    """One message through, so that connections are open and the workers registered; then
    count from zero."""
    send(billing, 1)
    settled(db_url, 1)
    if counted is not None:
        counted.reset()


def effects(db_url: str) -> int:
    return int(scalar(db_url, "SELECT count(*) FROM effects"))


def settled(db_url: str, count: int) -> None:
    wait_until(lambda: effects(db_url) >= count, what=f"{count} effects")
    # The worker's next claim, in the transaction that marked the last batch, finds nothing;
    # wait for every role to be back in its wait.
    wait_until(
        lambda: (
            scalar(
                db_url,
                "SELECT count(*) FROM outbox_inbox.inbox_messages WHERE status <> 'processed'",
            )
            == 0
        ),
        what="every message marked",
    )


def test_a_lone_message_goes_through_each_stage_in_one_transaction(
    db_url: str, mq_url: str
) -> None:
    billing = billing_with_effects(db_url, mq_url)
    counted = Counted(billing)
    try:
        with roles_running(billing):
            warm(billing, db_url)
            for n in range(1, 4):
                counted.reset()
                send(billing, 1, start=n)
                settled(db_url, n + 1)
                # The relay claims, publishes and marks in one transaction; the receiver
                # stores in one; the worker claims in one and handles, marks and claims the
                # next in one. No further transaction: no poll ran, no batch waited.
                assert counted.commits() == {"relay": 1, "receiver": 1, "worker": 2}
                # The receiver's round trips: its bounds with the message's lock, the insert.
                [stored] = counted.transactions["receiver"]
                assert len(stored) == 2, stored
    finally:
        counted.close()
        billing.close()


def test_each_stage_plans_its_prepared_statements_once_per_connection(
    db_url: str, mq_url: str
) -> None:
    """Planned anew at each call, the relay's claim and mark and the receiver's insert took
    more server time than they ran (about 1, 0.5 and 0.4 ms a transaction): a lone message
    paid it at every stage. Each role's transactions keep one generic plan a statement."""
    billing = billing_with_effects(db_url, mq_url)
    ran: dict[str, set[str]] = {role: set() for role in ROLES}
    custom_plans: dict[str, int] = {}  # by statement, of every session the roles used

    def note_statement(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if threading.current_thread().name in ROLES:  # as psycopg sends it: $1, $2...
            ran[threading.current_thread().name].add(as_prepared(statement)[0])

    def note_plans(conn: Any) -> None:  # on the role's own session, before its commit
        if threading.current_thread().name in ROLES:
            seen = "SELECT statement, custom_plans FROM pg_prepared_statements"
            for text_, n in conn.exec_driver_sql(seen).tuples().all():  # the most of any session
                custom_plans[text_] = max(n, custom_plans.get(text_, 0))

    event.listen(billing.engine, "before_cursor_execute", note_statement)
    event.listen(billing.engine, "commit", note_plans)
    try:
        with roles_running(billing):
            warm(billing, db_url)
            for n in range(1, 13):  # each statement prepared after its fifth call
                send(billing, 1, start=n)
                settled(db_url, n + 1)
    finally:
        event.remove(billing.engine, "commit", note_plans)
        event.remove(billing.engine, "before_cursor_execute", note_statement)
        billing.close()
    hot = {"relay": "SKIP LOCKED", "receiver": "INSERT INTO", "worker": "WITH RECURSIVE"}
    for role, statement in hot.items():
        prepared = {t: n for t, n in custom_plans.items() if t in ran[role]}
        assert any(statement in t for t in prepared), (role, list(prepared))
        # The statement that sets the plan cache's mode is planned before it takes effect.
        custom = {t[:70]: n for t, n in prepared.items() if n and "set_config" not in t[:20]}
        assert not custom, (role, custom)


def test_a_burst_is_carried_in_batches(db_url: str, mq_url: str) -> None:
    billing = billing_with_effects(db_url, mq_url)
    counted = Counted(billing)
    total = 400
    try:
        with roles_running(billing):
            warm(billing, db_url, counted)
            writers = [
                threading.Thread(target=send, args=(billing, total // 8, 1 + w * total // 8))
                for w in range(8)
            ]
            for writer in writers:
                writer.start()
            for writer in writers:
                writer.join()
            settled(db_url, total + 1)
            commits = counted.commits()
        # Eight writers offer more than one message per transaction of each stage can carry:
        # what arrives while a stage's transaction is in flight joins its next one.
        assert all(n <= total / 4 for n in commits.values()), commits
    finally:
        counted.close()
        billing.close()


@contextmanager
def receiver_held_on_its_next_batch(db_url: str, message_id: str) -> Iterator[None]:
    """Hold the lock the receiver takes on `message_id` before storing it (`INBOX_LOCK`):
    the receiver's transaction that stores it waits in flight until the block ends."""
    with billing_engine(db_url) as conn:
        conn.execute(
            text("SELECT pg_advisory_lock(:ns, hashtext(:m))"), {"ns": INBOX_LOCK, "m": message_id}
        )
        try:
            yield
        finally:
            conn.execute(
                text("SELECT pg_advisory_unlock(:ns, hashtext(:m))"),
                {"ns": INBOX_LOCK, "m": message_id},
            )


@contextmanager
def billing_engine(db_url: str) -> Iterator[Any]:
    from sqlalchemy import create_engine

    engine = create_engine(db_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


def waiting_on_advisory_lock(db_url: str) -> bool:
    return bool(
        scalar(
            db_url,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
        )
    )


def test_messages_arriving_while_the_receiver_stores_join_its_next_transaction(
    db_url: str, mq_url: str
) -> None:
    billing = billing_with_effects(db_url, mq_url)
    counted = Counted(billing)
    try:
        with roles_running(billing):
            warm(billing, db_url, counted)
            with ExitStack() as held:
                with billing.session() as session, session.begin():
                    first = str(billing.outbox.send(session, "billing", COMMAND, {"n": 1}))
                    # The outbox row commits after the lock is taken: its delivery is the
                    # first the receiver's next transaction stores, and it waits on the lock.
                    held.enter_context(receiver_held_on_its_next_batch(db_url, first))
                wait_until(lambda: waiting_on_advisory_lock(db_url), what="the receiver held")
                send(billing, 20, start=2)
                wait_until(
                    lambda: (
                        scalar(db_url, OUTBOX_UNSENT) == 0
                        and billing.broker.queue_depth("billing.inbox") == 0
                    ),
                    what="20 more published and delivered to the held receiver",
                )
                assert counted.commits()["receiver"] == 0
            settled(db_url, 22)
            commits = counted.commits()
        # One transaction in flight (the held one) and one that took all 20 that came meanwhile.
        assert commits["receiver"] == 2, commits
    finally:
        counted.close()
        billing.close()


def test_messages_arriving_while_a_handler_runs_join_the_workers_next_batch(
    db_url: str, mq_url: str
) -> None:
    billing = make_service(
        "billing", db_url, mq_url, relay_poll_interval=60, worker_poll_interval=60
    )
    release = threading.Event()
    running_first = threading.Event()

    @billing.on_command(COMMAND)
    def append(message: Message, session: Session) -> None:
        if message.payload["n"] == 1:
            running_first.set()
            release.wait(30)
        session.execute(
            text("INSERT INTO effects (message_id, type) VALUES (:m, :t)"),
            {"m": str(message.message_id), "t": message.type},
        )

    billing.declare_topology()
    counted = Counted(billing)
    try:
        with roles_running(billing):
            warm(billing, db_url, counted)
            send(billing, 1, start=1)
            assert running_first.wait(20)
            send(billing, 20, start=2)
            wait_until(
                lambda: scalar(db_url, "SELECT count(*) FROM outbox_inbox.inbox_messages") == 22,
                what="20 more stored while the handler runs",
            )
            release.set()
            settled(db_url, 22)
            handling = [
                sum("INSERT INTO effects" in statement for statement in transaction)
                for transaction in counted.transactions["worker"]
            ]
        # The first handled alone. The next claim is sized by its time (worker.BATCH_WORK): it
        # took seconds, so one; that one is quick, so the other 19 together.
        assert [n for n in handling if n] == [1, 1, 19], handling
    finally:
        release.set()
        counted.close()
        billing.close()


def test_only_the_relays_marks_and_the_workers_claims_commit_without_a_flush(
    db_url: str, mq_url: str
) -> None:
    billing = billing_with_effects(db_url, mq_url)
    with billing.engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE commits (tx bigint, what text, synchronous_commit text);"
                " CREATE FUNCTION record_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                "  INSERT INTO commits VALUES (txid_current(), TG_TABLE_NAME || ' ' || TG_OP,"
                "   current_setting('synchronous_commit')); RETURN NULL; END $$;"
                " CREATE TRIGGER record_commit AFTER INSERT OR UPDATE"
                "  ON outbox_inbox.outbox_messages FOR EACH STATEMENT"
                "  EXECUTE FUNCTION record_commit();"
                " CREATE TRIGGER record_commit AFTER INSERT OR UPDATE"
                "  ON outbox_inbox.inbox_messages FOR EACH STATEMENT"
                "  EXECUTE FUNCTION record_commit();"
            )
        )
    try:
        with roles_running(billing):
            send(billing, 3)
            settled(db_url, 3)
        recorded = rows(
            db_url,
            "SELECT string_agg(DISTINCT what, ', ' ORDER BY what), min(synchronous_commit)"
            " FROM commits GROUP BY tx",
        )
        kinds = {(what, setting) for what, setting in recorded}
        # The writers' business transactions and the receiver's inserts wait for the flush;
        # the relay's marks and the worker's lone claims do not; the worker's handling (its
        # mark and the claim of the next batch) does.
        assert kinds == {
            ("outbox_messages INSERT", "on"),
            ("outbox_messages UPDATE", "off"),
            ("inbox_messages INSERT", "on"),
            ("inbox_messages UPDATE", "off"),
            ("inbox_messages UPDATE", "on"),
        }, kinds
    finally:
        billing.close()


def test_a_lone_message_wakes_one_of_the_workers_and_a_backlog_all_of_them(
    db_url: str, mq_url: str
) -> None:
    billing = billing_with_effects(db_url, mq_url, worker_batch_size=10)
    counted = Counted(billing)
    workers = ("worker", "worker-2", "worker-3")
    try:
        with roles_running(billing, workers=3):
            warm(billing, db_url)
            for n in range(1, 4):
                counted.reset()
                send(billing, 1, start=n)
                settled(db_url, n + 1)
                # One worker claims and handles it; the others are not woken to find nothing.
                woken = {w: len(counted.transactions.get(w, [])) for w in workers}
                assert sorted(woken.values()) == [0, 0, 2], woken
            # A backlog of six batches stored at once: the worker that claims a whole batch
            # wakes the others, and all three handle some.
            with billing.session() as session, session.begin():
                for n in range(60):
                    billing.outbox.send(session, "billing", COMMAND, {"n": 100 + n})
            settled(db_url, 64)
        by_worker = dict(rows(db_url, "SELECT info, count(*) FROM effects GROUP BY info"))
        assert set(by_worker) == set(workers), by_worker
    finally:
        counted.close()
        billing.close()


def test_when_the_leading_workers_session_ends_another_worker_listens_in_its_place(
    db_url: str, mq_url: str
) -> None:
    billing = billing_with_effects(db_url, mq_url)
    lead = (
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
        f" AND classid = {LEAD_LOCK}"
    )
    try:
        with roles_running(billing, workers=2):
            warm(billing, db_url)
            first = wait_until(lambda: scalar(db_url, lead), what="a worker leading")
            # Ended as a dead process's session ends: its lock and its LISTEN go with it.
            scalar(db_url, f"SELECT pg_terminate_backend({int(first)})")
            second = wait_until(
                lambda: (pid := scalar(db_url, lead)) and pid != first and pid,
                what="another session leading",
            )
            assert second != first
            send(billing, 1, start=1)  # with polls a minute apart, only a wake-up moves it
            settled(db_url, 2)
    finally:
        billing.close()
