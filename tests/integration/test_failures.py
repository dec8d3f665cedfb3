"""Failure paths: backoff, expiry, backpressure, delay tiers, startup errors (DESIGN.md §5)."""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text

from helpers import drain, make_service, publish_raw, rows, running, scalar, wait_until
from outbox_inbox import (
    BrokerConnectionError,
    ConfigurationError,
    DatabaseUnavailable,
    Message,
    Retry,
    RetryPolicy,
    SchemaMissing,
    Service,
    TopologyMismatch,
)
from outbox_inbox.partitions import partitions


def test_retries_follow_the_backoff_within_tolerance(db_url: str, mq_url: str) -> None:
    svc = make_service("billing", db_url, mq_url, worker_poll_interval=0.05)
    times: list[float] = []

    @svc.on_command("job.run", retry=RetryPolicy(initial=0.5, multiplier=2, max_attempts=4))
    def run(message: Message, session: Any) -> None:
        times.append(time.monotonic())
        if len(times) < 4:
            raise RuntimeError("not yet")

    svc.declare_topology()
    publish_raw(mq_url, "commands", "billing.job.run", b"{}", message_id=str(uuid.uuid4()))
    worker = svc.worker()
    with running(svc.receiver(), worker):
        wait_until(lambda: worker.processed == 1, timeout=20)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    for gap, wanted in zip(gaps, [0.5, 1.0, 2.0], strict=True):
        assert wanted - 0.05 <= gap <= wanted + 0.6, (gaps, wanted)
    svc.close()


def test_retry_with_explicit_delay_and_max_attempts_zero_means_no_retry(
    db_url: str, mq_url: str
) -> None:
    svc = make_service("billing", db_url, mq_url, retry=RetryPolicy(max_attempts=0))
    calls: list[str] = []

    @svc.on_command("once.only")
    def once(message: Message, session: Any) -> None:
        calls.append("once")
        raise RuntimeError("boom")

    @svc.on_command("later.please", retry=RetryPolicy(max_attempts=3))
    def later(message: Message, session: Any) -> None:
        calls.append("later")
        if calls.count("later") == 1:
            raise Retry(delay=0.3)

    svc.declare_topology()
    for key in ("billing.once.only", "billing.later.please"):
        publish_raw(mq_url, "commands", key, b"{}", message_id=str(uuid.uuid4()))
    worker = svc.worker()
    with running(svc.receiver(), worker):
        wait_until(lambda: worker.processed == 1 and calls.count("once") == 1)
        time.sleep(0.5)
    assert calls.count("once") == 1
    assert calls.count("later") == 2
    states = dict(rows(db_url, "SELECT routing_key, status FROM outbox_inbox.inbox_messages"))
    assert states == {"billing.once.only": "dead", "billing.later.please": "processed"}
    svc.close()


def test_expired_messages_are_never_published_nor_handled(db_url: str, mq_url: str) -> None:
    svc = make_service("billing", db_url, mq_url)
    handled: list[Any] = []

    @svc.on_command("job.run")
    def run(message: Message, session: Any) -> None:
        handled.append(message.payload)

    svc.declare_topology()
    # An outbox row whose time to live runs out before a relay sees it.
    with svc.session() as session, session.begin():
        svc.outbox.send(session, "billing", "job.run", {"n": "outbox"}, ttl=0.2)
        svc.outbox.send(session, "billing", "job.run", {"n": "fresh"}, ttl=60)
    time.sleep(0.4)
    relay = svc.relay()
    relay.relay_once()
    assert relay.expired == 1
    assert relay.published == 1
    # A message that expired on its way, sent by another service.
    past = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    publish_raw(
        mq_url,
        "commands",
        "billing.job.run",
        b'{"n": "wire"}',
        message_id=str(uuid.uuid4()),
        headers={"x-expires-at": past},
    )
    worker = svc.worker()
    with running(svc.receiver(), worker):
        wait_until(
            lambda: (
                scalar(
                    db_url,
                    "SELECT count(*) FROM outbox_inbox.inbox_messages WHERE status <> 'pending'",
                )
                == 2
            )
        )
    assert handled == [{"n": "fresh"}]
    dead = rows(
        db_url, "SELECT payload, dead_reason FROM outbox_inbox.inbox_messages WHERE status = 'dead'"
    )
    assert dead == [({"n": "wire"}, "expired")]
    assert rows(
        db_url,
        "SELECT payload FROM outbox_inbox.outbox_messages"
        " WHERE expired_at IS NOT NULL AND published_at IS NULL",
    ) == [({"n": "outbox"},)]
    svc.close()


def test_full_inbox_queue_nacks_and_the_relay_keeps_rows_until_there_is_room(
    db_url: str, mq_url: str
) -> None:
    svc = make_service(
        "billing", db_url, mq_url, inbox_max_length=5, relay_retry_initial=0.2, relay_retry_max=0.5
    )
    svc.declare_topology()
    with svc.session() as session, session.begin():
        for n in range(12):
            svc.outbox.send(session, "billing", "job.run", {"n": n})
    relay = svc.relay()
    relay.relay_once()
    assert relay.published == 5
    unpublished = scalar(
        db_url,
        "SELECT count(*) FROM outbox_inbox.outbox_messages"
        " WHERE published_at IS NULL AND attempts = 1"
        " AND last_error = 'publish nacked'",
    )
    assert unpublished == 7
    receiver = svc.receiver()
    with running(relay, receiver):
        wait_until(lambda: receiver.stored == 12, timeout=30)
    payloads = rows(db_url, "SELECT payload FROM outbox_inbox.inbox_messages")
    assert sorted(p[0]["n"] for p in payloads) == list(range(12))
    svc.close()


def test_failing_head_holds_its_key_while_other_keys_flow_under_two_workers(
    db_url: str, mq_url: str
) -> None:
    svc = make_service("billing", db_url, mq_url, worker_batch_size=5)
    order: list[tuple[str, int]] = []
    failures = {"a": 2}
    lock = threading.Lock()

    @svc.on_command("step.run", retry=RetryPolicy(initial=0.5, multiplier=1, max_attempts=5))
    def step(message: Message, session: Any) -> None:
        key, n = message.key or "", message.payload["n"]
        with lock:
            if n == 0 and failures.get(key, 0) > 0:
                failures[key] -= 1
                raise RuntimeError("head fails")
            order.append((key, n))

    svc.declare_topology()
    with svc.session() as session, session.begin():
        for n in range(5):
            for key in ("a", "b", "c"):
                svc.outbox.send(session, "billing", "step.run", {"n": n}, key=key)
    receiver = svc.receiver()
    with running(svc.relay(), receiver):
        wait_until(lambda: receiver.stored == 15)
    workers = [svc.worker(), svc.worker()]
    with running(*workers):
        wait_until(lambda: sum(w.processed for w in workers) == 15, timeout=30)
    for key in ("a", "b", "c"):
        assert [n for k, n in order if k == key] == list(range(5))
    # b and c finished while a's head was still failing.
    first_a = order.index(("a", 0))
    assert {("b", 4), ("c", 4)} <= set(order[:first_a])
    svc.close()


def test_postgres_down_during_receive_leaves_messages_in_the_queue_then_all_stored(
    db_url: str, mq_url: str, local_postgres_server: Any
) -> None:
    # Delay tiers short enough that a message sent there would come back within the test.
    svc = make_service("billing", db_url, mq_url, delay_tiers=(1, 2))
    svc.declare_topology()
    receiver = svc.receiver()
    ids = [str(uuid.uuid4()) for _ in range(50)]
    with running(receiver):
        local_postgres_server.stop()
        try:
            for message_id in ids:
                publish_raw(
                    mq_url, "commands", "billing.job.run", b'{"n": 1}', message_id=message_id
                )
            # The receiver met the outage, gave back what it held and takes nothing more:
            # every message waits in the queue, where it keeps its place and delivery count.
            wait_until(
                lambda: svc.broker.queue_depth("billing.inbox") == 50,
                timeout=30,
                what="the messages back in the queue",
            )
            time.sleep(3)  # several of the receiver's retries
            assert svc.broker.queue_depth("billing.inbox") == 50
            assert (receiver.delayed, receiver.dead, receiver.stored) == (0, 0, 0)
        finally:
            local_postgres_server.start()
        wait_until(lambda: receiver.stored == 50, timeout=60, what="all stored")
    stored = rows(db_url, "SELECT message_id::text FROM outbox_inbox.inbox_messages")
    assert sorted(m for (m,) in stored) == sorted(ids)
    # Given back once at most: a redelivered message is counted before it is stored.
    assert (
        scalar(db_url, "SELECT coalesce(max(deliveries), 0) FROM outbox_inbox.inbox_deliveries")
        <= 1
    )
    assert (receiver.delayed, receiver.dead) == (0, 0)
    svc.close()


def test_a_worker_transaction_bounds_its_session_on_the_server_side_against_a_silent_client(
    db_url: str, mq_url: str
) -> None:
    # A worker cut off while the server sends it rows: keepalives do not probe while sent data
    # waits for its acknowledgement, so only tcp_user_timeout ends the session, and frees the
    # batch's row locks, before the server's retransmissions give up (minutes).
    svc = make_service("billing", db_url, mq_url)
    seen: list[tuple[str, ...]] = []

    @svc.on_command("job.run")
    def run(message: Message, session: Any) -> None:
        limits = text(
            "SELECT current_setting('tcp_user_timeout'), current_setting('tcp_keepalives_idle'),"
            " current_setting('idle_in_transaction_session_timeout')"
        )
        seen.append(tuple(session.execute(limits).one()))

    svc.declare_topology()
    publish_raw(mq_url, "commands", "billing.job.run", b"{}", message_id=str(uuid.uuid4()))
    worker = svc.worker()
    with running(svc.receiver(), worker):
        wait_until(lambda: worker.processed == 1, timeout=20)
    assert seen == [("10000", "10", "1min")]  # over TCP (a Unix socket ignores the first two)
    svc.close()


def test_relay_and_receiver_transactions_bound_their_sessions_on_the_server_side_too(
    db_url: str, mq_url: str
) -> None:
    # Their locks (a relay's claimed rows, a receiver's new message ids) go with the session:
    # cut off by a partition, it must not outlive it by the server's own timeouts (hours).
    svc = make_service("billing", db_url, mq_url)
    svc.declare_topology()
    with svc.engine.begin() as conn:
        conn.execute(text("CREATE TABLE seen_limits (what text, user_timeout text, idle text)"))
        conn.execute(
            text(
                "CREATE FUNCTION note_limits() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                " INSERT INTO seen_limits VALUES (TG_ARGV[0],"
                " current_setting('tcp_user_timeout'), current_setting('tcp_keepalives_idle'));"
                " RETURN NEW; END $$"
            )
        )
        for table, event in (("inbox_messages", "INSERT"), ("outbox_messages", "UPDATE")):
            conn.execute(
                text(
                    f"CREATE TRIGGER note_limits BEFORE {event} ON outbox_inbox.{table}"
                    f" FOR EACH ROW EXECUTE FUNCTION note_limits('{table}')"
                )
            )
    with svc.session() as session, session.begin():
        svc.outbox.send(session, "billing", "job.run", {})
    receiver = svc.receiver()
    with running(svc.relay(), receiver):
        wait_until(lambda: receiver.stored == 1, timeout=20)
    seen = rows(db_url, "SELECT what, user_timeout, idle FROM seen_limits ORDER BY what")
    assert [tuple(r) for r in seen] == [
        ("inbox_messages", "10000", "10"),  # the receiver's insert
        ("outbox_messages", "10000", "10"),  # the relay's mark, in its claim's transaction
    ]
    svc.close()


def test_a_message_that_can_never_be_stored_is_dead_lettered_after_max_attempts(
    db_url: str, mq_url: str
) -> None:
    svc = make_service(
        "billing",
        db_url,
        mq_url,
        delay_tiers=(0.2,),
        receive_retry=RetryPolicy(initial=0.1, max_attempts=3),
    )
    svc.declare_topology()
    # A trigger fails on this row: an error that is not about its values (those are
    # dead-lettered at once), so the receiver cannot tell it will never pass and retries.
    with svc.engine.begin() as conn:
        conn.execute(
            text(
                "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                " IF NEW.payload ? 'bad' THEN RAISE EXCEPTION 'not today'; END IF;"
                " RETURN NEW; END $$"
            )
        )
        conn.execute(
            text(
                "CREATE TRIGGER refuse BEFORE INSERT ON outbox_inbox.inbox_messages"
                " FOR EACH ROW EXECUTE FUNCTION refuse()"
            )
        )
    publish_raw(mq_url, "commands", "billing.job.run", b'{"bad": 1}', message_id="bad-1")
    publish_raw(mq_url, "commands", "billing.job.run", b'{"ok": 1}', message_id="good-1")
    receiver = svc.receiver()
    with running(receiver):
        wait_until(lambda: receiver.dead == 1, timeout=30)
    assert receiver.stored == 1
    ((props, body),) = drain(mq_url, "billing.dead_letter")
    assert props.message_id == "bad-1"
    assert props.headers["x-dead-reason"].startswith("store_failed: not stored after 3 attempts")
    assert props.headers["x-original-routing-key"] == "billing.job.run"
    assert json.loads(body) == {"bad": 1}
    svc.close()


def test_a_missing_partition_delays_messages_instead_of_dead_lettering_them_until_one_exists(
    db_url: str, mq_url: str
) -> None:
    svc = make_service(
        "billing",
        db_url,
        mq_url,
        delay_tiers=(1,),
        receive_retry=RetryPolicy(initial=1, max_interval=1, max_attempts=100),
    )
    svc.declare_topology()
    # The partition holding "now" goes away (a maintenance pass that never ran): the
    # database refuses every row, with the same IntegrityError class as a bad value.
    with svc.engine.begin() as conn:
        conn.execute(text("DROP TABLE outbox_inbox.inbox_messages_legacy"))
    receiver = svc.receiver()
    ids = [str(uuid.uuid4()) for _ in range(5)]
    with running(receiver):
        for message_id in ids:
            publish_raw(mq_url, "commands", "billing.job.run", b'{"n": 1}', message_id=message_id)
        wait_until(lambda: receiver.delayed >= 5, timeout=30, what="messages delayed")
        assert receiver.dead == 0
        with svc.engine.begin() as conn:
            first = partitions(conn, "outbox_inbox", "inbox_messages")[0].lower
            assert first is not None
            conn.execute(
                text(
                    "CREATE TABLE outbox_inbox.inbox_messages_now PARTITION OF "
                    "outbox_inbox.inbox_messages FOR VALUES FROM (MINVALUE) TO "
                    f"('{first.isoformat()}')"
                )
            )
        wait_until(lambda: receiver.stored == 5, timeout=30, what="all stored")
    assert receiver.dead == 0
    assert drain(mq_url, "billing.dead_letter") == []
    stored = rows(db_url, "SELECT message_id::text FROM outbox_inbox.inbox_messages")
    assert sorted(m for (m,) in stored) == sorted(ids)
    svc.close()


def test_quorum_queues_with_delivery_limit_are_declared_and_a_classic_service_is_refused(
    mq_url: str,
) -> None:
    quorum = Service(
        "billing",
        db_url="postgresql+psycopg://unused/x",
        mq_url=mq_url,
        queue_type="quorum",
        delivery_limit=5,
    )
    quorum.declare_topology()
    quorum.declare_topology()
    # Every service of a broker must agree on queue_type: `unroutable` is shared.
    classic = Service("shipping", db_url="postgresql+psycopg://unused/x", mq_url=mq_url)
    with pytest.raises(TopologyMismatch, match="unroutable"):
        classic.declare_topology()
    with pytest.raises(ConfigurationError):
        Service("x", db_url="postgresql+psycopg://unused/x", queue_type="quorum", max_priority=3)


def test_a_priority_queue_can_be_declared(mq_url: str) -> None:
    prioritized = Service(
        "shipping", db_url="postgresql+psycopg://unused/x", mq_url=mq_url, max_priority=10
    )
    prioritized.declare_topology()
    prioritized.declare_topology()


def test_unreachable_servers_with_fail_fast_and_missing_tables_fail_start_with_a_clear_error(
    db_url: str, mq_url: str
) -> None:
    no_tables = Service("billing", db_url=db_url, mq_url=mq_url)
    with pytest.raises(SchemaMissing, match="db upgrade"):
        no_tables.start()  # a configuration error: no waiting, even without fail_fast
    no_tables.close()
    no_db = Service("billing", db_url="postgresql+psycopg://u:secret@127.0.0.1:1/x", mq_url=mq_url)
    with pytest.raises(DatabaseUnavailable) as caught:
        no_db.start(fail_fast=True)
    assert "secret" not in str(caught.value)
    no_db.close()
    no_broker = make_service(
        "billing", db_url, "amqp://guest:secret@127.0.0.1:1/%2F", fail_fast=True
    )
    with pytest.raises(BrokerConnectionError) as broker_error:
        no_broker.start()
    assert "secret" not in str(broker_error.value)
    no_broker.close()
    with pytest.raises(ConfigurationError, match="broker URL"):
        make_service("billing", db_url, "amqp://guest@127.0.0.1:notaport/").start()


def test_a_service_started_while_postgres_is_down_waits_and_runs_once_it_is_back(
    db_url: str, mq_url: str, local_postgres_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    billing = make_service("billing", db_url, mq_url)
    handled: list[int] = []

    @billing.on_command("invoice.create")
    def create(message: Message, session: Any) -> None:
        handled.append(message.payload["n"])

    local_postgres_server.stop()
    started = threading.Event()
    thread = threading.Thread(target=lambda: (billing.start(), started.set()), daemon=True)
    try:
        with caplog.at_level("INFO", logger="outbox_inbox.service"):
            thread.start()
            time.sleep(3)
            assert not started.is_set(), "start() returned while PostgreSQL was down"
            assert thread.is_alive()
            waiting = [r for r in caplog.records if "waiting for its servers" in r.getMessage()]
            assert len(waiting) == 1, "one warning per outage, not one per try"
            local_postgres_server.start()
            assert started.wait(30), "start() did not return after PostgreSQL came back"
        assert any("working again after" in r.getMessage() for r in caplog.records)
        with billing.session() as session, session.begin():
            billing.outbox.send(session, "billing", "invoice.create", {"n": 1})
        wait_until(lambda: handled == [1], what="the command handled")
    finally:
        if not local_postgres_server.running:
            local_postgres_server.start()
        billing.stop()
        billing.close()


def test_stop_ends_a_start_that_waits_for_an_unreachable_broker(db_url: str) -> None:
    service = make_service("billing", db_url, "amqp://guest:guest@127.0.0.1:1/%2F")
    thread = threading.Thread(target=service.start, daemon=True)
    thread.start()
    time.sleep(1)
    assert thread.is_alive(), "start() gave up instead of waiting for the broker"
    service.stop()
    thread.join(10)
    assert not thread.is_alive()
    service.close()


def test_services_in_schemas_of_one_database_keep_their_tables_apart(
    db_url: str, mq_url: str
) -> None:
    """A service in its own schema keeps its tables apart from another's in one database."""
    one = make_service("orders", db_url, mq_url, schema="orders_box")
    two = make_service("billing", db_url, mq_url, schema="billing_box")
    with one.session() as session, session.begin():
        one.outbox.publish(session, "order.placed", {})
        session.execute(text("SELECT 1"))
    assert scalar(db_url, "SELECT count(*) FROM orders_box.outbox_messages") == 1
    assert scalar(db_url, "SELECT count(*) FROM billing_box.outbox_messages") == 0
    one.close()
    two.close()
