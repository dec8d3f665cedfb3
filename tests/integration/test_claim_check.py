"""The claim check on real servers: a payload over the threshold goes to a payload store and
by reference over the broker; the worker gives the handler the whole payload; a missing or
altered payload is dead as ``payload_missing``; a store that cannot be written fails the
publish; the retention removes stored payloads once past it, and not before."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import pytest
from sqlalchemy import text

from helpers import make_service, rows, running, scalar, wait_until
from outbox_inbox import Message, Service
from outbox_inbox.claim_check import DirectoryPayloadStore, PayloadStore, PostgresPayloadStore
from outbox_inbox.errors import StorageError

FIVE_MIB = 5 * 1024 * 1024


@dataclass
class Big:
    blob: str
    n: int


def _big(n: int = 1) -> dict[str, Any]:
    return {"blob": "x" * FIVE_MIB, "n": n}


def _sha(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _spy(mq_url: str) -> Any:
    """A queue bound to every event of orders, to read what crosses the broker."""
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    channel = connection.channel()
    channel.queue_declare("spy", durable=True)
    channel.queue_bind("spy", "events", "orders.#")
    return connection, channel


def _two_services(
    db_url_factory: Any, mq_url: str, store: PayloadStore, source: PayloadStore | None = None
) -> tuple[Service, Service]:
    orders = make_service("orders", db_url_factory(), mq_url, payload_store=store)
    billing = make_service("billing", db_url_factory(), mq_url, payload_sources=[source or store])
    return orders, billing


def _end_to_end(orders: Service, billing: Service, mq_url: str) -> None:
    """Publish a 5 MiB payload and a small one; the typed handler gets both whole; the broker
    body of the large one is at most 4 KiB."""
    got: list[tuple[int, str, int]] = []

    @billing.on_event("orders.blob.stored")
    def stored(message: Message, session: Any, payload: Big) -> None:
        got.append((payload.n, _sha(message.payload), len(payload.blob)))

    billing.declare_topology()
    connection, channel = _spy(mq_url)
    with orders.session() as session, session.begin():
        orders.outbox.publish(session, "blob.stored", _big(1))
        orders.outbox.publish(session, "blob.stored", {"blob": "small", "n": 2})
    worker = billing.worker()
    with running(orders.relay(), billing.receiver(), worker):
        wait_until(lambda: worker.processed == 2, what="both handled")
    assert sorted(got) == [(1, _sha(_big(1)), FIVE_MIB), (2, _sha({"blob": "small", "n": 2}), 5)]
    bodies = []
    for _ in range(2):
        method, props, body = channel.basic_get("spy", auto_ack=True)
        assert method is not None
        bodies.append((len(body), len(json.dumps(props.headers)), props.headers))
    connection.close()
    large = next(b for b in bodies if "x-payload-ref" in b[2])
    assert large[0] + large[1] <= 4096  # body and headers of the 5 MiB message
    assert large[2]["x-payload-size"] == len(json.dumps(_big(1), separators=(",", ":")))
    assert sum("x-payload-ref" in b[2] for b in bodies) == 1  # the small one went inline
    orders.close()
    billing.close()


def test_a_5_mib_payload_goes_by_reference_through_the_postgres_store_and_reaches_the_handler(
    db_url_factory: Any, mq_url: str
) -> None:
    orders_db = db_url_factory()
    orders = make_service("orders", orders_db, mq_url, payload_store=PostgresPayloadStore("orders"))
    # The receiver reaches the sender's store by its database URL.
    source = PostgresPayloadStore("orders", db_url=orders_db)
    billing = make_service("billing", db_url_factory(), mq_url, payload_sources=[source])
    _end_to_end(orders, billing, mq_url)
    assert scalar(orders_db, "SELECT count(*) FROM outbox_inbox.payloads") == 1
    # The outbox row and the receiver's inbox row keep only the reference.
    nulls = "SELECT count(*) FROM outbox_inbox.outbox_messages WHERE payload = 'null'::jsonb"
    assert scalar(orders_db, nulls) == 1
    inbox = rows(
        billing.settings.db_url or "",
        "SELECT payload::text, headers->>'x-payload-ref' FROM outbox_inbox.inbox_messages"
        " WHERE headers ? 'x-payload-ref'",
    )
    assert [(p, r.split("/")[0]) for p, r in inbox] == [("null", "orders")]


def test_a_5_mib_payload_goes_by_reference_through_the_directory_store(
    db_url_factory: Any, mq_url: str, tmp_path: Path
) -> None:
    store = DirectoryPayloadStore("shared", str(tmp_path))
    orders, billing = _two_services(db_url_factory, mq_url, store)
    _end_to_end(orders, billing, mq_url)
    assert len(list(tmp_path.iterdir())) == 1


def test_a_missing_or_altered_payload_is_dead_as_payload_missing_and_not_retried(
    db_url_factory: Any, mq_url: str, tmp_path: Path
) -> None:
    store = DirectoryPayloadStore("shared", str(tmp_path))
    orders, billing = _two_services(db_url_factory, mq_url, store)
    calls: list[int] = []
    billing.on_event("orders.blob.stored")(lambda message, session: calls.append(1))
    billing.declare_topology()
    for n in (1, 2):
        with orders.session() as session, session.begin():
            orders.outbox.publish(session, "blob.stored", _big(n))
    gone, altered = sorted(tmp_path.iterdir(), key=lambda p: p.stat().st_mtime_ns)
    gone.unlink()
    altered.write_bytes(json.dumps(_big(3), separators=(",", ":")).encode())  # same size
    worker = billing.worker()
    billing_db = billing.settings.db_url or ""
    sql = "SELECT count(*) FROM outbox_inbox.inbox_messages WHERE status = 'dead'"
    with running(orders.relay(), billing.receiver(), worker):
        wait_until(lambda: scalar(billing_db, sql) == 2, what="both dead")
    dead = rows(
        billing_db,
        "SELECT dead_reason, attempts, last_error FROM outbox_inbox.inbox_messages ORDER BY id",
    )
    assert [(r.dead_reason, r.attempts) for r in dead] == [("payload_missing", 1)] * 2
    assert "is not in" in dead[0].last_error and "SHA-256" in dead[1].last_error
    assert calls == []
    orders.close()
    billing.close()


def test_a_rolled_back_transaction_leaves_no_payload_in_the_postgres_store(
    db_url: str, mq_url: str
) -> None:
    orders = make_service("orders", db_url, mq_url, payload_store=PostgresPayloadStore("orders"))
    with orders.session() as session, session.begin():
        orders.outbox.publish(session, "blob.stored", _big())
        session.rollback()
    assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.payloads") == 0
    assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.outbox_messages") == 0
    with orders.session() as session, session.begin():
        orders.outbox.publish(session, "blob.stored", _big())
    assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.payloads") == 1
    orders.close()


def test_a_store_that_cannot_be_written_fails_the_publish_and_nothing_falls_back(
    db_url: str, mq_url: str, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    store = DirectoryPayloadStore("shared", str(blocker / "payloads"))
    orders = make_service("orders", db_url, mq_url, payload_store=store)
    with orders.session() as session, session.begin():
        with pytest.raises(StorageError, match="payload store 'shared' cannot be written"):
            orders.outbox.publish(session, "blob.stored", _big())
        orders.outbox.publish(session, "blob.stored", {"small": True})  # inline: no store
    # Neither inline nor in the database's store: the large payload went nowhere.
    assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.outbox_messages") == 1
    assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.payloads") == 0
    assert [p.name for p in tmp_path.iterdir()] == ["not-a-directory"]
    orders.close()


def test_retention_removes_stored_payloads_only_once_past_it(
    db_url: str, mq_url: str, tmp_path: Path
) -> None:
    retention = 7 * 86400.0
    pg = make_service("orders", db_url, mq_url, payload_store=PostgresPayloadStore("orders"))
    assert pg.settings.retention == retention
    with pg.session() as session, session.begin():
        for n in (1, 2, 3):
            pg.outbox.publish(session, "blob.stored", _big(n))
    with pg.engine.begin() as conn:  # one a second past the retention, one a minute short
        conn.execute(
            text(
                "UPDATE outbox_inbox.payloads SET created_at = now() - make_interval(secs => s)"
                " FROM (SELECT key, row_number() OVER (ORDER BY key) AS n"
                " FROM outbox_inbox.payloads) AS k"
                " CROSS JOIN LATERAL (SELECT CASE k.n WHEN 1 THEN :past WHEN 2 THEN :short"
                " ELSE 0 END AS s) AS t WHERE payloads.key = k.key"
            ),
            {"past": retention + 1, "short": retention - 60},
        )
    assert pg.maintain().pruned_payloads == 1
    assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.payloads") == 2
    pg.close()

    files = make_service(
        "files", db_url, mq_url, payload_store=DirectoryPayloadStore("shared", str(tmp_path))
    )
    with files.session() as session, session.begin():
        for n in (1, 2, 3):
            files.outbox.publish(session, "blob.stored", _big(n))
    old, short, _new = sorted(tmp_path.iterdir())
    now = time.time()
    os.utime(old, (now - retention - 1, now - retention - 1))
    os.utime(short, (now - retention + 60, now - retention + 60))
    assert files.maintain().pruned_payloads == 1
    assert sorted(tmp_path.iterdir()) == [short, _new]
    files.close()
