"""`outbox-inbox dashboard`: the web dashboard, served until SIGTERM or Ctrl-C."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import click

from outbox_inbox.dashboard import Dashboard, Guard, WatchedService, make_dashboard_server

from .audit import audit_log_option, write_audit
from .output import echo
from .target import Target, fail, parse_duration, resolve

TOKEN_ENV = "OUTBOX_INBOX_DASHBOARD_TOKEN"  # noqa: S105 - the variable's name, not a secret


def _token(token_file: str | None, env_token: str | None) -> str | None:
    if token_file is not None:
        try:
            value = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            fail(f"--token-file {token_file}: {exc.strerror or exc}")
        if not value:
            fail(f"--token-file {token_file} is empty")
        return value
    return env_token.strip() if env_token and env_token.strip() else None


def _watched(target: Target) -> WatchedService:
    name = target.require_name()
    if not target.has_database:
        fail(f"{name}: no database (--db-url, or the app's)")
    broker = target.broker() if target.has_broker else None
    return WatchedService(name, target.engine(), target.tables, broker, target.service)


class _Stop(Exception):
    """SIGTERM: stop serving."""


def _on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise _Stop


@click.command()
@click.option(
    "--app",
    "apps",
    multiple=True,
    metavar="MODULE:ATTR",
    help="A Service to show (repeat for several services).",
)
@click.option("--service", metavar="NAME", help="Service name, instead of --app (with the URLs).")
@click.option("--schema", metavar="NAME", help="PostgreSQL schema of the tables.")
@click.option("--db-url", metavar="URL", envvar="OUTBOX_INBOX_DB_URL", help="SQLAlchemy URL.")
@click.option("--mq-url", metavar="URL", envvar="OUTBOX_INBOX_MQ_URL", help="AMQP URL.")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on. Any other than a loopback address needs a token.",
)
@click.option(
    "--port",
    default=8089,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port to listen on (0: any free port, printed at start).",
)
@click.option(
    "--token-file",
    metavar="PATH",
    type=click.Path(dir_okay=False),
    help=f"File holding the access token [default: env {TOKEN_ENV}].",
)
@click.option(
    "--refresh",
    default=10,
    show_default=True,
    type=click.IntRange(min=0),
    metavar="SECONDS",
    help="Reload the overview page this often (0: never).",
)
@click.option(
    "--max-lag",
    metavar="DURATION",
    callback=parse_duration,
    help="Unhealthy when the oldest unpublished outbox row or pending inbox row is older, and "
    "when no worker claimed for this long while rows wait (as `status --max-lag`).",
)
@audit_log_option
def dashboard(
    apps: tuple[str, ...],
    host: str,
    port: int,
    token_file: str | None,
    refresh: int,
    max_lag: timedelta | None,
    audit_log: str,
    **target_options: str | None,
) -> None:
    """Serve a web dashboard of one or more services until SIGTERM or Ctrl-C.

    \b
    It shows, per service, what `outbox-inbox status` shows (outbox and inbox backlog and
    lag, dead letters, held-back keys, queue depths) with rates, and lists the dead letters
    of every source with filters. A dead letter opens with its payload, headers, error and
    trace id, and can be replayed or purged after a confirmation page: the same work as
    `dead-letters replay / purge --id`, written to the same audit log.

    \b
    Listens on 127.0.0.1 by default. With a token (env OUTBOX_INBOX_DASHBOARD_TOKEN or
    --token-file, at least 16 characters) every request needs it, as a bearer token or as
    the password of HTTP Basic auth; without one, only a loopback --host is accepted.
    """
    token = _token(token_file, os.environ.get(TOKEN_ENV))
    if not apps and not target_options["service"]:
        fail("choose the services to show: --app module:attribute (repeatable) or --service")
    if apps and target_options["service"]:
        fail("pass either --app or --service, not both")
    targets = [resolve(app=a, **target_options) for a in apps] or [resolve(**target_options)]
    try:
        watched = [_watched(t) for t in targets]
        names = [w.name for w in watched]
        if len(set(names)) != len(names):
            fail(f"two services have the same name: {', '.join(names)}")
        app = Dashboard(
            watched,
            audit=functools.partial(write_audit, audit_log),
            guard=Guard(token=token),
            refresh=refresh,
            max_lag=max_lag.total_seconds() if max_lag is not None else None,
        )
        _serve(make_dashboard_server(app, host, port), names)
    finally:
        for target in targets:
            target.close()


def _serve(server: Any, names: list[str]) -> None:
    """Serve until SIGTERM or Ctrl-C, saying where and when it stopped."""
    bound_host, bound_port = str(server.server_address[0]), int(server.server_address[1])
    shown = f"[{bound_host}]" if ":" in str(bound_host) else bound_host
    echo(f"dashboard on http://{shown}:{bound_port}/ ({', '.join(names)}); Ctrl-C to stop")
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with contextlib.suppress(KeyboardInterrupt, _Stop):
            server.serve_forever()
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.server_close()
    echo("dashboard stopped")
