"""Poison messages: one that kills the worker, one that hangs the receiver, one whose decoding
kills the receiver (real processes)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pika
from sqlalchemy import text

from helpers import make_service, rows, scalar, wait_until
from outbox_inbox import Service

APP = Path(__file__).with_name("poison_app.py")
ROOT = Path(__file__).resolve().parents[2]


def _start(role: str, db_url: str, mq_url: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(APP), role, db_url, mq_url],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(10)


def _publish(mq_url: str, payloads: list[dict[str, Any]]) -> list[str]:
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    ids = []
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for payload in payloads:
            message_id = str(uuid.uuid4())
            channel.basic_publish(
                "commands",
                "billing.job.run",
                json.dumps(payload).encode(),
                pika.BasicProperties(message_id=message_id, delivery_mode=2),
            )
            ids.append(message_id)
    finally:
        connection.close()
    return ids


def test_handler_that_kills_its_process_is_abandoned_while_other_messages_flow(
    db_url: str, mq_url: str
) -> None:
    sys.path.insert(0, str(APP.parent))
    from poison_app import SETTINGS

    svc = make_service("billing", db_url, mq_url, **SETTINGS)
    svc.declare_topology()
    payloads: list[dict[str, Any]] = [{"n": n} for n in range(20)]
    payloads.insert(3, {"poison": True})
    ids = _publish(mq_url, payloads)
    poison_id = ids[3]
    receiver = svc.receiver()
    stop = threading.Event()
    thread = threading.Thread(target=receiver.run, args=(stop,))
    thread.start()
    try:
        wait_until(lambda: receiver.stored == 21, what="21 stored")
    finally:
        stop.set()
        thread.join(10)
    kills = 0
    deadline = time.monotonic() + 60
    worker = None
    try:
        # A supervisor's job: start the worker again whenever it dies.
        while time.monotonic() < deadline:
            done = scalar(
                db_url, "SELECT count(*) FROM outbox_inbox.inbox_messages WHERE status <> 'pending'"
            )
            if done == 21:
                break
            if worker is None or worker.poll() is not None:
                if worker is not None:
                    assert worker.returncode == -signal.SIGKILL
                    kills += 1
                worker = _start("worker", db_url, mq_url)
            time.sleep(0.2)
    finally:
        if worker is not None:
            _stop(worker)
    states = {
        str(m): (s, r, a)
        for m, s, r, a in rows(
            db_url,
            "SELECT message_id, status, dead_reason, attempts FROM outbox_inbox.inbox_messages",
        )
    }
    assert states[poison_id] == ("dead", "abandoned", 3)
    others = {m: v for m, v in states.items() if m != poison_id}
    assert all(status == "processed" for status, _, _ in others.values()), others
    assert kills == 2  # abandon_after=2: the third claim does not run it
    effects = rows(db_url, "SELECT message_id FROM effects")
    assert sorted(m for (m,) in effects) == sorted(others)


def _sleeping(db_url: str) -> int:
    return int(
        scalar(
            db_url,
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event = 'PgSleep' AND datname = current_database()",
        )
    )


def hanging_billing(db_url: str, mq_url: str) -> Service:
    """billing with poison_app's settings, whose inbox INSERT hangs on a payload with "hang",
    as a driver bug or a runaway trigger would."""
    sys.path.insert(0, str(APP.parent))
    from poison_app import SETTINGS

    svc = make_service("billing", db_url, mq_url, **SETTINGS)
    svc.declare_topology()
    with svc.engine.begin() as conn:
        conn.execute(
            text(
                "CREATE FUNCTION hang() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                " IF NEW.payload ? 'hang' THEN PERFORM pg_sleep(3600); END IF; RETURN NEW; END $$"
            )
        )
        conn.execute(
            text(
                "CREATE TRIGGER hang BEFORE INSERT ON outbox_inbox.inbox_messages"
                " FOR EACH ROW EXECUTE FUNCTION hang()"
            )
        )
    return svc


def _assert_dead_lettered_after_three_deliveries(db_url: str, mq_url: str, message_id: str) -> None:
    """`message_id` was counted three times (max_redeliveries 2) and is billing's dead letter."""
    deliveries = scalar(
        db_url,
        "SELECT deliveries FROM outbox_inbox.inbox_deliveries WHERE message_id = :m",
        m=message_id,
    )
    assert deliveries == 3
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        method, props, _ = connection.channel().basic_get("billing.dead_letter", auto_ack=True)
    finally:
        connection.close()
    assert method is not None and props.message_id == message_id
    assert props.headers["x-dead-reason"].startswith("redelivered: redelivered 3 times")


def test_message_that_hangs_the_receiver_is_dead_lettered_after_max_redeliveries(
    db_url: str, mq_url: str
) -> None:
    hanging_billing(db_url, mq_url)
    (hang_id,) = _publish(mq_url, [{"hang": True}])
    kills = 0
    receiver = None
    try:
        for _ in range(3):  # first delivery, then two counted redeliveries: all hang
            receiver = _start("receiver", db_url, mq_url)
            wait_until(lambda: _sleeping(db_url) == 1, timeout=30, what="the receiver to hang")
            receiver.send_signal(signal.SIGKILL)
            receiver.wait(10)
            kills += 1
            # The server does not notice a killed client while it sleeps: end that session,
            # and wait until it is gone so the next round sees only its own receiver hang.
            scalar(
                db_url,
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE wait_event = 'PgSleep'",
            )
            wait_until(lambda: _sleeping(db_url) == 0, timeout=10, what="the session to end")
        (good_id,) = _publish(mq_url, [{"n": 1}])
        receiver = _start("receiver", db_url, mq_url)
        wait_until(
            lambda: scalar(db_url, "SELECT count(*) FROM outbox_inbox.inbox_messages") == 1,
            timeout=30,
            what="the next message to be stored",
        )
    finally:
        if receiver is not None:
            _stop(receiver)
    assert kills == 3
    assert rows(db_url, "SELECT message_id::text FROM outbox_inbox.inbox_messages") == [(good_id,)]
    _assert_dead_lettered_after_three_deliveries(db_url, mq_url, hang_id)


def test_message_whose_decoding_kills_the_receiver_is_dead_lettered_after_max_redeliveries(
    db_url: str, mq_url: str
) -> None:
    make_service("billing", db_url, mq_url).declare_topology()
    # The poison comes first in a batch with innocent messages: the first death takes their
    # deliveries with it, and they come back flagged redelivered too.
    poison_id, *innocent = _publish(
        mq_url, [{"die_in_decode": True}] + [{"n": n} for n in range(5)]
    )
    deaths = []
    receiver = None
    try:
        for _ in range(3):  # the first delivery, then two counted redeliveries: all die
            receiver = _start("receiver-dying-in-decode", db_url, mq_url)
            deaths.append(receiver.wait(60))
        receiver = _start("receiver-dying-in-decode", db_url, mq_url)
        wait_until(
            lambda: scalar(db_url, "SELECT count(*) FROM outbox_inbox.inbox_messages") == 5,
            timeout=30,
            what="the innocent messages stored",
        )
        assert receiver.poll() is None, "the fourth receiver died too"
    finally:
        if receiver is not None:
            _stop(receiver)
    assert deaths == [-signal.SIGKILL] * 3
    stored = rows(db_url, "SELECT message_id::text FROM outbox_inbox.inbox_messages")
    assert sorted(r[0] for r in stored) == sorted(innocent)
    # Counted before each decoding, so the count survived each death: 3 > max_redeliveries.
    _assert_dead_lettered_after_three_deliveries(db_url, mq_url, poison_id)
