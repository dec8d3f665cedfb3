"""Which service, database and broker a command works on, and the options that choose them."""

from __future__ import annotations

import importlib
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn, TypeVar

import click

from outbox_inbox import clock
from outbox_inbox.broker import Broker
from outbox_inbox.brokers import broker_at
from outbox_inbox.config import (
    DB_URL_ENV,
    MQ_URL_ENV,
    validate_db_url,
    validate_identifier,
    validate_service_name,
)
from outbox_inbox.database import DEFAULT_SCHEMA, Engine, connect, tables_for
from outbox_inbox.errors import ConfigurationError
from outbox_inbox.fingerprint import users_frame
from outbox_inbox.logsafe import mask_url
from outbox_inbox.service import Service
from outbox_inbox.tables import Tables
from outbox_inbox.topology import Topology

from .output import EXIT_ERROR, echo, remember_secret, verbosity

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, cause: BaseException | None = None) -> NoReturn:
    """Print ``error: <message>`` (masked) on stderr and exit 1; with -v, the traceback of
    `cause` first (where it was raised: the file and line of an app's own code)."""
    if cause is not None and verbosity():
        echo("".join(traceback.format_exception(cause)).rstrip(), err=True)
    echo(f"error: {message}", err=True)
    sys.exit(EXIT_ERROR)


def _raised_at(exc: BaseException) -> str:
    """`` (at FILE:LINE)``: the innermost frame of `exc` in the app's own code (not here, not
    in the standard library or a frozen module); empty when there is none."""
    # A SyntaxError names its file and line itself.
    found = None if isinstance(exc, SyntaxError) else users_frame(exc)
    if found is None or found[1].filename == __file__:
        return ""
    return f" (at {found[1].filename}:{found[1].lineno})"


def _a(value: object) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def load_app(spec: str) -> Service:
    """Import ``module:attribute`` and return the Service it names, or that a function it
    names returns when called without arguments (called once)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        fail(f"--app must be module:attribute, got {spec!r}")
    if "." not in sys.path:
        sys.path.insert(0, ".")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the service's own module failed: say so in one line
        what = f"importing {module_name!r} raised {type(exc).__name__}"
        if isinstance(exc, ImportError):
            what = f"cannot import {module_name!r}"
        fail(f"--app {spec}: {what}: {exc}{_raised_at(exc)}", exc)
    if not hasattr(module, attribute):
        fail(f"--app {spec}: module {module_name!r} has no attribute {attribute!r}")
    app = getattr(module, attribute)
    if isinstance(app, Service):
        return app
    if not callable(app):
        fail(
            f"--app {spec} is {_a(app)}, not an outbox_inbox.Service (nor a function returning one)"
        )
    try:
        made = app()
    except Exception as exc:  # a factory of the service's own: report, do not trace
        fail(f"--app {spec}: calling {attribute}() raised {type(exc).__name__}: {exc}", exc)
    if not isinstance(made, Service):
        fail(f"--app {spec}: {attribute}() returned {_a(made)}; expected an outbox_inbox.Service")
    return made


def checked_mq_url(url: str) -> str:
    """`url` if it is an AMQP URL; ConfigurationError otherwise."""
    remember_secret(url)
    if not re.match(r"^amqps?://", url):
        raise ConfigurationError(
            f"malformed broker URL {mask_url(url)}: expected a URL like amqp://user@host:5672/vhost"
        )
    broker_at(url)  # parses it here and raises ConfigurationError
    return url


@dataclass
class Target:
    """The service a command works on: its name, schema, database and broker.

    From ``--app`` (the Service's own URLs and settings unless --db-url / --mq-url are given)
    or from ``--service`` with the URLs.
    """

    name: str | None
    schema: str
    db_url: str | None
    mq_url: str | None
    service: Service | None = None
    _engine: Engine | None = field(default=None, repr=False)

    @property
    def tables(self) -> Tables:
        return tables_for(self.db_url or self.engine().url, self.schema)

    @property
    def has_database(self) -> bool:
        return bool(self.db_url) or self.service is not None

    @property
    def has_broker(self) -> bool:
        return bool(self.mq_url) or self._app_broker() is not None

    def _app_broker(self) -> Broker | None:
        """The app's own broker object, when it was given one instead of an mq_url; not an
        in-memory broker, which lives in the app's process, not in this one."""
        from outbox_inbox.brokers.memory import MemoryBroker

        if self.service is None:
            return None
        broker = self.service.broker
        return None if isinstance(broker, MemoryBroker) else broker

    def require_name(self) -> str:
        if self.name is None:
            fail("this needs a service: pass --app module:attribute or --service NAME")
        return self.name

    def engine(self) -> Engine:
        if self._engine is None:
            if self.db_url:
                self._engine = connect(self.db_url, self.schema).engine
            elif self.service is not None:
                return self.service.engine
            else:
                fail(f"no database: pass --db-url, set {DB_URL_ENV}, or --app")
        return self._engine

    def broker(self) -> Broker:
        if self.mq_url:
            return broker_at(self.mq_url)
        broker = self._app_broker()
        if broker is not None:
            return broker
        fail(f"no broker: pass --mq-url, set {MQ_URL_ENV}, or --app")

    def topology(self) -> Topology:
        if self.service is None:
            fail("the topology needs the service's handlers and settings: pass --app")
        return self.service.topology()

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
        if self.service is not None:
            self.service.close()


def resolve(
    *,
    app: str | None = None,
    service: str | None = None,
    schema: str | None = None,
    db_url: str | None = None,
    mq_url: str | None = None,
) -> Target:
    """Build the Target of a command from its options (the URLs are checked first)."""
    if db_url:
        db_url = validate_db_url(db_url)  # postgres:// and postgresql:// read as the library's
    if mq_url:
        checked_mq_url(mq_url)
    if app and service:
        fail("pass either --app or --service, not both")
    if schema is not None:
        validate_identifier(schema)
    if app:
        loaded = load_app(app)
        settings = loaded.settings
        return Target(
            name=loaded.name,
            schema=schema or settings.schema,
            db_url=db_url or settings.db_url,
            mq_url=mq_url or settings.mq_url,
            service=loaded,
        )
    if service:
        validate_service_name(service)
    return Target(name=service, schema=schema or DEFAULT_SCHEMA, db_url=db_url, mq_url=mq_url)


app_option = click.option(
    "--app",
    "app",
    metavar="MODULE:ATTR",
    help="Your Service object (or a function returning it), e.g. billing.app:service.",
)
service_option = click.option(
    "--service", metavar="NAME", help="Service name, instead of --app (with --db-url/--mq-url)."
)
schema_option = click.option(
    "--schema",
    metavar="NAME",
    help=f"PostgreSQL schema of the tables [default: the app's, else {DEFAULT_SCHEMA}].",
)
db_url_option = click.option(
    "--db-url",
    metavar="URL",
    envvar=DB_URL_ENV,
    help=f"SQLAlchemy URL of the database [env {DB_URL_ENV}; default: the app's].",
)
mq_url_option = click.option(
    "--mq-url",
    metavar="URL",
    envvar=MQ_URL_ENV,
    help=f"AMQP URL of RabbitMQ [env {MQ_URL_ENV}; default: the app's].",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")


def target_options(function: F) -> F:
    """--app / --service / --schema / --db-url / --mq-url."""
    for option in (mq_url_option, db_url_option, schema_option, service_option, app_option):
        function = option(function)
    return function


def parse_duration(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> timedelta | None:
    """Option callback: `clock.parse_duration`, a usage error when it does not read."""
    try:
        return None if value is None else clock.parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def parse_time(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    """Option callback: a date or an ISO 8601 time, UTC unless it names its zone."""
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a date or time like 2026-11-25 or 2026-11-25T06:00:00Z"
        ) from None
    if param.name == "day" and (parsed.hour, parsed.minute, parsed.second) != (0, 0, 0):
        raise click.BadParameter(f"{value!r} is not a day like 2026-11-25")
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)
