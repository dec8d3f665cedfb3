"""outbox_inbox: transactional outbox and inbox for Python services on PostgreSQL and RabbitMQ."""

from __future__ import annotations

from .errors import (
    BrokerAccessRefused,
    BrokerConnectionError,
    BrokerError,
    ConfigurationError,
    DatabaseUnavailable,
    InvalidMessage,
    MessageError,
    OutboxInboxError,
    PayloadTooLarge,
    Reject,
    Retry,
    SchemaMissing,
    StorageError,
    TopologyMismatch,
    TopologyMissing,
)
from .messages import Message
from .retry import RetryPolicy
from .service import Service

__version__ = "0.1.0"

__all__ = [
    "BrokerAccessRefused",
    "BrokerConnectionError",
    "BrokerError",
    "ConfigurationError",
    "DatabaseUnavailable",
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
    "TopologyMissing",
    "__version__",
]
