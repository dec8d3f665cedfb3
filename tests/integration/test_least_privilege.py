"""The roles of docs/security.md, granted as written there, run a service on real servers.

The PostgreSQL grants and the rabbitmqctl lines are read from docs/security.md and run with
names of this test (roles and users are global to their server). With them: the migration
role migrates; the runtime role and the service's RabbitMQ user, with ``declare=False``,
send, receive, handle, retry through a delay tier and dead-letter messages, and run
``status``, ``dead-letters list`` and ``db current``; what they must not do is refused.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import pika
import pika.exceptions
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ProgrammingError

from helpers import FAST, wait_until
from outbox_inbox import BrokerError, Service, TopologyMissing

REPO = Path(__file__).resolve().parents[2]
SECURITY_DOC = REPO / "docs" / "security.md"
CLI = [sys.executable, "-m", "cli.main"]

APP = """
import os
from sqlalchemy import text
from outbox_inbox import Reject, Service


def build(db_url, mq_url, **settings):
    settings = {"declare": False, "delay_tiers": (1,), **settings}
    service = Service("billing", db_url=db_url, mq_url=mq_url, **settings)

    @service.on_command("invoice.create")
    def create_invoice(message, session):
        if message.payload.get("bad"):
            raise Reject("bad invoice")
        session.execute(
            text("INSERT INTO effects (message_id) VALUES (:m)"), {"m": message.message_id}
        )

    return service


def from_env():
    return build(os.environ["OUTBOX_INBOX_DB_URL"], os.environ["OUTBOX_INBOX_MQ_URL"])
"""


def _blocks(language: str) -> list[str]:
    """The fenced code blocks of docs/security.md in `language`, in order."""
    found = re.findall(rf"```{language}\n(.*?)```", SECURITY_DOC.read_text(), re.DOTALL)
    assert found, f"docs/security.md has no {language} block"
    return found


@dataclass
class Roles:
    admin_url: str  # the database's superuser URL (the test's own)
    migrator_url: str
    runtime_url: str
    admin_mq_url: str  # the topology admin
    service_mq_url: str  # the service's user
    guest_mq_url: str
    management_url: str | None
    app_dir: Path


def _user_url(url: str, user: str, password: str) -> str:
    return make_url(url).set(username=user, password=password).render_as_string(hide_password=False)


def _amqp_url(guest_url: str, user: str, password: str) -> str:
    parts = urlsplit(guest_url)
    return (
        f"amqp://{quote(user)}:{quote(password, safe='')}@{parts.hostname}:{parts.port}{parts.path}"
    )


@pytest.fixture
def roles(db_url: str, mq_url: str, local_rabbitmq_server: Any, tmp_path: Path) -> Iterator[Roles]:
    tag = uuid.uuid4().hex[:8]
    migrator, runtime = f"lp_{tag}_migrator", f"lp_{tag}_runtime"
    db_name = make_url(db_url).database
    assert db_name
    setup_sql = _blocks("sql")[0]

    def named(sql: str) -> str:
        sql = sql.replace("billing_migrator", migrator).replace("billing_runtime", runtime)
        sql = sql.replace("'change-me-1'", "'pw-migrator'").replace("'change-me-2'", "'pw-rt'")
        return sql.replace("ON DATABASE billing ", f'ON DATABASE "{db_name}" ')

    admin = create_engine(db_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(named(setup_sql)))
        conn.execute(text("CREATE TABLE public.effects (message_id text PRIMARY KEY)"))
        conn.execute(text(f"GRANT SELECT, INSERT ON public.effects TO {runtime}"))

    vhost = unquote(urlsplit(mq_url).path[1:])
    mq_admin, mq_service = f"lp-{tag}-admin", f"lp-{tag}-billing"
    for line in _blocks("bash")[1].splitlines():
        if not line.startswith("rabbitmqctl "):
            continue
        args = shlex.split(line)[1:]
        args = [
            {"/prod": vhost, "topology-admin": mq_admin, "billing": mq_service}.get(a, a)
            for a in args
        ]
        local_rabbitmq_server.rabbitmqctl(*args)
    management = local_rabbitmq_server.management_url
    (tmp_path / "lp_app.py").write_text(APP)
    roles = Roles(
        admin_url=db_url,
        migrator_url=_user_url(db_url, migrator, "pw-migrator"),
        runtime_url=_user_url(db_url, runtime, "pw-rt"),
        admin_mq_url=_amqp_url(mq_url, mq_admin, "change-me-3"),
        service_mq_url=_amqp_url(mq_url, mq_service, "change-me-4"),
        guest_mq_url=mq_url,
        management_url=(
            management.replace("guest:guest", f"{mq_admin}:change-me-3") if management else None
        ),
        app_dir=tmp_path,
    )
    try:
        yield roles
    finally:
        admin.dispose()
        for user in (mq_admin, mq_service):
            local_rabbitmq_server.rabbitmqctl("delete_user", user)
        cleanup = create_engine(db_url, isolation_level="AUTOCOMMIT")
        with cleanup.connect() as conn:
            conn.execute(text(f"DROP OWNED BY {runtime} CASCADE"))
            conn.execute(text(f"DROP OWNED BY {migrator} CASCADE"))
            conn.execute(text(f"DROP ROLE {migrator}"))
            conn.execute(text(f"DROP ROLE {runtime}"))
        cleanup.dispose()


def _grants(roles: Roles) -> str:
    sql = _blocks("sql")[1]
    migrator = make_url(roles.migrator_url).username
    runtime = make_url(roles.runtime_url).username
    assert migrator and runtime
    return sql.replace("billing_migrator", migrator).replace("billing_runtime", runtime)


def cli(*args: str, roles: Roles, db_url: str | None, mq_url: str | None) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_INBOX_")}
    if db_url:
        env["OUTBOX_INBOX_DB_URL"] = db_url
    if mq_url:
        env["OUTBOX_INBOX_MQ_URL"] = mq_url
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(roles.app_dir)])
    return subprocess.run(
        [*CLI, *args],
        cwd=roles.app_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _service(roles: Roles, **settings: Any) -> Service:
    """The app's service on the runtime identities, built in this process."""
    sys.path.insert(0, str(roles.app_dir))
    try:
        import lp_app

        service: Service = lp_app.build(
            roles.runtime_url, roles.service_mq_url, **{**FAST, **settings}
        )
        return service
    finally:
        sys.path.remove(str(roles.app_dir))
        sys.modules.pop("lp_app", None)


def _count(roles: Roles, sql: str) -> Any:
    engine = create_engine(roles.admin_url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(sql)).scalar()
    finally:
        engine.dispose()


def test_documented_roles_run_a_service_with_dml_and_no_configure_rights(roles: Roles) -> None:
    # Deploy: the migration role migrates, then grants; the topology admin declares.
    done = cli("db", "upgrade", roles=roles, db_url=roles.migrator_url, mq_url=None)
    assert done.returncode == 0, done.stderr
    migrator = create_engine(roles.migrator_url, isolation_level="AUTOCOMMIT")
    with migrator.connect() as conn:
        conn.execute(text(_grants(roles)))
    migrator.dispose()

    # Without the topology, a declare=False service refuses to start, declaring nothing.
    early = _service(roles)
    with pytest.raises(TopologyMissing, match=r"billing\.inbox"):
        early.start(fail_fast=True)
    early.close()

    management = ["--management-url", roles.management_url] if roles.management_url else []
    done = cli(
        "topology", "apply", "--app", "lp_app:from_env", *management,
        roles=roles, db_url=roles.runtime_url, mq_url=roles.admin_mq_url,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr

    # Run: every role with the runtime identities.
    service = _service(roles)
    service.start(fail_fast=True)
    try:
        with service.session() as session, session.begin():
            service.outbox.send(session, "billing", "invoice.create", {"n": 1})
            service.outbox.send(session, "billing", "invoice.create", {"bad": True})
        wait_until(lambda: _count(roles, "SELECT count(*) FROM public.effects") == 1)
        wait_until(
            lambda: (
                _count(
                    roles, "SELECT count(*) FROM outbox_inbox.inbox_messages WHERE status = 'dead'"
                )
                == 1
            )
        )
        # A message the receiver cannot store yet goes to a delay tier by the default
        # exchange and comes back: the runtime role loses INSERT on the inbox for a moment.
        runtime = make_url(roles.runtime_url).username
        admin = create_engine(roles.admin_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f"REVOKE INSERT ON outbox_inbox.inbox_messages FROM {runtime}"))
        with service.session() as session, session.begin():
            service.outbox.send(session, "billing", "invoice.create", {"n": 2})
        # While it cannot be stored it goes round: inbox, delay queue (1 s), inbox...
        wait_until(lambda: _depth(roles, "billing.delay.1s"), what="a delayed delivery")
        with admin.connect() as conn:
            conn.execute(text(f"GRANT INSERT ON outbox_inbox.inbox_messages TO {runtime}"))
        admin.dispose()
        wait_until(lambda: _count(roles, "SELECT count(*) FROM public.effects") == 2)
    finally:
        service.close()

    # The operator's read-only commands work with the runtime identities too.
    status = cli(
        "status", "--service", "billing", "--json",
        roles=roles, db_url=roles.runtime_url, mq_url=roles.service_mq_url,
    )  # fmt: skip
    assert status.returncode == 0, status.stdout + status.stderr
    assert json.loads(status.stdout)
    listed = cli(
        "dead-letters", "list", "--service", "billing", "--source", "table", "--json",
        roles=roles, db_url=roles.runtime_url, mq_url=None,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert "bad invoice" in listed.stdout
    current = cli("db", "current", roles=roles, db_url=roles.runtime_url, mq_url=None)
    assert current.returncode == 0 and "(head)" in current.stdout, current.stderr


def _depth(roles: Roles, queue: str) -> int:
    """Messages ready in `queue`, read as guest with a passive declare."""
    connection = pika.BlockingConnection(pika.URLParameters(roles.guest_mq_url))
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        connection.close()


def test_runtime_identities_cannot_change_the_schema_or_the_shared_topology(
    roles: Roles,
) -> None:
    assert cli("db", "upgrade", roles=roles, db_url=roles.migrator_url, mq_url=None).returncode == 0
    migrator = create_engine(roles.migrator_url, isolation_level="AUTOCOMMIT")
    with migrator.connect() as conn:
        conn.execute(text(_grants(roles)))
    migrator.dispose()

    # PostgreSQL: no DDL, no writing the version table, no upgrade.
    runtime = create_engine(roles.runtime_url, isolation_level="AUTOCOMMIT")
    for statement in (
        "CREATE TABLE outbox_inbox.x (a int)",
        "DROP TABLE outbox_inbox.inbox_messages",
        "ALTER TABLE outbox_inbox.outbox_messages ADD COLUMN x int",
        "UPDATE outbox_inbox.outbox_inbox_version SET version_num = 'x'",
        "TRUNCATE outbox_inbox.outbox_messages",
    ):
        with (
            runtime.connect() as conn,
            pytest.raises(ProgrammingError, match=r"permission denied|must be owner"),
        ):
            conn.execute(text(statement))
    runtime.dispose()
    refused = cli("db", "downgrade", "base", roles=roles, db_url=roles.runtime_url, mq_url=None)
    assert refused.returncode == 1, refused.stderr
    assert re.search("permission denied|must be owner", refused.stderr), refused.stderr
    assert _count(roles, "SELECT count(*) FROM outbox_inbox.outbox_inbox_version") == 1

    # RabbitMQ: the admin declares; the service's user cannot delete, purge or declare.
    done = cli(
        "topology", "apply", "--app", "lp_app:from_env",
        roles=roles, db_url=roles.runtime_url, mq_url=roles.admin_mq_url,
    )  # fmt: skip
    assert done.returncode in (0,), done.stdout + done.stderr
    params = pika.URLParameters(roles.service_mq_url)
    actions: list[Callable[[Any], object]] = [
        lambda ch: ch.exchange_delete("events"),
        lambda ch: ch.queue_purge("unroutable"),
        lambda ch: ch.queue_delete("billing.inbox"),
        lambda ch: ch.exchange_declare("events", "topic", durable=True),
        lambda ch: ch.basic_get("billing.dead_letter"),
    ]
    for action in actions:
        connection = pika.BlockingConnection(params)
        try:
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused_by:
                action(connection.channel())
            assert refused_by.value.reply_code == 403
        finally:
            connection.close()
    # A service that declares its topology (the default) needs configure rights it lacks.
    declaring = _service(roles, declare=True)
    with pytest.raises(BrokerError, match="ACCESS_REFUSED"):
        declaring.start(fail_fast=True)
    declaring.close()
