"""A message that hangs the receiver ends alone: the messages delivered with it are stored.

The receiver (a real process) is killed each time it hangs on the poison message. When the
broker delivers a batch again, every message in it is flagged redelivered; the receiver counts
and stores each of those alone, so only the poison message's count grows from one kill to
the next, and only it reaches `max_redeliveries`.
"""

from __future__ import annotations

import signal

import pika

from helpers import rows, scalar, wait_until

from .test_poison import _publish, _sleeping, _start, _stop, hanging_billing


def test_only_the_message_that_hangs_the_receiver_is_dead_lettered(
    db_url: str, mq_url: str
) -> None:
    svc = hanging_billing(db_url, mq_url)
    ids = _publish(
        mq_url, [{"n": n} for n in range(5)] + [{"hang": True}] + [{"n": n} for n in range(5, 10)]
    )
    hang_id = ids[5]
    innocents = sorted(ids[:5] + ids[6:])
    kills = 0
    receiver = None
    try:
        for _ in range(3):  # the batch, then the poison redelivered twice: all hang
            receiver = _start("receiver", db_url, mq_url)
            wait_until(lambda: _sleeping(db_url) == 1, timeout=30, what="the receiver to hang")
            receiver.send_signal(signal.SIGKILL)
            receiver.wait(10)
            kills += 1
            scalar(
                db_url,
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE wait_event = 'PgSleep'",
            )
            wait_until(lambda: _sleeping(db_url) == 0, timeout=10, what="the session to end")
        receiver = _start("receiver", db_url, mq_url)
        wait_until(
            lambda: scalar(db_url, "SELECT count(*) FROM outbox_inbox.inbox_messages") == 10,
            timeout=30,
            what="the ten other messages stored",
        )
        wait_until(
            lambda: svc.broker.queue_depth("billing.dead_letter") == 1,
            timeout=10,
            what="the poison message dead-lettered",
        )
    finally:
        if receiver is not None:
            _stop(receiver)
    assert kills == 3
    stored = rows(db_url, "SELECT message_id::text FROM outbox_inbox.inbox_messages")
    assert sorted(m for (m,) in stored) == innocents
    counts = dict(
        rows(db_url, "SELECT message_id::text, deliveries FROM outbox_inbox.inbox_deliveries")
    )
    assert counts.pop(hang_id) == 3
    assert all(count <= 1 for count in counts.values()), counts
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        method, props, _ = connection.channel().basic_get("billing.dead_letter", auto_ack=True)
    finally:
        connection.close()
    assert method is not None
    assert props.message_id == hang_id
    assert props.headers["x-dead-reason"].startswith("redelivered: redelivered 3 times")
    svc.close()
