"""The PySpark audit on local Spark, over synthetic history with known numbers of faults.

The generator computes what the audit must report from the rows it writes (with numpy, apart
from Spark); the audit must report exactly that. Events published before a service subscribed
are in the history too: were they expected there, the audit would report them lost.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from audit_cases import Case

from history import cli
from outbox_inbox.analytics.synthetic import Expected

pyspark = pytest.importorskip("pyspark", reason="the audit needs the spark extra")


@pytest.fixture(scope="module")
def history(cases: dict[str, Case]) -> Expected:
    # 30,000 messages, every fault, in small chunks: the faults and files are spread over
    # several chunks, as with big histories. Shared with test_audit_one_pass.py.
    expected = cases["faults"].expected
    assert expected is not None
    return expected


@pytest.fixture(scope="module")
def summary(whole_audit: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    return whole_audit("faults")  # run_audit(spark, history.roots, now=..., grace=...)


def test_generator_injected_exactly_the_faults_it_was_asked_for(history: Expected) -> None:
    t = history.totals
    assert (t["lost"], t["in_flight"], t["handled_more_than_once"]) == (7, 3, 2)
    assert (t["expired"], t["unexpected"], t["duplicates_absorbed"]) == (4, 5, 11)
    assert t["dead"] == 9
    assert t["retried_messages"] >= 13  # and the dead by max_attempts, which retried too
    assert t["sent"] == 30_000


def test_audit_reports_exactly_the_counts_of_the_generated_history(
    summary: dict[str, Any], history: Expected
) -> None:
    assert summary["totals"] == history.totals
    assert summary["ok"] is False


def test_audit_lists_the_lost_and_doubly_handled_messages(summary: dict[str, Any]) -> None:
    assert len(summary["lost"]) == 7
    assert {(m["type"], m["producer"], m["consumer"]) for m in summary["lost"]} == {
        ("billing.invoice.create", "orders", "billing")
    }
    assert [m["copies"] for m in summary["handled_more_than_once"]] == [2, 2]


def test_audit_counts_dead_letters_by_type_and_reason_and_names_their_causes(
    summary: dict[str, Any], history: Expected
) -> None:
    by_type = {(d["type"], d["reason"]): d["count"] for d in summary["dead_letters"]}
    assert by_type == history.dead_by_type_reason
    causes = {c["reason"]: c for c in summary["dead_letter_causes"]}
    # The cause of a stored traceback is its last line, the exception.
    assert causes["max_attempts"]["error"] == "ValueError: card declined"
    assert sum(c["count"] for c in summary["dead_letter_causes"]) == 9


def test_audit_counts_retries_per_type(summary: dict[str, Any], history: Expected) -> None:
    retries = {r["type"]: r["retries"] for r in summary["retries"] if r["retries"]}
    assert retries == history.retries_by_type


def test_audit_latency_percentiles_match_the_generated_delays(
    summary: dict[str, Any], history: Expected
) -> None:
    assert history.end_to_end_p50 is not None
    latency = {row["type"]: row for row in summary["latency"]}
    assert set(latency) == {
        "orders.order.placed",
        "billing.invoice.create",
        "billing.invoice.created",
        "shipping.parcel.ship",
    }
    for row in latency.values():
        stages = row["stages"]
        assert stages["end_to_end"]["p50"] == pytest.approx(history.end_to_end_p50, rel=0.15)
        assert stages["publish"]["p50"] < stages["end_to_end"]["p50"]
        assert stages["end_to_end"]["p50"] <= stages["end_to_end"]["p90"]
        assert stages["end_to_end"]["p90"] <= stages["end_to_end"]["p99"]
        assert stages["end_to_end"]["p99"] <= stages["end_to_end"]["max"]
    histogram = summary["latency_histogram"]
    assert sum(b["count"] for b in histogram) == sum(r["count"] for r in latency.values())


def test_audit_throughput_covers_the_window(summary: dict[str, Any], history: Expected) -> None:
    series = summary["throughput"]["series"]
    assert summary["throughput"]["bucket_seconds"] == 1800  # three days in at most 240 points
    assert sum(p["published"] for p in series) == history.totals["published"]
    assert sum(p["processed"] for p in series) == history.totals["processed"]


def test_a_span_under_20_hours_has_its_throughput_counted_in_buckets_under_10_minutes(
    spark: Any, history: Expected
) -> None:
    from outbox_inbox.analytics.audit import Window, run_audit

    start = datetime(2026, 11, 1, 6, tzinfo=UTC)  # two hours of the generator's three days
    got = run_audit(
        spark,
        history.roots,
        now=history.now,
        grace=history.grace,
        window=Window(start, start + timedelta(hours=2)),
    )
    series = got["throughput"]["series"]
    assert got["throughput"]["bucket_seconds"] == 30  # two hours in at most 240 points
    assert sum(p["published"] for p in series) == got["totals"]["published"] > 0
    assert sum(p["processed"] for p in series) == got["totals"]["processed"]
    # Counted per 30 s, not per 10 minutes spread over them: nearly every 30 s have some.
    assert sum(1 for p in series if p["published"]) > 100


def test_audit_command_writes_summary_and_report_and_exits_4_when_messages_were_lost(
    history: Expected, tmp_path: Path
) -> None:
    assert history.now is not None
    result = cli(
        "audit",
        *history.roots,
        "--out",
        str(tmp_path),
        "--master",
        "local[2]",
        "--driver-memory",
        "1g",
        env={"OUTBOX_INBOX_SPARK_DIR": str(tmp_path / "spark")},
    )
    assert result.returncode == 4, result.stderr
    assert "FAILED: 10 lost, 2 handled more than once" in result.stdout
    # One line says how Spark ran; Spark's own start-up lines went to its log, not here.
    assert result.stderr.splitlines() == [
        f"Spark: a one-shot session on local[2] (Spark's output: {tmp_path}/spark/one-shot.log)"
    ]
    written = json.loads((tmp_path / "summary.json").read_text())
    # Audited now, not at the generator's clock: the three in flight are overdue, so lost.
    assert written["totals"]["lost"] == 7 + 3
    assert written["totals"]["in_flight"] == 0
    html = (tmp_path / "report.html").read_text()
    assert "chart-latency" in html and "chart-throughput" in html


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "nothing to audit"),
        (("/nonexistent/archive",), "is not a directory"),
        ((".", "--conf", "spark.executor.memory"), "is not KEY=VALUE"),
        ((".", "--db-url", "mysql://u:secret@h/db"), "mysql:// is not supported"),
    ],
)
def test_audit_command_rejects_bad_input_in_one_line(args: tuple[str, ...], message: str) -> None:
    result = cli("audit", *args)
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr and "secret" not in result.stderr


def test_audit_command_without_java_says_so_in_one_line(tmp_path: Path) -> None:
    result = cli("audit", str(tmp_path), env={"JAVA_HOME": str(tmp_path / "no-java")})
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: could not start Spark") and "Java 17+" in last
    assert "Traceback" not in result.stderr


def test_audit_of_an_empty_archive_is_ok_with_empty_charts(
    tmp_path: Path, warm_spark: dict[str, str]
) -> None:
    (tmp_path / "archive").mkdir()
    archive, out = str(tmp_path / "archive"), str(tmp_path / "report")
    result = cli("audit", archive, "--out", out, "--json", env=warm_spark)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["ok"] is True
    assert set(summary["totals"].values()) == {0}
    assert "no data" in (tmp_path / "report" / "report.html").read_text()
