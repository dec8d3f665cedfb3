"""Fixtures of the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local Spark session (two cores, 1 GB) for every audit test of the run."""
    pytest.importorskip("pyspark", reason="the audit needs the spark extra")
    from outbox_inbox.analytics.audit import spark_session

    session = spark_session("local[2]", driver_memory="1g")
    yield session
    session.stop()
