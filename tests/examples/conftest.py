"""Fixtures of the example tests: the example modules, and the databases of the harness tests.

The harness fixtures (``outbox_inbox_harness`` and friends) come from `outbox_inbox.testing`
through its pytest11 entry point. Here they are parametrized, so every harness test runs in
memory (SQLite and the in-memory broker, the plugin's default) and on the session's real
PostgreSQL and RabbitMQ.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from outbox_inbox.broker import Broker
from outbox_inbox.brokers.rabbitmq import RabbitMQBroker

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>/app.py`` as module ``example_<name>`` (once per session)."""
    module_name = f"example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / name / "app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=["memory", "servers"])
def harness_servers(request: pytest.FixtureRequest) -> str:
    """Where the harness tests run: SQLite and the in-memory broker (the plugin's default),
    or the session's PostgreSQL and RabbitMQ — the switch a user flips with
    OUTBOX_INBOX_HARNESS_DB_URL / OUTBOX_INBOX_HARNESS_MQ_URL."""
    return str(request.param)


@pytest.fixture
def outbox_inbox_db_url_factory(
    request: pytest.FixtureRequest,
    harness_servers: str,
    outbox_inbox_db_url_factory: Callable[[], str],
) -> Callable[[], str]:
    if harness_servers == "servers":
        factory: Callable[[], str] = request.getfixturevalue("db_url_factory")
        return factory
    return outbox_inbox_db_url_factory


@pytest.fixture
def outbox_inbox_broker(
    request: pytest.FixtureRequest, harness_servers: str, outbox_inbox_broker: Broker
) -> Broker:
    if harness_servers == "servers":
        return RabbitMQBroker(request.getfixturevalue("mq_url"))
    return outbox_inbox_broker
