"""A command that kills billing's worker process until it is abandoned sends orders one fault
(real processes: poison_app.py's worker, started again each time it dies)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from helpers import make_service, publish_raw, rows, wait_until
from outbox_inbox import Fault, HandlerContext, Message
from outbox_inbox.fingerprint import fingerprint

APP = Path(__file__).with_name("poison_app.py")
ROOT = Path(__file__).resolve().parents[2]


def test_a_command_abandoned_as_poison_sends_its_sender_one_fault(db_url: str, mq_url: str) -> None:
    sys.path.insert(0, str(APP.parent))
    from poison_app import SETTINGS

    orders = make_service("orders", db_url, mq_url, schema="orders_box")
    received: list[tuple[Message, Fault]] = []
    lock = threading.Lock()

    @orders.on_fault("billing.job.run")
    def on_fault(ctx: HandlerContext, payload: Fault) -> None:
        with lock:
            received.append((ctx.message, payload))

    # billing's relay and receiver run here; its worker is poison_app.py's, in a process.
    billing = make_service("billing", db_url, mq_url, **SETTINGS)
    orders.start(workers=1)
    billing.start(workers=0)
    poison_id = str(uuid.uuid4())
    worker: subprocess.Popen[bytes] | None = None
    kills = 0
    try:
        publish_raw(
            mq_url,
            "commands",
            "billing.job.run",
            json.dumps({"poison": True}).encode(),
            message_id=poison_id,
            correlation_id="order-9",
            app_id="orders",
        )
        deadline = time.monotonic() + 60
        while not received and time.monotonic() < deadline:
            if worker is None or worker.poll() is not None:  # a supervisor's job
                if worker is not None:
                    assert worker.returncode == -signal.SIGKILL
                    kills += 1
                worker = subprocess.Popen(
                    [sys.executable, str(APP), "worker", db_url, mq_url],
                    cwd=ROOT,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            time.sleep(0.2)
        wait_until(lambda: received, timeout=5, what="a fault at orders")
        time.sleep(1.0)  # a duplicate would have come by now
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        if worker is not None:
            worker.wait(10)
        billing.close()
        orders.close()
    assert kills == 2  # abandon_after=2
    assert rows(db_url, "SELECT status, dead_reason FROM outbox_inbox.inbox_messages") == [
        ("dead", "abandoned")
    ]
    assert len(received) == 1, received
    message, fault = received[0]
    assert (fault.message_id, fault.routing_key, fault.kind) == (
        poison_id,
        "billing.job.run",
        "command",
    )
    assert (fault.reason, fault.fingerprint, fault.service) == (
        "abandoned",
        fingerprint("abandoned"),
        "billing",
    )
    assert fault.correlation_id == "order-9"
    assert (message.causation_id, message.correlation_id) == (poison_id, "order-9")
    assert rows(db_url, "SELECT status FROM orders_box.inbox_messages") == [("processed",)]
