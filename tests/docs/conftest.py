"""The reader's project: docs/getting-started.md run once, top to bottom, on real servers.

Every other page of docs/ speaks to a reader who has done getting-started: its commands name
``--app billing.app:service``, its databases ``billing`` and ``orders``. So getting-started runs
once for the package (its own test checks that run) and each other page runs in a copy of the
project it leaves: ``billing/app.py``, ``orders/app.py``, the two databases with their tables,
the declared topology, an order invoiced and a dead letter, the roles stopped.
"""

from __future__ import annotations

import shutil
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from servers import (
    PG_BIN_DIR,
    PostgresHandle,
    PostgresServer,
    RabbitMQHandle,
    RabbitMQServer,
)

from .markdown_run import PageRun, base_env

DOCS = Path(__file__).resolve().parents[2] / "docs"
GETTING_STARTED = DOCS / "getting-started.md"
DATABASES = ("billing", "orders")  # what the page's createdb commands create
PAGE_ENVIRONMENT = {"PGHOST", "PGPORT", "PGUSER", "PGPASSWORD", "OUTBOX_INBOX_MQ_URL"}


def page_env(
    postgres_server: PostgresHandle, rabbitmq_server: RabbitMQHandle, mq_url: str
) -> dict[str, str]:
    """What the page's environment block sets, pointed at the test's servers: libpq's ``PG*``
    variables and ``OUTBOX_INBOX_MQ_URL``, plus the management API's URL where the session's
    broker has one (the page's default, port 15672 of the broker's host, is not where it is)."""
    server = make_url(postgres_server.url("postgres"))
    env = base_env(Path(sys.executable).parent)
    env["PATH"] += f":{PG_BIN_DIR}"  # psql and createdb, where the page's reader has them
    env.update(
        PGHOST=server.host or "localhost",
        PGPORT=str(server.port or 5432),
        PGUSER=server.username or "postgres",
        PGPASSWORD=server.password or "",
        OUTBOX_INBOX_MQ_URL=mq_url,
    )
    if isinstance(rabbitmq_server, RabbitMQServer) and rabbitmq_server.management_url:
        env["OUTBOX_INBOX_MANAGEMENT_URL"] = rabbitmq_server.management_url
    return env


@dataclass
class Project:
    """getting-started's run: where it left the project, and how it went."""

    workdir: Path
    env: dict[str, str]
    run: PageRun
    error: BaseException | None
    exit_codes: dict[str, int | None]

    def copy_to(self, target: Path) -> Path:
        """A copy of the project's files (the databases and the vhost are shared)."""
        shutil.copytree(self.workdir, target, symlinks=True)
        return target


def _drop_page_databases(postgres_server: PostgresHandle) -> None:
    admin = create_engine(postgres_server.url("postgres"))
    try:
        with admin.connect() as conn:
            found = sorted(
                conn.execute(
                    text("SELECT datname FROM pg_database WHERE datname IN ('billing', 'orders')")
                ).scalars()
            )
    finally:
        admin.dispose()
    if found and not isinstance(postgres_server, PostgresServer):
        pytest.skip(f"the page creates databases {DATABASES}; {found} exist on this server")
    for name in DATABASES:
        postgres_server.drop_database(name)


@pytest.fixture(scope="package")
def reader_project(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: PostgresHandle,
    rabbitmq_server: RabbitMQHandle,
) -> Iterator[Project]:
    """getting-started.md run once as written, in a fresh directory (with the repository's
    virtual environment as the reader's ``.venv``), on fresh ``billing`` and ``orders`` databases
    and a vhost of its own; its background roles stopped with SIGTERM at the end."""
    _drop_page_databases(postgres_server)
    vhost = None
    mq_url = rabbitmq_server.url
    if rabbitmq_server.supports_vhosts and isinstance(rabbitmq_server, RabbitMQServer):
        vhost = f"docs_{uuid.uuid4().hex[:8]}"
        rabbitmq_server.add_vhost(vhost)
        mq_url = rabbitmq_server.url_for_vhost(vhost)
    workdir = tmp_path_factory.mktemp("reader") / "project"
    workdir.mkdir()
    (workdir / ".venv").symlink_to(Path(sys.executable).parent.parent)
    env = page_env(postgres_server, rabbitmq_server, mq_url)
    run = PageRun(GETTING_STARTED, workdir, env, PAGE_ENVIRONMENT)
    error: BaseException | None = None
    try:
        run.run_all()
    except Exception as exc:  # the page's own test reports it; the others cannot start
        error = exc
    codes = run.stop(timeout=30 if error is None else 10)
    try:
        yield Project(workdir, env, run, error, codes)
    finally:
        for name in DATABASES:
            postgres_server.drop_database(name)
        if vhost is not None:
            rabbitmq_server.delete_vhost(vhost)
