"""Histories the audit is checked on, each with every kind of fault, built the same way every
time (seeded), so an audit's summary of them can be compared with a recorded one.

``audit_golden/<case>.json`` holds the summaries the two-pass audit (before the one-pass
rewrite) wrote for these cases; `tests/unit/test_audit_one_pass.py` holds the rewrite to them
field by field. Run this module to record them again:
``python tests/audit_cases.py DIRECTORY``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from outbox_inbox.analytics.audit import LiveRows
from outbox_inbox.analytics.synthetic import Expected, Faults, generate

GOLDEN = Path(__file__).parent / "audit_golden"

EVERY_FAULT = Faults(
    lost=7,
    in_flight=3,
    handled_twice=2,
    expired=4,
    unexpected=5,
    duplicates=11,
    retried=13,
    dead=9,
)


@dataclass
class Case:
    """One history: its archive roots, its live rows, and the audit's clock."""

    roots: list[str]
    now: datetime
    grace: timedelta
    live: list[LiveRows] = field(default_factory=list)
    expected: Expected | None = None


def faults(directory: Path) -> Case:
    """Three days, every fault, faults and files spread over several chunks."""
    e = generate(directory, 30_000, EVERY_FAULT, chunk=8_000)
    return Case(e.roots, e.now, e.grace, expected=e)  # type: ignore[arg-type]


def month(directory: Path) -> Case:
    """Thirty days of 20,000 messages, every fault, one date partition per day."""
    e = generate(
        directory,
        20_000,
        EVERY_FAULT,
        seed=11,
        span=timedelta(days=30),
        chunk=6_000,
    )
    return Case(e.roots, e.now, e.grace, expected=e)  # type: ignore[arg-type]


def live(directory: Path) -> Case:
    """Part of the history read from live tables rather than the archive: the last whole day
    of billing's inbox and of orders' outbox, one outbox row in both (archived while the audit
    read), a few live rows not finished yet, and one dead inbox row archived again after its
    replay was processed."""
    import pyarrow.parquet as pq

    e = generate(directory, 12_000, EVERY_FAULT, seed=3, chunk=5_000)
    root = directory
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {"orders": {}, "billing": {}}
    for service, source in (("orders", "outbox"), ("billing", "inbox")):
        last = root / service / source / f"service={service}" / "date=2026-11-03"
        records = pq.read_table(last).to_pylist()
        records.sort(key=lambda r: (r["message_id"], r["id"]))
        for path in last.iterdir():
            path.unlink()
        last.rmdir()
        later = datetime(2026, 12, 2, tzinfo=UTC)
        rows[service][source] = [dict(r, archived_at=later) for r in records]
    # Live rows not finished yet: three pending inbox rows, three unpublished outbox rows.
    for r in rows["billing"]["inbox"][:3]:
        r.update(status="pending", processed_at=None)
    for r in rows["orders"]["outbox"][:3]:
        r.update(published_at=None)
    # One outbox row both live and archived.
    first_outbox = sorted((root / "orders" / "outbox" / "service=orders").iterdir())[0]
    rows["orders"]["outbox"].append(pq.read_table(first_outbox).to_pylist()[0])
    # A dead row archived, replayed and processed, then archived again (a second file).
    inbox_dir = sorted((root / "billing" / "inbox" / "service=billing").iterdir())[0]
    dead = [r for r in pq.read_table(inbox_dir).to_pylist() if r["status"] == "dead"]
    if dead:
        replayed = dict(
            dead[0],
            status="processed",
            dead_reason=None,
            last_error=None,
            attempts=dead[0]["attempts"] + 1,
            processed_at=dead[0]["received_at"] + timedelta(hours=1),
            archived_at=datetime(2026, 12, 3, tzinfo=UTC),
        )
        import pyarrow as pa

        from outbox_inbox.archive import arrow_schema

        pq.write_table(
            pa.Table.from_pylist([replayed], schema=arrow_schema("inbox")),
            inbox_dir / "part-replayed.parquet",
        )
    subscriptions = {
        "orders": [],
        "billing": [
            {"exchange": "commands", "pattern": "billing.#", "subscribed_at": None},
            {
                "exchange": "events",
                "pattern": "orders.order.*",
                "subscribed_at": datetime(2026, 10, 31, tzinfo=UTC),
            },
        ],
    }
    parts = [
        LiveRows(
            service=service,
            outbox=rows[service].get("outbox", []),
            inbox=rows[service].get("inbox", []),
            subscriptions=subscriptions[service],
        )
        for service in ("orders", "billing")
    ]
    return Case(e.roots, e.now, e.grace, live=parts)  # type: ignore[arg-type]


def empty(directory: Path) -> Case:
    """An archive root with nothing in it."""
    directory.mkdir(parents=True, exist_ok=True)
    return Case([str(directory)], datetime(2026, 11, 4, tzinfo=UTC), timedelta(minutes=5))


CASES: dict[str, Callable[[Path], Case]] = {
    "faults": faults,
    "month": month,
    "live": live,
    "empty": empty,
}


def comparable(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary without what differs from run to run (the clock and the input paths)."""
    out = dict(summary)
    out.pop("generated_at", None)
    out["inputs"] = {k: v for k, v in summary["inputs"].items() if k != "archives"}
    return out


def record(directory: Path) -> None:
    """Write each case's audit summary into GOLDEN, audited by the code in the tree."""
    from outbox_inbox.analytics.audit import run_audit, spark_session

    spark = spark_session("local[2]", driver_memory="1g")
    GOLDEN.mkdir(exist_ok=True)
    try:
        for name, build in CASES.items():
            case = build(directory / name)
            summary = run_audit(spark, case.roots, live=case.live, now=case.now, grace=case.grace)
            text = json.dumps(comparable(summary), indent=1, sort_keys=True)
            (GOLDEN / f"{name}.json").write_text(text + "\n")
    finally:
        spark.stop()


if __name__ == "__main__":
    record(Path(sys.argv[1]))
