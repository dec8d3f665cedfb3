"""`outbox-inbox partitions list | maintain`: the time partitions of the outbox and the inbox.

The listing and the pass are the library's (outbox_inbox.partitions.survey and maintain);
this module chooses the retention from the options or the app's settings, and prints.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import click

from outbox_inbox.clock import as_timedelta
from outbox_inbox.config import Settings
from outbox_inbox.dashboard.views import format_age
from outbox_inbox.partitions import (
    INTERVALS,
    MaintenanceResult,
    PartitionState,
    Retention,
    maintain,
    partitioned,
    survey,
)

from .history import _service_name, checked_settings
from .output import echo, echo_json, plural, render_table
from .target import (
    Target,
    app_option,
    db_url_option,
    fail,
    json_option,
    parse_duration,
    resolve,
    schema_option,
    service_option,
)

PLAIN = "no partitions: the outbox and the inbox are plain tables"


@click.group()
def partitions() -> None:
    """List the time partitions of the outbox and the inbox; run one maintenance pass.

    On PostgreSQL (migration 0006 and later) outbox_messages is partitioned by created_at and
    inbox_messages by received_at, by UTC day or hour. Every role of a service runs a
    maintenance pass at its start and every maintenance_interval: it makes partitions ahead
    and drops those past the retention that hold no unfinished row. Run `maintain` as the
    tables' owner when the service's own database role may not run DDL (docs/runbook.md).
    SQLite keeps plain tables: both commands say so and exit 0.
    """


def _retention_options(function: Any) -> Any:
    options = [
        click.option(
            "--retention",
            metavar="DURATION",
            callback=parse_duration,
            help="Keep a partition this long after its range ended (7d) "
            "[default: the app's retention, else 7d].",
        ),
        click.option(
            "--dead-retention",
            metavar="DURATION",
            callback=parse_duration,
            help="Keep a dead or parked row's partition this long after it died "
            "[default: the app's dead_retention, else 30d].",
        ),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _retention(settings: Settings) -> Retention:
    return Retention(as_timedelta(settings.retention), as_timedelta(settings.dead_retention))


def _postgres(target: Target) -> bool:
    """Whether the target's database is PostgreSQL; SQLite keeps plain tables."""
    return target.engine().dialect.name != "sqlite"


def _size(n: int) -> str:
    """``8192 bytes``, ``16 kB``, ``120 MB``, ``3 GB`` (as pg_size_pretty rounds)."""
    size, unit = float(n), "bytes"
    for bigger in ("kB", "MB", "GB"):
        if size < 10 * 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:.0f} {unit}"


def _when(moment: Any) -> str:
    return "-" if moment is None else f"{moment:%Y-%m-%d %H:%M}"


def _fate(state: PartitionState) -> str:
    if not state.past_retention:
        return ""
    return f"kept: {state.kept}" if state.kept else "past: the next pass drops it"


@partitions.command(
    "list", short_help="Each partition, oldest first: range, rows, size, retention."
)
@app_option
@service_option
@db_url_option
@schema_option
@_retention_options
@json_option
def list_command(
    app: str | None,
    service: str | None,
    db_url: str | None,
    schema: str | None,
    retention: timedelta | None,
    dead_retention: timedelta | None,
    as_json: bool,
) -> None:
    """Each partitioned table's partitions, oldest first: range (UTC), estimated rows
    (pg_class.reltuples; - before the first ANALYZE), size with indexes, and for those past the
    retention whether the next pass drops them or keeps them, and why. Changes nothing."""
    target = resolve(app=app, service=service, db_url=db_url, schema=schema)
    try:
        settings = checked_settings(target, retention, dead_retention)
        postgres = _postgres(target)
        found: list[PartitionState] = []
        if postgres:
            with target.engine().connect() as conn:
                found = survey(conn, target.tables, _retention(settings))
    finally:
        target.close()
    if as_json:
        echo_json(
            {
                "partitioned": bool(found),
                "retention_seconds": settings.retention,
                "dead_retention_seconds": settings.dead_retention,
                "partitions": [s.as_dict() for s in found],
            }
        )
        return
    if not found:
        echo(_plain_note(postgres))
        return
    rows = [
        (
            s.partition.parent,
            s.partition.name + (" (detach pending)" if s.partition.detach_pending else ""),
            _when(s.partition.lower),
            _when(s.partition.upper),
            "-" if s.rows is None else s.rows,
            _size(s.size_bytes),
            _fate(s),
        )
        for s in found
    ]
    headers = ["TABLE", "PARTITION", "FROM (UTC)", "TO (UTC)", "ROWS (EST.)", "SIZE", "RETENTION"]
    echo(render_table(headers, rows))
    past = [s for s in found if s.past_retention]
    kept = [s for s in past if s.kept]
    echo(
        f"{plural(len(found), 'partition')}; retention {format_age(settings.retention)}: "
        f"{len(past)} past it, {len(kept)} kept"
    )


@partitions.command(
    "maintain", short_help="One maintenance pass: make, export and drop partitions."
)
@app_option
@service_option
@db_url_option
@schema_option
@_retention_options
@click.option(
    "--interval",
    type=click.Choice(sorted(INTERVALS)),
    help="Length of the partitions made ahead [default: the app's partition_interval, "
    "else as long as the newest partition].",
)
@click.option(
    "--archive-to",
    metavar="DIRECTORY",
    help="Export each partition to Parquet here before dropping it, as `archive` lays it "
    "out [default: the app's archive_to, else no export].",
)
@json_option
def maintain_command(
    app: str | None,
    service: str | None,
    db_url: str | None,
    schema: str | None,
    retention: timedelta | None,
    dead_retention: timedelta | None,
    interval: str | None,
    archive_to: str | None,
    as_json: bool,
) -> None:
    """One maintenance pass: make the partitions ahead, export (--archive-to) and drop those
    past the retention that hold no unfinished row, prune the redelivery counters and the rows
    of dead workers. Prints what it made, dropped, kept and exported.

    Runs DDL: run it as the tables' owner. One pass per schema at a time: exit 1 when another
    (a running service's) holds the lock, having done nothing.
    """
    target = resolve(app=app, service=service, db_url=db_url, schema=schema)
    try:
        settings = checked_settings(
            target, retention, dead_retention, partition_interval=interval, archive_to=archive_to
        )
        postgres = _postgres(target)
        plain = not postgres or not _partitioned(target)
        result = MaintenanceResult()
        if not plain:
            result = _maintain(target, settings, interval)
    finally:
        target.close()
    if result.busy:
        fail(f"another maintenance pass holds the lock of schema {target.schema}: nothing done")
    _print_result(result, _plain_note(postgres) if plain else None, as_json)


def _partitioned(target: Target) -> bool:
    with target.engine().connect() as conn:
        return bool(partitioned(conn, target.schema))


def _plain_note(postgres: bool) -> str:
    """What to say of plain tables: SQLite's, or PostgreSQL's before migration 0006."""
    return f"{PLAIN} (run `outbox-inbox db upgrade`)" if postgres else PLAIN


def _maintain(target: Target, settings: Settings, interval: str | None) -> MaintenanceResult:
    exporter = None
    if settings.archive_to:
        from outbox_inbox.archive import partition_exporter

        exporter = partition_exporter(target.tables, _service_name(target), settings.archive_to)
    return maintain(
        target.engine(),
        target.tables,
        # Without --interval or an app, partitions as long as the newest one.
        interval=interval or (settings.partition_interval if target.service else None),
        retention=_retention(settings),
        exporter=exporter,
    )


def _print_result(result: MaintenanceResult, plain: str | None, as_json: bool) -> None:
    if as_json:
        echo_json({"partitioned": plain is None, **dataclasses.asdict(result)})
        return
    if plain is not None:
        echo(plain)
        return
    if not (result.created or result.dropped or result.kept or result.exported) and not (
        result.pruned_deliveries or result.pruned_instances
    ):
        echo("nothing to do: the partitions ahead are made, and none is past the retention")
        return
    echo(f"made: {', '.join(result.created) or 'none'}")
    echo(f"dropped: {', '.join(result.dropped) or 'none'}")
    for name, why in result.kept.items():
        echo(f"kept: {name}: {why}")
    for source, rows in result.exported.items():
        echo(f"exported: {source} {plural(rows, 'row')}")
    if result.pruned_deliveries or result.pruned_instances:
        echo(
            f"pruned: {plural(result.pruned_deliveries, 'delivery counter')}, "
            f"{plural(result.pruned_instances, 'row')} of dead workers"
        )
