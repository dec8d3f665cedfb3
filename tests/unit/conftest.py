"""Fixtures of the unit tests."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from history import cli

if TYPE_CHECKING:
    from audit_cases import Case


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local Spark session (two cores, 1 GB) for every audit test of the run."""
    pytest.importorskip("pyspark", reason="the audit needs the spark extra")
    from outbox_inbox.analytics.audit import spark_session

    session = spark_session("local[2]", driver_memory="1g")
    yield session
    session.stop()


class _Cases(dict[str, "Case"]):
    """The histories of `audit_cases.CASES`, each generated on first use."""

    def __init__(self, base: Path) -> None:
        super().__init__()
        self.base = base

    def __missing__(self, name: str) -> Case:
        from audit_cases import CASES

        self[name] = CASES[name](self.base / name)
        return self[name]


@pytest.fixture(scope="session")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    """The audit's test histories, generated once for every test of the run (read only)."""
    return _Cases(tmp_path_factory.mktemp("cases"))


@pytest.fixture(scope="session")
def whole_audit(spark: Any, cases: dict[str, Case]) -> Callable[[str], dict[str, Any]]:
    """The whole audit of a case as summary.json holds it, run once per case; a fresh copy
    each call."""
    from outbox_inbox.analytics.audit import run_audit

    done: dict[str, str] = {}

    def audit(name: str) -> dict[str, Any]:
        if name not in done:
            case = cases[name]
            summary = run_audit(spark, case.roots, live=case.live, now=case.now, grace=case.grace)
            done[name] = json.dumps(summary)
        return dict(json.loads(done[name]))

    return audit


@pytest.fixture(scope="session")
def warm_spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment of `outbox-inbox audit` runs that share one warm Spark Connect server
    (the first starts it); it is stopped after the run, and the tests that assert how Spark
    started have their own."""
    pytest.importorskip("pyspark", reason="the audit needs the spark extra")
    directory = tmp_path_factory.mktemp("warm-spark")
    env = {"OUTBOX_INBOX_SPARK_SERVER": "warm", "OUTBOX_INBOX_SPARK_DIR": str(directory)}
    yield {**env, "OUTBOX_INBOX_SPARK_IDLE": "600"}
    stopped = cli("audit", "--server", "stop", env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert not (directory / "server.json").exists()
