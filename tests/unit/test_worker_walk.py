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


def _count_claims(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of rows of each `roles.claim_inbox` from now on, in order."""
    claimed: list[int] = []
    claim = roles.claim_inbox

    def counted_claim(*args: Any, **kwargs: Any) -> Any:
        rows = claim(*args, **kwargs)
        claimed.append(len(rows))
        return rows

    monkeypatch.setattr(roles, "claim_inbox", counted_claim)
    return claimed


def test_slow_handlers_get_batches_of_about_batch_work_seconds_and_fast_ones_full_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message that arrives while a batch runs waits for that batch and for the next, which
    is claimed with the marks: the next claim is sized from the last batch's time per message
    (`BATCH_WORK`), never above ``worker_batch_size``. The handlers advance the worker's clock
    (10 ms a bulk item, nothing a fast one); claim sizes are counted."""
    import time

    clock = [0.0]

    class Clock:
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        def perf_counter(self) -> float:
            return clock[0]

    monkeypatch.setattr(worker_module, "time", Clock())
    monkeypatch.setattr(worker_module, "BATCH_WORK", 0.05)
    service = Service("billing", db_url=f"sqlite:///{tmp_path / 'b.db'}", worker_batch_size=20)
    service.migrate()
    cost = {"billing.bulk.item": 0.01, "billing.fast.item": 0.0}

    @service.on_command("bulk.item")
    @service.on_command("fast.item")
    def handle(message: Message, session: Any) -> None:
        clock[0] += cost[message.type]

    claimed = _count_claims(monkeypatch)
    worker = service.worker()
    conn = worker.connect()
    sizes = {}
    try:
        for key in cost:
            rows = [received_row(routing_key=key) for _ in range(60)]
            with service.engine.begin() as c:
                roles.insert_inbox(c, service.tables, rows)
            claimed.clear()
            while worker.work_once(conn):
                pass
            sizes[key] = list(claimed)
    finally:
        conn.close()
        service.close()
    assert worker.processed == 120
    # 20 first (no estimate yet), then 0.05 s / 0.01 s = 5 a batch; the last claims find none.
    assert sizes["billing.bulk.item"] == [20] + [5] * 8 + [0, 0]
    # A fast handler: whole batches again, once one batch has shown it.
    assert sizes["billing.fast.item"] == [5, 20, 20, 15, 0, 0]


@pytest.mark.parametrize(
    ("leading", "batch_size", "claims"),
    [
        (True, 20, [3, 0]),  # the lead claims the next batch with its marks, as always
        (False, 20, [3]),  # a helper whose claim was not full claims no next batch: it waits
        (False, 2, [2, 1]),  # a helper's full claim: more is waiting, it claims on
    ],
)
def test_a_helper_claims_on_with_its_marks_only_while_its_claims_come_full(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    leading: bool,
    batch_size: int,
    claims: list[int],
) -> None:
    """Under a backlog the lead wakes the helpers (NOTIFY on their channel); a helper then
    keeps claiming only while its claims come full, and leaves a trickle to the lead instead
    of splitting it into smaller batches. Claims counted."""
    from types import SimpleNamespace

    service = Service(
        "billing", db_url=f"sqlite:///{tmp_path / 'b.db'}", worker_batch_size=batch_size
    )
    service.migrate()
    service.on_command("invoice.create")(lambda message, session: None)
    with service.engine.begin() as conn:
        roles.insert_inbox(conn, service.tables, [received_row() for _ in range(3)])
    claimed = _count_claims(monkeypatch)
    worker = service.worker()
    worker._waker = SimpleNamespace(listening=True, leading=leading)  # type: ignore[assignment]
    conn = worker.connect()
    try:
        worker.work_once(conn)
    finally:
        conn.close()
        service.close()
    assert claimed == claims
