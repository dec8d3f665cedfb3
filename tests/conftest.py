"""Fixtures giving tests a real PostgreSQL and a real RabbitMQ (DESIGN.md §9).

Where the servers come from, decided once per session and only when a test first asks:

1. ``OUTBOX_INBOX_TEST_DB_URL`` / ``OUTBOX_INBOX_TEST_MQ_URL``: servers someone else runs. The DB
   URL is an SQLAlchemy URL of a database whose user may CREATE DATABASE.
2. a Docker engine that answers ``docker info`` within 5 s: testcontainers ``postgres:15`` /
   ``rabbitmq:3.10``.
3. otherwise local servers from ``tests/servers.py`` (PostgreSQL 15 binaries, Debian's
   rabbitmq-server), started as plain processes in temporary directories.

Only local servers can be stopped, restarted and killed by tests: ask for
``local_postgres_server`` / ``local_rabbitmq_server``, which skip the test otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

_TESTS_DIR = Path(__file__).resolve().parent
if str(_TESTS_DIR) not in sys.path:  # `servers` is a plain module next to this file
    sys.path.insert(0, str(_TESTS_DIR))

from servers import (  # noqa: E402
    ExternalPostgres,
    ExternalRabbitMQ,
    PostgresHandle,
    PostgresServer,
    RabbitMQHandle,
    RabbitMQServer,
)

DB_URL_ENV = "OUTBOX_INBOX_TEST_DB_URL"
MQ_URL_ENV = "OUTBOX_INBOX_TEST_MQ_URL"

#: The session's local PostgreSQL does not fsync. fsync only matters when the operating system
#: crashes or loses power: a PostgreSQL that is killed, stopped or restarted loses nothing it had
#: written, as the kernel holds it, and no test crashes the kernel. Every commit still waits for
#: its WAL write (synchronous_commit stays on), so the crash, restart, failover and disk-full
#: tests see what they saw with fsync on; what stops waiting for the disk is the DDL of each
#: test's migration and its CREATE / DROP DATABASE (about 1 s less per migrated database).
SESSION_POSTGRES_SETTINGS = {"fsync": "off"}

_docker_answers: bool | None = None


def docker_available() -> bool:
    """True when a Docker engine answers ``docker info`` within 5 s (checked once)."""
    global _docker_answers
    if _docker_answers is None:
        _docker_answers = False
        if shutil.which("docker"):
            try:
                result = subprocess.run(
                    ["docker", "info"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=5,
                    check=False,
                )
                _docker_answers = result.returncode == 0
            except (OSError, subprocess.SubprocessError):
                _docker_answers = False
    return _docker_answers


def _unique_name() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"


# --------------------------------------------------------------------------------------------
# Collection: markers by folder
# --------------------------------------------------------------------------------------------


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    soak = "soak" in (config.option.markexpr or "")
    for item in items:
        if item.get_closest_marker("soak") and not soak:  # an hour: only when asked for
            item.add_marker(pytest.mark.skip(reason="the soak runs with -m soak (an hour)"))
        try:
            parts = item.path.resolve().relative_to(_TESTS_DIR).parts
        except ValueError:
            continue
        if parts and parts[0] == "integration":
            item.add_marker(pytest.mark.integration)
        elif parts and parts[0] == "e2e":
            item.add_marker(pytest.mark.e2e)


# --------------------------------------------------------------------------------------------
# Servers (session scope, started lazily by the first test that needs them)
# --------------------------------------------------------------------------------------------


def _testcontainers_postgres() -> ExternalPostgres:
    try:
        from testcontainers.community.postgres import PostgresContainer
    except ImportError:  # testcontainers < 4.14
        from testcontainers.postgres import PostgresContainer

    container: Any = PostgresContainer("postgres:15", driver="psycopg")
    container.start()
    try:
        return ExternalPostgres(container.get_connection_url(), on_cleanup=container.stop)
    except BaseException:
        container.stop()
        raise


def _testcontainers_rabbitmq() -> ExternalRabbitMQ:
    try:
        from testcontainers.community.rabbitmq import RabbitMqContainer
    except ImportError:  # testcontainers < 4.14
        from testcontainers.rabbitmq import RabbitMqContainer

    container: Any = RabbitMqContainer("rabbitmq:3.10")
    container.start()
    try:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(container.port)
        url = f"amqp://{container.username}:{container.password}@{host}:{port}/%2F"
        return ExternalRabbitMQ(url, on_cleanup=container.stop)
    except BaseException:
        container.stop()
        raise


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresHandle]:
    """The session's PostgreSQL server: external, testcontainers or local (see module doc)."""
    server: PostgresHandle
    external_url = os.environ.get(DB_URL_ENV)
    if external_url:
        server = ExternalPostgres(external_url)
    elif docker_available():
        server = _testcontainers_postgres()
    else:
        local = PostgresServer(settings=SESSION_POSTGRES_SETTINGS)
        try:
            local.start()
        except BaseException:
            local.cleanup()
            raise
        server = local
    try:
        yield server
    finally:
        discard(server)


@pytest.fixture(scope="session")
def rabbitmq_server() -> Iterator[RabbitMQHandle]:
    """The session's RabbitMQ server: external, testcontainers or local (see module doc)."""
    server: RabbitMQHandle
    external_url = os.environ.get(MQ_URL_ENV)
    if external_url:
        server = ExternalRabbitMQ(external_url)
    elif docker_available():
        server = _testcontainers_rabbitmq()
    else:
        local = RabbitMQServer()
        try:
            local.start()
        except BaseException:
            local.cleanup()
            raise
        server = local
    try:
        yield server
    finally:
        discard(server)


def discard(server: PostgresHandle | RabbitMQHandle) -> None:
    """Clean up a server the session is done with. A local one is killed first rather than
    stopped gracefully: its files are removed next, so nothing needs its shutdown, and a
    RabbitMQ node takes seconds to stop (at the end of a full run, this and the cluster's
    three nodes made a 30 s teardown). Killing is what the crash tests do to these servers."""
    if isinstance(server, PostgresServer | RabbitMQServer):
        server.kill()
    server.cleanup()


def _why_external(env_var: str) -> str:
    return f"{env_var} is set" if os.environ.get(env_var) else "testcontainers: Docker answers"


def _ensure_running(server: object) -> None:
    """Bring a local server back if a test left it stopped or killed."""
    if isinstance(server, PostgresServer | RabbitMQServer) and not server.running:
        server.start()


@pytest.fixture
def local_postgres_server(postgres_server: PostgresHandle) -> Iterator[PostgresServer]:
    """The session's PostgreSQL as a :class:`PostgresServer` the test may stop, start and kill.

    Skips the test when the server is external (env URL or testcontainers). Restarts the server
    after the test if the test left it down."""
    if not isinstance(postgres_server, PostgresServer):
        pytest.skip(
            "needs a local PostgreSQL server it can stop and restart; the session uses "
            f"{postgres_server!r} ({_why_external(DB_URL_ENV)})"
        )
    try:
        yield postgres_server
    finally:
        _ensure_running(postgres_server)


@pytest.fixture
def local_rabbitmq_server(rabbitmq_server: RabbitMQHandle) -> Iterator[RabbitMQServer]:
    """The session's RabbitMQ as a :class:`RabbitMQServer` the test may stop, start and kill.

    Skips the test when the server is external (env URL or testcontainers). Restarts the server
    after the test if the test left it down."""
    if not isinstance(rabbitmq_server, RabbitMQServer):
        pytest.skip(
            "needs a local RabbitMQ server it can stop and restart; the session uses "
            f"{rabbitmq_server!r} ({_why_external(MQ_URL_ENV)})"
        )
    try:
        yield rabbitmq_server
    finally:
        _ensure_running(rabbitmq_server)


@pytest.fixture
def rabbitmq_body_limit(local_rabbitmq_server: RabbitMQServer) -> Iterator[Callable[[int], None]]:
    """Sets the server's max_message_size (bytes) for channels opened from then on.

    The server's own value is restored after the test.
    """
    server = local_rabbitmq_server
    before = server.eval("application:get_env(rabbit, max_message_size).")
    if not before.startswith("{ok,"):
        raise AssertionError(f"cannot read max_message_size: {before}")
    original = int(before.strip("{}").split(",")[1])

    def set_limit(size: int) -> None:
        done = server.eval(f"application:set_env(rabbit, max_message_size, {int(size)}).")
        if done != "ok":
            raise AssertionError(f"cannot set max_message_size: {done}")

    try:
        yield set_limit
    finally:
        set_limit(original)


# --------------------------------------------------------------------------------------------
# Per-test databases and vhosts
# --------------------------------------------------------------------------------------------


@pytest.fixture
def db_url_factory(postgres_server: PostgresHandle) -> Iterator[Callable[[], str]]:
    """Callable making a fresh, empty database ``t_<random>`` and returning its SQLAlchemy URL
    (``postgresql+psycopg://...``). Every database it made is dropped (WITH (FORCE)) after the
    test."""
    created: list[str] = []

    def make() -> str:
        name = _unique_name()
        postgres_server.create_database(name)
        created.append(name)
        return postgres_server.url(name)

    try:
        yield make
    finally:
        _ensure_running(postgres_server)
        errors: list[BaseException] = []
        for name in reversed(created):
            try:
                postgres_server.drop_database(name)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


@pytest.fixture
def db_url(db_url_factory: Callable[[], str]) -> str:
    """SQLAlchemy URL (``postgresql+psycopg://...``) of a fresh database for this test only."""
    return db_url_factory()


@pytest.fixture
def mq_url(rabbitmq_server: RabbitMQHandle) -> Iterator[str]:
    """AMQP URL for this test: a fresh vhost ``t_<random>`` (guest has all permissions) on a
    local server, deleted afterwards with everything in it. External servers have no vhost of
    the test's own: their URL is given as is, and tests should name their queues uniquely."""
    if not (rabbitmq_server.supports_vhosts and isinstance(rabbitmq_server, RabbitMQServer)):
        yield rabbitmq_server.url
        return
    vhost = _unique_name()
    rabbitmq_server.add_vhost(vhost)
    try:
        yield rabbitmq_server.url_for_vhost(vhost)
    finally:
        _ensure_running(rabbitmq_server)
        rabbitmq_server.delete_vhost(vhost)


@pytest.fixture
def outbox_inbox_servers(
    local_postgres_server: PostgresServer, local_rabbitmq_server: RabbitMQServer
) -> tuple[PostgresServer, RabbitMQServer]:
    """The fault kit (`outbox_inbox.testing.faultkit`) on the session's servers, not a pair of
    its own: the override its documentation describes."""
    return local_postgres_server, local_rabbitmq_server
