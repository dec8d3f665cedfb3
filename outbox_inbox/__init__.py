"""outbox_inbox: transactional outbox and inbox for Python services on PostgreSQL and RabbitMQ."""

from __future__ import annotations

from .brokers.memory import MemoryBroker
from .errors import (
    BrokerAccessRefused,
    BrokerConnectionError,
    BrokerError,
    ConfigurationError,
    DatabaseUnavailable,
    HandlerExited,
    InvalidMessage,
    InvalidPayload,
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
from .handlers import AsyncBatchContext, AsyncHandlerContext, BatchContext, HandlerContext
from .listener import Listener, Listeners
from .messages import Message
from .retry import RetryPolicy
from .service import Service

__version__ = "0.1.0"

__all__ = [
    "AsyncBatchContext",
    "AsyncHandlerContext",
    "BatchContext",
    "BrokerAccessRefused",
    "BrokerConnectionError",
    "BrokerError",
    "ConfigurationError",
    "DatabaseUnavailable",
    "HandlerContext",
    "HandlerExited",
    "InvalidMessage",
    "InvalidPayload",
    "Listener",
    "Listeners",
    "MemoryBroker",
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
