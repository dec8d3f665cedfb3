"""A publisher whose channel first meets a quorum queue while the queue's leader is dead.

RabbitMQ 3.10 sends such a channel's messages to the queue's dead leader and nacks them for
as long as the channel lives, even after a new leader is elected on the nodes still up (a new
channel reaches it at once). A relay that reconnects to another node right after a node loss
is in exactly that place: its publisher must not stay on that channel, or nothing it relays
leaves until the dead node comes back.
"""

from __future__ import annotations

import time
import uuid
from urllib.parse import quote

import pika
import pytest

from outbox_inbox.broker import PublishOutcome
from outbox_inbox.brokers.rabbitmq import RabbitMQBroker
from outbox_inbox.messages import WireMessage

from .cluster import RabbitMQCluster

pytestmark = pytest.mark.cluster

QUEUE = "orders.quorum"
#: How soon after the node's death the same publisher must get a message confirmed.
BOUND = 15.0


def _message() -> WireMessage:
    return WireMessage(exchange="", routing_key=QUEUE, body=b"{}", message_id=str(uuid.uuid4()))


def test_a_publisher_nacked_by_a_quorum_queue_without_its_leader_gets_confirms_again(
    rabbitmq_cluster: RabbitMQCluster, cluster_vhost: str
) -> None:
    first, second = rabbitmq_cluster.nodes[0], rabbitmq_cluster.nodes[1]
    params = pika.ConnectionParameters(
        host=first.host,
        port=first.port,
        virtual_host=cluster_vhost,
        credentials=pika.PlainCredentials(first.username, first.password),
    )
    declaring = pika.BlockingConnection(params)
    declaring.channel().queue_declare(QUEUE, durable=True, arguments={"x-queue-type": "quorum"})
    declaring.close()
    assert rabbitmq_cluster.leader_of(QUEUE, cluster_vhost) is first

    url = (
        f"amqp://{second.username}:{second.password}@{second.host}:{second.port}/"
        f"{quote(cluster_vhost, safe='')}"
    )
    broker = RabbitMQBroker(url)
    publisher = broker.publisher()  # its channel is open, nothing sent on it yet
    first.kill()
    killed = time.monotonic()
    try:
        outcomes = publisher.publish_batch([_message()], window=10, timeout=10)
        # The precondition: what this test is about did happen.
        assert outcomes == [PublishOutcome.NACKED], (
            f"the first message after the leader's death was {outcomes[0].value}, not nacked: "
            "the channel did not meet the queue without its leader"
        )
        tries = 1
        while True:
            time.sleep(0.5)
            outcomes = publisher.publish_batch([_message()], window=10, timeout=10)
            tries += 1
            if outcomes == [PublishOutcome.CONFIRMED]:
                break
            assert not publisher.broken
            assert time.monotonic() - killed < BOUND, (
                f"{tries} messages nacked on the same publisher over {BOUND}s after the "
                "leader's node died; a new leader was elected on the nodes still up"
            )
        print(f"confirmed again {time.monotonic() - killed:.1f}s after the node's death")
    finally:
        publisher.close()
        broker.close()
        first.start()
        rabbitmq_cluster.wait_running(3)
