"""The engine and tables of a database URL, made by one rule (`connect`).

PostgreSQL: every connection the library opens has client-side bounds (`CLIENT_BOUNDS`), a
pooled connection idle over `PING_AFTER` is pinged before use, and statements are prepared
only on a direct connection, never through a pooler in transaction mode (docs/runbook.md).

SQLite, the development store (one process, one file, no schemas), has no row locks: every
transaction on its engine starts with ``BEGIN IMMEDIATE``, which takes the write lock at once,
so claims, handler transactions and outbox writes run one at a time, each waiting up to
`busy_timeout` seconds: correct for the roles of one process (threads), and slow by design.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from sqlalchemy import Engine as Engine  # re-exported: the type of `Database.engine`
from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DisconnectionError

from .errors import CommitOutcomeUnknown, database_unreachable, first_line, read_only_session
from .queries import roles
from .tables import Tables, build_tables

if TYPE_CHECKING:
    from sqlalchemy.engine import ExceptionContext
    from sqlalchemy.ext.asyncio import AsyncEngine

_E = TypeVar("_E", "Engine", "AsyncEngine")

#: The schema of the tables when none is named.
DEFAULT_SCHEMA = "outbox_inbox"

#: libpq's client-side bounds on every PostgreSQL connection the library opens (the engines of
#: `connect` and `aio.worker_engine`, the LISTEN connections of `waker.Waker`), unless the db_url
#: names them itself (`client_bounds`): without them a partitioned server makes a call hang for the
#: kernel's 15 minutes. What each bounds, and why: docs/failures.md ("A partition from PostgreSQL").
CLIENT_BOUNDS: dict[str, int] = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 5,
    "keepalives_count": 2,
    "tcp_user_timeout": 10_000,
}


@dataclass(frozen=True)
class Database:
    """An engine and the tables it reads and writes."""

    engine: Engine
    tables: Tables


def is_sqlite(url: str | URL) -> bool:
    """True when `url` names a SQLite database."""
    return make_url(url).get_backend_name() == "sqlite"


def tables_for(url: str | URL, schema: str = DEFAULT_SCHEMA) -> Tables:
    """The tables of `schema` in the database at `url`; on SQLite, which has no schemas, the
    tables of the database file itself. Raises ConfigurationError for an invalid schema name."""
    return build_tables(None if is_sqlite(url) else schema)


def client_bounds(url: str | URL) -> dict[str, int]:
    """The `CLIENT_BOUNDS` that `url` (a SQLAlchemy or libpq URL) does not set itself.

    A bound in the URL's query wins; so does ``PGCONNECT_TIMEOUT`` in the environment, libpq's
    own way of setting the connect timeout (libpq has no variable for the others)."""
    named = set(make_url(url).query)
    if "PGCONNECT_TIMEOUT" in os.environ:
        named.add("connect_timeout")
    return {key: value for key, value in CLIENT_BOUNDS.items() if key not in named}


def connect(
    url: str,
    schema: str = DEFAULT_SCHEMA,
    *,
    pool_size: int = 5,
    prepare_threshold: int | Literal["auto"] | None = "auto",
) -> Database:
    """The engine and tables for the database at `url` (one `config.validate_db_url` accepts),
    by the library's one engine policy (the module docstring): what `Service.engine`, the
    audit's live reads and the CLI use. Connects to nothing; the caller disposes of the engine.
    `pool_size` connections are kept, 10 more may open under load (PostgreSQL). Raises
    ConfigurationError for an invalid schema name."""
    if is_sqlite(url):
        return Database(_sqlite_engine(url), tables_for(url, schema))
    engine = postgres_engine(
        create_engine, url, prepare_threshold, pool_size=pool_size, max_overflow=10
    )
    ping_after_idle(engine)
    return Database(engine, tables_for(url, schema))


def postgres_engine(
    make: Callable[..., _E], url: str | URL, prepare_threshold: int | str | None, **options: Any
) -> _E:
    """`make` (`create_engine` or `create_async_engine`) on `url` and `options`, by the policy
    of the module docstring: `client_bounds`, statements prepared only on a direct connection
    (`prepare_threshold` "auto"), a read-only session dropping the pool."""
    engine = make(
        url, connect_args={**roles.prepare_args(prepare_threshold), **client_bounds(url)}, **options
    )
    if prepare_threshold == "auto":
        roles.unprepared_behind_pooler(engine)
    read_only_drops_the_pool(engine)
    return engine


#: Seconds a connection may wait in the pool and be used without a ping. A server gone within
#: this second (a restart, a failover) fails the next statement instead, once: the error
#: drops the pool, and the roles back off as from any outage.
PING_AFTER = 1.0


def ping_after_idle(engine: Engine) -> None:
    """Ping a connection of `engine`'s pool at checkout once it has been idle `PING_AFTER`; a
    dead one is replaced, as ``pool_pre_ping`` does for every checkout."""

    @event.listens_for(engine, "checkin")
    def _returned(_dbapi_connection: Any, record: Any) -> None:
        record.info["returned"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        if time.monotonic() - record.info.pop("returned", time.monotonic()) <= PING_AFTER:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as exc:
            if engine.dialect.is_disconnect(exc, dbapi_connection, None):
                raise DisconnectionError(first_line(exc)) from exc
            raise


def read_only_drops_the_pool(engine: Engine | AsyncEngine) -> None:
    """Make a read-only session (`errors.read_only_session`) a lost connection on `engine`
    (the pool's ping works on a standby and would keep it for good: docs/failures.md): the
    error drops the pool, raised with ``connection_invalidated`` set."""
    sync_engine = getattr(engine, "sync_engine", engine)

    @event.listens_for(sync_engine, "handle_error")
    def _read_only(context: ExceptionContext) -> None:
        if read_only_session(context.original_exception):
            context.is_disconnect = True


def business_engine(engine: Engine) -> Engine:
    """`engine` for business transactions (`Service.session`; the roles' engine is left as it
    is): a COMMIT that fails for want of the server raises `CommitOutcomeUnknown`."""
    business, flag = engine.execution_options(), "outbox_inbox.committing"
    event.listen(business, "begin", lambda conn: conn.info.pop(flag, None))
    event.listen(business, "commit", lambda conn: conn.info.update({flag: True}))

    @event.listens_for(business, "handle_error")  # fired for every engine of the dialect
    def _commit_lost(context: ExceptionContext) -> None:
        error, conn = context.original_exception, context.engine is business and context.connection
        if conn and conn.info.pop(flag, False) and database_unreachable(error):
            raise CommitOutcomeUnknown(
                f"the commit's outcome is unknown ({first_line(error)}): it may have committed;"
                " retry it idempotently, with the same message id or business key"
            )

    return business


def _sqlite_engine(url: str | URL, *, busy_timeout: float = 30.0) -> Engine:
    """An engine whose transactions begin with ``BEGIN IMMEDIATE`` (see the module docstring)."""
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": busy_timeout})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event emit BEGIN (pysqlite would defer it otherwise, and
        # savepoints need it), and wait for the write lock instead of failing at once.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


__all__ = ["connect"]
