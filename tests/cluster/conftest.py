"""Fixtures of the cluster tests (``-m cluster``): a three-node RabbitMQ cluster they share.

The e2e and fault fixtures are reused as they are; `mq_url` is overridden here, so that every
service, role process and probe of a test talks to the cluster (a fresh vhost per test) through
one URL that names the three nodes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

# The e2e fixtures, and its hook that attaches the role processes' logs to a failed test.
from e2e.conftest import (  # noqa: F401
    make_service,
    prepare_db,
    processes,
    pytest_runtest_makereport,
)

from .cluster import RabbitMQCluster


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/cluster/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="package")
def rabbitmq_cluster() -> Iterator[RabbitMQCluster]:
    """The three nodes, shared by the tests of this package and gone after its last one (not
    idling beside the rest of the run); killed, not stopped, at the end (see `discard`)."""
    cluster = RabbitMQCluster(3)
    try:
        cluster.start()
        yield cluster
    finally:
        for node in cluster.nodes:
            node.kill()
        cluster.cleanup()


@pytest.fixture
def cluster_vhost(rabbitmq_cluster: RabbitMQCluster) -> str:
    vhost = f"t_{uuid.uuid4().hex[:12]}"
    rabbitmq_cluster.add_vhost(vhost)
    return vhost


@pytest.fixture
def mq_url(rabbitmq_cluster: RabbitMQCluster, cluster_vhost: str) -> str:
    """The cluster's three nodes in one URL, on this test's vhost."""
    return rabbitmq_cluster.url(cluster_vhost)
