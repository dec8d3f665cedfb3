"""`outbox-inbox archive` and `outbox-inbox audit`: the message-history pipeline."""

from __future__ import annotations

import dataclasses
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import click

from outbox_inbox.archive import SOURCES, Archiver, ArchiveResult
from outbox_inbox.config import DB_URL_ENV, Settings, validate_db_url
from outbox_inbox.status import subscribed_services

from .output import EXIT_UNHEALTHY, echo, echo_json, progress, render_table, verbosity
from .target import Target, fail, json_option, parse_duration, parse_time, resolve
from .target import target_options as _target_options

if TYPE_CHECKING:
    from outbox_inbox.analytics.audit import Window

DEFAULT_RETENTION = "7d"


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """An event set by SIGTERM or SIGINT: the job stops after the batch in hand."""
    stop = threading.Event()

    def handler(signum: int, _frame: FrameType | None) -> None:
        echo(f"signal {signum}: stopping after the batch in hand", err=True)
        stop.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _service_name(target: Target) -> str:
    """--app's or --service's name, else the one service the subscriptions table names."""
    if target.name is not None:
        return target.name
    services = subscribed_services(target.engine(), target.tables)
    if len(services) != 1:
        fail(
            "cannot tell which service's rows these are "
            f"({len(services)} services in its subscriptions): pass --service NAME or --app"
        )
    return str(services[0])


def checked_settings(
    target: Target, retention: timedelta | None, dead_retention: timedelta | None, **more: Any
) -> Settings:
    """The app's settings (else the defaults) with the options given, validated as a Service
    validates them: a retention shorter than the duplicate window is refused."""
    given = {
        "retention": None if retention is None else retention.total_seconds(),
        "dead_retention": None if dead_retention is None else dead_retention.total_seconds(),
        **more,
    }
    base = target.service.settings if target.service is not None else Settings()
    return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


@click.command()
@_target_options
@click.option(
    "--to",
    "root",
    required=True,
    metavar="DIRECTORY",
    help="Archive root (a local or mounted directory); created when missing.",
)
@click.option(
    "--older-than",
    default=DEFAULT_RETENTION,
    show_default=True,
    metavar="DURATION",
    callback=parse_duration,
    help="Retention: rows finished longer ago than this are archived (e.g. 36h, 7d).",
)
@click.option(
    "--batch-size",
    default=10_000,
    show_default=True,
    type=click.IntRange(min=1),
    metavar="N",
    help="Rows per batch (per file and transaction).",
)
@click.option("--dry-run", is_flag=True, help="Only count what would be archived.")
@json_option
def archive(
    root: str,
    older_than: timedelta,
    batch_size: int,
    dry_run: bool,
    as_json: bool,
    **target_options: str | None,
) -> None:
    """Move published outbox rows and processed or dead inbox rows into Parquet files.

    \b
    Rows finished longer ago than --older-than (by the database clock) are written to
      DIRECTORY/outbox/service=NAME/date=YYYY-MM-DD/part-*.parquet
      DIRECTORY/inbox/service=NAME/date=YYYY-MM-DD/part-*.parquet
    batch by batch; each file is synced before its rows are deleted. Unpublished outbox rows
    and pending inbox rows are never moved. After a crash, run it again: the interrupted
    batch is finished first, and no row is lost or written twice. SIGTERM stops after the
    batch in hand. One run per schema at a time.

    The retention is also the inbox's duplicate-detection window: a copy of a message that
    arrives after the message was archived is stored and handled again. Keep it longer than
    any redelivery can take (docs/history.md).
    """
    target = resolve(**target_options)
    try:
        # The retention is the duplicate window, here as in `partitions` and Service.
        checked_settings(target, older_than, None)
        name = _service_name(target)
        bar: list[Callable[[int], None]] = []  # the progress bar's advance(n), once it shows
        archiver = Archiver(
            target.engine(),
            target.tables,
            name,
            root,
            older_than=older_than,
            batch_size=batch_size,
            progress=lambda _source, n: bar[0](n) if bar else None,
        )
        counts = archiver.count()
        if dry_run:
            _print_counts(name, archiver.root, counts, as_json)
            return
        with _stop_on_signals() as stop, progress(sum(counts.values()), name) as advance:
            bar.append(advance)
            result = archiver.run(stop)
    finally:
        target.close()
    _print_result(name, archiver.root, result, as_json)


def _print_counts(name: str, root: Path, counts: dict[str, int], as_json: bool) -> None:
    if as_json:
        echo_json({"service": name, "root": str(root), "dry_run": True, "rows": counts})
        return
    echo(f"{name}: would archive into {root}")
    echo(render_table(["table", "rows"], [[s, counts[s]] for s in SOURCES]))


def _print_result(name: str, root: Path, result: ArchiveResult, as_json: bool) -> None:
    report: dict[str, Any] = {
        "service": name,
        "root": str(root),
        "cutoff": result.cutoff.isoformat() if result.cutoff else None,
        "rows": result.rows,
        "files": result.files,
        "recovered_files": result.recovered_files,
        "abandoned_files": result.abandoned_files,
        "kept_rows": result.kept_rows,
        "pruned_deliveries": result.pruned_deliveries,
        "interrupted": result.interrupted,
    }
    if as_json:
        echo_json(report)
        return
    echo(f"{name}: archived rows finished before {report['cutoff']} into {root}")
    echo(render_table(["table", "rows"], [[s, result.rows[s]] for s in SOURCES]))
    echo(f"files written: {result.files}")
    if result.recovered_files or result.abandoned_files:
        echo(
            f"an interrupted run was finished: {result.recovered_files} file(s) completed, "
            f"{result.abandoned_files} never written"
        )
    if result.kept_rows:
        echo(f"{result.kept_rows} row(s) changed after they were written and stay in the table")
    if result.interrupted:
        echo("stopped by a signal: run again to archive the rest")


@click.command()
@click.argument("archives", nargs=-1, metavar="ARCHIVE...")
@click.option(
    "--db-url",
    "db_urls",
    multiple=True,
    metavar="URL",
    help="Also read this service database's live tables (repeatable). "
    f"{DB_URL_ENV} is not used here: name each database.",
)
@click.option("--schema", metavar="NAME", help="Schema of the live tables [outbox_inbox].")
@click.option(
    "--master",
    metavar="URL",
    help="Spark master: local[*], local[4], spark://host:7077, yarn ... "
    "[default: spark-submit's, else local[*]].",
)
@click.option(
    "--out",
    "out_dir",
    default="audit-report",
    show_default=True,
    metavar="DIRECTORY",
    help="Where summary.json and report.html are written.",
)
@click.option(
    "--grace",
    default="5m",
    show_default=True,
    metavar="DURATION",
    callback=parse_duration,
    help="A delivery missing for less than this since its publication is in flight, not lost.",
)
@click.option(
    "--since",
    metavar="TIME",
    callback=parse_time,
    help="Audit only the messages published from TIME on (2026-11-25 or an ISO 8601 time; "
    "UTC unless it says otherwise), reading only the archive days that can hold them.",
)
@click.option(
    "--until",
    metavar="TIME",
    callback=parse_time,
    help="... and before TIME [default: now]. Needs --since.",
)
@click.option(
    "--day",
    metavar="YYYY-MM-DD",
    callback=parse_time,
    help="Audit the messages published on this UTC day: --since DAY --until the next day.",
)
@click.option(
    "--results",
    metavar="DIRECTORY",
    help="Day results: --day stores the day's there too; --since DAY --until DAY (days) "
    "combines those days' stored results into the report, without Spark.",
)
@click.option(
    "--driver-memory",
    default="2g",
    show_default=True,
    metavar="SIZE",
    help="Memory of a local Spark driver (ignored on a cluster).",
)
@click.option(
    "--conf",
    "confs",
    multiple=True,
    metavar="KEY=VALUE",
    help="Extra Spark configuration (repeatable), e.g. spark.executor.memory=4g.",
)
@click.option(
    "--server",
    type=click.Choice(["warm", "none", "status", "stop"]),
    default="warm",
    show_default=True,
    envvar="OUTBOX_INBOX_SPARK_SERVER",
    help="warm: run on the local Spark Connect server, started when none runs; none: a "
    "one-shot Spark session; status, stop: show or stop the server (no audit).",
)
@json_option
def audit(
    archives: tuple[str, ...],
    db_urls: tuple[str, ...],
    schema: str | None,
    master: str | None,
    out_dir: str,
    grace: timedelta,
    since: datetime | None,
    until: datetime | None,
    day: datetime | None,
    results: str | None,
    driver_memory: str,
    confs: tuple[str, ...],
    server: str,
    as_json: bool,
) -> None:
    """Reconcile what every service sent with what every service received, on Spark.

    \b
    ARCHIVE is an archive root written by `outbox-inbox archive` (a directory, or any path
    Spark reads: hdfs://, s3a://); give every service's. Reports lost messages, duplicates
    absorbed, messages handled more than once, latency percentiles per type, retries, dead
    letters and throughput (docs/history.md). --day, or --since (and --until): only the
    messages published in that window, reading only the archive days from its start on.

    \b
    Runs on a local Spark Connect server kept warm between runs (--server), unless --master,
    --conf or spark-submit say where. Writes OUT/summary.json and OUT/report.html.
    Exit 0 when nothing was lost or handled twice, 4 otherwise.
    """
    from outbox_inbox.analytics import server as warm
    from outbox_inbox.analytics.report import write_audit

    if server in ("status", "stop"):
        found = warm.status() if server == "status" else warm.stop()
        shown = {k: v for k, v in (found or {}).items() if k != "token"}
        text = ", ".join(f"{k} {v}" for k, v in shown.items()) or "no server runs"
        echo_json(shown) if as_json else echo(f"{server}: {text}")
        return
    config = _audit_inputs(archives, db_urls, confs)
    db_urls = tuple(map(validate_db_url, db_urls))  # postgres:// read as the library reads it
    window = _window(since, until, day)
    summary, out = write_audit(
        out_dir,
        archives,
        db_urls=db_urls,
        schema=schema,
        master=master,
        driver_memory=driver_memory,
        config=config,
        grace=grace,
        window=window,
        results=results,
        warm=server == "warm",
        verbose=verbosity() > 0,
        note=lambda line: echo(line, err=True),
    )
    echo_json(summary) if as_json else _print_summary(summary, out)
    if not summary["ok"]:
        raise SystemExit(EXIT_UNHEALTHY)


def _window(since: datetime | None, until: datetime | None, day: datetime | None) -> Window | None:
    """The audit's window from its options, or None for the whole history."""
    from outbox_inbox.analytics.audit import Window
    from outbox_inbox.errors import ConfigurationError

    if day is not None:
        if since is not None or until is not None:
            fail("--day cannot be combined with --since or --until")
        since, until = day, day + timedelta(days=1)
    if since is None:
        if until is not None:
            fail("--until needs --since")
        return None
    try:
        return Window(since, until or datetime.now(UTC))
    except ConfigurationError as exc:
        fail(str(exc))


def _audit_inputs(
    archives: tuple[str, ...], db_urls: tuple[str, ...], confs: tuple[str, ...]
) -> dict[str, str]:
    """Check the audit's inputs (failing with one line); return the Spark --conf settings."""
    if not archives and not db_urls:
        fail("nothing to audit: give at least one ARCHIVE directory or --db-url")
    for path in archives:
        if "://" not in path and not Path(path).is_dir():
            fail(f"archive {path!r} is not a directory")
    config = {}
    for item in confs:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"--conf {item!r} is not KEY=VALUE")
        config[key.strip()] = value.strip()
    return config


def _print_summary(summary: dict[str, Any], out: Path) -> None:
    t = summary["totals"]
    verdict = (
        "OK: nothing lost, nothing handled twice"
        if summary["ok"]
        else f"FAILED: {t['lost']} lost, {t['handled_more_than_once']} handled more than once"
    )
    echo(verdict)
    names = "sent expected_deliveries delivered lost in_flight duplicates_absorbed"
    names += " handled_more_than_once unexpected dead retries"
    label = {"unexpected": "received from outside"}
    rows = [[label.get(n, n.replace("_", " ")), t[n]] for n in names.split()]
    echo(render_table(["", "count"], rows))
    echo(f"report: {out / 'report.html'}\nsummary: {out / 'summary.json'}")
