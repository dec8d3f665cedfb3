"""Dead-letter groups in the embedded mode: grouped, parked and replayed on SQLite, and
migration 0004 reverted with a parked row in the table."""

from __future__ import annotations

import uuid
from pathlib import Path

from sqlalchemy import create_engine, text

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
