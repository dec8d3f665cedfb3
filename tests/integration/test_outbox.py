"""Outbox writes happen in the caller's transaction and nowhere else."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import text

from helpers import make_service, rows, scalar
from outbox_inbox import MessageError, PayloadTooLarge, SchemaMissing, StorageError


def test_publish_and_send_write_rows_that_commit_with_the_business_transaction(
    db_url: str,
) -> None:
    svc = make_service("orders", db_url, None)
    with svc.session() as session, session.begin():
        session.execute(text("INSERT INTO effects (message_id, type) VALUES ('biz', 'order')"))
        event_id = svc.outbox.publish(session, "order.placed", {"id": 1}, key="order-1")
        command_id = svc.outbox.send(session, "billing", "invoice.create", {"order": 1})
        # Nothing is visible to others before the caller commits.
        assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.outbox_messages") == 0
    found = rows(
        db_url,
        "SELECT message_id, kind, exchange, routing_key, key, correlation_id"
        " FROM outbox_inbox.outbox_messages ORDER BY id",
    )
    assert [(r[0], r[1], r[2], r[3], r[4]) for r in found] == [
        (event_id, "event", "events", "orders.order.placed", "order-1"),
        (command_id, "command", "commands", "billing.invoice.create", None),
    ]
    assert found[0][5] == str(event_id)  # a new conversation is correlated by its first id
    svc.close()


def test_rolled_back_transaction_leaves_no_outbox_row(db_url: str) -> None:
    svc = make_service("orders", db_url, None)
    with svc.session() as session, session.begin():
        svc.outbox.publish(session, "order.placed", {"id": 1})
        session.rollback()
    with svc.engine.connect() as conn, conn.begin() as tx:
        svc.outbox.send(conn, "billing", "invoice.create", {})
        tx.rollback()
    assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.outbox_messages") == 0
    svc.close()


def test_the_outbox_never_commits_the_callers_transaction(db_url: str) -> None:
    svc = make_service("orders", db_url, None)
    session = svc.session()
    session.begin()
    svc.outbox.publish(session, "order.placed", {"id": 1})
    assert session.in_transaction()
    session.close()  # closing without commit discards the row
    assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.outbox_messages") == 0
    svc.close()


def test_bad_messages_are_refused_with_a_clear_error_and_the_transaction_survives(
    db_url: str,
) -> None:
    svc = make_service("orders", db_url, None, max_payload_bytes=100)
    with svc.session() as session, session.begin():
        with pytest.raises(PayloadTooLarge):
            svc.outbox.publish(session, "order.placed", {"blob": "x" * 200})
        with pytest.raises(MessageError, match="JSON"):
            svc.outbox.publish(session, "order.placed", {"id": {1, 2}})
        with pytest.raises(MessageError, match="invalid event name"):
            svc.outbox.publish(session, "order.*", {})
        with pytest.raises(MessageError, match="reserved"):
            svc.outbox.publish(session, "order.placed", {}, headers={"x-attempt": 3})
        svc.outbox.publish(session, "order.placed", {"id": 1})
    assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.outbox_messages") == 1
    svc.close()


def test_missing_tables_say_to_run_db_upgrade(db_url: str) -> None:
    from outbox_inbox import Service

    svc = Service("orders", db_url=db_url)
    with (
        svc.session() as session,
        session.begin(),
        pytest.raises(SchemaMissing, match="db upgrade"),
    ):
        svc.outbox.publish(session, "order.placed", {"id": 1}, message_id=uuid.uuid4())
    svc.close()


def test_a_connection_the_caller_has_not_begun_commits_the_row_only_with_its_commit(
    db_url: str,
) -> None:
    """As a statement would, the write begins the caller's Connection (autobegin): the
    caller's commit() commits it; closing without one discards it."""
    svc = make_service("orders", db_url, None)
    with svc.engine.connect() as conn:
        svc.outbox.send(conn, "billing", "invoice.create", {"n": 1})
        assert conn.in_transaction()
    assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.outbox_messages") == 0
    with svc.engine.connect() as conn:
        svc.outbox.send(conn, "billing", "invoice.create", {"n": 2})
        conn.commit()
    assert rows(db_url, "SELECT payload FROM outbox_inbox.outbox_messages") == [({"n": 2},)]
    svc.close()


def test_a_row_the_database_refuses_is_a_storage_error_that_shows_no_payload(
    db_url: str,
) -> None:
    svc = make_service("orders", db_url, None)
    message_id = uuid.uuid4()
    with svc.session() as session, session.begin():
        svc.outbox.publish(session, "order.placed", {"card": "4111-SECRET"}, message_id=message_id)
    with svc.session() as session, session.begin(), pytest.raises(StorageError) as refused:
        svc.outbox.publish(session, "order.placed", {"card": "4111-SECRET"}, message_id=message_id)
    assert "outbox_messages" in str(refused.value)
    assert "SECRET" not in str(refused.value) and "4111" not in str(refused.value)
    assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.outbox_messages") == 1
    svc.close()


_LATER_ROW = text(
    "INSERT INTO outbox_inbox.outbox_messages (message_id, kind, exchange, routing_key, payload,"
    " headers, created_at) VALUES (:m, 'event', 'events', 'orders.order.placed', '{}', '{}',"
    " now() + interval '2 days')"
)
_PARTITIONS = "SELECT DISTINCT tableoid::regclass::text FROM outbox_inbox.outbox_messages"


def test_a_second_write_of_a_message_id_fails_in_its_partition_and_not_across_one(
    db_url: str,
) -> None:
    """What docs/migrating.md ("Idempotency keys") says holds: the outbox's message_id is
    unique per time partition. The first row of `earlier` is two days ahead, in a daily
    partition (the migration's first partition ends at most a day and two hours ahead), that of
    `today` in the partition of now; each id is then written again now."""
    svc = make_service("orders", db_url, None)
    earlier, today = uuid.uuid4(), uuid.uuid4()
    with svc.engine.begin() as conn:
        conn.execute(_LATER_ROW, {"m": earlier})
    with svc.session() as session, session.begin():
        svc.outbox.publish(session, "order.placed", {"id": 1}, message_id=today)
    refused = pytest.raises(StorageError, match="duplicate key value violates unique")
    with refused, svc.session() as session, session.begin():
        svc.outbox.publish(session, "order.placed", {"id": 1}, message_id=today)
    with svc.session() as session, session.begin():  # across the boundary: accepted
        svc.outbox.publish(session, "order.placed", {"id": 2}, message_id=earlier)
    assert len(rows(db_url, _PARTITIONS)) == 2  # the rows are on both sides of a boundary
    count = "SELECT count(*) FROM outbox_inbox.outbox_messages WHERE message_id = :m"
    assert (scalar(db_url, count, m=today), scalar(db_url, count, m=earlier)) == (1, 2)
    svc.close()
