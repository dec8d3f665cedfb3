"""mq_url names one RabbitMQ node or several nodes of a cluster, tried in order."""

from __future__ import annotations

import pytest

from outbox_inbox import ConfigurationError
from outbox_inbox.brokers.rabbitmq import RabbitMQBroker
from outbox_inbox.config import Settings, broker_urls
from outbox_inbox.topology import service_topology


def test_hosts_separated_by_commas_share_the_credentials_vhost_and_options() -> None:
    assert broker_urls("amqp://u:p%2Fw@n1:5672,n2:5673, n3/v%2Fx?heartbeat=5") == [
        "amqp://u:p%2Fw@n1:5672/v%2Fx?heartbeat=5",
        "amqp://u:p%2Fw@n2:5673/v%2Fx?heartbeat=5",
        "amqp://u:p%2Fw@n3/v%2Fx?heartbeat=5",
    ]


def test_whole_urls_separated_by_commas_keep_their_own_credentials() -> None:
    assert broker_urls("amqp://a:1@n1/v,amqps://b:2@n2:5671/w") == [
        "amqp://a:1@n1/v",
        "amqps://b:2@n2:5671/w",
    ]


def test_a_list_of_urls_is_the_comma_form_and_no_password_is_shown() -> None:
    settings = Settings(mq_url=["amqp://u:first-secret@n1/v", "amqp://u:second-secret@n2/v"])
    assert broker_urls(settings.mq_url or "") == [
        "amqp://u:first-secret@n1/v",
        "amqp://u:second-secret@n2/v",
    ]
    shown = repr(settings) + RabbitMQBroker(settings.mq_url or "").description
    assert "first-secret" not in shown and "second-secret" not in shown
    assert RabbitMQBroker(settings.mq_url or "").description == (
        "amqp://u:***@n1/v,amqp://u:***@n2/v"
    )


@pytest.mark.parametrize(
    "url", ["amqp://u:pw-9f3@n1,,n2/v", "amqp://u:pw-9f3@/v", "amqp://u:pw-9f3@n1/v,http://n2"]
)
def test_an_empty_host_or_a_foreign_scheme_is_refused_with_the_password_masked(url: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        Settings(mq_url=url)
    assert "pw-9f3" not in str(refused.value)


def test_quorum_makes_every_queue_of_the_service_a_quorum_queue_with_safe_tier_expiry() -> None:
    topology = service_topology("billing", [], delay_tiers=(1, 5), queue_type="quorum")
    types = {q.name: q.arguments.get("x-queue-type") for q in topology.queues}
    assert set(types.values()) == {"quorum"}, types
    tier = next(q for q in topology.queues if q.name == "billing.delay.1s")
    assert tier.arguments["x-dead-letter-strategy"] == "at-least-once"
    assert tier.arguments["x-overflow"] == "reject-publish"
    classic = service_topology("billing", [], delay_tiers=(1,))
    assert all("x-queue-type" not in q.arguments for q in classic.queues)
