"""`outbox-inbox`: migrations, topology, dead letters, status, tail, running roles, history.

Every command prints one ``error: ...`` line on stderr and exits 1 on bad input, an unreachable
server, missing tables or an unknown app (``-v`` adds the traceback). Passwords are masked in
everything printed or logged. Exit codes are listed in docs/cli.md.
"""

from __future__ import annotations

import logging
import sys
import traceback
from dataclasses import fields, replace
from typing import Any

import click
from alembic.util.exc import CommandError
from sqlalchemy.exc import SQLAlchemyError

from outbox_inbox import migrate as migrations
from outbox_inbox.brokers.rabbitmq import CONNECTION_ERRORS
from outbox_inbox.config import Settings
from outbox_inbox.errors import (
    ConfigurationError,
    OutboxInboxError,
    SchemaMissing,
    storage_error,
)
from outbox_inbox.logsafe import mask_url
from outbox_inbox.metrics import MetricsServer, instrument
from outbox_inbox.service import Service

from .dashboard import dashboard
from .dead_letters import dead_letters
from .demo import demo
from .history import archive, audit
from .output import (
    EXIT_ERROR,
    EXIT_UNHEALTHY,
    MaskingFormatter,
    echo,
    echo_json,
    mask,
    render_table,
)
from .status import status
from .tail import tail
from .target import (
    Target,
    app_option,
    db_url_option,
    fail,
    json_option,
    load_app,
    mq_url_option,
    resolve,
    schema_option,
)
from .topology import topology

__all__ = ["load_app", "main"]

#: Errors that end a command with one line instead of a traceback.
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (
    OutboxInboxError,
    SQLAlchemyError,
    *CONNECTION_ERRORS,
    CommandError,
    OSError,
)


def describe(exc: BaseException) -> str:
    """One line saying what went wrong (masked by the caller's echo)."""
    if isinstance(exc, SQLAlchemyError):
        translated = storage_error(exc, "database")
        if isinstance(translated, SchemaMissing):
            return str(translated)
        return "database error: " + str(translated).removeprefix("database failed: ")
    text = str(exc).strip() or repr(exc)
    first = text.splitlines()[0]
    if isinstance(exc, OutboxInboxError | CommandError):
        return first
    return f"{type(exc).__name__}: {first}"


def _masked(exc: click.ClickException) -> click.ClickException:
    """`exc`, or the same error with the passwords of its message masked."""
    message = mask(exc.message)
    if message == exc.message:
        return exc
    if isinstance(exc, click.UsageError):  # exit code 2, as every usage error
        return click.UsageError(message, exc.ctx)
    return click.ClickException(message)


class _Commands(click.Group):
    """The root group: turns the errors an operator can cause into one line and exit 1."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.ClickException as exc:  # a URL given where a command was expected
            raise _masked(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:  # usage errors quote what was typed
            raise _masked(exc) from None
        except EXPECTED_ERRORS as exc:
            if ctx.meta.get("outbox_inbox.verbose"):
                echo("".join(traceback.format_exception(exc)).rstrip(), err=True)
            echo(f"error: {describe(exc)}", err=True)
            sys.exit(EXIT_ERROR)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug); tracebacks.")
@click.version_option(package_name="outbox-inbox", prog_name="outbox-inbox")
@click.pass_context
def main(ctx: click.Context, verbose: int) -> None:
    """Operate the transactional outbox and inbox of services on PostgreSQL and RabbitMQ.

    \b
    Commands take the servers they use from --db-url / --mq-url (or the environment
    variables OUTBOX_INBOX_DB_URL / OUTBOX_INBOX_MQ_URL), or from your Service with
    --app module:attribute. Output is a plain table; --json prints JSON for scripts.
    Passwords are masked in all output and logs. `outbox-inbox COMMAND --help` for more.
    """
    ctx.meta["outbox_inbox.verbose"] = verbose
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(MaskingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING - 10 * min(verbose, 2))
    # pika logs every failed connection attempt at ERROR; the command reports it in one line.
    logging.getLogger("pika").setLevel(logging.DEBUG if verbose >= 2 else logging.CRITICAL)


# --- db -----------------------------------------------------------------------------------


@main.group()
def db() -> None:
    """Create, upgrade and inspect the outbox/inbox tables.

    Runs the alembic migrations shipped inside the package; their version table is
    outbox_inbox_version in the library's schema, apart from your own alembic_version.
    """


def _db_target(app: str | None, db_url: str | None, schema: str | None) -> Target:
    target = resolve(app=app, db_url=db_url, schema=schema)
    if not target.has_database:
        fail("no database: pass --db-url, set OUTBOX_INBOX_DB_URL, or --app")
    return target


def _migrate(action: str, app: str | None, db_url: str | None, schema: str | None, rev: str) -> str:
    target = _db_target(app, db_url, schema)
    run = migrations.upgrade if action == "upgrade" else migrations.downgrade
    try:
        if target.db_url:
            run(migrations.alembic_config(target.db_url, schema=target.schema), rev)
            return f"{action}d {mask_url(target.db_url)} schema {target.schema} to {rev}"
        # An app built with engine= only: migrate on a connection of that engine.
        with target.engine().connect() as conn:
            run(migrations.alembic_config(schema=target.schema, connection=conn), rev)
            conn.commit()
        return f"{action}d {target.name}'s database schema {target.schema} to {rev}"
    finally:
        target.close()


@db.command()
@app_option
@db_url_option
@schema_option
@click.argument("revision", default="heads")
def upgrade(app: str | None, db_url: str | None, schema: str | None, revision: str) -> None:
    """Apply the migrations up to REVISION (default: the newest)."""
    echo(_migrate("upgrade", app, db_url, schema, revision))


@db.command()
@app_option
@db_url_option
@schema_option
@click.argument("revision")
def downgrade(app: str | None, db_url: str | None, schema: str | None, revision: str) -> None:
    """Revert the migrations down to REVISION (`base` drops the tables and their data)."""
    echo(_migrate("downgrade", app, db_url, schema, revision))


@db.command()
@app_option
@db_url_option
@schema_option
@json_option
def current(app: str | None, db_url: str | None, schema: str | None, as_json: bool) -> None:
    """Show the revision the database is at (changes nothing)."""
    target = _db_target(app, db_url, schema)
    try:
        with target.engine().connect() as conn:
            state = migrations.current(conn, target.schema)
    finally:
        target.close()
    if as_json:
        echo_json(state.as_dict())
        return
    if not state.revisions:
        echo(f"schema {target.schema}: no revision (run `outbox-inbox db upgrade`)")
    for revision in state.revisions:
        echo(f"{revision}{' (head)' if revision in state.heads else ''}")


@db.command()
@app_option
@db_url_option
@schema_option
@json_option
def check(app: str | None, db_url: str | None, schema: str | None, as_json: bool) -> None:
    """Check that the tables equal the newest migration; exit 4 when they differ."""
    target = _db_target(app, db_url, schema)
    try:
        with target.engine().connect() as conn:
            differences = migrations.check(conn, target.schema)
    finally:
        target.close()
    if as_json:
        echo_json({"schema": target.schema, "differences": differences, "ok": not differences})
    elif not differences:
        echo(f"schema {target.schema}: the tables are those of the newest migration")
    for difference in differences if not as_json else ():
        echo(f"differs: {difference}")
    if differences:
        sys.exit(EXIT_UNHEALTHY)


@db.command()
@json_option
def history(as_json: bool) -> None:
    """List the migrations shipped in the package, newest first."""
    revisions = migrations.history()
    if as_json:
        echo_json([r.as_dict() for r in revisions])
        return
    rows = [
        (r.revision, r.down_revision or "(base)", "yes" if r.head else "", r.message)
        for r in revisions
    ]
    echo(render_table(["REVISION", "DOWN FROM", "HEAD", "MESSAGE"], rows))


# --- run ----------------------------------------------------------------------------------


def with_urls(app: Service, db_url: str | None, mq_url: str | None) -> Service:
    """`app`, or a copy of it on other servers: same name, settings, handlers and listener.

    Handlers that use the original Service object's engine or session directly keep its
    database; those that write through the session they are given follow --db-url.
    """
    settings = app.settings
    if (not db_url or db_url == settings.db_url) and (not mq_url or mq_url == settings.mq_url):
        return app
    values = {f.name: getattr(settings, f.name) for f in fields(Settings)}
    values["db_url"] = db_url or settings.db_url
    values["mq_url"] = mq_url or settings.mq_url
    try:
        broker = None if values["mq_url"] else app.broker
    except ConfigurationError:
        broker = None
    copy = Service(
        app.name,
        engine=None if values["db_url"] else app.engine,
        broker=broker,
        listener=app.listener,
        tracer_provider=app.tracing.provider,
        **values,
    )
    copy.handlers = app.handlers
    return copy


@main.command(short_help="Run the relay, receiver, worker or all of them until SIGTERM.")
@click.argument("role", type=click.Choice(["relay", "receiver", "worker", "all"]))
@click.option("--app", "app_spec", required=True, metavar="MODULE:ATTR", help="Your Service.")
@db_url_option
@mq_url_option
@click.option(
    "--fail-fast",
    is_flag=True,
    help="Exit at once when PostgreSQL or RabbitMQ cannot be reached at start, instead of"
    " waiting for them.",
)
@click.option(
    "--processes",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Worker processes for `worker` and `all` (default: the service's `processes`"
    " setting, else one per CPU); 1 runs the workers in threads of this process.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    metavar="PORT",
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (docs/observability.md).",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    metavar="HOST",
    help="The address the metrics server binds (0.0.0.0 for every interface).",
)
def run(
    role: str,
    app_spec: str,
    db_url: str | None,
    mq_url: str | None,
    fail_fast: bool,
    processes: int | None,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Run one role of the service, or all, until SIGTERM or SIGINT (graceful stop).

    \b
    relay     publishes the outbox to RabbitMQ
    receiver  stores messages from <service>.inbox in the inbox table (declares the topology)
    worker    runs your handlers on the inbox rows, in --processes worker processes
    all       the relay and the receiver in threads of this process, the workers as `worker`

    Worker processes are started again when they die; SIGTERM stops them after their batch.

    A server that cannot be reached at start is waited for (one warning, then retries), unless
    --fail-fast is given. A configuration error (bad URL or credentials, missing schema) exits
    at once. On SIGTERM or SIGINT the work in hand is finished, then the command exits 0.

    With --metrics-port, Prometheus metrics of this process's roles and the service's backlog
    are served on 127.0.0.1 (--metrics-host to change); a port that cannot be bound exits 1.
    """
    resolve(db_url=db_url, mq_url=mq_url)  # checks the URLs before anything starts
    service = with_urls(load_app(app_spec), db_url, mq_url)
    if processes is not None:
        service.settings = replace(service.settings, processes=processes)
    wait = {"fail_fast": True} if fail_fast else {}
    server: MetricsServer | None = None
    if metrics_port is not None:
        try:
            server = instrument(service).serve(metrics_port, metrics_host)
        except OSError as exc:
            service.close()
            fail(f"cannot serve metrics on {metrics_host}:{metrics_port}: {exc.strerror or exc}")
        logging.getLogger(__name__).info(
            "metrics at http://%s:%d/metrics", metrics_host, server.port
        )
    try:
        if role == "all":
            service.run(**wait)
        elif role == "relay":
            service.run_relay(**wait)
        elif role == "receiver":
            service.run_receiver(**wait)
        else:
            service.run_worker(**wait)
    finally:
        service.close()
        if server is not None:
            server.close()


main.add_command(topology)
main.add_command(dead_letters)
main.add_command(status)
main.add_command(tail)
main.add_command(demo)
main.add_command(archive)
main.add_command(audit)
main.add_command(dashboard)


if __name__ == "__main__":
    main(prog_name="outbox-inbox")
