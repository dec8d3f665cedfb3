"""`outbox-inbox` commands given a pooler's URL with --db-url, while other clients use the pool.

A transaction pooler gives each transaction of a client whichever server connection is idle,
so a statement the client prepared on one is unknown on the next (PgBouncer 1.18 keeps no
prepared statements). A command that runs the same statement batch after batch must not
prepare it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import create_engine, text

from helpers import make_service, scalar
from outbox_inbox import Service
from outbox_inbox.cli.target import resolve
from outbox_inbox.database import connect

from .bouncer import PgBouncerServer
from .conftest import churn

DEAD_ROWS = 300


def test_dead_letter_replay_in_many_batches_through_the_transaction_pool_replays_every_row(
    db_url: str, mq_url: str, bouncers: dict[str, PgBouncerServer], tmp_path: Path
) -> None:
    """300 dead rows replayed 10 at a time (--rate 100): 30 runs of the same UPDATE on the
    command's pooled client connection, while three other clients keep the pool's server
    connections changing hands. Every row is pending afterwards and the command exits 0."""
    service = make_service("orders", db_url, mq_url)
    with service.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox_inbox.inbox_messages"
                " (message_id, kind, routing_key, payload, headers, status, dead_reason)"
                " SELECT gen_random_uuid(), 'command', 'thing.do', '{}', '{}', 'dead',"
                " 'handler_failed' FROM generate_series(1, :n)"
            ),
            {"n": DEAD_ROWS},
        )
    service.engine.dispose()
    pooled = bouncers["transaction"].url(db_url)
    others = create_engine(pooled, connect_args={"prepare_threshold": None}, pool_size=3)
    stop = threading.Event()
    churners = [threading.Thread(target=churn, args=(others, stop)) for _ in range(3)]
    command = Path(sys.executable).parent / "outbox-inbox"
    audit = tmp_path / "audit.log"
    try:
        for thread in churners:
            thread.start()
        replay = "dead-letters replay --service orders --source table --all --rate 100"
        result = subprocess.run(
            [str(command), *replay.split(), "--db-url", pooled, "--audit-log", str(audit)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OUTBOX_INBOX_MQ_URL": ""},
        )
    finally:
        stop.set()
        for thread in churners:
            thread.join()
        others.dispose()
    assert result.returncode == 0, result.stdout + result.stderr
    statuses = "SELECT count(*) FROM outbox_inbox.inbox_messages WHERE status = :s"
    assert scalar(db_url, statuses, s="pending") == DEAD_ROWS
    assert scalar(db_url, statuses, s="dead") == 0
    (line,) = [json.loads(x) for x in audit.read_text().splitlines()]
    assert line["count"] == DEAD_ROWS and "error" not in line


def test_the_commands_engine_is_the_services_it_prepares_directly_and_never_through_the_pool(
    db_url: str, mq_url: str, pooled: Callable[[str, str], str]
) -> None:
    """One engine policy (outbox_inbox.database.connect) for the service, a command given
    --db-url and the audit's live reads: each connection checks once whether it goes through
    a pooler; directly it prepares after 5 executions, through the transaction pool never."""
    make_service("orders", db_url, mq_url).engine.dispose()
    for way, threshold in (("direct", 5), ("transaction", None)):
        url = pooled(db_url, way)
        target = resolve(service="orders", db_url=url)
        service = Service("orders", db_url=url, mq_url=mq_url)
        audit = connect(url).engine  # analytics.audit.read_live's
        try:
            for engine in (target.engine(), service.engine, audit):
                with engine.connect() as conn:
                    assert conn.connection.driver_connection.prepare_threshold == threshold, way
        finally:
            target.close()
            service.close()
            audit.dispose()
