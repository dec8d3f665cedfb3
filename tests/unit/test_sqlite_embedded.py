"""The embedded mode: SQLite tables and the in-memory broker, no server at all."""

from __future__ import annotations

import gc
import os
import signal
import threading
from pathlib import Path
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text

from helpers import wait_until
from outbox_inbox import Message, Reject, RetryPolicy, Service
from outbox_inbox.brokers.memory import MemoryBroker
from outbox_inbox.tables import VERSION_TABLE, build_tables

FAST: dict[str, Any] = {
    "worker_poll_interval": 0.02,
    "relay_poll_interval": 0.02,
}


def _service(name: str, path: Path, broker: MemoryBroker, **settings: Any) -> Service:
    service = Service(name, db_url=f"sqlite:///{path}", broker=broker, **{**FAST, **settings})
    service.migrate()
    with service.engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS effects (message_id TEXT PRIMARY KEY)"))
    return service


def test_migrations_on_sqlite_yield_exactly_the_declared_metadata(tmp_path: Path) -> None:
    with MemoryBroker() as broker:
        service = _service("billing", tmp_path / "b.db", broker)
        with service.engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={
                    "include_object": lambda _o, name, type_, _r, _c: (
                        name not in (VERSION_TABLE, "effects")
                    )
                },
            )
            assert list(compare_metadata(context, build_tables(None).metadata)) == []
        service.close()


def test_two_services_on_sqlite_exchange_command_event_retry_and_dead_letter(
    tmp_path: Path,
) -> None:
    with MemoryBroker() as broker:
        orders = _service("orders", tmp_path / "orders.db", broker)
        billing = _service(
            "billing",
            tmp_path / "billing.db",
            broker,
            retry=RetryPolicy(initial=0.05, max_attempts=3),
        )
        seen: list[tuple[str, int]] = []
        tenants: list[str] = []  # each handler's message's: sent, then inherited by the event

        @billing.on_command("invoice.create")
        def create(message: Message, session: Any) -> None:
            seen.append(("create", message.attempt))
            tenants.append(message.tenant)
            if message.attempt == 1:
                raise RuntimeError("flaky")
            session.execute(text("INSERT INTO effects VALUES (:m)"), {"m": str(message.message_id)})
            billing.outbox.publish(session, "invoice.created", {"order": message.payload["order"]})

        @billing.on_command("invoice.void")
        def void(message: Message, session: Any) -> None:
            raise Reject("no such invoice")

        @orders.on_event("billing.invoice.created")
        def created(message: Message, session: Any) -> None:
            seen.append(("created", message.payload["order"]))
            tenants.append(message.tenant)

        orders.start()
        billing.start()
        try:
            with orders.session() as session, session.begin():
                orders.outbox.send(
                    session, "billing", "invoice.create", {"order": 7}, tenant="acme"
                )
                orders.outbox.send(session, "billing", "invoice.void", {"order": 8})
            wait_until(lambda: ("created", 7) in seen, timeout=20)
        finally:
            orders.stop()
            billing.stop()
        assert seen == [("create", 1), ("create", 2), ("created", 7)]
        assert tenants == ["acme"] * 3
        with billing.engine.connect() as conn:
            states = dict(
                conn.execute(
                    text(
                        "SELECT routing_key, status || ':' || coalesce(dead_reason, '')"
                        " FROM inbox_messages"
                    )
                ).all()
            )
            assert conn.execute(text("SELECT count(*) FROM effects")).scalar() == 1
        assert states == {
            "billing.invoice.create": "processed:",
            "billing.invoice.void": "dead:rejected",
        }
        orders.close()
        billing.close()


def test_two_worker_threads_on_sqlite_handle_each_message_once(tmp_path: Path) -> None:
    with MemoryBroker() as broker:
        svc = _service("billing", tmp_path / "b.db", broker, worker_batch_size=10)
        count = 0
        lock = threading.Lock()

        @svc.on_command("job.run")
        def run(message: Message, session: Any) -> None:
            nonlocal count
            session.execute(text("INSERT INTO effects VALUES (:m)"), {"m": str(message.message_id)})
            with lock:
                count += 1

        svc.declare_topology()
        with svc.session() as session, session.begin():
            for n in range(200):
                svc.outbox.send(session, "billing", "job.run", {"n": n}, key=f"k{n % 5}")
        svc.start(workers=2)
        try:
            wait_until(lambda: count >= 200, timeout=30)
        finally:
            svc.stop()
        with svc.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM effects")).scalar() == 200
            assert (
                conn.execute(
                    text(
                        "SELECT count(*) FROM inbox_messages"
                        " WHERE status = 'processed' AND attempts = 1"
                    )
                ).scalar()
                == 200
            )
        assert count == 200
        svc.close()


def test_the_claim_check_works_on_sqlite_with_both_stores(tmp_path: Path) -> None:
    """Development mode: the database store in the SQLite file, and a directory store."""
    from outbox_inbox.claim_check import DirectoryPayloadStore, PostgresPayloadStore

    (tmp_path / "payloads").mkdir()
    directory = DirectoryPayloadStore("files", str(tmp_path / "payloads"))
    with MemoryBroker() as broker:
        orders = _service(
            "orders", tmp_path / "o.db", broker, payload_store=PostgresPayloadStore("orders")
        )
        files = _service("files", tmp_path / "f.db", broker, payload_store=directory)
        sources = (PostgresPayloadStore("orders", db_url=f"sqlite:///{tmp_path / 'o.db'}"),)
        billing = _service(
            "billing", tmp_path / "b.db", broker, payload_sources=(*sources, directory)
        )
        got: list[int] = []
        billing.on_command("blob.store")(lambda m, s: got.append(len(m.payload["blob"])))
        billing.start()
        try:
            for sender in (orders, files):
                with sender.session() as session, session.begin():
                    sender.outbox.send(session, "billing", "blob.store", {"blob": "x" * 100_000})
                sender.start(workers=0)
            wait_until(lambda: len(got) == 2, timeout=20)
        finally:
            for service in (orders, files, billing):
                service.stop()
        assert got == [100_000, 100_000]
        with orders.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM payloads")).scalar() == 1
        assert len(list((tmp_path / "payloads").iterdir())) == 1
        for service in (orders, files, billing):
            service.close()


def test_a_run_keeps_what_its_process_held_out_of_full_collections_until_it_ends(
    tmp_path: Path,
) -> None:
    service = _service("frozen", tmp_path / "f.db", MemoryBroker())
    seen: list[int] = []

    def stop_once_running() -> None:
        try:
            wait_until(lambda: bool(gc.get_freeze_count()), timeout=10, what="objects frozen")
            seen.append(gc.get_freeze_count())
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # as a supervisor stops it

    threading.Thread(target=stop_once_running, daemon=True).start()
    service.run()  # returns on the signal
    assert seen and seen[0] > 10_000  # the modules' objects at least, not walked while it ran
    assert gc.get_freeze_count() == 0  # thawed: collected as before once the run is over
    service.close()
