"""The worker's walk of one batch: each claimed row is mapped to its message once and its
handlers are looked up once, on the failure path (the batch rerun one message at a time, the
retry decision, the dead mark and its fault) as on the normal one. Counted, not timed."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from helpers import received_row
from outbox_inbox import Message, Reject, Service
from outbox_inbox import worker as worker_module
from outbox_inbox.handlers import Handlers
from outbox_inbox.queries import roles


@pytest.mark.parametrize("failure", [None, ValueError("boom"), Reject("never")])
def test_each_row_is_mapped_once_and_its_handlers_looked_up_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: Exception | None
) -> None:
    service = Service("billing", db_url=f"sqlite:///{tmp_path / 'b.db'}")
    service.migrate()

    @service.on_command("invoice.create")
    def handle(message: Message, session: Any) -> None:
        if failure is not None and message.payload["order"] == 2:
            raise failure

    rows = [received_row(payload={"order": n}) for n in range(4)]
    rows.append(received_row(routing_key="billing.invoice.void"))  # no handler: dead, a fault
    with service.engine.begin() as conn:
        roles.insert_inbox(conn, service.tables, rows)
    calls: Counter[str] = Counter()
    mapped, find = worker_module.message_from_row, Handlers.find

    def counted_mapping(row: Any) -> Message:
        calls[f"map {row['id']}"] += 1
        return mapped(row)

    def counted_find(self: Handlers, kind: str, key: str, version: int = 1) -> Any:
        calls[f"find {key}"] += 1
        return find(self, kind, key, version)

    monkeypatch.setattr(worker_module, "message_from_row", counted_mapping)
    monkeypatch.setattr(Handlers, "find", counted_find)
    worker = service.worker()
    conn = worker.connect()
    try:
        assert worker.work_once(conn) == 5
    finally:
        conn.close()
        service.close()
    assert worker.processed == (4 if failure is None else 3)
    assert sorted(n for k, n in calls.items() if k.startswith("map ")) == [1] * 5
    assert calls["find billing.invoice.create"] == 4
    assert calls["find billing.invoice.void"] == 1
