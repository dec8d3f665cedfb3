"""A service with the default settings negotiates a 5 s AMQP heartbeat on every connection.

The heartbeat is how a half-open connection (a host that vanished, a NAT that dropped the flow)
is noticed: RabbitMQ's own default is 60 s, under which a relay would wait minutes before
reconnecting. What counts is what the server agreed to, so it is read from the server.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from helpers import wait_until
from outbox_inbox import Service
from servers import RabbitMQServer


def _timeouts(server: RabbitMQServer, vhost: str) -> list[int]:
    """The negotiated heartbeat (s) of every client connection of `vhost`, from the server."""
    out = server.rabbitmqctl("list_connections", "-q", "--no-table-headers", "vhost", "timeout")
    return [
        int(timeout)
        for line in out.splitlines()
        if line.strip()
        for name, timeout in [line.rsplit("\t", 1)]
        if name == vhost
    ]


def test_a_service_with_default_settings_negotiates_a_5s_heartbeat_on_every_connection(
    db_url: str, mq_url: str, local_rabbitmq_server: RabbitMQServer
) -> None:
    vhost = unquote(urlsplit(mq_url).path[1:])
    service = Service("heartbeat", db_url=db_url, mq_url=mq_url)  # the defaults, nothing else
    assert service.settings.heartbeat == 5.0
    service.migrate()
    service.start()
    try:
        # The relay's and the receiver's connections (a worker uses none).
        timeouts = wait_until(
            lambda: (
                (found := _timeouts(local_rabbitmq_server, vhost)) and len(found) >= 2 and found
            ),
            timeout=30,
            what="the roles' connections",
        )
    finally:
        service.close()
    assert timeouts and set(timeouts) == {5}, timeouts
