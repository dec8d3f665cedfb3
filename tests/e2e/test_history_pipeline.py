"""The message-history pipeline end to end: two services on real PostgreSQL and RabbitMQ
exchange messages, duplicates are injected on the wire, both services are archived with the
real command, and the PySpark audit (the real command, local Spark) reconciles them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from history import cli
from outbox_inbox import Service
from outbox_inbox.analytics.report import DEAD_LETTER_COLOR, LATENCY_COLOR, PROCESSED_COLOR
from outbox_inbox.archive import Archiver
from outbox_inbox.tables import build_tables
from report_check import assert_report_renders

from .harness import INBOX, OUTBOX, Database, running, wait_until

pytest.importorskip("pyspark", reason="the audit needs the spark extra")

EVENTS, COMMANDS = 120, 60  # from orders; each command makes billing publish one event back
REJECTED = 3  # commands billing rejects as bad input: dead letters, not losses
FAULTS = REJECTED  # each rejected command sends orders a fault (outbox_inbox.faults)
_FAULTS_HANDLED = "status = 'processed' AND routing_key LIKE 'orders.fault.%'"
ORDERS_DUPLICATES, BILLING_DUPLICATES = 25, 10


def _republish(db: Database, n: int) -> None:
    """Make the relay publish `n` published messages again, as after a relay crash between
    the broker's confirm and the commit that marks the rows published."""
    with db.engine.begin() as conn:
        conn.execute(
            text(
                f"UPDATE {OUTBOX} SET published_at = NULL WHERE id IN "
                f"(SELECT id FROM {OUTBOX} ORDER BY id LIMIT :n)"
            ),
            {"n": n},
        )


def _absorbed(db: Database) -> int:
    return int(db.scalar("SELECT coalesce(sum(duplicates), 0) FROM outbox_inbox.inbox_deliveries"))


def test_two_services_archived_and_audited_lose_nothing_and_report_the_injected_duplicates(
    db_url: str,
    db_url_factory: Callable[[], str],
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
    tmp_path: Path,
) -> None:
    orders_url, billing_url = db_url, db_url_factory()
    orders_db, billing_db = prepare_db("orders", orders_url), prepare_db("billing", billing_url)
    orders, billing = make_service("orders", orders_url), make_service("billing", billing_url)

    with running(billing, orders):
        with orders.session() as session, session.begin():
            for i in range(EVENTS):
                orders.outbox.publish(session, "order.placed", {"order": i}, key=f"order-{i % 7}")
            for i in range(COMMANDS):
                orders.outbox.send(
                    session, "billing", "invoice.create", {"order": i, "publish": "invoice.created"}
                )
            for _ in range(REJECTED):
                orders.outbox.send(
                    session, "billing", "invoice.create", {"reject": "order total is negative"}
                )
        wait_until(
            lambda: (
                billing_db.count("effects") == EVENTS + COMMANDS
                and orders_db.count("effects") == COMMANDS
                and billing_db.count(INBOX, "status = 'dead'") == REJECTED
                and orders_db.count(INBOX, _FAULTS_HANDLED) == FAULTS
            ),
            timeout=60,
            what="billing to handle every event and command, and orders every reply and fault",
        )
        _republish(orders_db, ORDERS_DUPLICATES)
        _republish(billing_db, BILLING_DUPLICATES)
        wait_until(
            lambda: (
                _absorbed(billing_db) == ORDERS_DUPLICATES
                and _absorbed(orders_db) == BILLING_DUPLICATES
                and orders_db.count(OUTBOX, "published_at IS NULL") == 0
                and billing_db.count(OUTBOX, "published_at IS NULL") == 0
            ),
            timeout=60,
            what="the re-published messages marked again and absorbed by the inboxes",
        )
    assert billing_db.count("effects") == EVENTS + COMMANDS  # nothing was handled twice
    assert orders_db.count("effects") == COMMANDS

    archive = tmp_path / "archive"
    assert _archive_everything(orders_url, archive / "orders", "orders") == {
        "outbox": EVENTS + COMMANDS + REJECTED,
        "inbox": COMMANDS + FAULTS,
    }

    # Orders from its archive, billing from its live tables.
    first = cli(
        "audit",
        str(archive / "orders"),
        "--db-url",
        billing_url,
        "--out",
        str(tmp_path / "audit-live"),
        "--master",
        "local[2]",
        "--json",
    )
    assert first.returncode == 0, first.stderr
    _assert_complete(json.loads(first.stdout))

    assert _archive_everything(billing_url, archive / "billing", "billing") == {
        "outbox": COMMANDS + FAULTS,
        "inbox": EVENTS + COMMANDS + REJECTED,
    }
    assert orders_db.count(OUTBOX) == 0 and billing_db.count(OUTBOX) == 0

    report_dir = tmp_path / "audit"
    final = cli(
        "audit",
        str(archive / "orders"),
        str(archive / "billing"),
        "--out",
        str(report_dir),
        "--master",
        "local[2]",
    )
    assert final.returncode == 0, final.stderr
    assert "OK: nothing lost" in final.stdout
    summary = json.loads((report_dir / "summary.json").read_text())
    _assert_complete(summary)

    # The report a person opens: its charts drawn in a real browser.
    dom = assert_report_renders(
        report_dir / "report.html",
        tmp_path / "browser",
        {
            "chart-latency": LATENCY_COLOR,
            "chart-throughput": PROCESSED_COLOR,
            "chart-dead-letters": DEAD_LETTER_COLOR,
        },
    )
    assert dom.verdict == "OK: nothing lost"


def _assert_complete(summary: dict[str, object]) -> None:
    totals = summary["totals"]
    assert isinstance(totals, dict)
    delivered = EVENTS + COMMANDS + REJECTED + COMMANDS + FAULTS
    assert totals["sent"] == delivered
    assert totals["expected_deliveries"] == delivered
    assert totals["delivered"] == delivered
    assert totals["lost"] == 0 and totals["in_flight"] == 0
    assert totals["duplicates_absorbed"] == ORDERS_DUPLICATES + BILLING_DUPLICATES
    assert totals["handled_more_than_once"] == 0
    assert totals["unexpected"] == 0
    assert totals["processed"] == delivered - REJECTED and totals["dead"] == REJECTED
    assert summary["ok"] is True
    assert summary["dead_letters"] == [
        {
            "type": "billing.invoice.create",
            "reason": "rejected",
            "count": REJECTED,
            "example_error": "order total is negative",
        }
    ]
    services = {s["service"]: s for s in summary["services"]}  # type: ignore[attr-defined]
    assert services["billing"]["duplicates_absorbed"] == ORDERS_DUPLICATES
    assert services["orders"]["duplicates_absorbed"] == BILLING_DUPLICATES
    types = {row["type"] for row in summary["latency"]}  # type: ignore[attr-defined]
    assert types == {
        "orders.order.placed",
        "billing.invoice.create",
        "billing.invoice.created",
        "orders.fault.billing.invoice.create",
    }


def _archive_everything(db_url: str, root: Path, service: str) -> dict[str, int]:
    """Archive every finished row, the newest included: the audit is to see the whole history.
    Through the library's Archiver: the command refuses an --older-than inside the duplicate
    window, as it should for a service that goes on receiving."""
    engine = create_engine(db_url)
    try:
        archiver = Archiver(engine, build_tables(), service, root, older_than=timedelta(0))
        return archiver.run().rows
    finally:
        engine.dispose()
