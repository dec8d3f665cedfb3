"""Broker implementations, and the broker at a URL (`broker_at`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..broker import Broker


def broker_at(url: str, **options: Any) -> Broker:
    """RabbitMQ at AMQP `url` (`config.broker_urls`) with `RabbitMQBroker`'s keyword `options`.
    Connects to nothing; raises ConfigurationError (password masked) for a malformed URL."""
    from .rabbitmq import RabbitMQBroker

    return RabbitMQBroker(url, **options)


__all__ = ["broker_at"]
