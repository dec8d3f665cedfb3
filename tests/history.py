"""Helpers of the message-history tests: seed finished rows, read archive files back."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from sqlalchemy import Engine, insert, update

from outbox_inbox.tables import Tables

REPO_ROOT = Path(__file__).resolve().parents[1]
OUTBOX_INBOX = [sys.executable, "-m", "outbox_inbox.cli.main"]


def seed_outbox(
    engine: Engine,
    tables: Tables,
    n: int,
    *,
    age: timedelta,
    state: str = "published",
    routing_key: str = "orders.order.placed",
) -> list[uuid.UUID]:
    """Insert `n` outbox rows created `age` ago, in `state` ('published', 'expired' or
    'unpublished', finished 1 s after creation). Returns their message ids."""
    created = datetime.now(UTC) - age
    finished = created + timedelta(seconds=1)
    ids = [uuid.uuid4() for _ in range(n)]
    rows = [
        {
            "message_id": m,
            "kind": "event",
            "exchange": "events",
            "routing_key": routing_key,
            "payload": {"n": i},
            "headers": {},
            "created_at": created,
            "available_at": created,
            "published_at": finished if state == "published" else None,
            "expired_at": finished if state == "expired" else None,
        }
        for i, m in enumerate(ids)
    ]
    if rows:
        with engine.begin() as conn:
            conn.execute(insert(tables.outbox), rows)
    return ids


def seed_inbox(
    engine: Engine,
    tables: Tables,
    n: int,
    *,
    age: timedelta,
    status: str = "processed",
    duplicates: int = 0,
) -> list[uuid.UUID]:
    """Insert `n` inbox rows received `age` ago in `status`, each with `duplicates` counted
    in inbox_deliveries. Returns their message ids."""
    received = datetime.now(UTC) - age
    ids = [uuid.uuid4() for _ in range(n)]
    rows = [
        {
            "message_id": m,
            "source": "orders",
            "kind": "event",
            "routing_key": "orders.order.placed",
            "payload": {"n": i},
            "headers": {"x-kind": "event"},
            "received_at": received,
            "status": status,
            "attempts": 1 if status != "pending" else 0,
            "processed_at": None if status == "pending" else received + timedelta(seconds=1),
            "dead_reason": "rejected" if status == "dead" else None,
        }
        for i, m in enumerate(ids)
    ]
    if rows:
        with engine.begin() as conn:
            conn.execute(insert(tables.inbox), rows)
            if duplicates:
                conn.execute(
                    insert(tables.deliveries),
                    [{"message_id": m, "duplicates": duplicates} for m in ids],
                )
    return ids


def make_dead_pending(engine: Engine, tables: Tables, message_ids: Sequence[uuid.UUID]) -> None:
    """What a replay does to a dead row: pending again."""
    with engine.begin() as conn:
        conn.execute(
            update(tables.inbox)
            .where(tables.inbox.c.message_id.in_(list(message_ids)))
            .values(status="pending", processed_at=None)
        )


def archived(root: Path, source: str) -> list[dict[str, Any]]:
    """Every row of every `source` file under `root`, with its service and date partition."""
    out = []
    for path in sorted((root / source).glob("service=*/date=*/*.parquet")):
        service = path.parent.parent.name.removeprefix("service=")
        day = path.parent.name.removeprefix("date=")
        for row in pq.read_table(path).to_pylist():
            out.append({**row, "service": service, "date": day, "file": path.name})
    return out


def archived_ids(root: Path, source: str) -> Counter[str]:
    """How many times each message id appears in the `source` files under `root`."""
    return Counter(row["message_id"] for row in archived(root, source))


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``outbox-inbox ARGS`` in a fresh interpreter; return the finished process."""
    return subprocess.run(
        [*OUTBOX_INBOX, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        # The command sees only the URLs a test gives it, never the environment's; an audit
        # runs one-shot unless a test says otherwise (no Spark server outlives the test).
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_INBOX_")},
            "OUTBOX_INBOX_SPARK_SERVER": "none",
            "OUTBOX_INBOX_SPARK_DIR": str(Path(tempfile.gettempdir()) / "outbox-inbox-test-spark"),
            **(env or {}),
        },
        check=False,
    )


def archive_cli(
    db_url: str, root: Path, *extra: str, service: str | None = "orders"
) -> subprocess.CompletedProcess[str]:
    """Run ``outbox-inbox archive --db-url URL [--service NAME] --to ROOT EXTRA...``."""
    named = ("--service", service) if service else ()
    return cli("archive", "--db-url", db_url, *named, "--to", str(root), *extra)
