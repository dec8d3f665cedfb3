"""A service process asked to stop finishes the work in hand, gives back the rest, exits 0."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

from outbox_inbox import Service

from .harness import INBOX, OUTBOX, Database, Processes, hold, queue_depth, wait_until


def test_sigterm_stops_roles_gracefully(
    db_url: str,
    mq_url: str,
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
    processes: Processes,
) -> None:
    db = prepare_db("billing", db_url)
    billing = make_service("billing", db_url)
    # Slow handlers and small batches, and a writer still writing when the signal comes: the
    # worker has a batch in hand, and the relay and the receiver have work too.
    settings = {"worker_batch_size": 10, "relay_batch_size": 20}
    message_ids: list[object] = []
    stop_writing = threading.Event()

    def write(count: int) -> None:
        with billing.session() as session, session.begin():
            for _ in range(count):
                n = len(message_ids)
                message_ids.append(
                    billing.outbox.send(session, "billing", "ledger.append", {"seq": n})
                )

    def keep_writing() -> None:
        while not stop_writing.wait(0.1):
            write(20)

    write(200)
    service = processes.start("run", settings=settings, handle_delay=0.02)
    writer = threading.Thread(target=keep_writing, name="e2e-writer", daemon=True)
    writer.start()
    try:
        processes.wait_until(
            lambda: db.count("effects") >= 30,
            timeout=60,
            what="the service to handle some messages",
        )
        signalled_at = time.monotonic()
        service.signal(signal.SIGTERM)
        exit_code = service.wait(timeout=20)
        stopped_in = time.monotonic() - signalled_at
    finally:
        stop_writing.set()
        writer.join(timeout=10)
    assert not writer.is_alive()
    total = len(message_ids)
    assert exit_code == 0, f"exit {exit_code} after SIGTERM:\n{service.log_tail()}"
    assert stopped_in < 8.0  # generous: the host may be busy; it takes well under 1 s
    assert "Traceback" not in service.log_path.read_text()

    # Each message is in exactly one place: unpublished, in the queue, or in the inbox. A batch
    # published but not marked, or stored but not acked, would be in two.
    def places() -> tuple[int, int, int]:
        return (
            db.count(OUTBOX, "published_at IS NULL"),
            queue_depth(mq_url, "billing.inbox"),
            db.count(INBOX),
        )

    wait_until(
        lambda: sum(places()) == total,
        timeout=5,
        what="every message to be in exactly one place",
        describe=places,
    )
    handled = db.count("effects")
    assert handled < total, "the signal came too late to find work in hand"
    # Nothing is left leased, and a claim given back is not counted as an attempt.
    assert (
        db.count(
            INBOX, "status = 'pending' AND (locked_by IS NOT NULL OR locked_until IS NOT NULL)"
        )
        == 0
    )
    assert db.count(INBOX, "status = 'pending' AND attempts <> 0") == 0
    # Effects and the processed marks committed together.
    assert db.count(INBOX, "status = 'processed'") == handled
    assert db.count(INBOX, "status = 'dead'") == 0

    # No message is lost: a new process finishes the rest, each message once.
    processes.start("run", settings=settings)
    processes.wait_until(
        lambda: db.count("effects") >= total,
        timeout=60,
        what="the restarted service to handle the rest",
        describe=lambda: (db.count(OUTBOX, "published_at IS NULL"), db.count(INBOX)),
    )
    hold(1.0, lambda: db.count("effects") == total, what="one effect per message")
    assert sorted(m for (m,) in db.rows("SELECT message_id FROM effects")) == sorted(message_ids)
    assert db.rows(
        f"SELECT status, attempts, finished, count(*) FROM {INBOX} GROUP BY 1, 2, 3"
    ) == [("processed", 1, 1, total)]
