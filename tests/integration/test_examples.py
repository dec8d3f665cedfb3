"""The README's example runs against real servers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_exchanges_command_and_events_between_two_services(
    db_url: str, mq_url: str
) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "quickstart.py"),
            "--db-url",
            db_url,
            "--mq-url",
            mq_url,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "billing  command billing.invoice.create" in out
    assert "billing  event   orders.order.placed {'order': 1}" in out
    assert "orders   event   billing.invoice.created" in out
    assert "'order': -1" not in out  # the rolled-back event never left
