"""Fixtures of the connection-pooler tests (``-m pooler``): two PgBouncers for the session.

One PgBouncer in session pooling and one in transaction pooling, both in front of the tests'
PostgreSQL, started once and shared by every test here. `pooled` turns a test database's
direct URL into the URL of one way in: ``direct``, ``session`` or ``transaction``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import Engine, text

from servers import PostgresHandle

from .bouncer import PgBouncerServer

#: Server connections per database and user in the transaction pooler: small, so that every
#: test touches all of them and a leak would reach the next client.
POOL_SIZE = 4
#: In session pooling each client connection pins a server connection for as long as it is
#: open: the pool must hold every connection of the service (docs/runbook.md, sizing).
SESSION_POOL_SIZE = 40


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/pooler/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.pooler)


@pytest.fixture(scope="session")
def bouncers(postgres_server: PostgresHandle) -> Iterator[dict[str, PgBouncerServer]]:
    """A PgBouncer in session pooling and one in transaction pooling (Debian's pgbouncer)."""
    started: dict[str, PgBouncerServer] = {}
    try:
        for mode in ("session", "transaction"):
            size = POOL_SIZE if mode == "transaction" else SESSION_POOL_SIZE
            bouncer = PgBouncerServer(postgres_server.url(), mode, pool_size=size)
            bouncer.start()
            started[mode] = bouncer
        yield started
    finally:
        for bouncer in started.values():
            bouncer.cleanup()


@pytest.fixture
def pooled(bouncers: dict[str, PgBouncerServer]) -> Callable[[str, str], str]:
    """``pooled(db_url, way)``: `db_url` directly (``direct``) or through a PgBouncer."""

    def url(db_url: str, way: str) -> str:
        return db_url if way == "direct" else bouncers[way].url(db_url)

    return url


def churn(engine: Engine, stop: threading.Event) -> None:
    """Short transactions of another client on `engine` until `stop`: behind a transaction
    pooler they keep handing the pool's server connections from one client to the next."""
    while not stop.is_set():
        with engine.begin() as conn:
            conn.execute(text("SELECT pg_sleep(0.002)"))
        time.sleep(0.01)
