"""At-most-once handlers (`delivery=`): settled before the attempt (`at_most_once`: an error or a
crash loses the message) and one attempt, then dead (`one_attempt`). Never run twice. On SQLite;
tests/e2e/test_at_most_once.py kills a real worker process on PostgreSQL."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from helpers import received_row
from outbox_inbox import ConfigurationError, Message, Retry, RetryPolicy, Service
from outbox_inbox.handlers import HandlerContext, HandlerOptions
from outbox_inbox.listener import Listener
from outbox_inbox.queries import roles

CREATE, VOID = "billing.invoice.create", "billing.invoice.void"


class _Ends(Listener):
    """Notes each `dead` hook's reason and count."""

    def __init__(self) -> None:
        self.dead_calls: list[tuple[str, int]] = []

    def dead(self, reason: str, count: int) -> None:
        self.dead_calls.append((reason, count))


def _service(tmp_path: Path, listener: Listener | None = None) -> Service:
    service = Service("billing", db_url=f"sqlite:///{tmp_path / 'b.db'}", listener=listener)
    service.migrate()
    with service.engine.begin() as conn:
        conn.execute(text("CREATE TABLE effects (n INTEGER PRIMARY KEY)"))
    return service


def _run(service: Service, rows: list[dict[str, Any]], **columns: Any) -> dict[int, tuple[Any]]:
    """Store `rows` (with `columns` set on each), run one batch; each order's (status,
    dead_reason, attempts, finished) and the orders whose effect committed."""
    with service.engine.begin() as conn:
        roles.insert_inbox(conn, service.tables, rows)
        if columns:
            conn.execute(service.tables.inbox.update().values(**columns))
    worker = service.worker()
    conn = worker.connect()
    try:
        worker.work_once(conn)
    finally:
        conn.close()
    with service.engine.connect() as conn:
        states = conn.execute(
            text(
                "SELECT json_extract(payload, '$.order'), status, dead_reason, attempts, finished"
                " FROM inbox_messages"
            )
        ).all()
        effects = [n for (n,) in conn.execute(text("SELECT n FROM effects"))]
    return {order: (*rest, order in effects) for order, *rest in states}


def _effect(session: Any, message: Message) -> None:
    session.execute(text("INSERT INTO effects VALUES (:n)"), {"n": message.payload["order"]})


def test_the_option_is_checked_when_the_handler_is_registered() -> None:
    assert HandlerOptions().delivery == "exactly_once"
    with pytest.raises(ConfigurationError, match="delivery must be"):
        HandlerOptions(delivery="at_least_once")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="no retry policy"):
        HandlerOptions(delivery="one_attempt", retry=RetryPolicy())


@pytest.mark.parametrize("error", [RuntimeError("boom"), Retry(delay=0)])
def test_at_most_once_is_processed_before_its_handler_and_an_error_loses_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    ends = _Ends()
    service = _service(tmp_path, ends)
    ran: Counter[int] = Counter()
    seen: dict[int, str] = {}

    @service.on_command("invoice.create", delivery="at_most_once")
    def create(message: Message, session: Any) -> None:
        n = message.payload["order"]
        ran[n] += 1
        inbox = service.tables.inbox
        seen[n] = session.execute(
            select(inbox.c.status).where(inbox.c.message_id == message.message_id)
        ).scalar_one()
        _effect(session, message)
        if n == 1:
            raise error

    @service.on_command("invoice.void")  # exactly once, in the same batch: one fails
    def void(message: Message, session: Any) -> None:
        _effect(session, message)
        if message.payload["order"] == 11:
            raise RuntimeError("void failed")

    rows = [received_row(payload={"order": n}) for n in range(3)]
    rows += [received_row(routing_key=VOID, payload={"order": n}) for n in (10, 11, 12)]
    with caplog.at_level(logging.ERROR, "outbox_inbox.worker"):
        states = _run(service, rows)
    service.close()
    assert seen == {0: "processed", 1: "processed", 2: "processed"}  # the mark came first
    assert ran == {0: 1, 1: 1, 2: 1}  # not run again by the batch-mate's failure
    assert states[0] == states[2] == ("processed", None, 1, 1, True)
    assert states[1] == ("processed", None, 1, 1, False)  # lost: no retry, no dead letter
    lost = str(rows[1]["message_id"])
    assert any(lost in r.getMessage() and "lost" in r.getMessage() for r in caplog.records)
    assert ends.dead_calls == [("lost", 1)]  # counted where the metrics count dead messages
    assert states[10] == states[12] == ("processed", None, 1, 1, True)
    assert states[11][:2] == ("pending", None)  # the exactly-once one is retried


@pytest.mark.parametrize("error", [RuntimeError("boom"), Retry(delay=0)])
def test_one_attempt_is_dead_at_its_first_error(tmp_path: Path, error: Exception) -> None:
    service = _service(tmp_path)
    ran: Counter[int] = Counter()

    @service.on_command("invoice.create", delivery="one_attempt")
    def create(message: Message, session: Any) -> None:
        ran[message.payload["order"]] += 1
        _effect(session, message)
        if message.payload["order"] == 1:
            raise error

    states = _run(service, [received_row(payload={"order": n}) for n in range(3)])
    service.close()
    assert ran == {0: 1, 1: 1, 2: 1}
    assert states[1] == ("dead", "max_attempts", 1, 1, False)  # at once, its effect undone
    assert states[0] == states[2] == ("processed", None, 1, 1, True)


def test_one_attempt_claimed_again_after_a_crash_is_dead_without_running(tmp_path: Path) -> None:
    service = _service(tmp_path)
    ran: Counter[int] = Counter()

    @service.on_command("invoice.create", delivery="one_attempt")
    def create(message: Message, session: Any) -> None:
        ran[message.payload["order"]] += 1

    @service.on_command("invoice.void")
    def void(message: Message, session: Any) -> None:
        ran[message.payload["order"]] += 1

    # Each claimed once before by a worker that died before it finished (a suspect): the
    # one-attempt row ends at once; the exactly-once row, claimed on, runs.
    states = _run(service, [received_row(payload={"order": 1})], attempts=1)
    assert states[1] == ("dead", "interrupted", 2, 0, False)
    states = _run(service, [received_row(routing_key=VOID, payload={"order": 2})], attempts=1)
    service.close()
    assert states[2] == ("processed", None, 2, 1, False)
    assert ran == {2: 1}


def test_handlers_of_one_event_that_differ_in_delivery_run_as_one_attempt(
    tmp_path: Path,
) -> None:
    service = _service(tmp_path)
    service.on_event("orders.order.*", delivery="at_most_once")(lambda m, s: None)
    service.on_event("orders.order.placed")(lambda m, s: None)
    assert service.handlers.find("event", "orders.order.placed").delivery == "one_attempt"
    assert service.handlers.find("event", "orders.order.paid").delivery == "at_most_once"
    assert service.handlers.find("event", "orders.order.paid").retry is None
    assert service.handlers.find("event", "orders.order.placed").retry == RetryPolicy(
        max_attempts=1
    )
    service.close()


def test_at_most_once_writes_and_publishes_commit_with_its_own_work_only(tmp_path: Path) -> None:
    service = _service(tmp_path)
    insert = text("INSERT INTO effects VALUES (:n)")

    @service.on_command("invoice.create", delivery="at_most_once")
    def create(ctx: HandlerContext) -> None:
        ctx.write(insert, {"n": ctx.payload["order"]})
        ctx.publish("invoice.created", {"order": ctx.payload["order"]})
        if ctx.payload["order"] == 1:
            raise RuntimeError("boom")

    states = _run(service, [received_row(payload={"order": n}) for n in range(2)])
    with service.engine.connect() as conn:
        published = conn.execute(text("SELECT payload FROM outbox_messages")).scalars().all()
    service.close()
    assert states == {0: ("processed", None, 1, 1, True), 1: ("processed", None, 1, 1, False)}
    assert [json.loads(p) if isinstance(p, str) else p for p in published] == [{"order": 0}]
