"""Options as values: a handler's options (`HandlerOptions`), a write's (`WriteOptions`) and
the dead-letter filters (`Filters`), each declared once and read where it acts."""

from __future__ import annotations

import dataclasses
import typing
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import select

from outbox_inbox import ConfigurationError, Message, MessageError, RetryPolicy, Service
from outbox_inbox.brokers.memory import MemoryBroker
from outbox_inbox.cli.main import main
from outbox_inbox.dead_letters import Filters
from outbox_inbox.handlers import HandlerKeywords, HandlerOptions
from outbox_inbox.outbox import WriteKeywords, WriteOptions
from outbox_inbox.testing import ServiceHarness


def _fields(value: type) -> dict[str, Any]:
    return {f.name: f.type for f in dataclasses.fields(value)}


@pytest.mark.parametrize(
    ("keywords", "value"), [(HandlerKeywords, HandlerOptions), (WriteKeywords, WriteOptions)]
)
def test_the_keywords_type_checkers_see_are_the_fields_of_the_options_value(
    keywords: type, value: type
) -> None:
    # Both are declared in one module; this holds them equal, name and type, so an option
    # added to the value and not to the keywords (or the other way round) fails here.
    annotations = {k: t.__forward_arg__ for k, t in keywords.__annotations__.items()}
    assert annotations == _fields(value)
    assert not typing.cast(Any, keywords).__required_keys__


@pytest.fixture
def service(tmp_path: Path) -> typing.Iterator[Service]:
    with MemoryBroker() as broker:
        service = Service(
            "billing",
            db_url=f"sqlite:///{tmp_path / 'billing.db'}",
            broker=broker,
            retry=RetryPolicy(initial=0.01, max_attempts=5),
        )
        yield service
        service.close()


def test_on_command_on_event_and_on_fault_give_their_options_to_the_subscription(
    service: Service,
) -> None:
    once = RetryPolicy(max_attempts=1)

    @service.on_command("invoice.create", retry=once, batch=True, version=2)
    @service.on_event("orders.order.*")
    @service.on_fault("billing.#", retry=once, batch=True)
    def handler(messages: Any, session: Any) -> None:
        """Registered three times; the tests look at the subscriptions only."""

    assert [s.options for s in service.handlers.subscriptions] == [
        HandlerOptions(retry=once, batch=True),
        HandlerOptions(),
        HandlerOptions(retry=once, batch=True, version=2),
    ]
    with pytest.raises(ConfigurationError, match="version must be an int >= 1, got 0"):
        service.on_event("orders.#", version=0)
    with pytest.raises(TypeError, match="timeout"):
        service.on_command("invoice.void", **typing.cast(Any, {"timeout": 1}))


def test_a_handlers_own_retry_policy_is_the_one_the_worker_applies(service: Service) -> None:
    attempts: list[int] = []

    @service.on_command("invoice.create", retry=RetryPolicy(max_attempts=2))
    def create(message: Message, session: Any) -> None:
        attempts.append(message.attempt)
        raise RuntimeError("the ledger is down")

    with ServiceHarness(service) as harness:
        row = harness.handle("billing.invoice.create", {"n": 1})

    assert (row.status, row.dead_reason, attempts) == ("dead", "max_attempts", [1, 2])


def test_every_write_option_reaches_the_outbox_row(service: Service) -> None:
    ServiceHarness(service).close()  # migrated
    message_id = uuid.uuid4()
    options: WriteKeywords = {
        "key": "order-7",
        "headers": {"tenant": "acme"},
        "correlation_id": "conversation-1",
        "message_id": message_id,
        "priority": 9,
        "ttl": timedelta(minutes=1),
        "version": 3,
        "delay": 30,
    }
    with service.session() as session, session.begin():
        service.outbox.send(session, "shipping", "parcel.ship", {"n": 1}, **options)
    outbox = service.tables.outbox
    with service.engine.connect() as conn:
        row = conn.execute(select(outbox).where(outbox.c.message_id == message_id)).one()

    assert (row.key, row.headers, row.correlation_id, row.priority, row.version) == (
        "order-7",
        {"tenant": "acme"},
        "conversation-1",
        9,
        3,
    )
    # The database's clock adds them (SQLite's created_at is in whole seconds).
    assert timedelta(seconds=59) < row.expires_at - row.created_at < timedelta(seconds=61)
    assert timedelta(seconds=29) < row.available_at - row.created_at < timedelta(seconds=31)
    with service.session() as session, pytest.raises(MessageError, match="priority"):
        service.outbox.publish(session, "order.placed", {}, priority=256)


@pytest.mark.parametrize("pattern", ["", ".", "orders..placed", "orders.", ".orders"])
def test_filters_refuse_a_type_that_is_not_a_routing_key_or_pattern(pattern: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        Filters(types=("orders.#", pattern))
    assert str(raised.value) == f"{pattern!r} is not a routing key or pattern"
    assert Filters(types=("orders.#", "*", "billing.invoice.create")).types


@pytest.mark.parametrize("command", ["list", "count", "replay", "purge", "park"])
def test_a_type_filters_refuse_is_the_dead_letter_commands_usage_error(command: str) -> None:
    types = ["--type", "orders.#", "--type", "orders..placed"]
    result = CliRunner().invoke(main, ["dead-letters", command, "--source", "table", *types])
    assert result.exit_code == 2, result.output
    assert result.output.endswith(
        "Error: Invalid value for --type: 'orders..placed' is not a routing key or pattern\n"
    )


def test_tail_refuses_what_filters_refuse_in_its_own_words() -> None:
    result = CliRunner().invoke(main, ["tail", "orders.#", "orders..placed"])
    assert result.exit_code == 2, result.output
    assert result.output.endswith(
        "Error: Invalid value for PATTERN: 'orders..placed' is not a topic pattern\n"
    )
