"""Fixtures of the end-to-end tests: service databases, in-process services, service processes.

Everything started here is stopped or SIGKILLed at teardown, whatever the test did. When a test
fails, the logs of its processes are printed with the report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from outbox_inbox import Service

from . import apps
from .harness import Database, Processes


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Attach the logs of the test's service processes to the report of a failed test."""
    report = yield
    group = getattr(item, "funcargs", {}).get("processes")
    if report.failed and isinstance(group, Processes) and group.started:
        report.sections.append(("service process logs", group.describe()))
    return report


@pytest.fixture
def make_service(
    mq_url: str, db_url_factory: Callable[[], str]
) -> Iterator[Callable[..., Service]]:
    """Build an `apps.build_service` service in this process; it is closed at teardown.

    (It asks for `db_url_factory` only so that its databases outlive the services.)"""
    built: list[Service] = []

    def make(name: str, db_url: str, **kwargs: Any) -> Service:
        service = apps.build_service(name, db_url=db_url, mq_url=mq_url, **kwargs)
        built.append(service)
        return service

    try:
        yield make
    finally:
        for service in reversed(built):
            service.close()


@pytest.fixture
def prepare_db(
    make_service: Callable[..., Service],
) -> Iterator[Callable[[str, str], Database]]:
    """Migrate a database for service `name`, add the tests' tables, return a probe of it."""
    probes: list[Database] = []

    def prepare(name: str, db_url: str) -> Database:
        service = make_service(name, db_url)
        service.migrate()
        apps.create_test_tables(service.engine)
        probe = Database(db_url)
        probes.append(probe)
        return probe

    try:
        yield prepare
    finally:
        for probe in probes:
            probe.dispose()


@pytest.fixture
def processes(
    tmp_path_factory: pytest.TempPathFactory, db_url: str, mq_url: str
) -> Iterator[Processes]:
    """Starts `apps.py` role processes (on `db_url` unless told otherwise); kills them all after."""
    log_dir = tmp_path_factory.mktemp("e2e-logs")
    group = Processes(log_dir, db_url, mq_url)
    try:
        yield group
    finally:
        group.kill_all()
