"""Dead letters through the library API alone: count, replay and purge on both sides, with
filters, and the audit record of each action."""

from __future__ import annotations

import json
import logging
import threading
import uuid
from pathlib import Path
from typing import Any

import pika
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from helpers import dead_rows_one_refused, inbox_message_ids, make_service, scalar, wait_until
from outbox_inbox import MemoryBroker, Message, Reject
from outbox_inbox.audit_trail import AUDIT_LOG_ENV
from outbox_inbox.dashboard.letters import WatchedService, act
from outbox_inbox.dead_letters import OUTBOX, QUEUE, TABLE, DeadLetters, Filters
from outbox_inbox.errors import StorageError
from outbox_inbox.messages import H_DEAD_QUEUE, H_DEAD_REASON

INVOICE = "billing.invoice.create"


def _dead_letter_in_the_queue(mq_url: str, message_id: str) -> None:
    """A message the receiver gave up on, as it leaves it in billing.dead_letter."""
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(
            "dead_letter",
            "billing",
            json.dumps({"n": 99}).encode(),
            pika.BasicProperties(
                message_id=message_id,
                type=INVOICE,
                content_type="application/json",
                delivery_mode=2,
                headers={
                    H_DEAD_REASON: "store_failed: database down",
                    H_DEAD_QUEUE: "billing.inbox",
                    "x-original-exchange": "commands",
                    "x-original-routing-key": INVOICE,
                },
            ),
        )
    finally:
        connection.close()


def test_replay_and_purge_through_the_library_with_filters_write_their_audit_records(
    db_url: str, mq_url: str, tmp_path: Path
) -> None:
    refusing = threading.Event()
    refusing.set()
    svc = make_service("billing", db_url, mq_url)

    @svc.on_command("invoice.create")
    def create(message: Message, session: Session) -> None:
        if refusing.is_set():
            raise Reject("invoices are refused today")
        session.execute(
            text("INSERT INTO effects (message_id, type) VALUES (:m, :t)"),
            {"m": str(message.message_id), "t": message.type},
        )

    svc.start()
    try:
        with svc.session() as session, session.begin():
            sent = [
                svc.outbox.send(session, "billing", "invoice.create", {"n": n}) for n in range(4)
            ]
        dead = "SELECT count(*) FROM outbox_inbox.inbox_messages WHERE status = 'dead'"
        wait_until(lambda: scalar(db_url, dead) == 4, what="four dead rows")
        queued = [str(uuid.uuid4()), str(uuid.uuid4())]
        for message_id in queued:
            _dead_letter_in_the_queue(mq_url, message_id)

        letters = DeadLetters.of(svc)
        assert letters.reachable()[0] == ["table", "outbox", "queue", "unroutable"]
        wait_until(lambda: letters.count([QUEUE]) == {QUEUE: 2}, what="two queued dead letters")
        assert letters.count([TABLE, OUTBOX], Filters(reason="rejected")) == {TABLE: 4, OUTBOX: 0}
        assert letters.count([TABLE], Filters(reason="max_attempts")) == {TABLE: 0}

        refusing.clear()  # the bug is fixed: replay two rows, by id
        audit_log = tmp_path / "audit.log"
        chosen = Filters(message_ids=tuple(str(m) for m in sent[:2]))
        report = letters.replay([TABLE], chosen, audit_log=audit_log, rate=100)
        assert sorted(report.done) == sorted(str(m) for m in sent[:2]) and not report.kept
        assert report.audit is not None and report.audit["command"] == "dead-letters replay"
        assert report.audit["counts"] == {TABLE: 2}
        effects = "SELECT count(*) FROM effects"
        wait_until(lambda: scalar(db_url, effects) == 2, what="the two replayed rows handled")
        assert letters.count([TABLE]) == {TABLE: 2}

        # The queue side: replay one by id (it is stored and handled), purge the other.
        replayed = letters.replay([QUEUE], Filters(message_ids=(queued[0],)), audit_log=audit_log)
        assert replayed.done == [queued[0]]
        wait_until(lambda: scalar(db_url, effects) == 3, what="the replayed queue letter")
        dry = letters.purge([QUEUE], Filters(), dry_run=True, audit_log=audit_log)
        assert [d.message_id for d in dry.selected] == [queued[1]] and not dry.done
        purged = letters.purge([QUEUE], Filters(reason="store_failed"), audit_log=audit_log)
        assert purged.done == [queued[1]]
        wait_until(lambda: letters.count([QUEUE]) == {QUEUE: 0}, what="an empty dead-letter queue")

        records = [json.loads(line) for line in audit_log.read_text().splitlines()]
        assert [(r["command"], r["source"], r["count"], r["dry_run"]) for r in records] == [
            ("dead-letters replay", TABLE, 2, False),
            ("dead-letters replay", QUEUE, 1, False),
            ("dead-letters purge", QUEUE, 1, True),
            ("dead-letters purge", QUEUE, 1, False),
        ]
        assert records[3]["message_ids"] == [queued[1]]
    finally:
        svc.stop()
        svc.close()


def test_on_the_memory_broker_health_counts_a_queued_dead_letter_and_replay_gets_it_handled(
    db_url: str, tmp_path: Path
) -> None:
    """The operator port on the in-memory broker: a command over max_message_bytes is
    dead-lettered by the receiver; `health` shows it in billing.dead_letter, `DeadLetters.of`
    lists it from the queue source; with the limit raised a replay gets it handled."""
    broker = MemoryBroker()
    small = make_service("billing", db_url, None, broker=broker, max_message_bytes=300)
    small.start()
    try:
        with small.session() as session, session.begin():
            sent = str(small.outbox.send(session, "billing", "invoice.create", {"x": "y" * 400}))
        dead_letter = "billing.dead_letter"
        wait_until(lambda: broker.queue_depth(dead_letter) == 1, what="a queued dead letter")
        health = small.health(max_dead=0)
        assert health.broker is not None and health.broker["error"] is None
        assert health.broker["queues"][dead_letter] == {"messages": 1, "consumers": 0}
        assert health.broker["queues"]["billing.inbox"] == {"messages": 0, "consumers": 1}
        assert health.problems == ("1 dead letter exceeds --max-dead 0",)
        with DeadLetters.of(small).select([QUEUE], Filters()) as [selection]:
            assert [letter.message_id for letter in selection.letters] == [sent]
    finally:
        small.stop()
        small.close()
    svc = make_service("billing", db_url, None, broker=broker)

    @svc.on_command("invoice.create")
    def create(message: Message, session: Session) -> None:
        session.execute(
            text("INSERT INTO effects (message_id, type) VALUES (:m, :t)"),
            {"m": str(message.message_id), "t": message.type},
        )

    svc.start()
    try:
        letters = DeadLetters.of(svc)
        assert letters.replay([QUEUE], Filters(), audit_log=tmp_path / "a.log").done == [sent]
        wait_until(lambda: scalar(db_url, "SELECT message_id FROM effects") == sent)
        assert letters.count([QUEUE]) == {QUEUE: 0} and svc.health().healthy
    finally:
        svc.stop()
        svc.close()


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_library_writes_the_audit_record_where_the_cli_does_when_not_told_where(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No `audit_log=`: a replay or purge from a service's own code is recorded in the CLI's
    file, $OUTBOX_INBOX_AUDIT_LOG else outbox-inbox-audit.log in the current directory, dry
    runs too. The log gets one short line per record (the dry run's below WARNING), no ids."""
    svc = make_service("billing", db_url, None)
    try:
        ids = [str(uuid.uuid4()) for _ in range(3)]
        dead = {"kind": "command", "routing_key": INVOICE, "payload": {}, "headers": {}}
        dead |= {"status": "dead", "dead_reason": "rejected"}
        with svc.engine.begin() as conn:
            conn.execute(svc.tables.inbox.insert(), [{**dead, "message_id": m} for m in ids])
        letters = DeadLetters.of(svc)
        monkeypatch.delenv(AUDIT_LOG_ENV, raising=False)
        monkeypatch.chdir(tmp_path)
        with caplog.at_level(logging.INFO, logger="outbox_inbox.audit"):
            letters.replay([TABLE], Filters(), dry_run=True)
            report = letters.replay([TABLE], Filters(message_ids=(ids[0],)))

        default = tmp_path / "outbox-inbox-audit.log"
        records = _records(default)
        assert [(r["command"], r["count"], r["dry_run"]) for r in records] == [
            ("dead-letters replay", 3, True),
            ("dead-letters replay", 1, False),
        ]
        assert records[1]["message_ids"] == [ids[0]] and records[1]["service"] == "billing"
        assert report.audit is not None and report.audit["time"] == records[1]["time"]
        assert inbox_message_ids(db_url, "pending") == [ids[0]]

        logged = [r for r in caplog.records if r.name == "outbox_inbox.audit"]
        assert [r.levelno for r in logged] == [logging.INFO, logging.WARNING]
        line = logged[1].getMessage()
        assert "dead-letters replay: 1 dead letter of billing (table 1)" in line
        assert line.endswith(f"recorded in {default}") and ids[0] not in line
        assert "dry run" in logged[0].getMessage()

        elsewhere = tmp_path / "ops" / "audit.jsonl"
        monkeypatch.setenv(AUDIT_LOG_ENV, str(elsewhere))
        letters.purge([TABLE], Filters(message_ids=(ids[1],)))
        (purged,) = _records(elsewhere)
        assert (purged["command"], purged["message_ids"]) == ("dead-letters purge", [ids[1]])
        assert len(_records(default)) == 2
    finally:
        svc.close()


def test_a_source_that_cannot_be_reached_is_named_with_why(db_url: str) -> None:
    letters = DeadLetters(engine=None, tables=None, broker=None, service=None)
    chosen, missing = letters.reachable()
    assert chosen == []
    assert dict(missing) == {
        "table": "no database",
        "outbox": "no database",
        "queue": "no RabbitMQ broker",
        "unroutable": "no RabbitMQ broker",
    }


def test_a_replay_that_fails_half_way_records_the_rows_it_replayed_before_the_failure(
    db_url: str, tmp_path: Path
) -> None:
    """50 dead rows replayed 10 a transaction (rate 100/s); a trigger refuses the 25th, so the
    third batch fails. The two batches before it were committed: the audit record names
    exactly their 20 message ids with the error, the database agrees, the rest stay dead."""
    svc = make_service("billing", db_url, None)
    try:
        ids = dead_rows_one_refused(svc, 50, refused=25)
        audit_log = tmp_path / "audit.log"
        letters = DeadLetters.of(svc)
        with pytest.raises(StorageError, match="this row is refused"):
            letters.replay([TABLE], Filters(), audit_log=audit_log, rate=100)

        (record,) = [json.loads(line) for line in audit_log.read_text().splitlines()]
        assert record["count"] == 20 and record["counts"] == {TABLE: 20}
        assert record["message_ids"] == ids[:20]
        assert "this row is refused" in record["error"]
        assert inbox_message_ids(db_url, "pending") == ids[:20]
        assert letters.count([TABLE]) == {TABLE: 30}
    finally:
        svc.close()


def test_a_dashboard_replay_that_fails_half_way_shows_and_records_what_it_did(
    db_url: str,
) -> None:
    """The dashboard's action on 150 rows (100 a transaction); the 125th is refused: the
    result and the audit line both carry the first 100 as done, and the error."""
    svc = make_service("billing", db_url, None)
    try:
        ids = dead_rows_one_refused(svc, 150, refused=125)
        lines: list[dict[str, Any]] = []
        watched = WatchedService("billing", svc.engine, svc.tables)
        result = act(
            watched, "replay", TABLE, ids, audit=lambda **line: lines.append(line), client="t"
        )
        assert result.error is not None and "this row is refused" in result.error
        assert result.done == ids[:100]
        (line,) = lines
        assert line["message_ids"] == ids[:100] and line["counts"] == {TABLE: 100}
        assert line["error"] == result.error
        assert inbox_message_ids(db_url, "pending") == ids[:100]
    finally:
        svc.close()
