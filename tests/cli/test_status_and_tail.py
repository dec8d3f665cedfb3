"""`outbox-inbox status` agrees with the database; `tail` prints live events and leaves nothing."""

from __future__ import annotations

import json
import re
import select
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from cli_support import Cli, base_env, command
from sqlalchemy import func, text

from helpers import scalar, wait_until
from outbox_inbox import Service
from outbox_inbox.brokers.memory import MemoryBroker

INBOX = "outbox_inbox.inbox_messages"


def _insert_inbox(service: Service, **values: Any) -> None:
    row = {
        "message_id": uuid.uuid4(),
        "kind": "command",
        "routing_key": "billing.invoice.create",
        "payload": {},
        "headers": {},
        **values,
    }
    with service.engine.begin() as conn:
        conn.execute(service.tables.inbox.insert().values(**row))


def test_status_numbers_match_the_database_and_thresholds_set_the_exit_code(
    cli: Cli, make_service: Callable[..., Service], db_url: str
) -> None:
    service = make_service()
    service.declare_topology()  # a missing inbox queue is a problem of its own
    with service.session() as session, session.begin():
        for n in range(3):
            service.outbox.send(session, "billing", "invoice.create", {"n": n})
    with service.engine.begin() as conn:  # one of them has been waiting for an hour
        conn.execute(
            text(
                "UPDATE outbox_inbox.outbox_messages SET created_at = now() - interval '1 hour',"
                " attempts = 2 WHERE id = (SELECT min(id) FROM outbox_inbox.outbox_messages)"
            )
        )
    ago = "now() - interval '10 minutes'"
    _insert_inbox(service)  # pending
    _insert_inbox(service, routing_key="orders.order.placed", kind="event")  # pending
    _insert_inbox(service, locked_until=func.now() + timedelta(minutes=1), locked_by="w1")
    _insert_inbox(service, status="dead", dead_reason="rejected", last_error="bad input")
    _insert_inbox(service, status="processed")
    # Key k1: its head failed and waits for a retry, holding back two more.
    with service.engine.begin() as conn:
        conn.execute(text(f"UPDATE {INBOX} SET received_at = {ago} WHERE status = 'pending'"))
    _insert_inbox(
        service,
        key="k1",
        finished=1,
        attempts=1,
        last_error="Traceback (most recent call last):\n  ...\nValueError: boom",
        next_attempt_at=func.now() + timedelta(minutes=5),
    )
    _insert_inbox(service, key="k1")
    _insert_inbox(service, key="k1")
    _insert_inbox(service, key="k2")  # a key whose head has not failed is not held back

    result = cli("status", "--app", "cli_app:billing", "--json")
    assert result.returncode == 0, result
    status = json.loads(result.stdout)

    def count(where: str, table: str = INBOX) -> int:
        return int(scalar(db_url, f"SELECT count(*) FROM {table} WHERE {where}"))

    assert (
        status["outbox"]["unpublished"]
        == count("published_at IS NULL AND expired_at IS NULL", "outbox_inbox.outbox_messages")
        == 3
    )
    assert status["outbox"]["retrying"] == 1
    assert 3590 < status["outbox"]["oldest_age_seconds"] < 3700
    inbox = status["inbox"]
    assert (
        inbox["pending"]
        == count("status = 'pending' AND (locked_until IS NULL OR locked_until <= now())")
        == 6
    )
    assert inbox["in_progress"] == count("status = 'pending' AND locked_until > now()") == 1
    assert inbox["dead"] == count("status = 'dead'") == 1
    assert inbox["processed"] == count("status = 'processed'") == 1
    assert 590 < inbox["oldest_pending_age_seconds"] < 700
    by_type = {t["type"]: t for t in inbox["by_type"]}
    assert by_type["billing.invoice.create"] == {
        "type": "billing.invoice.create",
        "pending": 5,
        "in_progress": 1,
        "dead": 1,
        "cap": None,  # no max_concurrency
        "rate": None,
        "cap_binding": False,
    }
    assert by_type["orders.order.placed"]["pending"] == 1
    held = status["held_keys"]
    assert held["count"] == 1
    (k1,) = held["keys"]
    assert (k1["key"], k1["waiting"], k1["failures"]) == ("k1", 2, 1)
    assert k1["last_error"] == "ValueError: boom"
    # The app has a broker: queue depths are reported.
    assert status["broker"]["queues"]["billing.inbox"] == {"messages": 0, "consumers": 0}

    human = cli("status", "--app", "cli_app:billing")
    assert human.returncode == 0, human
    assert "pending 6, in progress 1, dead 1, processed 1" in human.stdout
    assert re.search(r"k1 +\S+ +billing\.invoice\.create +1 +2 ", human.stdout)

    too_dead = cli("status", "--app", "cli_app:billing", "--max-dead", "0")
    assert too_dead.returncode == 4, too_dead
    assert "unhealthy: 1 dead letter exceeds --max-dead 0" in too_dead.stderr
    lagging = cli("status", "--app", "cli_app:billing", "--max-lag", "30m", "--no-broker")
    assert lagging.returncode == 4, lagging
    assert "outbox lag" in lagging.stderr and "inbox lag" not in lagging.stderr
    healthy = cli("status", "--app", "cli_app:billing", "--max-lag", "2h", "--max-dead", "1")
    assert healthy.returncode == 0, healthy


def test_status_reads_a_sqlite_database(tmp_path: Path) -> None:
    """SQLite has no schemas and no REPEATABLE READ: status reads its tables all the same."""
    db = f"sqlite:///{tmp_path / 'billing.db'}"
    service = Service("billing", db_url=db, broker=MemoryBroker())
    service.migrate()
    try:
        with service.session() as session, session.begin():
            service.outbox.send(session, "billing", "invoice.create", {"n": 1})
        _insert_inbox(service)
        _insert_inbox(service, status="dead", dead_reason="rejected", last_error="bad input")
    finally:
        service.close()
    argv = ["status", "--db-url", db, "--service", "billing", "--json"]
    result = subprocess.run(
        command(*argv), cwd=tmp_path, env=base_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["outbox"]["unpublished"] == 1
    assert (status["inbox"]["pending"], status["inbox"]["dead"]) == (1, 1)
    human = subprocess.run(
        command(*argv[:-1], "--max-dead", "0"),
        cwd=tmp_path,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert human.returncode == 4, human.stderr
    assert human.stdout.startswith("service billing, database time ")
    assert "pending 1, in progress 0, dead 1" in human.stdout
    assert "unhealthy: 1 dead letter exceeds --max-dead 0" in human.stderr


def _read_line(stream: Any, timeout: float) -> str:
    """One line from a child's pipe, failing after `timeout` seconds."""
    ready, _, _ = select.select([stream], [], [], timeout)
    if not ready:
        raise AssertionError(f"no output within {timeout}s")
    return str(stream.readline())


def _queue_state(mq_url: str, queue: str) -> int:
    """404 when the queue does not exist, 405 while an exclusive owner holds it, 200 else."""
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        connection.channel().queue_declare(queue, passive=True)
        return 200
    except pika.exceptions.ChannelClosedByBroker as exc:
        return int(exc.reply_code)
    finally:
        if connection.is_open:
            connection.close()


@pytest.mark.parametrize("ending", ["sigterm", "count"])
def test_tail_prints_a_published_event_and_leaves_no_queue_behind(
    ending: str,
    spawn: Callable[..., subprocess.Popen[str]],
    make_service: Callable[..., Service],
    mq_url: str,
) -> None:
    make_service().declare_topology()
    args = ["tail", "orders.#", "--app", "cli_app:billing", "--json"]
    tail = spawn(*args, *(["--count", "1"] if ending == "count" else []))
    seen = []
    while not (match := re.search(r"through queue (\S+)", seen[-1] if seen else "")):
        assert len(seen) < 10, seen
        seen.append(_read_line(tail.stderr, 30))
    queue = match[1]
    assert _queue_state(mq_url, queue) == 405  # exists, exclusive to the tail

    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        channel.basic_publish("events", "billing.invoice.created", b'{"skip": true}')
        channel.basic_publish(
            "events",
            "orders.order.placed",
            b'{"order": 7}',
            pika.BasicProperties(message_id="m-7", content_type="application/json"),
        )
    finally:
        connection.close()

    event = json.loads(_read_line(tail.stdout, 10))
    assert (event["routing_key"], event["message_id"], event["payload"]) == (
        "orders.order.placed",
        "m-7",
        {"order": 7},
    )
    if ending == "sigterm":
        time.sleep(0.2)
        tail.send_signal(signal.SIGTERM)
    assert tail.wait(timeout=10) == 0
    assert tail.stdout is not None and tail.stdout.read() == ""  # nothing but that one event
    wait_until(lambda: _queue_state(mq_url, queue) == 404, timeout=5, what="the queue gone")
