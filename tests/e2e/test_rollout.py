"""A rolling deploy: the old and the new code of billing run as two worker processes on one inbox.

The new code adds a handler of ``orders.order.cancelled`` and one of version 2 of
``orders.order.placed`` (tests/e2e/rollout_app.py). While both run, messages of the new key
and of version 2 flow, and the old worker claims some of them: it leaves them, uncounted and in
their key's order, to the new one. Then the old process stops. Nothing is dead, and every
message is handled once, by the new code wherever only it can.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from outbox_inbox import Service

from . import apps, rollout_app
from .harness import INBOX, Database, Processes, ServiceProcess, hold, running

APP = Path(rollout_app.__file__).resolve()


def _start(processes: Processes, code: str, db_url: str, mq_url: str) -> ServiceProcess:
    """A worker process of billing's `code`, killed at teardown with the others."""
    log_path = processes._log_dir / f"billing-{code}.log"
    env = {**os.environ, "E2E_DB_URL": db_url, "E2E_MQ_URL": mq_url, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log_file:
        popen = subprocess.Popen(
            [sys.executable, str(APP), code],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    process = ServiceProcess(f"billing-{code}", popen, log_path)
    processes.started.append(process)
    return process


def _publish(orders: Service, first: int, count: int) -> None:
    """For each order n: version 2 of order.placed then order.cancelled, both keyed order-n;
    version 1 of order.placed keyed v1-n; and an unkeyed order.cancelled. One transaction."""
    with orders.session() as session, session.begin():
        for n in range(first, first + count):
            key = f"order-{n}"
            orders.outbox.publish(session, "order.placed", {"n": n}, key=key, version=2)
            orders.outbox.publish(session, "order.cancelled", {"n": n}, key=key)
            orders.outbox.publish(session, "order.placed", {"n": n}, key=f"v1-{n}")
            orders.outbox.publish(session, "order.cancelled", {"n": n})


def _advertised(db: Database, process: ServiceProcess) -> int:
    """The rows of the instances table of `process`'s workers (named host:pid:…)."""
    return db.count("outbox_inbox.instances", "instance LIKE :p", p=f"%:{process.pid}:%")


def _warnings(process: ServiceProcess, what: str) -> int:
    return sum(
        1
        for line in process.log_path.read_text(errors="replace").splitlines()
        if "left, uncounted" in line and what in line
    )


def test_rollout_old_and_new_workers_on_one_inbox_nothing_dead_each_message_once_by_new_code(
    db_url: str,
    db_url_factory: Callable[[], str],
    mq_url: str,
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
    processes: Processes,
) -> None:
    billing_url, orders_url = db_url, db_url_factory()
    db = prepare_db("billing", billing_url)
    prepare_db("orders", orders_url)
    orders = make_service("orders", orders_url)
    # This process runs billing's receiver with the new topology (it binds the new key), and
    # orders' relay; the two codes' workers run as processes of their own.
    billing = rollout_app.build("new", billing_url, mq_url)
    try:
        with running(billing, orders, workers=0):
            old = _start(processes, "old", billing_url, mq_url)
            new = _start(processes, "new", billing_url, mq_url)
            processes.wait_until(
                lambda: old.entered_role() and new.entered_role(),
                timeout=60,
                what="both workers to start",
            )
            processes.wait_until(
                lambda: _advertised(db, old) and _advertised(db, new),
                timeout=30,
                what="both workers to advertise their handlers",
            )

            # The new worker is slow (paused, still live): the old one meets the new messages.
            new.signal(signal.SIGSTOP)
            _publish(orders, 0, 10)
            processes.wait_until(
                lambda: (
                    db.count("effects") == 10
                    and _warnings(old, "orders.order.placed version 2")
                    and _warnings(old, "orders.order.cancelled")
                ),
                timeout=30,
                what="the old worker to handle version 1 and leave the rest, with warnings",
                describe=lambda: (db.rows(f"SELECT status, count(*) FROM {INBOX} GROUP BY 1"),),
            )
            hold(
                2.0,
                lambda: db.count(INBOX, "status = 'dead'") == 0 and db.count("effects") == 10,
                what="nothing dead, nothing else handled, while only the old worker runs",
            )
            new.popen.send_signal(signal.SIGCONT)
            processes.wait_until(
                lambda: db.count("effects") == 40, timeout=30, what="the new worker to catch up"
            )

            # Both run while messages flow; then the old one stops, as a rollout ends it.
            _publish(orders, 10, 10)
            time.sleep(0.3)
            old.signal(signal.SIGTERM)
            _publish(orders, 20, 10)
            assert old.wait(30) == 0, old.log_tail()
            processes.wait_until(
                lambda: db.count("effects") == 120,
                timeout=60,
                what="every message to be handled",
                describe=lambda: db.rows(
                    f"SELECT status, version, routing_key, attempts, count(*) FROM {INBOX}"
                    " GROUP BY 1, 2, 3, 4"
                ),
            )
            hold(1.0, lambda: db.count("effects") == 120, what="each message handled once")
            # The stopped worker took its row out of the instances table.
            assert not _advertised(db, old) and _advertised(db, new)
    finally:
        billing.close()

    assert db.count(INBOX) == 120 and db.count(INBOX, "status = 'processed'") == 120
    # Left to another worker is no attempt: each row counts the one claim that handled it.
    assert db.count(INBOX, "attempts <> 1 OR finished <> 1") == 0
    assert (
        db.count(
            "effects", "handled_by <> :pid AND (seq = 2 OR type LIKE '%cancelled')", pid=new.pid
        )
        == 0
    )
    assert db.count("effects", "handled_by = :pid", pid=old.pid) >= 10
    # Each key's rows in order: version 2 of order.placed before order.cancelled.
    out_of_order = db.rows(
        "SELECT p.key FROM effects p JOIN effects c ON c.key = p.key"
        " WHERE p.type = 'orders.order.placed' AND c.type = 'orders.order.cancelled'"
        " AND p.handled_order > c.handled_order"
    )
    assert out_of_order == []
    # One warning per routing key and version a minute, not one per poll.
    for what in ("orders.order.placed version 2", "orders.order.cancelled"):
        assert 1 <= _warnings(old, what) <= 2, old.log_tail(80)
    assert apps.STARTING in old.log_path.read_text()
