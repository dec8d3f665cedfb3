"""The README's two-service example, examples/quickstart.py, runs against real servers."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import uuid
from pathlib import Path
from types import ModuleType

import pika

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.py"


def run_quickstart(db_url: str, mq_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(QUICKSTART), "--db-url", db_url, "--mq-url", mq_url],
        capture_output=True,
        text=True,
        timeout=90,
    )


def load_quickstart() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_quickstart", QUICKSTART)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_exchanges_command_and_events_between_two_services(
    db_url: str, mq_url: str
) -> None:
    result = run_quickstart(db_url, mq_url)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "billing  command billing.invoice.create" in out
    assert "billing  event   orders.order.placed {'order': 1}" in out
    assert "orders   event   billing.invoice.created" in out
    assert "'order': -1" not in out  # the rolled-back event never left


def test_quickstart_ignores_a_stale_reply_and_waits_for_its_own(db_url: str, mq_url: str) -> None:
    """A billing.invoice.created of an earlier conversation, waiting in orders.inbox before the
    run starts, is handled first; the run must not report success on it."""
    orders, billing, _ = load_quickstart().build(db_url, mq_url)
    try:
        orders.declare_topology()  # orders.inbox, bound to billing.invoice.created
    finally:
        orders.close()
        billing.close()
    stale_correlation = str(uuid.uuid4())
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(
            "events",
            "billing.invoice.created",
            json.dumps({"invoice": 999, "order": 999}).encode(),
            pika.BasicProperties(
                message_id=str(uuid.uuid4()),
                correlation_id=stale_correlation,
                content_type="application/json",
                delivery_mode=2,
            ),
            mandatory=True,
        )
    finally:
        connection.close()

    result = run_quickstart(db_url, mq_url)

    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    own_reply = [
        i
        for i, line in enumerate(lines)
        if "orders   event   billing.invoice.created" in line and re.search(r"'order': 1[,}]", line)
    ]
    done = [i for i, line in enumerate(lines) if line.endswith("demo     done")]
    assert len(own_reply) == 1 and len(done) == 1, result.stdout
    assert own_reply[0] < done[0], result.stdout  # "done" only once its own reply was handled
    stale = [i for i, line in enumerate(lines) if "'order': 999" in line]
    assert len(stale) == 1, result.stdout
    assert lines[stale[0]].endswith(f"(correlation {stale_correlation[:8]}): ignored")
    [order_line] = [line for line in lines if "orders   order 1 written" in line]
    correlation = re.search(r"correlation ([0-9a-f]{8})\)", order_line)
    assert correlation is not None and correlation.group(1) != stale_correlation[:8]


def test_the_two_tenant_example_stores_and_handles_each_tenants_note_in_its_schema(
    db_url: str, mq_url: str
) -> None:
    example = ROOT / "examples" / "tenants" / "app.py"
    result = subprocess.run(
        [sys.executable, str(example), "--db-url", db_url, "--mq-url", mq_url],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "acme    handled notes.note.add" in result.stdout
    assert "globex  handled notes.note.add" in result.stdout
    assert result.stdout.rstrip().endswith("done")
