"""Fixtures of the example tests: the example modules, and the databases of the harness tests.

The harness fixtures (``outbox_inbox_harness`` and friends) come from `outbox_inbox.testing`
through its pytest11 entry point. Here the database fixture is parametrized, so every harness
test runs on SQLite (the plugin's default) and on PostgreSQL (the session's server).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

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


@pytest.fixture(params=["sqlite", "postgresql"])
def outbox_inbox_db_url_factory(
    request: pytest.FixtureRequest, outbox_inbox_db_url_factory: Callable[[], str]
) -> Callable[[], str]:
    """Fresh databases for the harness: the plugin's default (SQLite files in tmp_path), or
    databases on the session's PostgreSQL server (started only for these)."""
    if request.param == "postgresql":
        factory: Callable[[], str] = request.getfixturevalue("db_url_factory")
        return factory
    return outbox_inbox_db_url_factory
