from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import create_engine

from outbox_inbox import ConfigurationError, MessageError, Service
from outbox_inbox.logsafe import mask_url
from outbox_inbox.tables import build_tables
from outbox_inbox.waker import psycopg_conninfo


@pytest.mark.parametrize(
    "schema", ["public; drop table x", "Outbox", "1abc", "a" * 64, "", "x-y", 'a"b']
)
def test_schema_that_is_not_an_identifier_is_refused(schema: str) -> None:
    with pytest.raises(ConfigurationError, match="invalid schema"):
        Service("billing", db_url="postgresql+psycopg://localhost/x", schema=schema)
    with pytest.raises(ConfigurationError):
        build_tables(schema)


@pytest.mark.parametrize("name", ["Billing", "bill.ing", "bill*", "#", "", "1billing"])
def test_service_name_must_fit_in_routing_keys(name: str) -> None:
    with pytest.raises(ConfigurationError, match="invalid service name"):
        Service(name, db_url="postgresql+psycopg://localhost/x")


def test_unknown_or_invalid_setting_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="unknown setting"):
        Service("billing", db_url="postgresql+psycopg://localhost/x", lease_time=3)
    with pytest.raises(ConfigurationError, match="lease must be > 0"):
        Service("billing", db_url="postgresql+psycopg://localhost/x", lease=0)
    with pytest.raises(ConfigurationError, match="needs db_url"):
        Service("billing")


def test_constructing_a_service_connects_to_nothing() -> None:
    service = Service(
        "billing", db_url="postgresql+psycopg://u:pw@127.0.0.1:1/x", mq_url="amqp://127.0.0.1:1/"
    )
    assert "pw" not in repr(service)
    assert "pw" not in repr(service.settings)
    assert "u:***@127.0.0.1:1/x" in repr(service.settings)


def test_invalid_message_names_are_refused_before_any_database_work() -> None:
    service = Service("billing", db_url="postgresql+psycopg://localhost/x")
    with pytest.raises(MessageError, match="Session or Connection"):
        service.outbox.publish(object(), "invoice.created", {})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql+psycopg://app:s3cr%40t@db:5432/x", "postgresql+psycopg://app:***@db:5432/x"),
        ("amqp://guest:guest@127.0.0.1:5672/%2F", "amqp://guest:***@127.0.0.1:5672/%2F"),
        ("amqp://127.0.0.1/", "amqp://127.0.0.1/"),
        (None, ""),
        # Malformed: a missing colon after the scheme, a raw "/" or "@" in the password.
        ("postgresql+psycopg//u:PW1@db/x", "postgresql+psycopg//u:***@db/x"),
        ("amqp//u:PW2@rabbit/", "amqp//u:***@rabbit/"),
        ("postgresql+psycopg://u:P/W3@db/x", "postgresql+psycopg://u:***@db/x"),
        ("postgresql://u:P@W4@db/x", "postgresql://u:***@db/x"),
        ("http:u:PW5@mgmt:15672", "http:***@mgmt:15672"),
        (
            "error: malformed database URL postgresql+psycopg//u:PW6@db:x/y; see --help",
            "error: malformed database URL postgresql+psycopg//u:***@db:x/y; see --help",
        ),
        (
            "two: amqp://a:PW7@h1/ and amqp://b:PW8@h2/",
            "two: amqp://a:***@h1/ and amqp://b:***@h2/",
        ),
        ("user@host without a password", "user@host without a password"),
    ],
)
def test_mask_url_hides_passwords(url: str | None, masked: str) -> None:
    assert mask_url(url) == masked


@pytest.mark.parametrize(
    ("given", "used"),
    [
        (
            "postgres://app:s%40cret@db:5432/orders",
            "postgresql+psycopg://app:s%40cret@db:5432/orders",
        ),
        ("postgresql://app@db/orders", "postgresql+psycopg://app@db/orders"),
        ("postgresql+psycopg://app@db/orders", "postgresql+psycopg://app@db/orders"),
        ("sqlite:///orders.db", "sqlite:///orders.db"),
    ],
)
def test_a_postgres_url_without_the_driver_runs_on_psycopg_3(given: str, used: str) -> None:
    service = Service("orders", db_url=given, listen_url=given)
    assert service.settings.db_url == used
    assert service.settings.listen_url == used


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:s%40cret@/orders?host=db1:5432,db2:5433&target_session_attrs=read-write",
        "postgresql+psycopg://app:s%40cret@/orders?host=db1:5432&host=db2:5433"
        "&target_session_attrs=read-write",
        "postgresql+psycopg://app:s%40cret@/orders?host=db1,db2&port=5432,5433"
        "&target_session_attrs=read-write",
    ],
)
def test_a_failover_url_names_each_server_alike_for_sqlalchemy_and_libpq(url: str) -> None:
    # The pool's connections (SQLAlchemy) and the LISTEN connection (a libpq conninfo) must
    # walk the same host list, with its ports, to find the primary after a failover.
    used = Service("orders", db_url=url).settings.db_url
    engine = create_engine(used)
    args = engine.dialect.create_connect_args(engine.url)[1]
    wanted = {
        "host": "db1,db2",
        "port": "5432,5433",
        "target_session_attrs": "read-write",
        "password": "s@cret",
    }
    assert {key: str(args[key]) for key in wanted} == wanted
    libpq = psycopg.conninfo.conninfo_to_dict(psycopg_conninfo(used))
    assert {key: libpq[key] for key in wanted} == wanted


@pytest.mark.parametrize(
    "url",
    ["postgresql+psycopg2://app:Hidden-pw9@db/orders", "mysql://app:Hidden-pw9@db/orders"],
)
def test_a_database_the_library_cannot_run_on_is_refused_when_the_service_is_built(
    url: str,
) -> None:
    with pytest.raises(ConfigurationError, match="not supported") as refused:
        Service("orders", db_url=url)
    assert "Hidden" not in str(refused.value) and "pw9" not in str(refused.value)
    assert "postgresql+psycopg://" in str(refused.value)
