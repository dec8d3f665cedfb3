"""The relay's marks of a batch whose publishes failed: each row's retry delayed by its own
attempts, one log line counting them by reason."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from sqlalchemy import select

from outbox_inbox import Service
from outbox_inbox.broker import PublishOutcome
from outbox_inbox.relay import _Marking


def test_failed_publishes_are_marked_per_attempt_and_logged_once_per_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    svc = Service("billing", db_url=f"sqlite:///{tmp_path / 'a.db'}")
    svc.migrate()
    with svc.session() as session, session.begin():
        for n in range(3):
            svc.outbox.publish(session, "invoice.created", {"n": n})
    outbox = svc.tables.outbox
    with svc.engine.begin() as conn:
        ids = list(conn.execute(select(outbox.c.id).order_by(outbox.c.id)).scalars())
        marking = _Marking(ids, ["event"] * 3, [0, 2, 0])  # the second tried twice before
        nacked = [PublishOutcome.NACKED] * 3
        with caplog.at_level(logging.WARNING, logger="outbox_inbox.relay"):
            assert svc.relay()._mark(conn, marking, nacked, {}) == []
        rows = conn.execute(select(outbox.c.id, outbox.c.attempts, outbox.c.available_at))
        found = {row.id: (row.attempts, row.available_at) for row in rows}
    assert [found[i][0] for i in ids] == [1, 1, 1]
    first, second, third = (found[i][1] for i in ids)
    assert first == third < second  # the retry's delay grows with the attempts before
    assert [r.getMessage() for r in caplog.records if r.name == "outbox_inbox.relay"] == [
        "relay: 3 of 3 messages not confirmed, kept for retry (3 publish nacked)"
    ]
    svc.close()
