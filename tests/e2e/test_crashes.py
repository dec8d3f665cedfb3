"""Crashes at the worst moments: a relay, a worker, the broker. Nothing is lost or doubled."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from outbox_inbox import Service
from outbox_inbox.listener import Listener
from servers import RabbitMQServer

from .harness import INBOX, OUTBOX, Database, Processes, hold, running, wait_until


class ReceiptCounter(Listener):
    """Counts what the receiver stored and what it dropped as already stored."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stored = 0
        self.duplicates = 0

    def received(self, stored: int, duplicates: int) -> None:
        with self._lock:
            self.stored += stored
            self.duplicates += duplicates


def _read_marker(path: Path) -> dict[str, Any]:
    content: dict[str, Any] = json.loads(path.read_text())
    return content


def _write_orders(orders: Service, count: int) -> list[object]:
    """Commit `count` messages from orders, half commands to billing and half events."""
    ids: list[object] = []
    with orders.session() as session, session.begin():
        for n in range(count):
            if n % 2:
                ids.append(orders.outbox.publish(session, "order.placed", {"order": n}))
            else:
                ids.append(orders.outbox.send(session, "billing", "invoice.create", {"order": n}))
    return ids


def test_relay_killed_after_confirm_before_mark_republishes_and_inbox_absorbs(
    db_url: str,
    db_url_factory: Callable[[], str],
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
    processes: Processes,
    tmp_path: Path,
) -> None:
    count = 20
    orders_url, billing_url = db_url, db_url_factory()
    orders_db, billing_db = prepare_db("orders", orders_url), prepare_db("billing", billing_url)
    orders = make_service("orders", orders_url)
    counter = ReceiptCounter()
    billing = make_service("billing", billing_url, listener=counter)

    with running(billing):
        message_ids = _write_orders(orders, count)
        marker = tmp_path / "confirmed"
        paused = processes.start(
            "relay",
            service="orders",
            settings={"relay_batch_size": 100},
            pause_after_confirm=marker,
        )
        processes.wait_until(marker.exists, timeout=30, what="the relay to pause after the confirm")
        confirmed = _read_marker(marker)
        assert sorted(confirmed["message_ids"]) == sorted(str(m) for m in message_ids)
        assert set(confirmed["outcomes"]) == {"confirmed"}
        # The broker has them: billing handles every message once, from the first copies.
        wait_until(
            lambda: billing_db.count("effects") == count,
            timeout=30,
            what="billing to handle the first copies",
            describe=lambda: billing_db.count("effects"),
        )
        assert orders_db.count(OUTBOX, "published_at IS NULL") == count

        paused.signal(signal.SIGKILL)
        assert paused.wait(10) == -signal.SIGKILL
        assert orders_db.count(OUTBOX, "published_at IS NULL") == count
        assert counter.duplicates == 0

        processes.start("relay", service="orders")
        processes.wait_until(
            lambda: orders_db.count(OUTBOX, "published_at IS NULL") == 0,
            timeout=30,
            what="the second relay to publish and mark the rows",
        )
        wait_until(
            lambda: counter.duplicates >= count,
            timeout=30,
            what="billing's receiver to get the second copies",
            describe=lambda: (counter.stored, counter.duplicates),
        )
        hold(1.0, lambda: billing_db.count("effects") == count, what="one effect per message")

    assert (counter.stored, counter.duplicates) == (count, count)
    assert billing_db.count("effects") == count
    inbox = billing_db.rows(f"SELECT message_id, status, attempts, finished FROM {INBOX}")
    assert sorted(inbox) == sorted((m, "processed", 1, 1) for m in message_ids)


def test_worker_killed_inside_handler_is_handled_once_by_another_worker_long_before_its_lease_ends(
    db_url: str,
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
    processes: Processes,
    tmp_path: Path,
) -> None:
    lease = 60.0  # the default: the dead worker's claim must not wait for it
    db = prepare_db("billing", db_url)
    billing = make_service("billing", db_url)
    worker_settings = {"lease": lease}
    marker = tmp_path / "hanging"

    # The transport runs here; only the workers run in their own processes.
    with running(billing, workers=0):
        with billing.session() as session, session.begin():
            message_id = billing.outbox.send(session, "billing", "ledger.append", {"seq": 1})
        first = processes.start("worker", settings=worker_settings, hang_marker=marker)
        processes.wait_until(
            marker.exists, timeout=30, what="the first worker to hang in the handler"
        )
        hung = _read_marker(marker)
        assert hung["message_id"] == str(message_id)
        assert hung["attempts"] == 1
        lease_end = datetime.fromisoformat(str(hung["locked_until"]))

        first.signal(signal.SIGKILL)
        assert first.wait(10) == -signal.SIGKILL
        second = processes.start("worker", settings=worker_settings, hang_marker=marker)
        processes.wait_until(
            lambda: db.count("effects") == 1,
            timeout=30,
            what="the second worker to handle the message",
        )
        hold(1.0, lambda: db.count("effects") == 1, what="one effect")

    effect = db.rows("SELECT message_id, handled_by, handled_at FROM effects")
    assert [(m, pid) for m, pid, _ in effect] == [(message_id, second.pid)]
    # The dead worker's liveness lock went with its session: its claim was free at once,
    # long before the lease (judged on the database clock) ran out.
    assert effect[0].handled_at < lease_end - timedelta(seconds=lease / 2)
    status, attempts, finished, locked_by = db.rows(
        f"SELECT status, attempts, finished, locked_by FROM {INBOX}"
    )[0]
    assert (status, attempts, finished, locked_by) == ("processed", 2, 1, None)


def test_rabbitmq_restart_while_relay_publishes_loses_nothing(
    db_url: str,
    db_url_factory: Callable[[], str],
    prepare_db: Callable[[str, str], Database],
    make_service: Callable[..., Service],
    processes: Processes,
    local_rabbitmq_server: RabbitMQServer,
) -> None:
    total, batch = 3000, 100
    orders_url, billing_url = db_url, db_url_factory()
    orders_db, billing_db = prepare_db("orders", orders_url), prepare_db("billing", billing_url)
    orders = make_service("orders", orders_url)
    relay_settings = {"relay_batch_size": 100}

    # billing's queue and bindings exist before orders' relay can publish a command to it.
    make_service("billing", billing_url).declare_topology()
    processes.start("run", service="billing", db_url=billing_url)
    relay = processes.start("relay", service="orders", settings=relay_settings)

    written: list[int] = []
    writer_error: list[BaseException] = []

    def write() -> None:
        # Batches spread over a dozen seconds, so that the outage falls in the middle.
        try:
            for n in range(0, total, batch):
                with orders.session() as session, session.begin():
                    for seq in range(n, n + batch):
                        orders.outbox.send(session, "billing", "invoice.create", {"seq": seq})
                written.append(n + batch)
                time.sleep(0.4)
        except BaseException as exc:
            writer_error.append(exc)

    writer = threading.Thread(target=write, name="e2e-writer", daemon=True)
    writer.start()
    try:
        processes.wait_until(
            lambda: orders_db.count(OUTBOX, "published_at IS NOT NULL") >= 600,
            timeout=60,
            what="the relay to publish the first 600 messages",
        )
        local_rabbitmq_server.stop()
        published_at_stop = orders_db.count(OUTBOX, "published_at IS NOT NULL")
        written_at_stop = written[-1] if written else 0
        time.sleep(1.0)  # the relay finds the broker gone while rows keep coming
        local_rabbitmq_server.start()
    finally:
        writer.join(timeout=60)
    assert not writer.is_alive() and not writer_error, writer_error
    # The outage really happened while messages were being written and published.
    assert published_at_stop < total and written_at_stop < total

    processes.wait_until(
        lambda: billing_db.count("effects") >= total,
        timeout=90,
        what="billing to handle every message",
        describe=lambda: (
            orders_db.count(OUTBOX, "published_at IS NULL"),
            billing_db.count(INBOX),
            billing_db.count("effects"),
        ),
    )
    hold(1.0, lambda: billing_db.count("effects") == total, what="one effect per message")
    assert orders_db.count(OUTBOX) == total
    assert orders_db.count(OUTBOX, "published_at IS NULL") == 0
    # The relay met the outage: with rows in hand (a publish failed and was retried), or
    # between batches, when its heartbeat servicing found the connection closed and it
    # reported the broker unavailable.
    assert orders_db.count(OUTBOX, "attempts > 0") > 0 or "broker unavailable" in (
        relay.log_tail(400)
    )
    assert billing_db.scalar("SELECT count(DISTINCT seq) FROM effects") == total
    # Every message was stored once and handled once: no handler ever ran it a second time.
    assert billing_db.rows(
        f"SELECT status, attempts, finished, count(*) FROM {INBOX} GROUP BY 1, 2, 3"
    ) == [("processed", 1, 1, total)]
