"""What an operator sees of a service's tenants: per-tenant backlog and lag in the status, its
--json, the health rule "tenant never drained", an unreachable tenant, and the metrics."""

from __future__ import annotations

import json
import socket
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import event, make_url, text

from helpers import received_row
from outbox_inbox import Service, Tenant, migrate
from outbox_inbox import status as status_module
from outbox_inbox.cli.status import status
from outbox_inbox.dashboard import Dashboard, WatchedService
from outbox_inbox.metrics import instrument
from outbox_inbox.queries import roles

pytestmark = pytest.mark.integration

PASSWORD = "s3cret-tenant-pw"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def urls(db_url_factory: Callable[[], str]) -> tuple[str, str]:
    """A database with the service's schema and two tenants' (tenant_a, tenant_b), and a
    database of its own for tenant c."""
    shared, own = db_url_factory(), db_url_factory()
    for schema in ("outbox_inbox", "tenant_a", "tenant_b"):
        migrate.upgrade(migrate.alembic_config(shared, schema=schema))
    migrate.upgrade(migrate.alembic_config(own))
    return shared, own


def _tenants(own: str) -> dict[str, Tenant]:
    down = f"postgresql+psycopg://app:{PASSWORD}@127.0.0.1:{_closed_port()}/gone"
    return {
        "a": Tenant(schema="tenant_a"),
        "b": Tenant(schema="tenant_b"),
        "c": Tenant(db_url=own),
        "down": Tenant(db_url=down),
    }


@pytest.fixture
def service(urls: tuple[str, str]) -> Iterator[Service]:
    """billing with tenants a, b (schemas in its database), c (its own database) and down (a
    database nobody answers at): a has 2 unsent and 3 pending rows waiting an hour, b one
    processed row (drained), c one unsent row just written."""
    shared, own = urls
    app = Service("billing", db_url=shared, tenants=_tenants(own))
    _fill(app)
    try:
        yield app
    finally:
        app.close()


def _fill(app: Service) -> None:
    a, b, c = (app.tenant(t) for t in "abc")
    with a.session() as session, session.begin():
        for n in range(2):
            a.outbox.send(session, "shipping", "parcel.send", {"n": n})
    with a.engine.begin() as conn:
        roles.insert_inbox(conn, a.tables, [received_row(tenant="a") for _ in range(3)])
        for t in (a.tables.outbox, a.tables.inbox):
            stamp = "created_at" if t is a.tables.outbox else "received_at"
            conn.execute(t.update().values({stamp: text("now() - interval '1 hour'")}))
    with b.engine.begin() as conn:
        roles.insert_inbox(conn, b.tables, [received_row(tenant="b")])
        conn.execute(b.tables.inbox.update().values(status="processed", processed_at=text("now()")))
    with c.session() as session, session.begin():
        c.outbox.publish(session, "invoice.paid", {"n": 1})


def _rows(top: list[dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
    return {t["tenant"]: (t["outbox"], t["inbox"], t["error"] is None) for t in top}


def test_health_shows_each_tenant_backlog_lag_and_the_never_drained_rule(
    service: Service,
) -> None:
    statements: list[str] = []
    event.listen(service.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    checked = service.health(max_lag=600)
    tenants = checked.tenants
    assert tenants is not None
    # Unreachable first, then the largest lag, then the largest backlog.
    assert [t["tenant"] for t in tenants["top"]] == ["down", "a", "c", "b"]
    assert _rows(tenants["top"]) == {
        "down": (None, None, False),
        "a": (2, 3, True),
        "c": (1, 0, True),
        "b": (0, 0, True),
    }
    a = tenants["top"][1]
    assert 3500 < a["lag_seconds"] < 3700
    assert tenants["top"][3]["lag_seconds"] == 0  # b: nothing waits
    assert (tenants["count"], tenants["waiting"], tenants["unreachable"]) == (4, 2, 1)
    assert (tenants["outbox"], tenants["inbox"], tenants["never_drained"]) == (3, 3, 1)
    # a and b share the service's database: their backlog is one statement.
    assert sum("tenant_a" in s and "tenant_b" in s for s in statements) == 1
    assert sum("tenant_a" in s for s in statements) == 1

    tenant_problems = [p for p in checked.problems if p.startswith("tenant ")]
    assert len(tenant_problems) == 2, checked.problems
    assert tenant_problems[0].startswith("tenant down unreachable: ")
    assert tenant_problems[1].startswith("tenant a never drained for ")
    assert tenant_problems[1].endswith("s (> 600s)")
    assert PASSWORD not in json.dumps(checked.as_dict())
    # Drained within the bound: an hour and a half allowed, only the unreachable one is a problem.
    relaxed = service.health(max_lag=5400)
    assert [p.split(":")[0] for p in relaxed.problems if p.startswith("tenant ")] == [
        "tenant down unreachable"
    ]


def test_a_tenant_schema_without_tables_is_shown_as_such_while_the_others_are(
    urls: tuple[str, str],
) -> None:
    shared, own = urls
    # "gone": a database named as its URL's password, which the server's error repeats.
    gone = make_url(shared).set(password=PASSWORD, database=PASSWORD)
    tenants = {**_tenants(own), "x": Tenant(schema="never_migrated"), "y": Tenant(schema="a b")}
    tenants["down"] = Tenant(db_url=gone.render_as_string(hide_password=False))
    app = Service("billing", db_url=shared, tenants=tenants)
    try:
        _fill(app)
        found = app.health(max_lag=600).tenants
        assert found is not None
        assert _rows(found["top"]) == {
            "down": (None, None, False),
            "x": (None, None, False),
            "y": (None, None, False),  # Service.tenant refuses its schema
            "a": (2, 3, True),
            "c": (1, 0, True),
            "b": (0, 0, True),
        }
        errors = {t["tenant"]: t["error"] for t in found["top"]}
        assert "db upgrade" in errors["x"]
        assert "does not exist" in errors["down"] and PASSWORD not in errors["down"]
    finally:
        app.close()


def test_a_service_without_tenants_shows_no_tenant_section(urls: tuple[str, str]) -> None:
    app = Service("billing", db_url=urls[0])
    try:
        assert app.health().tenants is None
        assert app.health().as_dict()["tenants"] is None
    finally:
        app.close()


def test_status_command_lists_tenants_and_exits_unhealthy_for_the_never_drained_one(
    service: Service, urls: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = f"tenants_app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        "from outbox_inbox import Service, Tenant\n"
        f"service = Service('billing', db_url={urls[0]!r}, tenants={_tenants(urls[1])!r})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    runner = CliRunner()
    app = ["--app", f"{module}:service", "--no-broker"]
    try:
        as_json = runner.invoke(status, [*app, "--json", "--max-lag", "10m"])
        assert as_json.exit_code == 4, as_json.output
        report = json.loads(as_json.stdout)
        assert _rows(report["tenants"]["top"])["a"] == (2, 3, True)
        assert report["tenants"]["never_drained"] == 1
        assert "unhealthy: tenant a never drained for " in as_json.stderr
        assert "unhealthy: tenant down unreachable: " in as_json.stderr

        human = runner.invoke(status, [*app, "--max-lag", "2h"])
        assert human.exit_code == 4, human.output  # the unreachable tenant
        lines = human.stdout.splitlines()
        assert any(line.startswith("tenants 4, 2 waiting (outbox 3, inbox 3)") for line in lines)
        assert [line.split()[:3] for line in lines if line.startswith(("a ", "c "))] == [
            ["a", "2", "3"],
            ["c", "1", "0"],
        ]
        assert "never drained" not in human.stderr
        assert PASSWORD not in human.output + as_json.output
    finally:
        sys.modules.pop(module, None)


def test_metrics_expose_each_tenant_backlog_lag_and_the_never_drained_count(
    service: Service,
) -> None:
    registry = CollectorRegistry()
    instrument(service, registry=registry)
    body = generate_latest(registry).decode()
    assert PASSWORD not in body
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[
            (f"outbox_inbox_{name}", tuple(sorted({"service": "billing", **labels}.items())))
        ]

    assert value("tenant_backlog", tenant="a", table="outbox") == 2
    assert value("tenant_backlog", tenant="a", table="inbox") == 3
    assert value("tenant_backlog", tenant="c", table="outbox") == 1
    assert value("tenant_backlog", tenant="b", table="inbox") == 0
    assert 3500 < value("tenant_lag_seconds", tenant="a") < 3700
    assert value("tenant_up", tenant="a") == 1
    assert value("tenant_up", tenant="down") == 0
    assert (
        "outbox_inbox_tenant_lag_seconds",
        (("service", "billing"), ("tenant", "down")),
    ) not in samples
    assert value("tenants_never_drained") == 1  # a, over NEVER_DRAINED_AFTER


def test_dashboard_page_shows_the_tenants_and_the_never_drained_problem(service: Service) -> None:
    watched = WatchedService(service.name, service.engine, service.tables, tenants=service)
    app = Dashboard([watched], audit=lambda **_: None, max_lag=600)
    replies: list[str] = []
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/service", "HTTP_HOST": "127.0.0.1"}
    body = b"".join(
        app({**environ, "QUERY_STRING": "name=billing"}, lambda s, h: replies.append(s))
    ).decode()
    assert replies == ["200 OK"]
    assert "<h2 id=tenants>Tenants: 4, 2 waiting (outbox 3, inbox 3), 1 unreachable" in body
    assert "tenant a never drained for " in body and 'class="badge unhealthy"' in body
    assert PASSWORD not in body


def test_tenants_of_one_database_are_read_a_few_schemas_a_statement(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(status_module, "TENANTS_PER_STATEMENT", 1)
    statements: list[str] = []
    event.listen(service.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    found = status_module.tenant_status(service)
    assert found is not None
    assert _rows(found["top"])["a"] == (2, 3, True) and _rows(found["top"])["b"] == (0, 0, True)
    assert [("tenant_a" in s, "tenant_b" in s) for s in statements] == [
        (True, False),
        (False, True),
    ]
