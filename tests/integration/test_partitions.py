"""Time partitions on a real PostgreSQL: duplicates across partitions, retention, maintenance.

Most tests first rebuild the (empty) partitions of a freshly migrated database from a day in
the past (`_partitions_since`): the migration's legacy partition holds every time before the
next midnight, so without that no row could sit in a partition that retention may drop.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, func, insert, select, text
from sqlalchemy.exc import OperationalError

from helpers import received_row
from history import REPO_ROOT, archived
from outbox_inbox import MemoryBroker, Message, Service
from outbox_inbox.archive import Archiver, partition_exporter
from outbox_inbox.config import Settings, duplicate_horizon
from outbox_inbox.errors import ConfigurationError
from outbox_inbox.partitions import (
    KEYS,
    MaintenanceResult,
    Partition,
    Retention,
    maintain,
    make_ahead,
    partition_name,
    partitions,
)
from outbox_inbox.queries import operations, roles
from outbox_inbox.queries.roles import insert_inbox
from outbox_inbox.status import collect_status
from outbox_inbox.tables import DEAD, PARKED, PENDING, PROCESSED, Tables
from outbox_inbox.testing import ServiceHarness

DAY = timedelta(days=1)
#: The retention most tests maintain with: partitions ended more than 2 days ago are old.
RETENTION = Retention(finished=2 * DAY, dead=5 * DAY)


@pytest.fixture
def billing(db_url: str) -> Iterator[Service]:
    """Service `billing` on a fresh migrated database and a broker of its own."""
    service = Service("billing", db_url=db_url, broker=MemoryBroker())
    service.migrate()
    yield service
    service.close()


# --- helpers -----------------------------------------------------------------------------


def _db_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        now: datetime = operations.database_now(conn)
    return now


def _q(conn: Connection, name: str) -> str:
    # Names read from the catalogue or made by the library: quoted by the dialect.
    return str(conn.dialect.identifier_preparer.quote(name))


def _partitions_since(engine: Engine, tables: Tables, since: datetime) -> None:
    """Drop every partition of both tables (they must be empty) and make daily ones again
    from the day of `since` to a week past now: what a database whose partitions were made
    since then holds."""
    with engine.connect() as conn:
        for parent in KEYS:
            for p in partitions(conn, tables.schema, parent):
                conn.execute(text(f"DROP TABLE {_q(conn, tables.schema)}.{_q(conn, p.name)}"))
        conn.commit()
        make_ahead(conn, tables, "day", since)
        make_ahead(conn, tables, "day", operations.database_now(conn))


def _names(engine: Engine, tables: Tables, parent: str) -> list[str]:
    with engine.connect() as conn:
        return [p.name for p in partitions(conn, tables.schema, parent)]


def _day(parent: str, moment: datetime) -> str:
    return partition_name(parent, moment, "day")


def _midday(moment: datetime) -> datetime:
    """Noon of `moment`'s UTC day: an hour either side is still in that day's partition, at
    whatever hour the test runs."""
    return moment.astimezone(UTC).replace(hour=12, minute=0, second=0, microsecond=0)


def _inbox(engine: Engine, tables: Tables, received_at: datetime, **values: Any) -> uuid.UUID:
    """Insert one inbox row received at `received_at` (processed unless `status` says)."""
    message_id = uuid.uuid4()
    status = values.pop("status", PROCESSED)
    row = {
        "message_id": message_id,
        "source": "orders",
        "kind": "command",
        "routing_key": "billing.invoice.create",
        "payload": {"n": 1},
        "headers": {},
        "received_at": received_at,
        "status": status,
        "processed_at": None if status == PENDING else received_at + timedelta(seconds=1),
        **values,
    }
    with engine.begin() as conn:
        conn.execute(insert(tables.inbox), [row])
    return message_id


def _outbox(engine: Engine, tables: Tables, created_at: datetime, **values: Any) -> uuid.UUID:
    """Insert one outbox row created at `created_at` (unsent unless `values` say)."""
    message_id = uuid.uuid4()
    row = {
        "message_id": message_id,
        "kind": "event",
        "exchange": "events",
        "routing_key": "orders.order.placed",
        "payload": {"n": 1},
        "headers": {},
        "created_at": created_at,
        "available_at": created_at,
        **values,
    }
    with engine.begin() as conn:
        conn.execute(insert(tables.outbox), [row])
    return message_id


def _received(message_id: uuid.UUID, **values: Any) -> dict[str, Any]:
    """An inbox row as the receiver hands it to `insert_inbox`."""
    return received_row(message_id=message_id, **{"payload": {"copy": 2}, **values})


def _where(engine: Engine, tables: Tables, parent: str, message_id: uuid.UUID) -> list[str]:
    """The partitions holding rows of `message_id` in `parent`, one name per row."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    f"SELECT c.relname FROM {_q(conn, tables.schema)}.{parent} t "
                    "JOIN pg_class c ON c.oid = t.tableoid WHERE t.message_id = :m"
                ),
                {"m": message_id},
            ).scalars()
        )


def _duplicates_counted(engine: Engine, tables: Tables, message_id: uuid.UUID) -> int:
    d = tables.deliveries
    with engine.connect() as conn:
        found = conn.execute(select(d.c.duplicates).where(d.c.message_id == message_id))
        return int(found.scalar() or 0)


def _one_partition_per_time(found: list[Partition]) -> bool:
    """No two partitions of `found` (oldest first) overlap, and none is listed twice."""
    names = [p.name for p in found]
    ordered = all(a.upper <= b.lower for a, b in itertools.pairwise(found))  # type: ignore[operator]
    return len(names) == len(set(names)) and ordered


# --- 1. duplicates across partitions --------------------------------------------------------


def test_a_copy_arriving_days_after_the_first_one_is_a_duplicate_across_partitions(
    billing: Service,
) -> None:
    engine, tables = billing.engine, billing.tables
    now = _db_now(engine)
    _partitions_since(engine, tables, now - 20 * DAY)
    first = _inbox(engine, tables, now - 3 * DAY, payload={"copy": 1})
    assert _where(engine, tables, "inbox_messages", first) == [
        _day("inbox_messages", now - 3 * DAY)
    ]

    # The receiver's insert, a new copy received now (today's partition): not inserted.
    with engine.begin() as conn:
        assert insert_inbox(conn, tables, [_received(first)]) == set()
    with ServiceHarness(billing, migrate=False) as harness:
        # Through the broker and the receiver: dropped, and counted as a duplicate.
        harness.deliver("billing.invoice.create", {"copy": 3}, message_id=first)
        assert _duplicates_counted(engine, tables, first) == 1

        # Maintenance drops the older partitions, within the window: the first copy's stays.
        done = maintain(engine, tables, interval="day", retention=Retention(4 * DAY, 30 * DAY))
        older = {_day("inbox_messages", now - n * DAY) for n in range(5, 21)}
        assert older <= set(done.dropped)
        assert _day("inbox_messages", now - 3 * DAY) not in done.dropped

        harness.deliver("billing.invoice.create", {"copy": 4}, message_id=first)
        assert _duplicates_counted(engine, tables, first) == 2
        [row] = harness.inbox_rows()
        assert row.payload == {"copy": 1}  # the first copy, and no other
    assert _where(engine, tables, "inbox_messages", first) == [
        _day("inbox_messages", now - 3 * DAY)
    ]


# --- 2. concurrent receivers across a partition boundary -----------------------------------


def _boundary_in_two_seconds(engine: Engine, tables: Tables) -> datetime:
    """Replace the inbox's partitions by two: one ending 2 to 3 s from now, one starting there.
    Returns the boundary (database clock)."""
    with engine.connect() as conn:
        s = _q(conn, tables.schema)
        for p in partitions(conn, tables.schema, "inbox_messages"):
            conn.execute(text(f"DROP TABLE {s}.{_q(conn, p.name)}"))
        now: datetime = operations.database_now(conn)
        boundary = now.replace(microsecond=0) + timedelta(seconds=3)
        bounds = [(now - DAY, boundary), (boundary, now + DAY)]
        for n, (lower, upper) in enumerate(bounds):
            name = f"inbox_messages_boundary{n}"
            conn.execute(
                text(
                    f"CREATE TABLE {s}.{name} (LIKE {s}.inbox_messages "
                    "INCLUDING DEFAULTS INCLUDING CONSTRAINTS);"
                    f"CREATE UNIQUE INDEX {name}_message_id ON {s}.{name} (message_id);"
                    f"ALTER TABLE {s}.inbox_messages ATTACH PARTITION {s}.{name} "
                    f"FOR VALUES FROM ('{lower.isoformat()}') TO ('{upper.isoformat()}')"
                )
            )
        conn.commit()
    return boundary


def test_two_receivers_storing_one_message_on_both_sides_of_a_partition_boundary_store_it_once(
    billing: Service,
) -> None:
    engine, tables = billing.engine, billing.tables
    boundary = _boundary_in_two_seconds(engine, tables)
    message_id = uuid.uuid4()
    with engine.connect() as a, engine.connect() as b:
        # A's transaction starts before the boundary: its row goes to the first partition.
        assert a.execute(select(func.now())).scalar_one() < boundary
        assert insert_inbox(a, tables, [_received(message_id, payload={"copy": 1})]) == {message_id}
        while _db_now(engine) <= boundary:
            time.sleep(0.05)
        # B's starts after it: its now() and its row fall in the second partition.
        assert b.execute(select(func.now())).scalar_one() >= boundary
        b_pid = b.execute(select(func.pg_backend_pid())).scalar_one()
        stored: list[set[uuid.UUID]] = []
        errors: list[BaseException] = []

        def receive_b() -> None:
            try:
                stored.append(insert_inbox(b, tables, [_received(message_id)]))
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)

        thread = threading.Thread(target=receive_b)
        thread.start()

        def b_waits_for_a_lock() -> bool:
            with engine.connect() as conn:
                return bool(
                    conn.execute(
                        text(
                            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = :pid "
                            "AND locktype = 'advisory' AND NOT granted)"
                        ),
                        {"pid": b_pid},
                    ).scalar_one()
                )

        deadline = time.monotonic() + 5
        while thread.is_alive() and not b_waits_for_a_lock() and time.monotonic() < deadline:
            time.sleep(0.05)
        waited = thread.is_alive() and b_waits_for_a_lock()
        a.commit()
        thread.join(10)
        assert not errors, errors
        b.commit()
    assert stored == [set()]  # B inserted nothing
    assert _where(engine, tables, "inbox_messages", message_id) == ["inbox_messages_boundary0"]
    assert waited, "B did not wait for A's commit"


# --- 3. retention keeps what is unfinished -------------------------------------------------


def test_retention_keeps_partitions_with_unfinished_or_recently_dead_rows_and_drops_the_rest(
    billing: Service,
) -> None:
    engine, tables = billing.engine, billing.tables
    now = _db_now(engine)
    _partitions_since(engine, tables, now - 20 * DAY)

    def ago(days: int) -> datetime:
        return _midday(now - days * DAY)

    recently = now - DAY  # younger than the dead retention (5 days)
    kept_rows = {
        ("inbox_messages", 15): _inbox(engine, tables, ago(15), status=PENDING),
        ("inbox_messages", 14): _inbox(
            engine,
            tables,
            ago(14),
            status=PENDING,
            attempts=1,
            locked_by="worker-1",
            locked_until=now + timedelta(minutes=5),
        ),
        ("inbox_messages", 13): _inbox(
            engine, tables, ago(13), status=DEAD, processed_at=recently, dead_reason="rejected"
        ),
        ("inbox_messages", 12): _inbox(
            engine, tables, ago(12), status=PARKED, processed_at=recently, dead_reason="rejected"
        ),
        ("outbox_messages", 15): _outbox(engine, tables, ago(15)),
        ("outbox_messages", 14): _outbox(
            engine, tables, ago(14), dead_at=recently, dead_reason="refused"
        ),
    }
    # A finished row next to each unfinished one does not make its partition droppable.
    for parent, days in kept_rows:
        if parent == "inbox_messages":
            _inbox(engine, tables, ago(days) + timedelta(hours=1))
        else:
            _outbox(engine, tables, ago(days) + timedelta(hours=1), published_at=ago(days))
    dropped_rows = {
        ("inbox_messages", 11): _inbox(engine, tables, ago(11)),
        # Dead longer than the dead retention: no longer keeps its partition.
        ("inbox_messages", 10): _inbox(
            engine, tables, ago(10), status=DEAD, processed_at=ago(10), dead_reason="rejected"
        ),
        ("outbox_messages", 13): _outbox(engine, tables, ago(13), published_at=ago(13)),
        ("outbox_messages", 12): _outbox(
            engine, tables, ago(12), dead_at=ago(12), dead_reason="refused"
        ),
    }
    with engine.connect() as conn:
        old = {
            p.name
            for parent in KEYS
            for p in partitions(conn, tables.schema, parent)
            if p.upper is not None and p.upper <= now - 2 * DAY
        }

    done = maintain(engine, tables, interval="day", retention=RETENTION)

    kept = {_day(parent, ago(days)) for parent, days in kept_rows}
    assert set(done.kept) == kept
    assert set(done.dropped) == old - kept
    assert {_day(parent, ago(days)) for parent, days in dropped_rows} <= set(done.dropped)
    for (parent, days), message_id in kept_rows.items():
        assert _where(engine, tables, parent, message_id) == [_day(parent, ago(days))]
    for (parent, _days), message_id in dropped_rows.items():
        assert _where(engine, tables, parent, message_id) == []
    assert set(_names(engine, tables, "inbox_messages")).isdisjoint(done.dropped)


# --- 4. two passes at once ------------------------------------------------------------------


def test_two_maintenance_passes_at_once_make_each_partition_once_and_drop_nothing_kept(
    billing: Service,
) -> None:
    engine, tables = billing.engine, billing.tables
    now = _db_now(engine)
    # Partitions from 20 days ago to 13 days ago only: a pass has 20 days to make per table.
    with engine.connect() as conn:
        for parent in KEYS:
            for p in partitions(conn, tables.schema, parent):
                conn.execute(text(f"DROP TABLE {_q(conn, tables.schema)}.{_q(conn, p.name)}"))
        conn.commit()
        make_ahead(conn, tables, "day", now - 20 * DAY)
    pending = _inbox(engine, tables, now - 15 * DAY, status=PENDING)
    unsent = _outbox(engine, tables, now - 15 * DAY)
    finished = _inbox(engine, tables, now - 14 * DAY)

    start = threading.Barrier(2)
    results: list[MaintenanceResult] = []
    errors: list[BaseException] = []

    def one_pass() -> None:
        start.wait()
        try:
            results.append(maintain(engine, tables, interval="day", retention=RETENTION))
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=one_pass) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert len(results) == 2
    created = [name for r in results for name in r.created]
    dropped = [name for r in results for name in r.dropped]
    assert len(created) == len(set(created)) > 0
    assert len(dropped) == len(set(dropped)) > 0
    assert [r.busy for r in results].count(False) >= 1
    for parent in KEYS:
        with engine.connect() as conn:
            found = partitions(conn, tables.schema, parent)
        assert _one_partition_per_time(found), [p.name for p in found]
        # From 13 days ago, where the partitions ended, to a week ahead: no day missing.
        recent = [p for p in found if p.upper is not None and p.upper > now - 13 * DAY]
        assert all(a.upper == b.lower for a, b in itertools.pairwise(recent))
        assert recent[-1].upper is not None and recent[-1].upper > now + 6 * DAY
    assert _where(engine, tables, "inbox_messages", pending) == [
        _day("inbox_messages", now - 15 * DAY)
    ]
    assert _where(engine, tables, "outbox_messages", unsent) == [
        _day("outbox_messages", now - 15 * DAY)
    ]
    assert _where(engine, tables, "inbox_messages", finished) == []


# --- 5. a pass that died after DETACH -------------------------------------------------------


def test_a_partition_left_detached_with_finished_rows_is_exported_and_dropped_by_the_next_pass(
    billing: Service, tmp_path: Path
) -> None:
    engine, tables = billing.engine, billing.tables
    now = _db_now(engine)
    _partitions_since(engine, tables, now - 20 * DAY)
    ids = [_inbox(engine, tables, now - 15 * DAY) for _ in range(3)]
    name = _day("inbox_messages", now - 15 * DAY)
    with engine.connect() as conn:
        s = _q(conn, tables.schema)
        conn.execute(text(f"ALTER TABLE {s}.inbox_messages DETACH PARTITION {s}.{name}"))
        conn.commit()

    done = maintain(
        engine,
        tables,
        interval="day",
        retention=RETENTION,
        exporter=partition_exporter(tables, "billing", tmp_path),
    )

    assert name in done.dropped
    assert done.exported["inbox"] == 3
    assert sorted(r["message_id"] for r in archived(tmp_path, "inbox")) == sorted(map(str, ids))
    with engine.connect() as conn:
        assert conn.execute(select(func.to_regclass(f"{tables.schema}.{name}"))).scalar() is None


@pytest.mark.parametrize("how", ["", "CONCURRENTLY"])
def test_a_partition_left_detached_with_a_pending_row_is_attached_again_and_the_row_claimable(
    billing: Service, how: str
) -> None:
    engine, tables = billing.engine, billing.tables
    now = _db_now(engine)
    _partitions_since(engine, tables, now - 20 * DAY)
    pending = _inbox(engine, tables, now - 15 * DAY, status=PENDING)
    name = _day("inbox_messages", now - 15 * DAY)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        s = _q(conn, tables.schema)
        conn.execute(text(f"ALTER TABLE {s}.inbox_messages DETACH PARTITION {s}.{name} {how}"))
    assert name not in _names(engine, tables, "inbox_messages")

    done = maintain(engine, tables, interval="day", retention=RETENTION)

    assert name in done.kept and name not in done.dropped
    with engine.connect() as conn:
        [p] = [p for p in partitions(conn, tables.schema, "inbox_messages") if p.name == name]
    assert (p.lower, p.upper) == (
        (now - 15 * DAY).replace(hour=0, minute=0, second=0, microsecond=0),
        (now - 14 * DAY).replace(hour=0, minute=0, second=0, microsecond=0),
    )
    with engine.begin() as conn:
        claimed = roles.claim_inbox(conn, tables, "worker-1", 10, timedelta(seconds=30))
    assert [r["message_id"] for r in claimed] == [pending]


def test_a_detach_interrupted_half_way_is_finalised_by_the_next_pass(billing: Service) -> None:
    engine, tables = billing.engine, billing.tables
    now = _db_now(engine)
    _partitions_since(engine, tables, now - 20 * DAY)
    finished = _inbox(engine, tables, now - 15 * DAY)
    name = _day("inbox_messages", now - 15 * DAY)
    with engine.connect() as reader, engine.connect() as detacher:
        # A reader's open transaction makes DETACH CONCURRENTLY wait in its second step; the
        # statement timeout interrupts it there, leaving the partition "detach pending".
        reader.execute(select(func.count()).select_from(tables.inbox)).scalar_one()
        detacher = detacher.execution_options(isolation_level="AUTOCOMMIT")
        detacher.execute(text("SET statement_timeout = '1s'"))
        s = _q(detacher, tables.schema)
        with pytest.raises(OperationalError, match="statement timeout"):
            detacher.execute(
                text(f"ALTER TABLE {s}.inbox_messages DETACH PARTITION {s}.{name} CONCURRENTLY")
            )
        detacher.execute(text("RESET statement_timeout"))  # the connection goes back to the pool
        reader.rollback()
    with engine.connect() as conn:
        [p] = [p for p in partitions(conn, tables.schema, "inbox_messages") if p.name == name]
    assert p.detach_pending

    # In a thread: a FINALIZE waiting for a snapshot that never goes would hang the test.
    results: list[MaintenanceResult] = []
    thread = threading.Thread(
        target=lambda: results.append(
            maintain(engine, tables, interval="day", retention=RETENTION)
        ),
        daemon=True,
    )
    thread.start()
    thread.join(30)
    assert results, "the pass did not end within 30 s"
    [done] = results

    assert name in done.dropped
    assert _where(engine, tables, "inbox_messages", finished) == []


# --- 6. retention with archive_to -----------------------------------------------------------


def test_a_service_with_archive_to_exports_each_partition_to_parquet_before_dropping_it(
    db_url: str, tmp_path: Path
) -> None:
    service = Service(
        "billing",
        db_url=db_url,
        broker=MemoryBroker(),
        retention=2 * 86400,
        dead_retention=5 * 86400,
        archive_to=str(tmp_path),
    )
    service.migrate()
    engine, tables = service.engine, service.tables
    try:
        now = _db_now(engine)
        _partitions_since(engine, tables, now - 20 * DAY)
        inbox = [_inbox(engine, tables, now - n * DAY) for n in (15, 15, 10)]
        outbox = [_outbox(engine, tables, now - 12 * DAY, published_at=now - 12 * DAY)]
        recent = _inbox(engine, tables, now - timedelta(hours=1))

        done = service.maintain()

        assert done.exported == {"inbox": 3, "outbox": 1}
        assert sorted(r["message_id"] for r in archived(tmp_path, "inbox")) == sorted(
            map(str, inbox)
        )
        assert [r["message_id"] for r in archived(tmp_path, "outbox")] == list(map(str, outbox))
        assert {r["date"] for r in archived(tmp_path, "inbox")} == {
            (now - n * DAY).date().isoformat() for n in (15, 10)
        }
        assert _where(engine, tables, "inbox_messages", inbox[0]) == []
        assert len(_where(engine, tables, "inbox_messages", recent)) == 1
    finally:
        service.close()


def test_the_archiver_exports_and_drops_whole_partitions_past_older_than(
    billing: Service, tmp_path: Path
) -> None:
    engine, tables = billing.engine, billing.tables
    now = _db_now(engine)
    _partitions_since(engine, tables, now - 20 * DAY)
    old = [_inbox(engine, tables, _midday(now - 15 * DAY)) for _ in range(4)]
    pending = _inbox(engine, tables, _midday(now - 15 * DAY) + timedelta(hours=1), status=PENDING)
    other = [_inbox(engine, tables, now - 12 * DAY) for _ in range(2)]

    result = Archiver(engine, tables, "billing", tmp_path, older_than=7 * DAY).run()

    assert _day("inbox_messages", now - 12 * DAY) in result.partitions
    assert _day("inbox_messages", now - 15 * DAY) not in result.partitions  # the pending row
    # The kept partition's finished rows go row by row; the pending one stays.
    assert sorted(r["message_id"] for r in archived(tmp_path, "inbox")) == sorted(
        map(str, old + other)
    )
    assert len(_where(engine, tables, "inbox_messages", pending)) == 1


# --- 7. a duplicate window too short is refused ----------------------------------------------


def test_a_retention_shorter_than_the_duplicate_window_is_refused_with_the_numbers() -> None:
    horizon = sum(duplicate_horizon(Settings(retention=None)).values())
    assert horizon > 600
    with pytest.raises(ConfigurationError) as refused:
        Settings(retention=600)
    message = str(refused.value)
    assert "retention 10m is shorter" in message
    assert "1h 21m 51s" in message or str(round(horizon)) in message, message
    assert "receiver delay tiers" in message and "relay retries" in message
    Settings(retention=horizon)  # the window itself is enough


def test_outbox_inbox_run_refuses_to_start_with_a_too_short_retention(
    db_url: str, tmp_path: Path
) -> None:
    (tmp_path / "short_window.py").write_text(
        textwrap.dedent(
            f"""
            from outbox_inbox import Service

            app = Service("billing", db_url={db_url!r}, retention=600)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_INBOX_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    started = subprocess.run(
        [sys.executable, "-m", "outbox_inbox.cli.main", "run", "all", "--app", "short_window:app"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env=env,
        check=False,
    )
    assert started.returncode != 0
    assert "retention 10m is shorter than the inbox's duplicate window" in started.stderr
    assert "Traceback" not in started.stderr


# --- 8. the roles with rows over several partitions ------------------------------------------


def test_worker_relay_and_status_see_rows_over_several_partitions_in_priority_then_id_order(
    billing: Service,
) -> None:
    engine, tables = billing.engine, billing.tables
    now = _db_now(engine)
    _partitions_since(engine, tables, now - 20 * DAY)
    handled: list[uuid.UUID] = []

    @billing.on_command("invoice.create")
    def create(message: Message, session: object) -> None:
        handled.append(message.message_id)

    # Inserted newest first: the older partition's rows get the higher ids.
    rows = [
        (now, 5),
        (now, 0),
        (now - 3 * DAY, 5),
        (now - 3 * DAY, 9),
        (now - 3 * DAY, 0),
    ]
    ids = [_inbox(engine, tables, at, status=PENDING, priority=p) for at, p in rows]
    unsent = [_outbox(engine, tables, now - 3 * DAY), _outbox(engine, tables, now)]
    assert len({_where(engine, tables, "inbox_messages", m)[0] for m in ids}) == 2

    status = collect_status(engine, tables, service="billing", admin=None)
    assert status["inbox"]["pending"] == 5
    assert status["outbox"]["unpublished"] == 2
    assert status["outbox"]["oldest_age_seconds"] >= 3 * 86400 - 60

    with ServiceHarness(billing, migrate=False) as harness:
        assert harness.relay() == 2
        assert [m.sent for m in harness.published()] == [True, True]
        assert [m.message_id for m in harness.published()] == unsent
        harness.run_until_idle()
    # Priorities 9, 5, 5, 0, 0, and within a priority the lower id first, whatever partition.
    assert handled == [ids[3], ids[0], ids[2], ids[1], ids[4]]
    status = collect_status(engine, tables, service="billing", admin=None)
    assert status["inbox"]["pending"] == 0 and status["outbox"]["unpublished"] == 0
