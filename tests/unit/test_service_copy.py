"""`Service.with_urls` and `Service.tenant`: the service on other servers or in a tenant's
database and schema, and what the copy keeps."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest

from outbox_inbox import ConfigurationError, Listener, Message, MessageError, Service, Tenant
from outbox_inbox.brokers.memory import MemoryBroker
from outbox_inbox.database import connect


def test_with_urls_is_the_service_itself_when_no_url_is_another(tmp_path: Path) -> None:
    app = Service("billing", db_url=f"sqlite:///{tmp_path / 'a.db'}")
    assert app.with_urls() is app
    assert app.with_urls(db_url=app.settings.db_url) is app


def test_with_urls_keeps_name_settings_handlers_listener_and_a_given_broker(
    tmp_path: Path,
) -> None:
    listener = Listener()
    with MemoryBroker() as broker:
        app = Service(
            "billing",
            db_url=f"sqlite:///{tmp_path / 'a.db'}",
            broker=broker,
            listener=listener,
            worker_threads=3,
            relay_batch_size=7,
        )

        @app.on_command("invoice.create")
        def create(message: Message, session: object) -> None: ...

        other = f"sqlite:///{tmp_path / 'b.db'}"
        copy = app.with_urls(db_url=other)
        try:
            assert copy is not app and copy.name == "billing"
            assert copy.settings == replace(app.settings, db_url=other)
            assert copy.handlers is app.handlers and copy.listener is listener
            assert copy.broker is broker
            assert str(copy.engine.url) == other and copy.engine is not app.engine
        finally:
            copy.close()
            app.close()


def test_with_urls_keeps_a_given_engine_when_only_the_broker_is_another(tmp_path: Path) -> None:
    engine = connect(f"sqlite:///{tmp_path / 'a.db'}").engine
    app = Service("billing", engine=engine)
    copy = app.with_urls(mq_url="amqp://guest:secret@localhost:5672/")
    try:
        assert copy.engine is engine
        assert copy.settings.mq_url == "amqp://guest:secret@localhost:5672/"
        assert copy.broker.description == "amqp://guest:***@localhost:5672/"
    finally:
        engine.dispose()


def test_a_tenant_is_the_service_in_its_schema_sharing_the_engine_of_its_database(
    tmp_path: Path,
) -> None:
    registry = {"acme": Tenant(schema="t_acme"), "beta": Tenant(schema="t_beta")}
    app = Service("billing", db_url="postgresql+psycopg://u@localhost/shop", tenants=registry)
    acme, beta = app.tenant("acme"), app.tenant("beta")
    assert app.tenant_ids() == ["acme", "beta"] and app.tenant("acme") is acme
    assert (acme.tenant_id, acme.tables.inbox.schema, beta.tables.inbox.schema) == (
        "acme",
        "t_acme",
        "t_beta",
    )
    assert acme.engine is app.engine is beta.engine and acme.handlers is app.handlers
    with pytest.raises(ConfigurationError, match="no tenant 'gamma'"):
        app.tenant("gamma")
    app.close()


def test_a_tenants_outbox_stamps_its_tenant_and_refuses_another(tmp_path: Path) -> None:
    other = f"sqlite:///{tmp_path / 'acme.db'}"
    app = Service(
        "billing", db_url=f"sqlite:///{tmp_path / 'a.db'}", tenants=lambda: {"acme": Tenant(other)}
    )
    acme = app.tenant("acme")
    assert str(acme.engine.url) == other and acme.engine is not app.engine
    row = acme.outbox._row("event", "events", "billing.x", {}, {})
    assert row["headers"]["x-tenant"] == "acme"
    with pytest.raises(MessageError, match="cannot write for 'beta'"):
        acme.outbox._row("event", "events", "billing.x", {}, {"tenant": "beta"})
    app.close()


def test_a_registry_that_raises_or_returns_garbage_is_a_configuration_error(
    tmp_path: Path,
) -> None:
    def broken() -> dict[str, Tenant]:
        raise OSError("registry table away")

    for registry, match in ((broken, "registry raised: registry table away"), ({"a": "x"}, "map")):
        app = Service("billing", db_url=f"sqlite:///{tmp_path / 'a.db'}", tenants=registry)
        with pytest.raises(ConfigurationError, match=match):
            app.tenant_ids()


def test_a_bad_registry_entry_fails_its_own_lookup_not_another_tenants(tmp_path: Path) -> None:
    registry = {"good": Tenant(schema="good"), "bad": "not a Tenant"}
    app = Service("billing", db_url=f"sqlite:///{tmp_path / 'a.db'}", tenants=registry)
    assert app.tenant("good").tenant_id == "good"
    with pytest.raises(ConfigurationError, match="map ids"):
        app.tenant("bad")
    with pytest.raises(ConfigurationError, match="map ids"):
        app.tenant_ids()  # the fleet's read: every entry
    app.close()


@pytest.mark.parametrize(
    ("tenants", "interval", "gap"),
    [
        (10, "day", 300 / 11),  # maintenance_interval spread over them
        (1_000, "day", 10.0),  # the fewest seconds apart
        (1_000, "hour", 10.0),
        (20_000, "hour", 48 * 3600 / 4 / 20_001),  # a pass within a quarter of the lead
    ],
)
def test_the_tenants_maintenance_gap_keeps_every_tenants_partitions_ahead(
    tmp_path: Path, tenants: int, interval: str, gap: float
) -> None:
    registry = {f"t{n}": Tenant(schema=f"t{n}") for n in range(tenants)}
    app = Service(
        "billing",
        db_url=f"sqlite:///{tmp_path / 'a.db'}",
        tenants=registry,
        partition_interval=interval,
    )
    waits: list[float | None] = []

    class Once(threading.Event):  # the first gap asked for, then stopped
        def wait(self, timeout: float | None = None) -> bool:
            waits.append(timeout)
            return True

    app._maintain_quietly(stop=Once())  # the service's own pass, then its first gap
    assert waits == [pytest.approx(gap)]
    app.close()
