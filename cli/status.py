"""`outbox-inbox status`: backlog, inbox states, held-back keys; a health check with thresholds."""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import click

from outbox_inbox.dashboard.views import TENANT_HEADERS, cap_shown, format_age, tenants_shown
from outbox_inbox.status import health

from .output import EXIT_UNHEALTHY, echo, echo_json, one_line, render_table
from .target import json_option, parse_duration, resolve, target_options


@click.command()
@target_options
@click.option(
    "--max-lag",
    metavar="DURATION",
    callback=parse_duration,
    help="Unhealthy when the oldest unpublished outbox row or pending inbox row is older "
    "(e.g. 30s, 5m).",
)
@click.option(
    "--max-dead",
    type=click.IntRange(min=0),
    metavar="N",
    help="Unhealthy when there are more dead letters (dead rows + <service>.dead_letter).",
)
@click.option("--no-broker", is_flag=True, help="Do not ask the broker for the queue depths.")
@click.option(
    "--keys",
    "keys_limit",
    default=20,
    show_default=True,
    type=click.IntRange(min=0),
    metavar="N",
    help="Held-back keys to list.",
)
@json_option
def status(
    app: str | None,
    service: str | None,
    schema: str | None,
    db_url: str | None,
    mq_url: str | None,
    max_lag: timedelta | None,
    max_dead: int | None,
    no_broker: bool,
    keys_limit: int,
    as_json: bool,
) -> None:
    """Outbox backlog, inbox pending / in progress / dead, and keys held back.

    \b
    outbox     unpublished rows, how many failed at least once, age of the oldest; dead
               rows (refused by the broker on every attempt: see dead-letters)
    webhook    per endpoint: deliveries waiting (failed at least once), dead; last error
    inbox      pending (waiting for a worker, due or scheduled for a retry), in progress
               (leased by a worker), dead, processed; age of the oldest pending row;
               the same counts per message type
    held keys  ordering keys whose head message failed and waits for its retry, holding
               back the messages behind it
    queues     ready messages and consumers of <service>.inbox, <service>.dead_letter
               and unroutable (when a broker URL is known; --no-broker skips them)

    \b
    As a health check: exit 4 when --max-lag or --max-dead is exceeded, the inbox is
    stalled (rows claimable for longer than --max-lag, else 60 s, with none in progress
    and none handled: no worker claims), or the broker cannot be asked; exit 1 when the
    database cannot be read; else 0.
    """
    target = resolve(app=app, service=service, schema=schema, db_url=db_url, mq_url=mq_url)
    try:
        checked = health(
            target.engine(),
            target.tables,
            service=target.name,
            broker=target.broker() if not no_broker and target.has_broker else None,
            listen_url=target.service.settings.listen_url if target.service else None,
            held_keys_limit=keys_limit,
            max_lag=max_lag.total_seconds() if max_lag is not None else None,
            max_dead=max_dead,
            tenants=target.service,
        )
    finally:
        target.close()
    report = checked.as_dict()
    if as_json:
        echo_json(report)
    else:
        _print(report)
    for problem in checked.problems:
        echo(f"unhealthy: {problem}", err=True)
    if checked.problems:
        sys.exit(EXIT_UNHEALTHY)


def _print(report: dict[str, Any]) -> None:
    outbox, inbox = report["outbox"], report["inbox"]
    who = f"service {report['service']}, " if report["service"] else ""
    schema = f"schema {report['schema']}, " if report["schema"] else ""  # SQLite has none
    echo(f"{who}{schema}database time {report['database_time']}")
    echo()
    echo(
        f"outbox  unpublished {outbox['unpublished']} (retrying {outbox['retrying']}), "
        f"oldest {format_age(outbox['oldest_age_seconds'])}, dead {outbox['dead']}"
    )
    for w in outbox.get("webhooks", ()):
        error = f", last error: {w['last_error']}" if w["last_error"] else ""
        echo(
            f"webhook {w['endpoint']}: waiting {w['waiting']} (failing {w['failing']}), "
            f"dead {w['dead']}{error}"
        )
    echo(
        f"inbox   pending {inbox['pending']}, in progress {inbox['in_progress']}, "
        f"dead {inbox['dead']}, processed {inbox['processed']}, "
        f"oldest pending {format_age(inbox['oldest_pending_age_seconds'])}"
    )
    if inbox["by_type"]:
        echo()
        types = [
            (t["type"], t["pending"], t["in_progress"], t["dead"], cap_shown(t))
            for t in inbox["by_type"]
        ]
        echo(render_table(["TYPE", "PENDING", "IN PROGRESS", "DEAD", "CAP"], types))
    if inbox["by_tenant"]:
        echo(f"\n{inbox['tenants_waiting']} tenants waiting; most waiting:")
        tenants = [(t["tenant"], t["pending"], t["in_progress"]) for t in inbox["by_tenant"]]
        echo(render_table(["TENANT", "PENDING", "IN PROGRESS"], tenants))
    if report["tenants"]:
        totals, rows = tenants_shown(report["tenants"])
        echo(f"\ntenants {totals}; largest lag first:")
        echo(render_table([h.upper() for h in TENANT_HEADERS], rows))
    _print_wakeups(report.get("wakeups") or {})
    _print_held_keys(report["held_keys"])
    _print_broker(report["broker"])


def _print_wakeups(wakeups: dict[str, Any]) -> None:
    if wakeups.get("mode"):
        echo()
    if wakeups.get("mode") == "polling":
        echo(
            f"wake-ups: polling (NOTIFY does not come back through {wakeups['via']}: a pooler "
            "in transaction mode? set listen_url to a direct PostgreSQL URL)"
        )
    elif wakeups.get("mode"):
        echo(f"wake-ups: {wakeups['mode']} (LISTEN through {wakeups['via']})")


def _print_held_keys(held: dict[str, Any]) -> None:
    echo()
    echo(f"held-back keys: {held['count']}")
    if held["keys"]:
        columns = ("key", "message_id", "type", "failures", "waiting", "next_attempt_at")
        keys = [(*(k[c] for c in columns), one_line(k["last_error"], 50)) for k in held["keys"]]
        headers = ["KEY", "HEAD MESSAGE", "TYPE", "FAILURES", "WAITING", "NEXT ATTEMPT", "ERROR"]
        echo(render_table(headers, keys))
        if held["count"] > len(held["keys"]):
            echo(f"... and {held['count'] - len(held['keys'])} more (--keys N)")


def _print_broker(broker: dict[str, Any] | None) -> None:
    if broker is not None:
        echo()
        rows = [
            (name, "missing", "")
            if queue is None
            else (name, queue["messages"], queue["consumers"])
            for name, queue in broker["queues"].items()
        ]
        if rows:
            echo(render_table(["QUEUE", "MESSAGES", "CONSUMERS"], rows))
        if broker["error"]:
            echo(f"broker: {broker['error']}")
        if broker.get("blocked"):
            echo(f"broker: blocks publishers ({broker['blocked']}): relays wait until it ends")
