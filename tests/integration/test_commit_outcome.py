"""A business commit that loses its connection, and the failover URL of docs/failures.md.

The connection is cut between the COMMIT's send and its answer by terminating the session's
backend from the ``commit`` event (fired just before the driver sends COMMIT): what a failover,
a restart or a partition does to a commit in flight.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from outbox_inbox import CommitOutcomeUnknown, DatabaseUnavailable, Service
from outbox_inbox.testing.servers import free_port

FAILURES_DOC = Path(__file__).resolve().parents[2] / "docs" / "failures.md"


def _cut_at_commit(engine: Engine, admin: Engine) -> None:
    """Terminate the backend of every connection of `engine` that is about to commit."""

    @event.listens_for(engine, "commit")
    def _terminate(conn: Any) -> None:
        pid = conn.connection.dbapi_connection.info.backend_pid
        with admin.connect() as other:
            other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})


def test_a_commit_that_loses_its_connection_raises_commit_outcome_unknown(db_url: str) -> None:
    service = Service("orders", db_url=db_url, mq_url=None)
    admin = create_engine(db_url)
    try:
        with service.engine.begin() as conn:
            conn.execute(text("CREATE TABLE orders (id int PRIMARY KEY)"))
        with service.session() as session, session.begin():  # committed: its pooled connection
            session.execute(text("INSERT INTO orders VALUES (0)"))  # goes back to the roles
        _cut_at_commit(service.engine, admin)
        # The service's engine, as the roles use it, is left as it was, even on a connection
        # a business transaction committed on.
        with pytest.raises(OperationalError), service.engine.begin() as conn:
            conn.execute(text("INSERT INTO orders VALUES (3)"))
        session = service.session()
        with pytest.raises(CommitOutcomeUnknown) as raised, session, session.begin():
            session.execute(text("INSERT INTO orders VALUES (1)"))
        error = raised.value
        assert isinstance(error, DatabaseUnavailable)
        assert isinstance(error.__cause__, psycopg.OperationalError)  # the driver's
        assert "outcome is unknown" in str(error) and "same message id" in str(error)
        # A user's own engine: SQLAlchemy's error, recognised as docs/failures.md says.
        own = create_engine(db_url)
        _cut_at_commit(own, admin)
        with pytest.raises(OperationalError) as raw, own.begin() as conn:
            conn.execute(text("INSERT INTO orders VALUES (2)"))
        assert raw.value.connection_invalidated
        own.dispose()
    finally:
        service.close()
        admin.dispose()


def test_the_failover_url_of_the_docs_connects_with_a_users_own_engine(db_url: str) -> None:
    """The documented host list, a dead server first: SQLAlchemy's engine and the service's
    both skip it and reach the live one, which accepts writes."""
    [documented] = re.findall(
        r"postgresql\+psycopg://\S*host=db1,db2&port=\S*", FAILURES_DOC.read_text()
    )
    url = make_url(db_url)
    live = documented.replace("app:pw@", f"{url.username}:{url.password}@")
    live = live.replace("/orders?", f"/{url.database}?").replace(
        "db1,db2", f"{url.host},{url.host}"
    )
    live = live.replace("port=5432,5432", f"port={free_port()},{url.port}")
    own = create_engine(live)
    service = Service("orders", db_url=live, mq_url=None)
    try:
        with own.connect() as conn:
            assert conn.scalar(text("SELECT inet_server_port()")) == url.port
        with service.session() as session:
            assert session.scalar(text("SELECT inet_server_port()")) == url.port
    finally:
        own.dispose()
        service.close()


def _last_query(admin: psycopg.Connection[Any], pid: int) -> str:
    row = admin.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return str(row[0]) if row else ""


def test_a_pooled_connection_is_pinged_only_after_a_second_idle(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Back within `PING_AFTER`, a connection is used as it is (no round trip before the
    caller's first statement); idle longer, it is pinged first. Seen on the server: the
    backend's last query is the caller's, or the ping's empty one."""
    from outbox_inbox import database

    monkeypatch.setattr(database, "PING_AFTER", 0.5)
    engine = database.connect(db_url).engine
    admin = psycopg.connect(make_url(db_url).set(drivername="postgresql").render_as_string(False))
    admin.autocommit = True  # a fresh view of pg_stat_activity at each read
    try:
        with engine.connect() as conn:
            pid = conn.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
            conn.execute(text("SELECT 'mine'"))
        # The pool's reset on return (a rollback) is the session's last query.
        assert _last_query(admin, pid) == "ROLLBACK"
        with engine.connect() as conn:  # back at once: no ping
            assert conn.connection.dbapi_connection.info.backend_pid == pid  # type: ignore[union-attr]
            assert _last_query(admin, pid) == "ROLLBACK"
        time.sleep(0.7)
        with engine.connect() as conn:  # idle past PING_AFTER: pinged before it is handed out
            assert _last_query(admin, pid) not in ("ROLLBACK", "")
    finally:
        admin.close()
        engine.dispose()


def test_a_connection_that_died_while_idle_is_replaced_at_checkout(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server session ended while its connection waited in the pool (a restart, an idle
    timeout) costs the caller nothing once the connection was idle `PING_AFTER`: the ping
    finds it dead and the pool connects again."""
    from outbox_inbox import database

    monkeypatch.setattr(database, "PING_AFTER", 0.2)
    engine = database.connect(db_url).engine
    admin = psycopg.connect(make_url(db_url).set(drivername="postgresql").render_as_string(False))
    admin.autocommit = True
    try:
        with engine.connect() as conn:
            pid = conn.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        time.sleep(0.4)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar() == 1
            assert conn.connection.dbapi_connection.info.backend_pid != pid  # type: ignore[union-attr]
    finally:
        admin.close()
        engine.dispose()
