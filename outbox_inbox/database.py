"""The engine and tables of a database URL, made by one rule (`connect`).

PostgreSQL: connections are checked before use (``pool_pre_ping``), and statements are
prepared (the ``prepare_threshold`` setting, "auto") on a direct connection, never through a
pooler in transaction mode, where the next execution may land on a server connection that
never saw them prepared (`queries.roles.unprepared_behind_pooler`, docs/runbook.md).

SQLite, the development store (one process, one file, no schemas), has no row locks, so
`SKIP LOCKED` claims cannot keep two claimers apart. Instead every transaction on its engine
starts with ``BEGIN IMMEDIATE``, which takes the database's write lock at once: claims,
handler transactions and outbox writes run one at a time, and a claim never sees a row
another claim is about to take. Waiting transactions retry for `busy_timeout` seconds:
correct for the roles of one process (threads), and slow by design.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import Engine as Engine  # re-exported: the type of `Database.engine`
from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, make_url

from .errors import read_only_session
from .queries import roles
from .tables import Tables, build_tables

if TYPE_CHECKING:
    from sqlalchemy.engine import ExceptionContext
    from sqlalchemy.ext.asyncio import AsyncEngine

#: The schema of the tables when none is named.
DEFAULT_SCHEMA = "outbox_inbox"


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


def connect(
    url: str,
    schema: str = DEFAULT_SCHEMA,
    *,
    pool_size: int = 5,
    prepare_threshold: int | Literal["auto"] | None = "auto",
) -> Database:
    """The engine and tables for the database at `url`, by the library's one engine policy
    (the module docstring): what `Service.engine`, the audit's live reads and the CLI use.

    `url` is one `config.validate_db_url` accepts. Connects to nothing: the first connection
    opens when the engine is first used; the caller disposes of it. `pool_size` connections
    are kept, 10 more may open under load (PostgreSQL; SQLite keeps SQLAlchemy's own pool).
    Raises ConfigurationError for an invalid schema name.
    """
    if is_sqlite(url):
        return Database(_sqlite_engine(url), tables_for(url, schema))
    engine = create_engine(
        url,
        pool_pre_ping=True,
        pool_size=pool_size,
        max_overflow=10,
        connect_args=roles.prepare_args(prepare_threshold),
    )
    if prepare_threshold == "auto":
        roles.unprepared_behind_pooler(engine)
    read_only_drops_the_pool(engine)
    return Database(engine, tables_for(url, schema))


def read_only_drops_the_pool(engine: Engine | AsyncEngine) -> None:
    """Make a read-only session (`errors.read_only_session`) a lost connection on `engine`.

    A session on a standby stays there: ``pool_pre_ping``'s ``SELECT 1`` works on it, and
    every write fails, after the failover too, if the standby is not the server promoted.
    Taken for a disconnect, the error invalidates the pool: the next connection resolves the
    address, or walks the host list (``target_session_attrs``), again; the roles back off as
    from any outage, since the error is raised with ``connection_invalidated`` set.
    """
    sync_engine = getattr(engine, "sync_engine", engine)

    @event.listens_for(sync_engine, "handle_error")
    def _read_only(context: ExceptionContext) -> None:
        if read_only_session(context.original_exception):
            context.is_disconnect = True


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
