"""The one-pass audit against the summaries the audit wrote before it was rewritten, and the
incremental audit against the whole audit restricted to its window.

The recorded summaries are in ``tests/audit_golden/`` (see `audit_cases`). Every field must be
equal but the latency percentiles: Spark's ``percentile_approx`` merges the sketches of the
parts in the order they arrive, so its answer moves within its error (a rank or two) from run
to run, the old audit's too; they are held to 1%, which any wrong column misses by far.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from audit_cases import CASES, GOLDEN, Case, comparable

from history import cli
from outbox_inbox.analytics.audit import TOTALS
from outbox_inbox.topology import topic_matches

pyspark = pytest.importorskip("pyspark", reason="the audit needs the spark extra")


def _audit(spark: Any, case: Case, **options: Any) -> dict[str, Any]:
    from outbox_inbox.analytics.audit import run_audit

    summary = run_audit(
        spark, case.roots, live=case.live, now=case.now, grace=case.grace, **options
    )
    return json.loads(json.dumps(summary))  # as summary.json holds it


@pytest.mark.parametrize("name", list(CASES))
def test_one_pass_audit_reports_what_the_recorded_audit_reported_field_by_field(
    whole_audit: Callable[[str], dict[str, Any]], name: str
) -> None:
    got = comparable(whole_audit(name))  # `_audit` of the case, run once for every test
    want = json.loads((GOLDEN / f"{name}.json").read_text())
    got_latency, want_latency = got.pop("latency"), want.pop("latency")
    assert got == want
    assert [(r["type"], r["count"]) for r in got_latency] == [
        (r["type"], r["count"]) for r in want_latency
    ]
    for mine, theirs in zip(got_latency, want_latency, strict=True):
        for stage, figures in theirs["stages"].items():
            assert mine["stages"][stage]["max"] == figures["max"]
            for p in ("p50", "p90", "p99"):
                assert mine["stages"][stage][p] == pytest.approx(figures[p], rel=0.01), (
                    theirs["type"],
                    stage,
                    p,
                )


def test_topic_patterns_match_in_spark_exactly_as_the_broker_matches_them(spark: Any) -> None:
    from pyspark.sql import functions as F

    from outbox_inbox.analytics.audit import topic_regex

    rng = random.Random(5)
    words = ["a", "b", "orders", "", "*", "#", "a+b", "x(y)", "$", "ä", "\\", "^", "[c]", "d|e"]
    literal = [w for w in words if w not in ("*", "#")]
    pairs = set()
    for _ in range(3000):
        pattern = ".".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
        key = ".".join(rng.choice(literal) for _ in range(rng.randint(1, 4)))
        pairs.add((pattern, key))
        # Keys built from the pattern, so that many pairs match.
        fill = ".".join(
            rng.choice(literal) if w in ("*", "#") else w
            for w in pattern.split(".")
            if not (w == "#" and rng.random() < 0.5)
        )
        pairs.add((pattern, fill))
    frame = spark.createDataFrame(
        [(p, topic_regex(p), k) for p, k in sorted(pairs)],
        "pattern string, regex string, key string",
    )
    got = {
        (r["pattern"], r["key"]): r["m"]
        for r in frame.select(
            "pattern", "key", F.expr("concat('.', key) rlike regex").alias("m")
        ).collect()
    }
    wrong = [pair for pair, matched in got.items() if matched != topic_matches(*pair)]
    assert not wrong, wrong[:10]
    assert sum(got.values()) > len(got) // 4  # the sample holds matches, not only misses


def _days(case: Case) -> list[datetime]:
    assert case.expected is not None and case.now is not None
    first = datetime(2026, 11, 1, tzinfo=UTC)
    return [first + timedelta(days=n) for n in range((case.now - first).days + 1)]


@pytest.mark.parametrize("day", [0, 13, 29])
def test_a_day_audit_reads_only_its_days_and_later_and_equals_it_reading_everything(
    spark: Any, cases: dict[str, Case], day: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pyspark.sql import functions as F

    from outbox_inbox.analytics import audit
    from outbox_inbox.analytics.audit import Window

    case = cases["month"]
    since = _days(case)[day]
    pruned = _audit(spark, case, window=Window(since, since + timedelta(days=1)))
    # The same window reading every partition and every row: nothing is left unread.
    listed = audit._listed
    monkeypatch.setattr(audit, "_listed", lambda base, first: listed(base, None))
    monkeypatch.setattr(Window, "read", lambda self: F.lit(True))
    everything = _audit(spark, case, window=Window(since, since + timedelta(days=1)))
    for summary in (pruned, everything):
        summary["inputs"].pop("window")
    assert comparable(pruned) == comparable(everything)
    assert pruned["totals"]["sent"] > 0


def test_day_audits_add_up_to_the_whole_audit(
    spark: Any, cases: dict[str, Case], whole_audit: Callable[[str], dict[str, Any]]
) -> None:
    from outbox_inbox.analytics.audit import Window

    case = cases["month"]
    whole = whole_audit("month")["totals"]
    days = _days(case)
    sums = dict.fromkeys(TOTALS, 0)
    # Ten-day windows over every day the archive holds (a window after it is an error).
    for start in range(0, len(days) - 1, 10):
        window = Window(days[start], days[start] + timedelta(days=10))
        totals = _audit(spark, case, window=window)["totals"]
        for name in TOTALS:
            sums[name] += totals[name]
    assert sums == {name: whole[name] for name in TOTALS}
    assert whole["handled_more_than_once"] == 2 and whole["lost"] == 7


def _write(root: Path, source: str, service: str, rows: list[dict[str, Any]]) -> None:
    """Archive `rows` of `source` as `outbox-inbox archive` lays them out, one file per day."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from outbox_inbox.archive import _by_day, arrow_schema

    for day, day_rows in _by_day(source, rows, None):
        folder = root / source / f"service={service}" / f"date={day.isoformat()}"
        folder.mkdir(parents=True, exist_ok=True)
        table = pa.Table.from_pylist(day_rows, schema=arrow_schema(source))
        pq.write_table(table, folder / "part-0.parquet")


@pytest.fixture(scope="module")
def midnight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three commands to billing around the midnight that starts 2026-11-10: one published
    the second before it (received after), one the second before the next midnight (received
    after that), one at noon; each received two seconds after its publication."""
    root = tmp_path_factory.mktemp("midnight")
    day = datetime(2026, 11, 10, tzinfo=UTC)
    published = {
        "before": day - timedelta(seconds=1),
        "late": day + timedelta(days=1, seconds=-1),
        "noon": day + timedelta(hours=12),
    }
    archived = datetime(2026, 12, 1, tzinfo=UTC)
    outbox = [
        {
            "id": n,
            "message_id": f"00000000-0000-4000-8000-00000000000{n}",
            "kind": "command",
            "exchange": "commands",
            "routing_key": "billing.invoice.create",
            "created_at": at - timedelta(milliseconds=5),
            "published_at": at,
            "attempts": 0,
            "archived_at": archived,
        }
        for n, at in enumerate(published.values(), start=1)
    ]
    inbox = [
        dict(
            row,
            source="orders",
            received_at=row["published_at"] + timedelta(seconds=2),
            processed_at=row["published_at"] + timedelta(seconds=3),
            status="processed",
            attempts=1,
            duplicates=0,
        )
        for row in outbox
    ]
    _write(root / "orders", "outbox", "orders", outbox)
    _write(root / "billing", "inbox", "billing", inbox)
    return root


def test_receipts_just_outside_the_window_belong_to_their_messages(
    spark: Any, midnight: Path
) -> None:
    from outbox_inbox.analytics.audit import Window, run_audit

    day = datetime(2026, 11, 10, tzinfo=UTC)
    roots = [str(midnight / "orders"), str(midnight / "billing")]
    now = datetime(2026, 11, 20, tzinfo=UTC)
    summary = run_audit(spark, roots, now=now, window=Window(day, day + timedelta(days=1)))
    t = summary["totals"]
    # "late" was received after the window: delivered. "before" was received inside it but
    # published before it: it belongs to the day before, not an unexpected receipt here.
    assert (t["sent"], t["delivered"], t["lost"], t["unexpected"]) == (2, 2, 0, 0)
    assert [s["received"] for s in summary["services"] if s["service"] == "billing"] == [2]


@pytest.fixture(scope="module")
def late_commit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An order whose outbox row was created on 2026-11-10 and committed (so published) on
    the 13th, received on the 18th, after a receiver outage; an order of the 13th received at
    once; and a receipt of a message nobody archived, created the 12th, received the 13th."""
    root = tmp_path_factory.mktemp("late-commit")
    at = datetime(2026, 11, 10, 23, tzinfo=UTC)
    created = {"late": at, "prompt": at + timedelta(days=2, hours=13)}
    published = {"late": at + timedelta(days=2, hours=11), "prompt": created["prompt"]}
    received = {"late": at + timedelta(days=8), "prompt": published["prompt"]}
    outbox = [
        {
            "id": n,
            "message_id": f"00000000-0000-4000-8000-00000000000{n}",
            "kind": "command",
            "exchange": "commands",
            "routing_key": "billing.invoice.create",
            "created_at": created[name],
            "published_at": published[name],
            "attempts": 0,
            "archived_at": datetime(2026, 12, 1, tzinfo=UTC),
        }
        for n, name in enumerate(created, start=1)
    ]
    stranger = dict(outbox[0], message_id="00000000-0000-4000-8000-000000000009")
    inbox = [
        dict(
            row,
            source="orders",
            received_at=got + timedelta(seconds=2),
            processed_at=got + timedelta(seconds=3),
            status="processed",
            attempts=1,
            duplicates=0,
        )
        for row, got in zip(
            [*outbox, dict(stranger, created_at=at + timedelta(days=1, hours=12))],
            [*received.values(), at + timedelta(days=2, hours=1)],
            strict=True,
        )
    ]
    _write(root / "orders", "outbox", "orders", outbox)
    _write(root / "billing", "inbox", "billing", inbox)
    return root


def test_a_late_commit_is_judged_in_its_publication_window_as_in_the_whole_audit(
    spark: Any, late_commit: Path
) -> None:
    from outbox_inbox.analytics.audit import Window, run_audit

    roots = [str(late_commit / "orders"), str(late_commit / "billing")]
    now = datetime(2026, 11, 25, tzinfo=UTC)
    keys = ("sent", "delivered", "lost", "unexpected")
    whole = run_audit(spark, roots, now=now)["totals"]
    assert [whole[k] for k in keys] == [2, 2, 0, 1]
    first = datetime(2026, 11, 10, tzinfo=UTC)
    days = {}
    for n in range(9):  # to the last day archived: a window after it is an error
        since = first + timedelta(days=n)
        totals = run_audit(spark, roots, now=now, window=Window(since, since + timedelta(1)))
        days[since.day] = [totals["totals"][k] for k in keys]
    # Both orders in the day they were published, delivered however late the receipt; the
    # stranger's receipt in the day its message was created.
    assert days[13] == [2, 2, 0, 0]
    assert days[12] == [0, 0, 0, 1]
    assert sum(map(sum, days.values())) == 5


def test_webhook_deliveries_are_not_messages_to_the_audit(spark: Any, tmp_path: Path) -> None:
    """An event and its delivery row to the endpoint ``erp`` (webhooks.py): one message sent,
    to a service subscribed to it, and received there; the delivery is expected nowhere."""
    from outbox_inbox.analytics.audit import run_audit
    from outbox_inbox.archive import SUBSCRIPTIONS, to_records, write_parquet

    at = datetime(2026, 11, 10, 12, tzinfo=UTC)
    event = {
        "id": 1,
        "message_id": "00000000-0000-4000-8000-000000000001",
        "kind": "event",
        "exchange": "events",
        "routing_key": "orders.order.placed",
        "created_at": at,
        "published_at": at,
        "attempts": 0,
        "archived_at": at + timedelta(days=2),
    }
    delivery = dict(event, id=2, exchange="webhook:erp", message_id=event["message_id"][:-1] + "2")
    received = dict(event, source="orders", received_at=at, status="processed", attempts=1)
    _write(tmp_path / "orders", "outbox", "orders", [event, delivery])
    _write(tmp_path / "billing", "inbox", "billing", [dict(received, processed_at=at)])
    subscribed = [{"exchange": "events", "pattern": "orders.order.*", "subscribed_at": at}]
    path = tmp_path / "billing" / SUBSCRIPTIONS / "service=billing" / "subscriptions.parquet"
    path.parent.mkdir(parents=True)
    write_parquet(path, SUBSCRIPTIONS, to_records(SUBSCRIPTIONS, subscribed, None))
    roots = [str(tmp_path / "orders"), str(tmp_path / "billing")]
    totals = run_audit(spark, roots, now=at + timedelta(days=3))["totals"]
    assert (totals["sent"], totals["events"], totals["lost"]) == (1, 1, 0)


def test_a_window_the_archive_does_not_hold_is_an_error_not_an_empty_report(
    spark: Any, midnight: Path
) -> None:
    from outbox_inbox.analytics.audit import AuditError, Window, run_audit

    since = datetime(2027, 1, 1, tzinfo=UTC)
    with pytest.raises(AuditError, match="no archive partition holds the day 2027-01-01 or a"):
        run_audit(spark, [str(midnight / "orders")], window=Window(since, since + timedelta(1)))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--day", "2026-11-10", "--since", "2026-11-09"), "--day cannot be combined"),
        (("--until", "2026-11-09"), "--until needs --since"),
        (("--since", "2026-11-10", "--until", "2026-11-10"), "the audit window is empty"),
        (("--day", "2026-11-10T05:00"), "is not a day like 2026-11-25"),
        (("--since", "yesterday"), "is not a date or time"),
    ],
)
def test_audit_window_options_refuse_bad_input_in_one_line(
    args: tuple[str, ...], message: str, midnight: Path
) -> None:
    result = cli("audit", str(midnight / "orders"), *args)
    assert result.returncode in (1, 2), result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_audit_command_audits_one_day_and_fails_on_a_day_never_archived(
    midnight: Path, tmp_path: Path, warm_spark: dict[str, str]
) -> None:
    roots = [str(midnight / "orders"), str(midnight / "billing")]
    day = ("--day", "2026-11-10")
    done = cli("audit", *roots, *day, "--out", str(tmp_path), "--json", env=warm_spark)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["inputs"]["window"] == {
        "since": "2026-11-10T00:00:00+00:00",
        "until": "2026-11-11T00:00:00+00:00",
    }
    assert (summary["totals"]["sent"], summary["totals"]["delivered"]) == (2, 2)
    missing = cli("audit", *roots, "--day", "2026-12-24", "--out", str(tmp_path / "x"))
    assert missing.returncode == 1
    assert "no archive partition holds the day 2026-12-24 or a later one" in missing.stderr
    assert not (tmp_path / "x" / "summary.json").exists()


def test_day_results_combine_into_the_whole_audit_without_reading_a_row(
    spark: Any,
    cases: dict[str, Case],
    whole_audit: Callable[[str], dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from contextlib import contextmanager

    from outbox_inbox.analytics import report
    from outbox_inbox.analytics.audit import Window

    @contextmanager
    def this_session(*_: Any) -> Any:
        yield spark, "Spark: the test's session"

    case = cases["month"]
    monkeypatch.setattr(report, "_one_shot", this_session)
    monkeypatch.setattr(report, "run_audit", functools.partial(report.run_audit, now=case.now))
    results = tmp_path / "days"
    whole = whole_audit("month")  # as write_audit(..., case.roots, grace=case.grace) gives it
    days = _days(case)[:-1]  # the 30 days the archive holds
    for day in days:
        window = Window(day, day + timedelta(days=1))
        report.write_audit(
            tmp_path / "day", case.roots, grace=case.grace, window=window, results=results
        )
    monkeypatch.setattr(report, "_one_shot", None)  # the combined report starts no Spark
    month = Window(days[0], days[-1] + timedelta(days=1))
    combined, _ = report.combine_days(tmp_path / "combined", results, month)

    got, want = comparable(json.loads(json.dumps(combined))), comparable(whole)
    for summary in (got, want):
        summary.pop("inputs", None)
    got_latency, want_latency = got.pop("latency"), want.pop("latency")
    assert got == want  # every count, example, histogram and throughput bucket
    assert whole["totals"]["lost"] == 7 and whole["totals"]["handled_more_than_once"] == 2
    assert [(r["type"], r["count"]) for r in got_latency] == [
        (r["type"], r["count"]) for r in want_latency
    ]
    for mine, theirs in zip(got_latency, want_latency, strict=True):
        for stage, figures in theirs["stages"].items():
            assert mine["stages"][stage]["max"] == figures["max"]
            for p in ("p50", "p90", "p99"):  # within the 1% of the latency buckets
                assert mine["stages"][stage][p] == pytest.approx(figures[p], rel=0.0101, abs=1e-6)


def test_audit_command_stores_day_results_and_combines_them_without_spark(
    midnight: Path, tmp_path: Path, warm_spark: dict[str, str]
) -> None:
    roots = [str(midnight / "orders"), str(midnight / "billing")]
    results = str(tmp_path / "days")
    for day in ("2026-11-10", "2026-11-11"):
        kept = ("--day", day, "--results", results, "--out", str(tmp_path))
        done = cli("audit", *roots, *kept, env=warm_spark)
        assert done.returncode == 0, done.stderr
    both = ("--since", "2026-11-10", "--until", "2026-11-12", "--results", results)
    combined = cli("audit", *roots, *both, "--out", str(tmp_path / "both"), "--json")
    assert combined.returncode == 0, combined.stderr
    assert "Spark" not in combined.stderr  # no session, warm or one-shot, was used
    totals = json.loads(combined.stdout)["totals"]
    assert (totals["sent"], totals["delivered"], totals["unexpected"]) == (2, 2, 0)
    # Results stored by the versions before 2026-12 count a bucket's publications as "sent".
    for stored in Path(results).glob("*.json"):
        record = json.loads(stored.read_text())
        for part in (p for p in record["parts"] if p["g"] == "t"):
            part["sent"] = part.pop("n")
        stored.write_text(json.dumps(record))
    older = cli("audit", *roots, *both, "--out", str(tmp_path / "older"), "--json")
    assert older.returncode == 0, older.stderr
    throughput = json.loads(combined.stdout)["throughput"]
    assert sum(b["published"] for b in throughput["series"]) == 2
    assert json.loads(older.stdout)["throughput"] == throughput
    earlier = ("--since", "2026-11-09", "--until", "2026-11-11", "--results", results)
    missing = cli("audit", *roots, *earlier, "--out", str(tmp_path / "x"))
    assert missing.returncode == 1
    assert f"no result of 2026-11-09 in {results}" in missing.stderr
