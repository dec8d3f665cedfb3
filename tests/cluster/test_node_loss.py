"""A RabbitMQ node dies in a three-node cluster: nothing is lost, and the flow goes on without it.

``orders`` commits 2,400 messages at 150 a second (half commands to billing, half events billing
subscribes to) and runs a relay process; ``billing`` runs a receiver and a worker process; all of
them with the library's defaults and ``queue_type="quorum"``, connected through one URL that
names the three nodes, first node first. So the relay, the receiver and the declarations all
start on the first node, and the quorum queues have their leaders there (RabbitMQ places a new
queue's leader on the declaring client's node). Once messages flow, that node is SIGKILLed:
the roles connected to it move to the next node, the queues elect new leaders on the two
others, and the test measures how soon every message committed before the kill is handled
while the node is still down. Then the node is started again and the writer's last messages
must come through; every committed message has exactly one effect at billing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from e2e.harness import Processes
from faults.flow import TwoServices

from outbox_inbox import Service

from .cluster import RabbitMQCluster

pytestmark = pytest.mark.cluster

#: Every message committed before the kill, and in the DOWN seconds after it, must be handled
#: this long after it, the node still down.
FAILOVER_BOUND = 20.0
DOWN = 4.0


def test_the_node_holding_the_queue_leaders_and_the_relay_is_killed_and_nothing_is_lost(
    rabbitmq_cluster: RabbitMQCluster,
    cluster_vhost: str,
    mq_url: str,
    db_url: str,
    db_url_factory: Callable[[], str],
    make_service: Callable[..., Service],
    prepare_db: Callable[..., Any],
    processes: Processes,
) -> None:
    flow = TwoServices(
        orders_url=db_url,
        billing_url=db_url_factory(),
        mq_url=mq_url,
        make_service=make_service,
        prepare_db=prepare_db,
        processes=processes,
        settings={"queue_type": "quorum"},
    )
    first = rabbitmq_cluster.first
    try:
        flow.start()
        assert rabbitmq_cluster.leader_of("billing.inbox", cluster_vhost) is first
        first.kill()
        killed = time.monotonic()
        flow.fault_begins()
        assert flow.writer is not None
        before = flow.writer.committed()
        deadline = killed + FAILOVER_BOUND
        while flow._handled(before) < len(before):
            processes.check()
            assert time.monotonic() < deadline, (
                f"{len(before) - flow._handled(before)} of {len(before)} messages committed "
                f"before the kill were not handled within {FAILOVER_BOUND}s, the node down"
            )
            time.sleep(0.2)
        failover = time.monotonic() - killed
        # The flow goes on with the node down: what was committed in the DOWN seconds after
        # the kill is handled before the node comes back.
        time.sleep(max(0.0, killed + DOWN - time.monotonic()))
        while_down = flow.writer.committed()[len(before) :]
        assert len(while_down) > DOWN * 50, "the writer did not go on while the node was down"
        while flow._handled(while_down) < len(while_down):
            processes.check()
            assert time.monotonic() < deadline, (
                f"{len(while_down) - flow._handled(while_down)} of {len(while_down)} messages "
                f"committed while the node was down were not handled, the node still down"
            )
            time.sleep(0.2)
        resumed = time.monotonic() - killed
        new_leader = rabbitmq_cluster.leader_of("billing.inbox", cluster_vhost)
        assert new_leader is not first
        print(
            f"cluster failover: the messages committed before the kill were handled "
            f"{failover:.1f}s after it, the {len(while_down)} committed in the {DOWN:g}s after "
            f"it {resumed:.1f}s after it, the node still down"
        )
        first.start()
        rabbitmq_cluster.wait_running(3)
        flow.fault_over()
        result = flow.finish("cluster-node-sigkill")
    finally:
        flow.stop_writer()
        if not first.running:
            first.start()
    assert not result.problems, "\n".join(result.problems)
    assert result.lost == 0 and result.duplicates == 0
