"""docs/getting-started.md works as written: its blocks run in order against real servers.

The page's own conventions (files, commands, outputs, background processes) are those of
`markdown_run`. The test gives the page's environment block its servers: libpq's ``PG*``
variables for the session's PostgreSQL and ``OUTBOX_INBOX_MQ_URL`` for a fresh vhost, plus the
RabbitMQ management API's URL where the session's broker has one (the page's default, port
15672 of the broker's host, is not where the test's broker listens).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from servers import PG_BIN_DIR, PostgresHandle, PostgresServer, RabbitMQHandle, RabbitMQServer

from .markdown_run import PageRun, base_env, parse_blocks

pytestmark = pytest.mark.integration

PAGE = Path(__file__).resolve().parents[2] / "docs" / "getting-started.md"
DATABASES = ("billing", "orders")  # what the page's createdb commands create
PAGE_ENVIRONMENT = {"PGHOST", "PGPORT", "PGUSER", "PGPASSWORD", "OUTBOX_INBOX_MQ_URL"}


@pytest.fixture
def page_databases(postgres_server: PostgresHandle) -> Iterator[None]:
    """No `billing` or `orders` database before the page runs (it creates them), none after."""
    admin = create_engine(postgres_server.url("postgres"))
    try:
        with admin.connect() as conn:
            existing = conn.execute(
                text("SELECT datname FROM pg_database WHERE datname IN ('billing', 'orders')")
            ).scalars()
            found = sorted(existing)
    finally:
        admin.dispose()
    if found and not isinstance(postgres_server, PostgresServer):
        pytest.skip(f"the page creates databases {DATABASES}; {found} exist on this server")
    for name in DATABASES:
        postgres_server.drop_database(name)
    try:
        yield
    finally:
        for name in DATABASES:
            postgres_server.drop_database(name)


def page_env(
    postgres_server: PostgresHandle, rabbitmq_server: RabbitMQHandle, mq_url: str
) -> dict[str, str]:
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


def test_getting_started_runs_as_written_on_real_servers(
    tmp_path: Path,
    postgres_server: PostgresHandle,
    rabbitmq_server: RabbitMQHandle,
    mq_url: str,
    page_databases: None,
) -> None:
    workdir = tmp_path / "project"
    workdir.mkdir()
    run = PageRun(
        PAGE,
        workdir,
        page_env(postgres_server, rabbitmq_server, mq_url),
        PAGE_ENVIRONMENT,
    )
    try:
        run.run_all()
    except BaseException:
        run.stop(timeout=10)
        print("\n".join(run.log))
        print(run.background_logs())
        raise
    assert run.background, "the page starts the services' roles"
    codes = run.stop()
    print("\n".join(run.log))
    assert all(code == 0 for code in codes.values()), (codes, run.background_logs())


def test_the_page_runs_the_commands_it_shows() -> None:
    """Every shell, console and Python block of the page is run, written or skipped with a
    reason: only the installation and the server containers are skipped."""
    blocks = parse_blocks(PAGE.read_text(encoding="utf-8"))
    skipped = [block for block in blocks if block.marker("not run") is not None]
    assert [block.text.split()[0] for block in skipped] == ["python3", "docker"]
    files = [block.marker("file") for block in blocks if block.marker("file")]
    assert files == ["billing/app.py", "orders/app.py", "place_order.py", "dev.py"]
