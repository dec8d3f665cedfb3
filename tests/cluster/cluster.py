"""A RabbitMQ cluster of private nodes on loopback, for the cluster tests.

Each node is a `servers.RabbitMQServer` (its own data directory, AMQP and distribution ports);
the nodes share one Erlang cookie and one epmd, so that they can find each other, and the
second and later nodes join the first with ``rabbitmqctl join_cluster``.
"""

from __future__ import annotations

import logging
import time
from urllib.parse import quote

from servers import RabbitMQServer, ServerError

log = logging.getLogger("outbox_inbox.tests.cluster")


class RabbitMQCluster:
    """`size` RabbitMQ nodes joined in one cluster. `start()`, then `url(vhost)`; `cleanup()`."""

    def __init__(self, size: int = 3) -> None:
        self.nodes = [RabbitMQServer(management=False) for _ in range(size)]
        first = self.nodes[0]
        for node in self.nodes[1:]:
            node.cookie = first.cookie
            node.epmd_port = first.epmd_port

    @property
    def first(self) -> RabbitMQServer:
        return self.nodes[0]

    def start(self) -> None:
        """Start every node and join them; return once the first node sees them all running."""
        started = time.monotonic()
        for node in self.nodes:
            node.start()
        for node in self.nodes[1:]:
            node.rabbitmqctl("stop_app")
            node.rabbitmqctl("join_cluster", self.first.nodename)
            node.rabbitmqctl("start_app")
        self.wait_running(len(self.nodes))
        log.info("RabbitMQ cluster of %d nodes ready in %.1fs", len(self.nodes),
                 time.monotonic() - started)  # fmt: skip

    def running_nodes(self, via: RabbitMQServer | None = None) -> set[str]:
        """The names of the running nodes, as `via` (a running node) sees them."""
        asking = via or next(node for node in self.nodes if node.running)
        found = asking.eval("rabbit_nodes:all_running().")
        return {node.nodename for node in self.nodes if node.nodename in found}

    def wait_running(self, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            running = self.running_nodes()
            if len(running) >= count:
                return
            if time.monotonic() > deadline:
                raise ServerError(f"only {sorted(running)} of the cluster run after {timeout}s")
            time.sleep(0.5)

    def add_vhost(self, vhost: str) -> None:
        """Create `vhost` (cluster-wide) with all permissions for the guest user."""
        next(node for node in self.nodes if node.running).add_vhost(vhost)

    def url(self, vhost: str = "/") -> str:
        """One AMQP URL naming every node, first node first: ``amqp://u:p@h:p1,h:p2,h:p3/v``."""
        first = self.first
        hosts = ",".join(f"{node.host}:{node.port}" for node in self.nodes)
        return f"amqp://{first.username}:{first.password}@{hosts}/{quote(vhost, safe='')}"

    def leader_of(self, queue: str, vhost: str) -> RabbitMQServer:
        """The node holding the leader of quorum queue `queue`."""
        asking = next(node for node in self.nodes if node.running)
        listing = asking.rabbitmqctl("list_queues", "-p", vhost, "--quiet", "name", "leader")
        for line in listing.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == queue:
                return next(node for node in self.nodes if node.nodename == parts[1])
        raise ServerError(f"no leader of {queue!r} in vhost {vhost!r}:\n{listing}")

    def cleanup(self) -> None:
        """Stop every node (the first, which started the shared epmd, last)."""
        errors: list[BaseException] = []
        for node in reversed(self.nodes):
            try:
                node.cleanup()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
