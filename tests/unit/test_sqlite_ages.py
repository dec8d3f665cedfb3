"""Ages on SQLite, the embedded default: status, health, dead-letter filters and the metrics
gauges read the same age of a row written ten minutes ago (database clock)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path

from prometheus_client import CollectorRegistry
from sqlalchemy import text

from outbox_inbox import Service
from outbox_inbox.brokers.memory import MemoryBroker
from outbox_inbox.dead_letters import OUTBOX, TABLE, DeadLetters, Filters
from outbox_inbox.metrics import instrument

TEN_MINUTES_AGO = text("strftime('%Y-%m-%d %H:%M:%f000', 'now', '-600 seconds')")


def _about_ten_minutes(age: float | None) -> bool:
    # The row was written 600 s before the read; the read follows within the test's run.
    return age is not None and 600 <= age < 3600


def test_ages_on_sqlite_are_seconds_since_the_row_everywhere(tmp_path: Path) -> None:
    with MemoryBroker() as broker:
        service = Service("billing", db_url=f"sqlite:///{tmp_path / 'b.db'}", broker=broker)
        service.migrate()
        registry = CollectorRegistry()
        instrument(service, registry=registry)
        t = service.tables
        with service.engine.begin() as conn:
            conn.execute(
                t.outbox.insert().values(
                    message_id=uuid.uuid4(),
                    kind="command",
                    exchange="commands",
                    routing_key="billing.invoice.create",
                    payload={},
                    headers={},
                    created_at=TEN_MINUTES_AGO,
                )
            )
            for status in ("pending", "dead"):
                conn.execute(
                    t.inbox.insert().values(
                        message_id=uuid.uuid4(),
                        kind="command",
                        routing_key="billing.invoice.create",
                        payload={},
                        headers={},
                        status=status,
                        received_at=TEN_MINUTES_AGO,
                        processed_at=TEN_MINUTES_AGO if status == "dead" else None,
                        dead_reason="rejected" if status == "dead" else None,
                    )
                )

        health = service.health(max_lag=60)
        assert _about_ten_minutes(health.outbox["oldest_age_seconds"])
        assert _about_ten_minutes(health.inbox["oldest_pending_age_seconds"])
        assert _about_ten_minutes(health.inbox["last_handled_age_seconds"])
        assert not health.healthy
        assert any("older" in problem or "lag" in problem for problem in health.problems)

        for gauge in ("outbox_oldest_age_seconds", "inbox_oldest_pending_age_seconds"):
            value = registry.get_sample_value(f"outbox_inbox_{gauge}", {"service": "billing"})
            assert _about_ten_minutes(value), (gauge, value)

        letters = DeadLetters.of(service)
        assert letters.count([TABLE], Filters(older_than=timedelta(minutes=5))) == {TABLE: 1}
        assert letters.count([TABLE], Filters(older_than=timedelta(minutes=15))) == {TABLE: 0}
        with letters.select([TABLE, OUTBOX], Filters(older_than=timedelta(minutes=5))) as found:
            [dead] = found[0].letters
            assert _about_ten_minutes(dead.age_seconds)
            assert found[1].letters == []
        service.close()
