"""SQLite as the development store: one process, the tables in one file, no server.

SQLite has no row locks, so `SKIP LOCKED` claims cannot keep two claimers apart. Instead every
transaction on an engine prepared here starts with ``BEGIN IMMEDIATE``, which takes the
database's write lock at once: claims, handler transactions and outbox writes run one at a
time, and a claim can never see a row another claim is about to take. Waiting transactions
retry for `busy_timeout` seconds. This is correct for the roles of one process (threads), and
slow by design; PostgreSQL is the production store.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url


def is_sqlite(url: str | URL) -> bool:
    """True when `url` names a SQLite database."""
    return make_url(url).get_backend_name() == "sqlite"


def create_sqlite_engine(url: str | URL, *, busy_timeout: float = 30.0) -> Engine:
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
