"""outbox_inbox: transactional outbox and inbox for Python services on PostgreSQL and RabbitMQ."""

from __future__ import annotations

from .errors import (
    BrokerConnectionError,
    BrokerError,
    ConfigurationError,
    InvalidMessage,
    MessageError,
    OutboxInboxError,
    PayloadTooLarge,
    Reject,
    Retry,
    SchemaMissing,
    StorageError,
    TopologyMismatch,
)
from .messages import Message
from .retry import RetryPolicy
from .service import Service

__version__ = "0.1.0"

__all__ = [
    "BrokerConnectionError",
    "BrokerError",
    "ConfigurationError",
    "InvalidMessage",
    "Message",
    "MessageError",
    "OutboxInboxError",
    "PayloadTooLarge",
    "Reject",
    "Retry",
    "RetryPolicy",
    "SchemaMissing",
    "Service",
    "StorageError",
    "TopologyMismatch",
    "__version__",
]
