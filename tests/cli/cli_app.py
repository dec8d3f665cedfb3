"""The services the CLI tests point ``--app`` at, built from the environment like a real app.

``--app cli_app:billing`` / ``--app cli_app:shipping`` (factories, called by the command) read
the database and broker URLs from ``CLI_TEST_DB_URL`` / ``CLI_TEST_MQ_URL``. Every handler
records its effect as a row of ``effects`` through the session it is given, so the effect commits
exactly when the message is marked processed. A handler raises ``Reject`` while the ``failing``
table lists the message's type (that is how the tests make dead letters, and then cure them),
a plain exception, retried later, while the ``flaky`` table lists it, and calls
``sys.exit(3)`` while the ``exiting`` table lists it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from outbox_inbox import Message, Reject, Service

DB_ENV = "CLI_TEST_DB_URL"
MQ_ENV = "CLI_TEST_MQ_URL"

FAST: dict[str, Any] = {
    "relay_poll_interval": 0.2,
    "worker_poll_interval": 0.1,
    "reconnect_initial": 0.1,
    "reconnect_max": 1.0,
}

TABLES_DDL = (
    "CREATE TABLE IF NOT EXISTS effects ("
    " seq bigserial PRIMARY KEY, message_id text NOT NULL UNIQUE, type text NOT NULL,"
    " payload jsonb)",
    "CREATE TABLE IF NOT EXISTS failing (type text PRIMARY KEY)",
    "CREATE TABLE IF NOT EXISTS flaky (type text PRIMARY KEY)",
    "CREATE TABLE IF NOT EXISTS exiting (type text PRIMARY KEY)",
)


def _record(message: Message, session: Session) -> None:
    failing = session.execute(
        text("SELECT count(*) FROM failing WHERE type = :t"), {"t": message.type}
    ).scalar_one()
    if failing:
        raise Reject(f"{message.type} is failing on purpose")
    flaky = session.execute(
        text("SELECT count(*) FROM flaky WHERE type = :t"), {"t": message.type}
    ).scalar_one()
    if flaky:
        raise RuntimeError(f"{message.type} is flaky on purpose")
    exiting = session.execute(
        text("SELECT count(*) FROM exiting WHERE type = :t"), {"t": message.type}
    ).scalar_one()
    if exiting:
        sys.exit(3)  # a handler ending "the program": a BaseException, not an Exception
    session.execute(
        text("INSERT INTO effects (message_id, type, payload) VALUES (:m, :t, CAST(:p AS jsonb))"),
        {"m": str(message.message_id), "t": message.type, "p": json.dumps(message.payload)},
    )


def build(name: str, db_url: str, mq_url: str | None, **settings: Any) -> Service:
    """Service `name` with handlers for its commands and for orders events."""
    service = Service(name, db_url=db_url, mq_url=mq_url, **{**FAST, **settings})
    if name == "billing":
        service.on_command("invoice.create")(_record)
        service.on_command("ledger.append")(_record)
        service.on_event("orders.order.*")(_record)
    else:
        service.on_command("parcel.ship")(_record)
    return service


def prepare(service: Service) -> None:
    """Migrate the service's database and create the tables the handlers use."""
    service.migrate()
    with service.engine.begin() as conn:
        for ddl in TABLES_DDL:
            conn.execute(text(ddl))


def billing() -> Service:
    return build("billing", os.environ[DB_ENV], os.environ[MQ_ENV])


def shipping() -> Service:
    return build("shipping", os.environ[DB_ENV], os.environ[MQ_ENV])


def set_types(service: Service, table: str, *types: str) -> None:
    """Make `table` (``failing``, ``flaky`` or ``exiting``) list exactly `types`."""
    if table not in ("failing", "flaky", "exiting"):
        raise ValueError(f"not a switch table: {table}")
    with service.engine.begin() as conn:
        conn.execute(text(f"DELETE FROM {table}"))
        for t in types:
            conn.execute(text(f"INSERT INTO {table} (type) VALUES (:t)"), {"t": t})
