"""Helpers shared by the integration and end-to-end tests."""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pika
from sqlalchemy import create_engine, text

from outbox_inbox import Service

T = TypeVar("T")

#: Settings that make the roles react fast in tests.
FAST: dict[str, Any] = {
    "relay_poll_interval": 0.2,
    "worker_poll_interval": 0.1,
    "reconnect_initial": 0.1,
    "reconnect_max": 1.0,
    "processes": 1,  # run() / run_worker() in the test's process, as start() does
}


def as_prepared(statement: str) -> tuple[str, list[str]]:
    """`statement` as SQLAlchemy hands it to psycopg (``%(name)s``), written as psycopg sends
    it to the server and as ``PREPARE`` takes it (``$1``, ``$2``... in order of first use;
    ``%%`` as ``%``), and the parameter names in that order."""
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", statement)))
    numbered = re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m[1]) + 1}", statement)
    return numbered.replace("%%", "%"), names


def wait_until(
    condition: Callable[[], T], timeout: float = 20.0, interval: float = 0.05, what: str = ""
) -> T:
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(interval)


def make_service(name: str, db_url: str, mq_url: str | None, **settings: Any) -> Service:
    """A migrated service with an `effects` table its handlers can write to."""
    values = {**FAST, **settings}
    service = Service(name, db_url=db_url, mq_url=mq_url, **values)
    service.migrate()
    with service.engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS effects ("
                " message_id text PRIMARY KEY, type text NOT NULL, info text,"
                " seq bigserial, at timestamptz NOT NULL DEFAULT clock_timestamp())"
            )
        )
    return service


def scalar(db_url: str, sql: str, **params: Any) -> Any:
    """Run one query on a short-lived connection and return its single value."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(sql), params).scalar()
    finally:
        engine.dispose()


def rows(db_url: str, sql: str, **params: Any) -> list[Any]:
    """Run one query on a short-lived connection and return all rows."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(sql), params).all())
    finally:
        engine.dispose()


@contextmanager
def running(*roles: Any) -> Iterator[None]:
    """Run each role's `run(stop)` in a thread for the block; stop and join them after it."""
    stop = threading.Event()
    threads = [threading.Thread(target=role.run, args=(stop,)) for role in roles]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads)


def publish_raw(mq_url: str, exchange: str, routing_key: str, body: bytes, **props: Any) -> None:
    """Publish one persistent message with plain pika (confirmed), as any AMQP client would."""
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(
            exchange, routing_key, body, pika.BasicProperties(delivery_mode=2, **props)
        )
    finally:
        connection.close()


def drain(mq_url: str, queue: str) -> list[tuple[pika.spec.BasicProperties, bytes]]:
    """Take every message now in `queue` (acknowledged), in order: (properties, body)."""
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        got = []
        while True:
            method, props, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                return got
            got.append((props, body))
    finally:
        connection.close()


def inbox_message_ids(db_url: str, status: str, routing_key: str | None = None) -> list[str]:
    """Message ids of the inbox rows of `status` (and `routing_key`, if given), in id order."""
    sql = "SELECT message_id::text FROM outbox_inbox.inbox_messages WHERE status = :s"
    if routing_key:
        sql += " AND routing_key = :t"
    return [r[0] for r in rows(db_url, sql + " ORDER BY id", s=status, t=routing_key)]


def dead_rows_one_refused(service: Service, count: int, refused: int) -> list[str]:
    """`count` dead inbox rows, in id order; a trigger makes any change of the `refused`-th
    (from 1) fail. Their message ids."""
    with service.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox_inbox.inbox_messages"
                " (message_id, kind, routing_key, payload, headers, status, dead_reason,"
                " fingerprint) SELECT gen_random_uuid(), 'command', 'invoice.create', '{}', '{}',"
                " 'dead', 'rejected', 'rejected' FROM generate_series(1, :n)"
            ),
            {"n": count},
        )
        ids = [
            str(m)
            for m in conn.execute(
                text("SELECT message_id FROM outbox_inbox.inbox_messages ORDER BY id")
            ).scalars()
        ]
        conn.execute(text("CREATE TABLE refused (message_id uuid PRIMARY KEY)"))
        conn.execute(text("INSERT INTO refused VALUES (CAST(:m AS uuid))"), {"m": ids[refused - 1]})
        conn.execute(
            text(
                "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$"
                " BEGIN IF EXISTS (SELECT 1 FROM refused WHERE message_id = NEW.message_id)"
                " THEN RAISE EXCEPTION 'this row is refused'; END IF; RETURN NEW; END $$"
            )
        )
        conn.execute(
            text(
                "CREATE TRIGGER refuse BEFORE UPDATE ON outbox_inbox.inbox_messages"
                " FOR EACH ROW EXECUTE FUNCTION refuse()"
            )
        )
    return ids


def received_row(**values: Any) -> dict[str, Any]:
    """An inbox row as the receiver hands it to `queries.roles.insert_inbox` (a command to billing
    from orders, a new message id), with `values` instead of the defaults."""
    return {
        "message_id": uuid.uuid4(),
        "source": "orders",
        "kind": "command",
        "routing_key": "billing.invoice.create",
        "payload": {"order": 1},
        "headers": {},
        "version": 1,
        "correlation_id": None,
        "causation_id": None,
        "key": None,
        "tenant": "",
        "priority": 0,
        "created_at": None,
        "expires_at": None,
        **values,
    }
