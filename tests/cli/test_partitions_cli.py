"""`outbox-inbox partitions list | maintain` on a real PostgreSQL (and on SQLite).

Partitions in the past are built as the partitions module allows: the fresh database's empty
partitions (the legacy one included) are dropped, and `make_ahead` is called with a `now` ten
days ago, so the days D-10 .. D-4 (D: today, UTC) have partitions of their own.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cli_support import Cli
from sqlalchemy import Engine, func, insert, make_url, select, text

from history import archived, seed_inbox, seed_outbox
from outbox_inbox import Service
from outbox_inbox.partitions import KEYS, floor_time, make_ahead, partition_name, partitions
from outbox_inbox.tables import Tables

pytestmark = pytest.mark.integration

TODAY = floor_time(datetime.now(UTC), "day")


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    """No broker: partitions need only the database (given with --db-url)."""
    return {"OUTBOX_INBOX_AUDIT_LOG": str(tmp_path / "audit.log")}


@pytest.fixture
def store(db_url: str) -> Iterator[tuple[Engine, Tables]]:
    """Service `orders`'s migrated tables, partitioned from ten days ago (see module doc)."""
    service = Service("orders", db_url=db_url)
    service.migrate()
    engine, tables = service.engine, service.tables
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        for parent in KEYS:
            for p in partitions(conn, tables.schema, parent):
                conn.execute(text(f"DROP TABLE {tables.schema}.{p.name}"))
        make_ahead(conn, tables, "day", TODAY - timedelta(days=10))
    yield engine, tables
    service.close()


def _age(days_ago: int) -> timedelta:
    """The age of a row that falls one hour into day D-`days_ago`."""
    return datetime.now(UTC) - (TODAY - timedelta(days=days_ago) + timedelta(hours=1))


def _name(parent: str, days_ago: int) -> str:
    return partition_name(parent, TODAY - timedelta(days=days_ago), "day")


def _names(engine: Engine, tables: Tables) -> list[str]:
    with engine.connect() as conn:
        return [p.name for parent in KEYS for p in partitions(conn, tables.schema, parent)]


def _count(engine: Engine, table: object) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())  # type: ignore[arg-type]


def _seed(engine: Engine, tables: Tables) -> dict[str, list[str]]:
    """D-9: finished rows; D-8: an unsent outbox row; D-10: a pending inbox row."""
    return {
        "published": [str(m) for m in seed_outbox(engine, tables, 3, age=_age(9))],
        "unsent": [
            str(m) for m in seed_outbox(engine, tables, 1, age=_age(8), state="unpublished")
        ],
        "processed": [str(m) for m in seed_inbox(engine, tables, 2, age=_age(9))],
        "pending": [str(m) for m in seed_inbox(engine, tables, 1, age=_age(10), status="pending")],
    }


def test_list_shows_partitions_oldest_first_with_range_rows_size_and_what_retention_keeps(
    cli: Cli, store: tuple[Engine, Tables], db_url: str
) -> None:
    engine, tables = store
    _seed(engine, tables)
    with engine.begin() as conn:
        conn.execute(text(f"ANALYZE {tables.schema}.outbox_messages"))
    before = _names(engine, tables)

    listed = cli("partitions", "list", "--db-url", db_url, "--retention", "7d", "--json")
    assert listed.returncode == 0, listed
    found = json.loads(listed.stdout)["partitions"]
    outbox = [p for p in found if p["table"] == "outbox_messages"]
    assert [p["name"] for p in outbox] == [_name("outbox_messages", d) for d in range(10, 3, -1)]
    first = outbox[0]
    assert first["from"] == (TODAY - timedelta(days=10)).isoformat()
    assert first["to"] == (TODAY - timedelta(days=9)).isoformat()
    by_name = {p["name"]: p for p in found}
    assert by_name[_name("outbox_messages", 9)]["rows"] == 3  # reltuples, after ANALYZE
    assert all(p["size_bytes"] > 0 for p in found)
    # Past the retention: D-10, D-9 and D-8 (their ranges ended 7 days ago or more).
    past = {p["name"]: p["kept"] for p in found if p["past_retention"]}
    assert past == {
        _name("outbox_messages", 10): None,
        _name("outbox_messages", 9): None,
        _name("outbox_messages", 8): "holds unfinished or recently dead rows",
        _name("inbox_messages", 10): "holds unfinished or recently dead rows",
        _name("inbox_messages", 9): None,
        _name("inbox_messages", 8): None,
    }

    table = cli("partitions", "list", "--db-url", db_url, "--retention", "7d")
    assert table.returncode == 0, table
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["TABLE", "PARTITION", "FROM"]
    kept_line = next(line for line in lines if _name("outbox_messages", 8) in line)
    assert "kept: holds unfinished" in kept_line
    dropped_line = next(line for line in lines if _name("outbox_messages", 9) in line)
    assert "past: the next pass drops it" in dropped_line
    assert lines[-1].startswith("14 partitions; retention 7d00h: 6 past it, 2 kept")
    assert _names(engine, tables) == before  # a listing changes nothing


def test_maintain_makes_ahead_exports_and_drops_finished_partitions_and_keeps_unfinished(
    cli: Cli, store: tuple[Engine, Tables], db_url: str, tmp_path: Path
) -> None:
    engine, tables = store
    seeded = _seed(engine, tables)

    result = cli(
        "partitions",
        "maintain",
        "--db-url",
        db_url,
        "--service",
        "orders",
        "--retention",
        "7d",
        "--archive-to",
        str(tmp_path / "history"),
        "--json",
    )
    assert result.returncode == 0, result
    report = json.loads(result.stdout)
    past = [(parent, d) for parent in KEYS for d in (10, 9, 8)]
    kept = {_name("outbox_messages", 8), _name("inbox_messages", 10)}
    assert sorted(report["dropped"]) == sorted({_name(p, d) for p, d in past} - kept)
    assert set(report["kept"]) == kept
    assert report["exported"] == {"outbox": 3, "inbox": 2}
    # Made from D-3 to a week past today, for each table.
    assert sorted(report["created"]) == sorted(
        _name(parent, -d) for parent in KEYS for d in range(-3, 7)
    )
    names = _names(engine, tables)
    assert kept <= set(names) and not set(report["dropped"]) & set(names)
    assert _count(engine, tables.outbox) == 1 and _count(engine, tables.inbox) == 1
    history = tmp_path / "history"
    assert sorted(r["message_id"] for r in archived(history, "outbox")) == sorted(
        seeded["published"]
    )
    assert sorted(r["message_id"] for r in archived(history, "inbox")) == sorted(
        seeded["processed"]
    )

    again = cli("partitions", "maintain", "--db-url", db_url, "--retention", "7d")
    assert again.returncode == 0, again
    assert again.stdout.splitlines()[:2] == ["made: none", "dropped: none"]
    assert f"kept: {_name('outbox_messages', 8)}: holds unfinished" in again.stdout


def test_maintain_deletes_the_instances_rows_of_workers_unseen_for_a_day(
    cli: Cli, store: tuple[Engine, Tables], db_url: str
) -> None:
    engine, tables = store
    with engine.begin() as conn:
        now = conn.execute(select(func.now())).scalar_one()
        conn.execute(
            insert(tables.instances),
            [
                # A service that no longer runs: no worker of its own will ever forget it.
                {
                    "service": "gone",
                    "instance": "w1",
                    "handlers": [],
                    "seen_at": now - timedelta(days=2),
                },
                {
                    "service": "orders",
                    "instance": "w2",
                    "handlers": [],
                    "seen_at": now - timedelta(hours=20),
                },
                {"service": "orders", "instance": "w3", "handlers": [], "seen_at": now},
            ],
        )

    result = cli("partitions", "maintain", "--db-url", db_url, "--json")
    assert result.returncode == 0, result
    assert json.loads(result.stdout)["pruned_instances"] == 1
    with engine.connect() as conn:
        left = conn.execute(select(tables.instances.c.instance)).scalars().all()
    assert sorted(left) == ["w2", "w3"]


def test_maintain_while_another_pass_holds_the_lock_exits_1_and_does_nothing(
    cli: Cli, store: tuple[Engine, Tables], db_url: str
) -> None:
    engine, tables = store
    _seed(engine, tables)
    before = _names(engine, tables)
    with engine.connect() as holder:
        key = func.hashtext(f"outbox_inbox.partitions.{tables.schema}")
        assert holder.execute(select(func.pg_try_advisory_xact_lock(key))).scalar_one()
        result = cli("partitions", "maintain", "--db-url", db_url, "--retention", "7d")
        holder.rollback()
    assert result.returncode == 1, result
    assert "another maintenance pass holds the lock of schema outbox_inbox" in result.stderr
    assert _names(engine, tables) == before


def test_maintain_as_a_role_that_may_not_run_ddl_exits_1_naming_the_refusal(
    cli: Cli, store: tuple[Engine, Tables], db_url: str
) -> None:
    engine, tables = store
    role = f"runtime_{uuid.uuid4().hex[:8]}"  # roles belong to the whole server
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'"))
        conn.execute(text(f"GRANT USAGE ON SCHEMA {tables.schema} TO {role}"))
        conn.execute(
            text(
                "GRANT SELECT, INSERT, UPDATE, DELETE "
                f"ON ALL TABLES IN SCHEMA {tables.schema} TO {role}"
            )
        )
    before = _names(engine, tables)
    try:
        url = make_url(db_url).set(username=role, password="pw")
        result = cli(
            "partitions", "maintain", "--db-url", url.render_as_string(hide_password=False)
        )
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))
    assert result.returncode == 1, result
    assert result.stderr.strip() == (
        f"error: maintaining the partitions failed: permission denied for schema {tables.schema}"
    )
    assert _names(engine, tables) == before


@pytest.mark.parametrize(
    ("options", "code", "error"),
    [
        (("--interval", "week"), 2, "'week' is not one of 'day', 'hour'"),
        (("--retention", "-1d"), 2, "'-1d' is not a duration"),
        (("--dead-retention", "-5m"), 2, "'-5m' is not a duration"),
        (("--retention", "1h"), 1, "retention 1h is shorter than the inbox's duplicate window"),
        (("--retention", "0s"), 1, "retention must be > 0"),
    ],
)
def test_bad_input_is_refused_with_one_clear_line_and_changes_nothing(
    cli: Cli,
    store: tuple[Engine, Tables],
    db_url: str,
    options: tuple[str, ...],
    code: int,
    error: str,
) -> None:
    engine, tables = store
    _seed(engine, tables)
    before = _names(engine, tables)
    result = cli("partitions", "maintain", "--db-url", db_url, *options)
    assert result.returncode == code, result
    assert error in result.stderr
    assert "Traceback" not in result.stderr
    assert _names(engine, tables) == before


def test_on_sqlite_there_are_no_partitions_and_both_commands_exit_0(
    cli: Cli, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'orders.db'}"
    service = Service("orders", db_url=url)
    service.migrate()
    service.close()
    # Both take what docs/runbook.md says both take: --service and the two retentions.
    both = ("--service", "orders", "--retention", "7d", "--dead-retention", "30d")
    for command in ("list", "maintain"):
        result = cli("partitions", command, "--db-url", url, *both)
        assert result.returncode == 0, result
        assert result.stdout.strip() == "no partitions: the outbox and the inbox are plain tables"
    listed = cli("partitions", "list", "--db-url", url, "--json")
    assert json.loads(listed.stdout)["partitions"] == []


def test_archive_refuses_an_older_than_under_the_duplicate_window_and_moves_nothing(
    cli: Cli, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'orders.db'}"
    service = Service("orders", db_url=url)
    service.migrate()
    seed_inbox(service.engine, service.tables, 3, age=timedelta(days=1))
    count = select(func.count()).select_from(service.tables.inbox)
    base = ("archive", "--db-url", url, "--service", "orders", "--to", str(tmp_path / "a"))
    refused = cli(*base, "--older-than", "1m")
    assert refused.returncode == 1, refused
    assert "retention 1m is shorter than the inbox's duplicate window" in refused.stderr
    assert "Traceback" not in refused.stderr
    with service.engine.connect() as conn:
        assert conn.execute(count).scalar_one() == 3
    taken = cli(*base, "--older-than", "2h")
    assert taken.returncode == 0, taken
    with service.engine.connect() as conn:
        assert conn.execute(count).scalar_one() == 0
    service.close()
