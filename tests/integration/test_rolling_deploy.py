"""Rolling deploys, with the workers in this process on the real database.

A row whose routing key or payload version no handler of a worker takes is no failure of the
message: while a live instance of the service advertises a handler for it, the worker gives it
back uncounted, holds its key's later rows behind it, does not claim it again at every poll,
and warns once per key. It is dead (``no_handler``) only once no live instance has advertised
one for ``no_handler_grace``. The rollout with worker processes is tests/e2e/test_rollout.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import SQLAlchemyError

from helpers import make_service, rows, wait_until
from outbox_inbox import Message, Service
from outbox_inbox.queries.roles import AWAY
from outbox_inbox.worker import Worker

INBOX = "outbox_inbox.inbox_messages"


def _effect(message: Message, session: Any) -> None:
    session.execute(
        text("INSERT INTO effects (message_id, type, info) VALUES (:m, :t, :v)"),
        {"m": str(message.message_id), "t": message.type, "v": f"v{message.version}"},
    )


def _code(service: Service, *, new: bool) -> Service:
    """billing's handlers: the old code handles version 1 of orders.order.placed; the new
    code adds version 2 and orders.order.cancelled."""
    service.on_event("orders.order.placed", version=1)(_effect)
    if new:
        service.on_event("orders.order.placed", version=2)(_effect)
        service.on_event("orders.order.cancelled")(_effect)
    return service


def _old_and_new(db_url: str, **settings: Any) -> tuple[Service, Service]:
    old = _code(make_service("billing", db_url, None, **settings), new=False)
    new = _code(make_service("billing", db_url, None, **settings), new=True)
    return old, new


def _store(engine: Engine, routing_key: str, *, version: int = 1, key: str | None = None) -> str:
    """An event row in billing's inbox, as the receiver stores it; its message id."""
    message_id = str(uuid.uuid4())
    with engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO {INBOX} (message_id, source, kind, routing_key, payload, headers,"
                " version, key) VALUES (:m, 'orders', 'event', :r, '{}', '{}', :v, :k)"
            ),
            {"m": message_id, "r": routing_key, "v": version, "k": key},
        )
    return message_id


def _row(db_url: str, message_id: str) -> Any:
    return rows(
        db_url,
        f"SELECT status, attempts, finished, dead_reason, last_error,"
        f" next_attempt_at > now() AS later FROM {INBOX} WHERE message_id = :m",
        m=message_id,
    )[0]


def _effects(db_url: str) -> list[tuple[str, str]]:
    return [(r.message_id, r.info) for r in rows(db_url, "SELECT * FROM effects ORDER BY seq")]


@contextlib.contextmanager
def _connected(worker: Worker) -> Iterator[Connection]:
    conn = worker.connect()
    try:
        yield conn
    finally:
        with contextlib.suppress(SQLAlchemyError):
            conn.invalidate()
        conn.close()
        worker.close_liveness()


def _away_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "left, uncounted" in r.getMessage()]


def test_a_row_only_a_live_new_instance_handles_waits_uncounted_and_holds_its_key(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    old, new = _old_and_new(db_url)
    old_worker, new_worker = old.worker(), new.worker()
    caplog.set_level(logging.WARNING, logger="outbox_inbox.worker")
    with _connected(new_worker) as new_conn, _connected(old_worker) as old_conn:
        assert new_worker.work_once(new_conn) == 0  # the new instance advertises its handlers
        v2 = _store(old.engine, "orders.order.placed", version=2, key="order-1")
        v1_after = _store(old.engine, "orders.order.placed", version=1, key="order-1")
        cancelled = _store(old.engine, "orders.order.cancelled", key="order-2")

        assert old_worker.work_once(old_conn) == 2  # v2 and cancelled; v1_after waits behind v2
        # Left, uncounted, due a little later: not claimed again at the next poll.
        for message_id in (v2, cancelled):
            assert tuple(_row(db_url, message_id))[:4] == ("pending", 0, 0, None)
            assert _row(db_url, message_id).later
        assert old_worker.work_once(old_conn) == 0
        # The key's later row, which the old code could handle, is not handled before v2.
        assert tuple(_row(db_url, v1_after))[:3] == ("pending", 0, 0)
        assert _effects(db_url) == []
        # Due to other workers first: the one that left them waits twice as long, then
        # claims and leaves them again: still uncounted, and no second warning.
        time.sleep(AWAY.total_seconds() + 0.1)
        assert old_worker.work_once(old_conn) == 0
        time.sleep(AWAY.total_seconds())
        assert old_worker.work_once(old_conn) == 2
        assert _row(db_url, v2).attempts == 0
        warnings = _away_warnings(caplog)
        assert len(warnings) == 2, warnings  # one per routing key and version
        assert all(old_worker.name in w and new_worker.name in w for w in warnings), warnings
        assert any("orders.order.placed version 2" in w for w in warnings), warnings
        assert any("orders.order.cancelled version 1" in w for w in warnings), warnings

        # The new instance takes them once due, the key's rows in their order.
        wait_until(
            lambda: new_worker.work_once(new_conn) == 0 and len(_effects(db_url)) == 3,
            timeout=10,
            what="the new instance to handle the three rows",
        )
    assert _effects(db_url) == [(v2, "v2"), (cancelled, "v1"), (v1_after, "v1")]
    for message_id in (v2, v1_after, cancelled):
        assert tuple(_row(db_url, message_id))[:3] == ("processed", 1, 1)


def test_a_row_no_live_instance_handles_is_dead_as_no_handler_once_the_grace_ran_out(
    db_url: str,
) -> None:
    grace = 2.0
    old, new = _old_and_new(db_url, no_handler_grace=grace)
    old_worker, new_worker = old.worker(), new.worker()
    with _connected(new_worker) as new_conn:
        new_worker.work_once(new_conn)  # advertises once, then dies without a word
    advertised = time.monotonic()
    cancelled = _store(old.engine, "orders.order.cancelled", key="order-1")
    placed = _store(old.engine, "orders.order.placed", key="order-1")
    with _connected(old_worker) as conn:
        old_worker.work_once(conn)
        assert _row(db_url, cancelled).status == "pending"  # the new instance may come back

        wait_until(
            lambda: old_worker.work_once(conn) >= 0 and _row(db_url, cancelled).status == "dead",
            timeout=grace + 10,
            what="the row to be dead once the grace ran out",
        )
        died = time.monotonic() - advertised
        wait_until(
            lambda: old_worker.work_once(conn) == 0 and _row(db_url, placed).status != "pending",
            timeout=10,
            what="the key's next row to be handled",
        )
    assert grace - 0.5 <= died <= grace + 2 * AWAY.total_seconds() + 3, died
    row = _row(db_url, cancelled)
    assert (row.dead_reason, row.attempts, row.finished) == ("no_handler", 1, 1)
    assert "no handler for orders.order.cancelled version 1 on any live instance" in row.last_error
    assert _effects(db_url) == [(placed, "v1")]


def test_a_worker_that_stops_is_no_longer_a_live_instance_at_once(db_url: str) -> None:
    old, new = _old_and_new(db_url)  # the default grace: minutes
    old_worker, new_worker = old.worker(), new.worker()
    with _connected(new_worker) as new_conn:
        new_worker.work_once(new_conn)
        new_worker.retire(new_conn)  # what its run() does when it stops
    cancelled = _store(old.engine, "orders.order.cancelled")
    with _connected(old_worker) as conn:
        old_worker.work_once(conn)
    assert _row(db_url, cancelled).dead_reason == "no_handler"


def test_a_receiver_declaring_new_bindings_advertises_its_handlers_before_its_workers_run(
    db_url: str, mq_url: str
) -> None:
    old = _code(make_service("billing", db_url, mq_url), new=False)
    new = _code(make_service("billing", db_url, mq_url), new=True)
    new.start(relay=False, workers=0)  # binds orders.order.cancelled; no worker of its own yet
    try:
        cancelled = _store(old.engine, "orders.order.cancelled")
        old_worker = old.worker()
        with _connected(old_worker) as conn:
            assert old_worker.work_once(conn) == 1
        assert tuple(_row(db_url, cancelled))[:4] == ("pending", 0, 0, None)
    finally:
        new.stop()
        new.close()
        old.close()


def test_on_sqlite_the_same_rule_holds(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'billing.db'}"
    handled: list[int] = []
    old, new = (Service("billing", db_url=url) for _ in range(2))
    old.migrate()
    old.on_event("orders.order.placed", version=1)(lambda m, s: handled.append(m.version))
    new.on_event("orders.order.placed", version=2)(lambda m, s: handled.append(m.version))
    old_worker, new_worker = old.worker(), new.worker()
    with _connected(new_worker) as new_conn:
        new_worker.work_once(new_conn)  # advertises version 2
        message_id = uuid.uuid4().hex
        with old.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO inbox_messages (message_id, source, kind, routing_key, payload,"
                    " headers, version) VALUES (:m, 'orders', 'event', 'orders.order.placed',"
                    " '{}', '{}', 2)"
                ),
                {"m": message_id},
            )
        with _connected(old_worker) as old_conn:
            assert old_worker.work_once(old_conn) == 1
        with old.engine.connect() as conn:
            row = conn.execute(text("SELECT status, attempts FROM inbox_messages")).one()
        assert tuple(row) == ("pending", 0)
        time.sleep(AWAY.total_seconds() + 0.1)
        assert new_worker.work_once(new_conn) == 1
    assert handled == [2]
    old.close()
    new.close()
