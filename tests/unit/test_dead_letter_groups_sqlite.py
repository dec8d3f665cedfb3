"""Dead-letter groups in the embedded mode: grouped, parked and replayed on SQLite, and
migration 0004 reverted with a parked row in the table."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from helpers import wait_until
from outbox_inbox import Message, Service
from outbox_inbox.brokers.memory import MemoryBroker
from outbox_inbox.dead_letters import OUTBOX, TABLE, DeadLetters, Filters
from outbox_inbox.migrate import alembic_config, downgrade, upgrade
from outbox_inbox.tables import build_tables


def test_groups_park_and_replay_on_sqlite_and_the_migration_reverts_parked_rows(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'groups.db'}"
    config = alembic_config(url)
    upgrade(config)
    engine = create_engine(url)
    tables = build_tables(None)
    now = text("CURRENT_TIMESTAMP")
    dead = {"kind": "command", "payload": {}, "headers": {}, "status": "dead"}
    with engine.begin() as conn:
        for n in range(5):
            conn.execute(
                tables.inbox.insert().values(
                    message_id=uuid.uuid4(),
                    routing_key=f"billing.t{n % 2}",
                    dead_reason="rejected",
                    fingerprint="fp1" if n < 3 else "fp2",
                    processed_at=now,
                    **dead,
                )
            )
        conn.execute(
            tables.outbox.insert().values(
                message_id=uuid.uuid4(),
                kind="event",
                exchange="events",
                routing_key="billing.done",
                payload={},
                headers={},
                dead_reason="refused",
                fingerprint="fp1",
                dead_at=now,
            )
        )
    letters = DeadLetters(engine=engine, tables=tables)
    audit = tmp_path / "audit.log"
    first, second = letters.groups()
    assert (first.fingerprint, first.count, first.sources) == ("fp1", 4, (OUTBOX, TABLE))
    assert first.types == ("billing.done", "billing.t0", "billing.t1")
    assert first.first_seen is not None and first.first_seen.tzinfo is not None
    assert (second.fingerprint, second.count) == ("fp2", 2)

    assert len(letters.park([TABLE, OUTBOX], Filters(fingerprint="fp1"), audit_log=audit).done) == 4
    assert [g.fingerprint for g in letters.groups()] == ["fp2"]
    assert [(g.fingerprint, g.count) for g in letters.groups(parked=True)] == [("fp1", 4)]
    back = letters.replay([OUTBOX], Filters(parked=True), audit_log=audit)
    assert len(back.done) == 1 and letters.groups(parked=True)[0].count == 3

    downgrade(config, "0003")
    with engine.connect() as conn:
        statuses = conn.execute(text("SELECT status, count(*) FROM inbox_messages GROUP BY 1"))
        assert dict(statuses.all()) == {"dead": 5}
    engine.dispose()


@dataclass
class Invoice:
    amount_cents: int


def test_an_invalid_payload_is_grouped_by_its_reason_and_a_replay_keeps_the_first_seen(
    tmp_path: Path,
) -> None:
    with MemoryBroker() as broker:
        billing = Service(
            "billing",
            db_url=f"sqlite:///{tmp_path / 'b.db'}",
            broker=broker,
            worker_poll_interval=0.02,
            relay_poll_interval=0.02,
        )
        billing.migrate()

        @billing.on_command("invoice.create")
        def create(message: Message, session: Any, payload: Invoice) -> None:
            raise AssertionError("an invalid payload never reaches the handler")

        letters = DeadLetters.of(billing)
        billing.start()
        try:
            with billing.session() as session, session.begin():
                billing.outbox.send(session, "billing", "invoice.create", {"amount": 1})
            [group] = wait_until(letters.groups, timeout=20)
            assert group.fingerprint == "invalid_payload"
            # The row died an hour ago, after arriving a minute before.
            with billing.engine.begin() as conn:
                conn.execute(
                    text(
                        "UPDATE inbox_messages SET received_at = datetime('now', '-61 minutes'),"
                        " processed_at = datetime('now', '-60 minutes')"
                    )
                )
            [before] = letters.groups()
            audit = tmp_path / "audit.log"
            assert (
                len(
                    letters.replay(
                        [TABLE], Filters(fingerprint=group.fingerprint), audit_log=audit
                    ).done
                )
                == 1
            )
            [after] = wait_until(lambda: [g for g in letters.groups() if g.replayed], timeout=20)
        finally:
            billing.stop()
        assert after.fingerprint == "invalid_payload" and after.count == 1
        assert after.first_seen is not None and before.first_seen is not None
        assert after.first_seen <= before.first_seen
        assert after.last_seen is not None and after.last_seen > before.last_seen
        billing.close()
