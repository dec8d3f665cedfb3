"""`outbox-inbox demo` runs with no server at all and tells the whole story."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXPECTED = [
    "order 1 (total 42) written with event order.placed and command billing.invoice.create",
    "written, then ROLLED BACK: nothing is sent",
    "relay published command billing.invoice.create of order 1 (message ",
    "relay published event orders.order.placed of order 2 (message ",
    "billing.invoice.create failed: TimeoutError('payment provider timed out'); RETRY scheduled",
    "billing.invoice.create is DEAD: order 2 has total -5 (a dead letter)",
    "attempt 2: invoice 1 written, event invoice.created in the same commit",
    "event billing.invoice.created: order 1 is invoiced",
    "billing inbox: billing.invoice.create of order 2     dead (rejected)",
]


def run_demo(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_INBOX_")}
    return subprocess.run(
        [sys.executable, "-m", "outbox_inbox.cli.main", "demo", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_demo_without_servers_shows_command_event_retry_and_dead_letter(tmp_path: Path) -> None:
    result = run_demo(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for line in EXPECTED:
        assert line in result.stdout, f"missing {line!r} in:\n{result.stdout}"
    assert "running on sqlite and memory://" in result.stdout
    # Each published message is told apart: no two "published" lines are the same.
    published = [
        line.split("  ", 2)[-1] for line in result.stdout.splitlines() if "published" in line
    ]
    assert len(published) >= 5 and len(set(published)) == len(published), published
    assert "order 3" not in result.stdout.split("ROLLED BACK")[1]  # the rollback sent nothing
    assert list(tmp_path.iterdir()) == []  # the SQLite files lived in a temporary directory
