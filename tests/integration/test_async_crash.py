"""The asyncio worker's process killed inside an async handler: nothing of its batch commits,
the others are handled once, and the poison message ends dead as ``abandoned``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pika

from helpers import make_service, rows, running, scalar, wait_until

APP = Path(__file__).resolve().parent / "async_poison_app.py"
INBOX = "outbox_inbox.inbox_messages"


def test_a_worker_killed_inside_an_async_handler_loses_its_batch_and_the_poison_ends_abandoned(
    db_url: str, mq_url: str
) -> None:
    billing = make_service("billing", db_url, mq_url)
    billing.on_command("job.run")(lambda message, session: None)  # for its topology only
    billing.declare_topology()
    ids = [str(uuid.uuid4()) for _ in range(4)]
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for n, message_id in enumerate(ids):
            body = {"n": n, "poison": n == 1}
            channel.basic_publish(
                "commands",
                "billing.job.run",
                json.dumps(body).encode(),
                pika.BasicProperties(message_id=message_id, delivery_mode=2),
            )
    finally:
        connection.close()
    receiver = billing.receiver()
    with running(receiver):
        wait_until(lambda: receiver.stored == 4, what="4 stored")
    poison = str(
        rows(db_url, f"SELECT message_id FROM {INBOX} WHERE payload->>'poison' = 'true'")[0][0]
    )

    deaths = 0
    deadline = time.monotonic() + 60
    while scalar(db_url, f"SELECT count(*) FROM {INBOX} WHERE status = 'pending'"):
        assert time.monotonic() < deadline, rows(db_url, f"SELECT * FROM {INBOX}")
        process = subprocess.Popen(
            [sys.executable, str(APP), db_url, mq_url],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            while (
                process.poll() is None
                and time.monotonic() < deadline
                and scalar(db_url, f"SELECT count(*) FROM {INBOX} WHERE status = 'pending'")
            ):
                time.sleep(0.1)
        finally:
            if process.poll() is None:
                process.terminate()
            code = process.wait(20)
        if code == -9:
            deaths += 1
            # The killed batch committed nothing: not even the poison handler's own effect.
            assert (
                scalar(db_url, "SELECT count(*) FROM effects WHERE message_id = :m", m=poison) == 0
            )

    assert deaths >= 2
    states = {
        str(m): (s, r)
        for m, s, r in rows(db_url, f"SELECT message_id, status, dead_reason FROM {INBOX}")
    }
    assert states.pop(poison) == ("dead", "abandoned")
    assert set(states.values()) == {("processed", None)}
    effects = [m for (m,) in rows(db_url, "SELECT message_id FROM effects")]
    assert sorted(effects) == sorted(states)  # each of the others once, the poison never
    billing.close()
