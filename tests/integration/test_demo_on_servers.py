"""`outbox-inbox demo --db-url --mq-url` tells the same story on PostgreSQL and RabbitMQ."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import scalar


def test_demo_on_postgres_and_rabbitmq(tmp_path: Path, db_url: str, mq_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_INBOX_")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "outbox_inbox.cli.main",
            "demo",
            "--db-url",
            db_url,
            "--mq-url",
            mq_url,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # guest's password is "guest": masked wherever it appears, the user's name too
    assert "running on postgresql and amqp://***:***@" in result.stdout
    assert "RETRY scheduled" in result.stdout
    assert "is DEAD: order 2 has total -5" in result.stdout
    assert "order 1 is invoiced" in result.stdout
    assert scalar(db_url, "SELECT state FROM demo_orders.orders WHERE id = 1") == "invoiced"
    assert scalar(db_url, "SELECT count(*) FROM demo_billing.invoices") == 1
    assert (
        scalar(
            db_url,
            "SELECT count(*) FROM demo_billing.inbox_messages"
            " WHERE status = 'dead' AND dead_reason = 'rejected'",
        )
        == 1
    )
