"""`outbox-inbox archive` on a real PostgreSQL: what moves, where it goes, and crash safety.

The crash tests SIGKILL real archive processes: once at the exact point between a synced file
and the delete of its rows, and then at random moments of runs over many small batches. After
the last run every row is in exactly one file and none is left in the tables.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from history import (
    OUTBOX_INBOX,
    REPO_ROOT,
    archive_cli,
    archived,
    archived_ids,
    make_dead_pending,
    seed_inbox,
    seed_outbox,
)
from outbox_inbox import Service
from outbox_inbox.archive import ArchiveBusy, Archiver
from outbox_inbox.queries import archive, roles
from outbox_inbox.tables import Tables

OLD, RECENT = timedelta(days=10), timedelta(hours=1)


@pytest.fixture
def store(db_url: str) -> Iterator[tuple[Engine, Tables]]:
    """The migrated tables of service `orders` (no broker: the archive needs none)."""
    service = Service("orders", db_url=db_url)
    service.migrate()
    yield service.engine, service.tables
    service.close()


def _count(engine: Engine, table: object) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())  # type: ignore[arg-type]


def test_archive_moves_only_finished_rows_older_than_the_retention_into_partitions(
    store: tuple[Engine, Tables], db_url: str, tmp_path: Path
) -> None:
    engine, tables = store
    published = seed_outbox(engine, tables, 30, age=OLD)
    expired = seed_outbox(engine, tables, 3, age=OLD, state="expired")
    unpublished = seed_outbox(engine, tables, 4, age=OLD, state="unpublished")
    recent = seed_outbox(engine, tables, 5, age=RECENT)
    processed = seed_inbox(engine, tables, 20, age=OLD, duplicates=2)
    dead = seed_inbox(engine, tables, 6, age=OLD, status="dead")
    pending = seed_inbox(engine, tables, 7, age=OLD, status="pending")
    recent_in = seed_inbox(engine, tables, 8, age=RECENT)

    result = archive_cli(db_url, tmp_path, "--older-than", "7d", "--batch-size", "16", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["rows"] == {"outbox": 33, "inbox": 26}
    assert report["files"] >= 4  # batches of 16 rows: 3 outbox, 2 inbox

    out_rows, in_rows = archived(tmp_path, "outbox"), archived(tmp_path, "inbox")
    assert sorted(r["message_id"] for r in out_rows) == sorted(map(str, published + expired))
    assert sorted(r["message_id"] for r in in_rows) == sorted(map(str, processed + dead))
    assert {r["service"] for r in out_rows + in_rows} == {"orders"}
    # Dated by publication or expiry (outbox) and receipt (inbox), in UTC.
    at = [r["published_at"] or r["expired_at"] for r in out_rows]
    assert [r["date"] for r in out_rows] == [a.date().isoformat() for a in at]
    assert all(r["date"] == r["received_at"].date().isoformat() for r in in_rows)
    assert {r["message_id"] for r in in_rows if r["duplicates"] == 2} == set(map(str, processed))
    assert sum(r["expired_at"] is not None for r in out_rows) == 3
    assert json.loads(out_rows[0]["payload"]).keys() == {"n"}
    # No temporary file is left beside the archive.
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()]

    with engine.connect() as conn:
        left_out = {r["message_id"] for r in archive.history_rows(conn, tables, "outbox")}
        left_in = {r["message_id"] for r in archive.history_rows(conn, tables, "inbox")}
    assert left_out == set(unpublished + recent)
    assert left_in == set(pending + recent_in)
    assert _count(engine, tables.deliveries) == 0  # the counters left with their rows
    assert _count(engine, tables.archive_files) == 0

    again = archive_cli(db_url, tmp_path, "--json")
    assert json.loads(again.stdout)["rows"] == {"outbox": 0, "inbox": 0}
    assert archived_ids(tmp_path, "outbox").most_common(1)[0][1] == 1


def test_dry_run_counts_and_moves_nothing(
    store: tuple[Engine, Tables], db_url: str, tmp_path: Path
) -> None:
    engine, tables = store
    seed_outbox(engine, tables, 3, age=OLD)
    seed_inbox(engine, tables, 2, age=OLD)
    result = archive_cli(db_url, tmp_path, "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["rows"] == {"outbox": 3, "inbox": 2}
    assert not list(tmp_path.rglob("*.parquet"))
    assert _count(engine, tables.outbox) == 3


_KILL_AFTER_FILE = textwrap.dedent(
    """
    import os, signal, sys
    from sqlalchemy import create_engine
    from datetime import timedelta
    from outbox_inbox.archive import Archiver
    from outbox_inbox.queries import archive
    from outbox_inbox.tables import build_tables

    real_delete = archive.delete_archived

    def die_before_delete(*args, **kwargs):
        # The batch's files are written and synced: the process dies before deleting rows.
        os.kill(os.getpid(), signal.SIGKILL)

    archive.delete_archived = die_before_delete
    engine = create_engine(sys.argv[1])
    Archiver(engine, build_tables("outbox_inbox"), "orders", sys.argv[2],
             older_than=timedelta(days=7), batch_size=1000).run()
    """
)


def test_archive_killed_after_a_file_is_synced_completes_that_batch_when_run_again(
    store: tuple[Engine, Tables], db_url: str, tmp_path: Path
) -> None:
    engine, tables = store
    ids = seed_outbox(engine, tables, 50, age=OLD)
    killed = subprocess.run(
        [sys.executable, "-c", _KILL_AFTER_FILE, db_url, str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    # The file is complete and synced, the rows are still in the table, the journal names it.
    assert archived_ids(tmp_path, "outbox") == {str(m): 1 for m in ids}
    assert _count(engine, tables.outbox) == 50
    with engine.connect() as conn:
        journal = archive.unfinished_archive_files(conn, tables)
    assert [Path(j["path"]).exists() for j in journal] == [True]

    result = Archiver(engine, tables, "orders", tmp_path, older_than=timedelta(days=7)).run()
    assert result.recovered_files == 1
    assert result.rows["outbox"] == 50
    assert result.files == 0  # nothing was left to write: the rows were in the finished file
    assert archived_ids(tmp_path, "outbox") == {str(m): 1 for m in ids}
    assert _count(engine, tables.outbox) == 0
    assert _count(engine, tables.archive_files) == 0


def test_archive_killed_at_random_moments_loses_no_row_and_writes_none_twice(
    store: tuple[Engine, Tables], db_url: str, tmp_path: Path
) -> None:
    engine, tables = store
    out_ids = seed_outbox(engine, tables, 1500, age=OLD)
    in_ids = seed_inbox(engine, tables, 1500, age=OLD, duplicates=1)
    rng = random.Random(20261122)
    args = [
        *OUTBOX_INBOX,
        "archive",
        "--db-url",
        db_url,
        "--service",
        "orders",
        "--to",
        str(tmp_path),
        "--batch-size",
        "20",
    ]
    interrupted = 0
    for _ in range(5):
        files_before = len(list(tmp_path.rglob("*.parquet")))
        process = subprocess.Popen(
            args, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        # Kill it while it works: once it wrote a file of its own, within a few batches.
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            if len(list(tmp_path.rglob("*.parquet"))) > files_before:
                break
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.2))
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            interrupted += 1
        process.wait(timeout=60)
    assert interrupted >= 3, f"only {interrupted} of 5 runs were interrupted"

    final = archive_cli(db_url, tmp_path, "--json")
    assert final.returncode == 0, final.stderr
    assert archived_ids(tmp_path, "outbox") == {str(m): 1 for m in out_ids}
    assert archived_ids(tmp_path, "inbox") == {str(m): 1 for m in in_ids}
    assert sum(r["duplicates"] for r in archived(tmp_path, "inbox")) == 1500
    assert _count(engine, tables.outbox) == 0
    assert _count(engine, tables.inbox) == 0
    assert _count(engine, tables.deliveries) == 0
    assert _count(engine, tables.archive_files) == 0
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()]


def test_a_dead_row_replayed_after_its_file_was_written_stays_in_the_table(
    store: tuple[Engine, Tables], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, tables = store
    dead = seed_inbox(engine, tables, 3, age=OLD, status="dead")
    journal = archive.journal_archive_files

    def journal_then_replay(conn: Any, tables_: Tables, files: Any) -> None:
        # An operator replays one dead row while the archive writes the batch's file.
        journal(conn, tables_, files)
        make_dead_pending(engine, tables, dead[:1])

    monkeypatch.setattr(archive, "journal_archive_files", journal_then_replay)
    result = Archiver(engine, tables, "orders", tmp_path, older_than=timedelta(days=7)).run()
    assert result.rows["inbox"] == 2 and result.kept_rows == 1
    with engine.connect() as conn:
        left = archive.history_rows(conn, tables, "inbox")
    assert [(r["message_id"], r["status"]) for r in left] == [(dead[0], "pending")]


def test_a_second_run_is_refused_while_one_holds_the_schema_lock(
    store: tuple[Engine, Tables], db_url: str, tmp_path: Path
) -> None:
    engine, tables = store
    seed_outbox(engine, tables, 2, age=OLD)
    with engine.connect() as holder:
        assert archive.try_archive_lock(holder, "outbox_inbox")
        with pytest.raises(ArchiveBusy):
            Archiver(engine, tables, "orders", tmp_path, older_than=timedelta(0)).run()
        result = archive_cli(db_url, tmp_path)
        assert result.returncode == 1
        assert "another archive run holds the lock" in result.stderr
        assert "Traceback" not in result.stderr
        holder.rollback()  # ends the transaction and its lock
    assert _count(engine, tables.outbox) == 2
    assert not list(tmp_path.rglob("*.parquet"))

    # Once released, runs follow each other, in this process (pooled connections keep their
    # sessions) and in others.
    for _ in range(3):
        Archiver(engine, tables, "orders", tmp_path, older_than=timedelta(0)).run()
    with engine.connect() as other, engine.connect() as another:
        assert archive.try_archive_lock(other, "outbox_inbox")
        other.rollback()  # ends the transaction and its lock
        assert archive.try_archive_lock(another, "outbox_inbox")
        another.rollback()  # ends the transaction and its lock
    assert _count(engine, tables.outbox) == 0


def test_archive_without_a_service_name_uses_the_one_its_subscriptions_name(
    store: tuple[Engine, Tables], db_url: str, tmp_path: Path
) -> None:
    engine, tables = store
    seed_outbox(engine, tables, 2, age=OLD)
    nameless = archive_cli(db_url, tmp_path, service=None)
    assert nameless.returncode == 1
    assert "pass --service NAME or --app" in nameless.stderr
    with engine.begin() as conn:
        roles.record_subscriptions(conn, tables, "orders", [("commands", "orders.#")])
    result = archive_cli(db_url, tmp_path, "--json", service=None)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["service"] == "orders"
    subscriptions = pq.read_table(
        tmp_path / "subscriptions" / "service=orders" / "subscriptions.parquet"
    ).to_pylist()
    assert [(s["exchange"], s["pattern"]) for s in subscriptions] == [("commands", "orders.#")]
