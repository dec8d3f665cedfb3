"""`queries.roles.insert_inbox` on PostgreSQL and SQLite: every value is stored as decoded, once.

On PostgreSQL a batch goes in as one array per column (``unnest``); on SQLite as rows. Both
must store the same values, skip a message_id stored before or twice in the batch, and return
only the new ids: the receiver's exactly-once storage and its duplicate counts rest on that.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from helpers import received_row
from outbox_inbox import MemoryBroker, Service
from outbox_inbox.queries.roles import insert_inbox


def _row(**values: Any) -> dict[str, Any]:
    return received_row(**{"source": None, **values})


ROWS = [
    _row(),  # every optional column NULL
    _row(
        source="orders",
        kind="event",
        routing_key="orders.order.placed",
        payload={"text": "zürich ✓ \U0001f680", "nested": [1, 2.5, None, {"a": True}]},
        headers={"x-trace": "abc", "n": 3},
        version=2,
        correlation_id="c-1",
        causation_id="m-0",
        key="order-7",
        priority=9,
        created_at=datetime(2026, 11, 23, 12, 0, tzinfo=UTC),
        expires_at=datetime(2026, 11, 24, 12, 0, tzinfo=UTC) + timedelta(microseconds=7),
    ),
    _row(payload=None),  # JSON null, not SQL NULL
    _row(payload="just a string"),
    _row(payload=[]),
    _row(payload="x" * 200_000),
]


@pytest.fixture(params=["postgresql", "sqlite"])
def service(request: pytest.FixtureRequest, tmp_path: Path) -> Service:
    if request.param == "postgresql":
        db_url_factory: Callable[[], str] = request.getfixturevalue("db_url_factory")
        url = db_url_factory()
    else:
        url = f"sqlite:///{tmp_path / 'inbox.db'}"
    service = Service("billing", db_url=url, broker=MemoryBroker())
    service.migrate()
    return service


def _stored(service: Service) -> dict[uuid.UUID, dict[str, Any]]:
    inbox = service.tables.inbox
    columns = [inbox.c[name] for name in ROWS[0]]
    with service.engine.connect() as conn:
        found = conn.execute(select(*columns)).mappings().all()
    return {row["message_id"]: dict(row) for row in found}


def test_every_value_is_stored_as_decoded(service: Service) -> None:
    with service.engine.begin() as conn:
        new = insert_inbox(conn, service.tables, ROWS)
    assert new == {row["message_id"] for row in ROWS}
    stored = _stored(service)
    for row in ROWS:
        got = stored[row["message_id"]]
        for name in ("created_at", "expires_at"):  # SQLite gives naive UTC back
            if got[name] is not None and got[name].tzinfo is None:
                got[name] = got[name].replace(tzinfo=UTC)
        assert got == row


def test_a_message_stored_before_or_twice_in_a_batch_is_stored_once(service: Service) -> None:
    first, second = _row(payload={"n": 1}), _row(payload={"n": 2})
    with service.engine.begin() as conn:
        assert insert_inbox(conn, service.tables, [first]) == {first["message_id"]}
    again = dict(first, payload={"n": "changed"})
    twice = dict(second, payload={"n": "twice"})
    with service.engine.begin() as conn:
        new = insert_inbox(conn, service.tables, [again, second, twice])
    assert new == {second["message_id"]}
    stored = _stored(service)
    assert len(stored) == 2
    assert stored[first["message_id"]]["payload"] == {"n": 1}  # the first copy stays
    assert stored[second["message_id"]]["payload"] == {"n": 2}
