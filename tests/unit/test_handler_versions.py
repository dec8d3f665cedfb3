"""Handlers chosen by the message's payload version, and what an instance advertises."""

from __future__ import annotations

from typing import Any

import pytest

from outbox_inbox import ConfigurationError
from outbox_inbox.handlers import HandlerOptions, Handlers, Subscription, handled_by


def _handler(message: Any, session: Any) -> None:
    """A handler; the tests only look it up."""


def _v1(message: Any, session: Any) -> None:
    """The version 1 handler."""


def _v2(message: Any, session: Any) -> None:
    """The version 2 handler."""


def test_a_handler_without_version_takes_every_version_and_one_with_a_version_only_its_own() -> (
    None
):
    handlers = Handlers()
    handlers.add(Subscription("event", "orders.order.*", _handler))
    handlers.add(
        Subscription("event", "orders.order.placed", _v1, options=HandlerOptions(version=1))
    )
    handlers.add(
        Subscription("event", "orders.order.placed", _v2, options=HandlerOptions(version=2))
    )
    handlers.add(
        Subscription("command", "billing.invoice.create", _v2, options=HandlerOptions(version=2))
    )

    def found(kind: str, key: str, version: int) -> list[Any]:
        return [s.handler for s in handlers.find(kind, key, version).every]

    assert found("event", "orders.order.placed", 1) == [_handler, _v1]
    assert found("event", "orders.order.placed", 2) == [_handler, _v2]
    assert found("event", "orders.order.placed", 3) == [_handler]
    assert found("command", "billing.invoice.create", 2) == [_v2]
    assert found("command", "billing.invoice.create", 1) == []  # left for another instance
    assert handlers.find("event", "orders.order.placed", 2)[1:3] == (
        handlers.find("event", "orders.order.placed", 2).every,
        [],
    )


def test_a_command_takes_one_handler_per_version() -> None:
    handlers = Handlers()
    handlers.add(
        Subscription("command", "billing.invoice.create", _v1, options=HandlerOptions(version=1))
    )
    handlers.add(
        Subscription("command", "billing.invoice.create", _v2, options=HandlerOptions(version=2))
    )
    with pytest.raises(ConfigurationError, match="version 2 already has a handler"):
        handlers.add(
            Subscription(
                "command", "billing.invoice.create", _handler, options=HandlerOptions(version=2)
            )
        )
    with pytest.raises(ConfigurationError, match="already has a handler"):
        handlers.add(Subscription("command", "billing.invoice.create", _handler))
    with pytest.raises(ConfigurationError, match="version must be an int >= 1"):
        Subscription("command", "billing.invoice.void", _handler, options=HandlerOptions(version=0))


def test_what_an_instance_advertises_answers_which_messages_it_takes() -> None:
    handlers = Handlers()
    handlers.add(
        Subscription("event", "orders.order.placed", _v1, options=HandlerOptions(version=1))
    )
    handlers.add(
        Subscription("event", "orders.order.placed", _v2, options=HandlerOptions(version=2))
    )
    handlers.add(Subscription("event", "orders.#", _handler))
    handlers.add(
        Subscription("command", "billing.invoice.create", _v2, options=HandlerOptions(version=2))
    )
    advertised = handlers.advertised()

    assert advertised == [
        {"kind": "event", "pattern": "orders.order.placed", "versions": [1, 2]},
        {"kind": "event", "pattern": "orders.#", "versions": None},
        {"kind": "command", "pattern": "billing.invoice.create", "versions": [2]},
    ]
    assert handled_by(advertised, "event", "orders.order.cancelled", 7)
    assert handled_by(advertised, "command", "billing.invoice.create", 2)
    assert not handled_by(advertised, "command", "billing.invoice.create", 1)
    assert not handled_by(advertised, "command", "billing.invoice.void", 2)
    assert not handled_by(advertised, "event", "billing.invoice.created", 1)
