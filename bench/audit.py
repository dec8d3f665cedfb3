"""Benchmark: the PySpark audit's rows per second next to Spark's own limits on the same files.

    .venv/bin/python bench/audit.py [--sizes 1000000 10000000] [--dir DIR] [--master local[*]]
                                    [--driver-memory 6g] [--json FILE]

For each size it generates a synthetic history (`outbox_inbox.analytics.synthetic`, with a few
faults of each kind), then times on one SparkSession, one after the other:

* scan   -- Spark reads every archived row (outbox and inbox), decoding the message id, a time
            and the routing key of each: the read limit;
* join   -- Spark joins inbox to outbox on message_id and counts: the smallest reconciliation,
            one shuffle of both sides, the limit of anything that compares sent with received;
* audit  -- `run_audit` over the same roots: everything the report needs.

Rows are archived rows read (outbox + inbox). The figures are ratios to the raw limits of the
same Spark on the same files in the same run, after an untimed warm-up round of 20,000
messages. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from outbox_inbox.analytics.audit import read_archives, run_audit, spark_session  # noqa: E402
from outbox_inbox.analytics.synthetic import Faults, generate  # noqa: E402
from outbox_inbox.archive import INBOX, OUTBOX  # noqa: E402

FAULTS = Faults(
    lost=50,
    in_flight=5,
    handled_twice=5,
    expired=20,
    unexpected=20,
    duplicates=500,
    retried=1000,
    dead=300,
)


def _timed(what: str, run: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    value = run()
    seconds = time.perf_counter() - start
    print(f"  {what:<6} {seconds:8.1f} s", flush=True)
    return seconds, value


def measure(spark: Any, directory: Path, size: int) -> dict[str, Any]:
    """Generate `size` messages under `directory` and time scan, join and audit over them."""
    print(f"{size:,} messages", flush=True)
    generated, expected = _timed("gen", lambda: generate(directory, size, FAULTS))
    roots = expected.roots
    from pyspark.sql import functions as F

    def scan() -> int:
        # Decode the columns the audit reads (a bare count() would be answered from the
        # Parquet footers without reading any data).
        total = 0
        for source, time_column in ((OUTBOX, "published_at"), (INBOX, "processed_at")):
            row = (
                read_archives(spark, roots, source)
                .agg(F.count("message_id"), F.max(time_column), F.max("routing_key"))
                .first()
            )
            total += int(row[0])
        return total

    def join() -> int:
        outbox = read_archives(spark, roots, OUTBOX).select("message_id", "published_at")
        inbox = read_archives(spark, roots, INBOX).select("message_id", "received_at")
        return int(outbox.join(inbox, "message_id", "full_outer").agg(F.count("*")).first()[0])

    scan_s, rows = _timed("scan", scan)
    join_s, _ = _timed("join", join)
    audit_s, summary = _timed(
        "audit", lambda: run_audit(spark, roots, now=expected.now, grace=expected.grace)
    )
    exact = summary["totals"] == expected.totals
    print(f"  rows {rows:,}; audit {rows / audit_s:,.0f} rows/s; counts exact: {exact}")
    return {
        "messages": size,
        "rows": rows,
        "generate_s": round(generated, 1),
        "scan_s": round(scan_s, 1),
        "join_s": round(join_s, 1),
        "audit_s": round(audit_s, 1),
        "scan_rows_per_s": round(rows / scan_s),
        "join_rows_per_s": round(rows / join_s),
        "audit_rows_per_s": round(rows / audit_s),
        "audit_over_join": round(join_s / audit_s, 2),
        "audit_over_scan": round(scan_s / audit_s, 3),
        "counts_exact": exact,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--dir", help="Where histories are generated [default: a temp dir].")
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--driver-memory", default="6g")
    parser.add_argument("--json", dest="json_path", help="Also write the figures here.")
    args = parser.parse_args()

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="outbox-inbox-bench-"))
    spark = spark_session(args.master, driver_memory=args.driver_memory)
    results = []
    try:
        # Untimed warm-up: the JVM compiles Spark's hot paths on the first jobs it runs.
        measure(spark, base / "warm-up", 20_000)
        shutil.rmtree(base / "warm-up", ignore_errors=True)
        for size in args.sizes:
            directory = base / f"history-{size}"
            shutil.rmtree(directory, ignore_errors=True)
            results.append(measure(spark, directory, size))
            shutil.rmtree(directory, ignore_errors=True)
    finally:
        spark.stop()
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)

    print()
    print(
        f"{'messages':>12} {'rows':>12} {'scan rows/s':>12} {'join rows/s':>12} "
        f"{'audit rows/s':>13} {'audit s':>8} {'audit/join':>10}"
    )
    for r in results:
        print(
            f"{r['messages']:>12,} {r['rows']:>12,} {r['scan_rows_per_s']:>12,} "
            f"{r['join_rows_per_s']:>12,} {r['audit_rows_per_s']:>13,} {r['audit_s']:>8} "
            f"{r['audit_over_join']:>10}"
        )
    if len(results) > 1:
        first, last = results[0], results[-1]
        print(
            f"time x{last['audit_s'] / first['audit_s']:.1f} for rows "
            f"x{last['rows'] / first['rows']:.1f}"
        )
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(
                {
                    "results": results,
                    "master": args.master,
                    "driver_memory": args.driver_memory,
                    "python": platform.python_version(),
                    "cpus": __import__("os").cpu_count(),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
