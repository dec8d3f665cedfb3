"""outbox_inbox: transactional outbox and inbox for Python services on PostgreSQL and RabbitMQ."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .brokers.memory import MemoryBroker
    from .config import Tenant
    from .errors import (
        BrokerAccessRefused,
        BrokerConnectionError,
        BrokerError,
        CommitOutcomeUnknown,
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
    from .faults import Fault
    from .handlers import AsyncBatchContext, AsyncHandlerContext, BatchContext, HandlerContext
    from .listener import Listener, Listeners
    from .messages import Message
    from .retry import RetryPolicy
    from .service import Service

__version__ = "0.1.0"

__all__ = [
    "AsyncBatchContext", "AsyncHandlerContext", "BatchContext", "BrokerAccessRefused",
    "BrokerConnectionError", "BrokerError", "CommitOutcomeUnknown", "ConfigurationError",
    "DatabaseUnavailable", "Fault", "HandlerContext", "HandlerExited", "InvalidMessage",
    "InvalidPayload", "Listener", "Listeners", "MemoryBroker", "Message", "MessageError",
    "OutboxInboxError", "PayloadTooLarge", "Reject", "Retry", "RetryPolicy", "SchemaMissing",
    "Service", "StorageError", "Tenant", "TopologyMismatch", "TopologyMissing", "__version__",
]  # fmt: skip

_ERRORS = (
    "BrokerAccessRefused", "BrokerConnectionError", "BrokerError", "CommitOutcomeUnknown",
    "ConfigurationError", "DatabaseUnavailable", "HandlerExited", "InvalidMessage",
    "InvalidPayload", "MessageError", "OutboxInboxError", "PayloadTooLarge", "Reject",
    "Retry", "SchemaMissing", "StorageError", "TopologyMismatch", "TopologyMissing",
)  # fmt: skip

#: The module of each public name. A name is imported when first used, so that a module of the
#: package imported on its own (the `outbox-inbox` command, for its --version and --help) does
#: not import SQLAlchemy, psycopg and pika with the whole API.
_HOMES = {
    name: module
    for module, names in {
        ".brokers.memory": ("MemoryBroker",),
        ".config": ("Tenant",),
        ".errors": _ERRORS,
        ".faults": ("Fault",),
        ".handlers": ("AsyncBatchContext", "AsyncHandlerContext", "BatchContext", "HandlerContext"),
        ".listener": ("Listener", "Listeners"),
        ".messages": ("Message",),
        ".retry": ("RetryPolicy",),
        ".service": ("Service",),
    }.items()
    for name in names
}


def __getattr__(name: str) -> Any:
    module = _HOMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
