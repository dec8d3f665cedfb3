"""`outbox-inbox`: schema migrations and running the roles of a service."""

from __future__ import annotations

import importlib
import io
import logging
import sys
from typing import Any, NoReturn

import click

from outbox_inbox import migrate as migrations
from outbox_inbox.config import DB_URL_ENV, MQ_URL_ENV
from outbox_inbox.errors import OutboxInboxError
from outbox_inbox.logsafe import mask_url
from outbox_inbox.service import Service


def _fail(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


def load_app(spec: str) -> Service:
    """Import ``module:attribute`` and return the Service it names."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        _fail(f"--app must be module:attribute, got {spec!r}")
    sys.path.insert(0, ".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        _fail(f"cannot import {module_name!r}: {exc}")
    app = getattr(module, attribute, None)
    if callable(app) and not isinstance(app, Service):
        app = app()
    if not isinstance(app, Service):
        _fail(f"{spec} is not an outbox_inbox.Service")
    return app


db_url_option = click.option(
    "--db-url", envvar=DB_URL_ENV, help=f"SQLAlchemy URL of the database [env {DB_URL_ENV}]."
)
mq_url_option = click.option(
    "--mq-url", envvar=MQ_URL_ENV, help=f"AMQP URL of RabbitMQ [env {MQ_URL_ENV}]."
)
schema_option = click.option(
    "--schema", default=migrations.DEFAULT_SCHEMA, show_default=True, help="PostgreSQL schema."
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def main(verbose: int) -> None:
    """Transactional outbox and inbox for services on PostgreSQL and RabbitMQ."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.group()
def db() -> None:
    """Create, upgrade and inspect the outbox/inbox tables (alembic, shipped migrations)."""


def _config(db_url: str | None, schema: str, out: Any = None) -> Any:
    if not db_url:
        _fail(f"no database: pass --db-url or set {DB_URL_ENV}")
    try:
        return migrations.alembic_config(db_url, schema=schema, stdout=out)
    except OutboxInboxError as exc:
        _fail(str(exc))


@db.command()
@db_url_option
@schema_option
@click.argument("revision", default="heads")
def upgrade(db_url: str | None, schema: str, revision: str) -> None:
    """Apply the migrations up to REVISION (default: the newest)."""
    try:
        migrations.upgrade(_config(db_url, schema), revision)
    except OutboxInboxError as exc:
        _fail(str(exc))
    click.echo(f"upgraded {mask_url(db_url)} schema {schema} to {revision}")


@db.command()
@db_url_option
@schema_option
@click.argument("revision")
def downgrade(db_url: str | None, schema: str, revision: str) -> None:
    """Revert the migrations down to REVISION (`base` drops the tables)."""
    try:
        migrations.downgrade(_config(db_url, schema), revision)
    except OutboxInboxError as exc:
        _fail(str(exc))
    click.echo(f"downgraded {mask_url(db_url)} schema {schema} to {revision}")


@db.command()
@db_url_option
@schema_option
def current(db_url: str | None, schema: str) -> None:
    """Show the revision the database is at."""
    out = io.StringIO()
    try:
        migrations._run("current", _config(db_url, schema, out))
    except OutboxInboxError as exc:
        _fail(str(exc))
    click.echo(out.getvalue().strip() or "(no revision: run `outbox-inbox db upgrade`)")


@db.command()
@schema_option
def history(schema: str) -> None:
    """List the shipped revisions."""
    out = io.StringIO()
    migrations._run("history", migrations.alembic_config(schema=schema, stdout=out))
    click.echo(out.getvalue().strip())


@main.command()
@click.argument("role", type=click.Choice(["relay", "receiver", "worker", "all"]))
@click.option("--app", "app_spec", required=True, help="module:attribute of your Service.")
def run(role: str, app_spec: str) -> None:
    """Run ROLE of the service until SIGTERM or SIGINT (graceful stop)."""
    service = load_app(app_spec)
    try:
        if role == "all":
            service.run()
        elif role == "relay":
            service.run_relay()
        elif role == "receiver":
            service.run_receiver()
        else:
            service.run_worker()
    except OutboxInboxError as exc:
        _fail(str(exc))
    finally:
        service.close()
