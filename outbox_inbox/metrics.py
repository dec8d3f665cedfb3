"""Prometheus metrics of a service's messaging: ``metrics = instrument(service)`` before it
starts (names, types, labels and use: docs/observability.md, "Metrics (Prometheus)"). Lags
subtract a time the database wrote from the host's clock: clock skew between the hosts shows."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    make_asgi_app,
    make_wsgi_app,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from .broker import PublishOutcome
from .errors import ConfigurationError, first_line
from .listener import Listener, combine
from .logsafe import mask_text, mask_url
from .messages import COMMAND, Message, OutgoingMessage
from .queries import operations
from .service import Service
from .status import tenant_status
from .tables import Tables

log = logging.getLogger(__name__)

PREFIX = "outbox_inbox"

#: Buckets of the lag histograms, in seconds: from a few milliseconds to an hour.
LAG_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600,
)  # fmt: skip
#: Buckets of the handler duration histogram, in seconds.
HANDLER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _Families:
    """The metric families of one registry, shared by every service instrumented in it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, ["service", *labels], registry=registry)

        def histogram(name: str, doc: str, buckets: Sequence[float] = LAG_BUCKETS) -> Histogram:
            return Histogram(
                f"{PREFIX}_{name}", doc, ["service"], buckets=buckets, registry=registry
            )

        self.published = counter(
            "published", "Messages the relay published and marked (committed).", "kind"
        )
        self.received = counter("received", "New messages the receiver stored in the inbox.")
        self.duplicates = counter(
            "duplicates", "Deliveries the receiver dropped as copies of a stored message."
        )
        self.handled = counter("handled", "Messages whose handlers returned.")
        self.retried = counter("retried", "Handler failures scheduled for a retry.")
        self.dead = counter("dead", "Messages that ended dead, by reason.", "reason")
        self.publish_failures = counter(
            "relay_publish_failures",
            "Messages the broker did not confirm (kept for a retry), by outcome.",
            "outcome",
        )
        self.publish_lag = histogram(
            "publish_lag_seconds",
            "From the outbox row's created_at (its transaction) to its publish being marked.",
        )
        self.receive_lag = histogram(
            "receive_lag_seconds",
            "From the message's created_at (the sender's transaction) to its inbox row's commit.",
        )
        self.handle_lag = histogram(
            "handle_lag_seconds",
            "From the inbox row's received_at to its handlers having returned.",
        )
        self.handler_duration = histogram(
            "handler_duration_seconds",
            "Wall time of one run of a message's handlers, failed runs included.",
            HANDLER_BUCKETS,
        )
        self.state = _StateCollector()
        registry.register(self.state)


_lock = threading.Lock()
_families: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()


def _families_of(registry: CollectorRegistry) -> _Families:
    with _lock:
        if registry not in _families:
            _families[registry] = _Families(registry)
        return _families[registry]


class Metrics(Listener):
    """The Prometheus metrics of one service (built by `instrument`): a `Listener` whose hooks
    only count and observe (thread-safe, a microsecond or two each), and scrape-time gauges."""

    forwarded_from_workers = True  # served by the service's own process

    def __init__(self, service: str, registry: CollectorRegistry, families: _Families) -> None:
        self.service, self.registry = service, registry
        f = families
        self._published = {kind: f.published.labels(service, kind) for kind in (COMMAND, "event")}
        self._received = f.received.labels(service)
        self._duplicates = f.duplicates.labels(service)
        self._handled = f.handled.labels(service)
        self._retried = f.retried.labels(service)
        self._dead = f.dead
        self._failures = f.publish_failures
        self._publish_lag = f.publish_lag.labels(service)
        self._receive_lag = f.receive_lag.labels(service)
        self._handle_lag = f.handle_lag.labels(service)
        self._handler_duration = f.handler_duration.labels(service)
        # Present from the start, at 0: a rate() over a late counter misses its first increase.
        f.dead.labels(service, "rejected")
        f.dead.labels(service, "max_attempts")
        f.publish_failures.labels(service, PublishOutcome.NACKED.value)

    def relay_confirmed(
        self, messages: Sequence[OutgoingMessage], outcomes: Sequence[PublishOutcome]
    ) -> None:
        for message, outcome in zip(messages, outcomes, strict=False):
            if outcome is PublishOutcome.CONFIRMED or outcome is PublishOutcome.SKIPPED:
                continue
            if outcome is PublishOutcome.RETURNED and message.kind != COMMAND:
                continue  # an event nobody subscribes to is published: that is its meaning
            self._failures.labels(self.service, outcome.value).inc()

    def relay_committed(self, messages: Sequence[OutgoingMessage]) -> None:
        now = time.time()
        for message in messages:
            counter = self._published.get(message.kind)
            if counter is not None:
                counter.inc()
            if message.created_at is not None:
                self._publish_lag.observe(max(0.0, now - message.created_at.timestamp()))

    def received(self, stored: int, duplicates: int) -> None:
        self._received.inc(stored)
        self._duplicates.inc(duplicates)

    def stored(self, messages: Sequence[Message]) -> None:
        now = time.time()
        for message in messages:
            if message.created_at is not None:
                self._receive_lag.observe(max(0.0, now - message.created_at.timestamp()))

    def handled(self, message: Message) -> None:
        received = message.received_at
        self.forwarded_handled(received.timestamp() if received is not None else None)

    def failed(self, message: Message, error: BaseException, *, dead: bool) -> None:
        self.forwarded_failed(dead)

    def handler_ran(self, message: Message, seconds: float, error: BaseException | None) -> None:
        self.forwarded_handler_ran(seconds)

    def dead(self, reason: str, count: int) -> None:
        self._dead.labels(self.service, reason).inc(count)

    # What a worker process sends (outbox_inbox.supervisor): the hooks' values as plain data.

    def forwarded_handled(self, received_at: float | None) -> None:
        self._handled.inc()
        if received_at is not None:
            self._handle_lag.observe(max(0.0, time.time() - received_at))

    def forwarded_failed(self, dead: bool) -> None:
        if not dead:
            self._retried.inc()

    def forwarded_handler_ran(self, seconds: float) -> None:
        self._handler_duration.observe(seconds)

    forwarded_dead = dead  # its values are plain data already

    def wsgi_app(self) -> Callable[..., Any]:
        """A WSGI application that serves this registry in the Prometheus text format."""
        return make_wsgi_app(self.registry)

    def asgi_app(self) -> Callable[..., Any]:
        """An ASGI application that serves this registry in the Prometheus text format."""
        return make_asgi_app(self.registry)

    def serve(self, port: int, host: str = "127.0.0.1") -> MetricsServer:
        """Serve this registry at ``http://host:port/metrics`` from a daemon thread until
        `MetricsServer.close()`; port 0 picks a free port. OSError if it cannot be bound."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        return MetricsServer(server, thread)


class MetricsServer:
    """The HTTP server `Metrics.serve` started."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread

    @property
    def host(self) -> str:
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def instrument(service: Service, *, registry: CollectorRegistry | None = None) -> Metrics:
    """Count `service`'s messages in `registry` (default: prometheus_client's global one) and
    read its backlog gauges at each scrape; call it before the service starts its roles
    (docs/observability.md). One service name twice in a registry raises ConfigurationError."""
    registry = REGISTRY if registry is None else registry
    families = _families_of(registry)
    families.state.watch(service)
    metrics = Metrics(service.name, registry, families)
    service.listener = combine(service.listener, metrics)
    return metrics


#: Each gauge: its name, its help, and the field of operations.outbox_status or inbox_status
#: it shows.
_GAUGES = (
    ("outbox_backlog", "Outbox rows not yet published (and not dead or expired).", "unpublished"),
    ("outbox_retrying", "Unpublished outbox rows that failed at least once.", "retrying"),
    (
        "outbox_oldest_age_seconds",
        "Age of the oldest unpublished outbox row (database clock); 0 when none.",
        "oldest_age_seconds",
    ),
    ("outbox_dead", "Outbox rows the broker refused on every attempt.", "dead"),
    (
        "inbox_pending",
        "Inbox rows waiting for a worker (due, or scheduled for a retry).",
        "pending",
    ),
    ("inbox_in_progress", "Pending inbox rows a worker holds a lease on.", "in_progress"),
    (
        "inbox_oldest_pending_age_seconds",
        "Age of the oldest pending inbox row (database clock); 0 when none.",
        "oldest_pending_age_seconds",
    ),
    ("inbox_dead", "Dead inbox rows.", "dead"),
    ("inbox_tenants_waiting", "Tenants with inbox rows pending.", "tenants_waiting"),
)


class _StateCollector(Collector):
    """Reads the backlog gauges of each watched service at scrape time, in one snapshot: the
    numbers `outbox-inbox status` shows. A database that cannot be read gives a warning,
    ``outbox_inbox_state_up 0`` and no gauges for that service; its tenants' (`tenant_status`)
    are read each in its own database."""

    def __init__(self) -> None:
        self._watched: dict[str, Service] = {}
        self._lock = threading.Lock()

    def watch(self, service: Service) -> None:
        with self._lock:
            if service.name in self._watched:
                raise ConfigurationError(
                    f"service {service.name!r} is instrumented twice in the same registry"
                )
            self._watched[service.name] = service

    def describe(self) -> Iterable[Metric]:
        return list(self._families().values())

    def collect(self) -> Iterable[Metric]:
        families = self._families()
        with self._lock:
            watched = list(self._watched.items())
        for service, watched_service in watched:
            self._tenants(families, service, watched_service)
            state = _read_state(watched_service.engine, watched_service.tables)
            families["state_up"].add_metric([service], 0 if state is None else 1)
            if state is None:
                continue
            for name, _doc, field in _GAUGES:
                value = state[name.split("_", 1)[0]][field]  # "outbox" or "inbox"
                families[name].add_metric([service], float(value or 0))
            for t in state["inbox"]["by_type"]:
                families["inbox_type_pending"].add_metric([service, t["type"]], t["pending"])
                if t["cap"] is not None or t["rate"] is not None:
                    binding = float(t["cap_binding"])
                    families["inbox_cap_binding"].add_metric([service, t["type"]], binding)
            for t in state["inbox"]["by_tenant"]:
                families["inbox_tenant_pending"].add_metric([service, t["tenant"]], t["pending"])
        return list(families.values())

    @staticmethod
    def _tenants(families: dict[str, GaugeMetricFamily], name: str, service: Service) -> None:
        try:
            tenants = tenant_status(service) or {"top": []}
        except ConfigurationError as exc:
            return log.warning("metrics: %s", mask_text(exc, service.settings.db_url))
        if tenants["top"]:
            families["tenants_never_drained"].add_metric([name], tenants["never_drained"])
        for t in tenants["top"]:
            labels = [name, t["tenant"]]
            families["tenant_up"].add_metric(labels, t["error"] is None)
            if t["error"] is None:
                families["tenant_lag_seconds"].add_metric(labels, t["lag_seconds"])
                for table in ("outbox", "inbox"):
                    families["tenant_backlog"].add_metric([*labels, table], t[table])

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily]:
        described = [
            ("state_up", "1 if the last scrape could read the service's tables, else 0.", ()),
            *((name, doc, ()) for name, doc, _field in _GAUGES),
            ("inbox_type_pending", "Inbox rows of the type waiting for a worker.", ("type",)),
            ("inbox_cap_binding", "1 while a cap of the type holds back work, else 0.", ("type",)),
            (
                "inbox_tenant_pending",
                "Inbox rows of the tenant waiting, for the 10 tenants with the most.",
                ("tenant",),
            ),
            ("tenants_never_drained", "Tenants whose oldest row waits over 300 s.", ()),
            ("tenant_up", "1 if the tenant's tables could be read, else 0.", ("tenant",)),
            ("tenant_backlog", "Tenant's rows unsent/pending, by table.", ("tenant", "table")),
            ("tenant_lag_seconds", "Age of the tenant's oldest unsent/pending row.", ("tenant",)),
        ]
        return {
            name: GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["service", *labels])
            for name, doc, labels in described
        }


def _read_state(engine: Engine, tables: Tables) -> dict[str, Any] | None:
    try:
        with engine.connect() as conn:
            # SQLite's transactions are serializable already and it knows no REPEATABLE READ.
            level = "REPEATABLE READ" if engine.dialect.name == "postgresql" else "SERIALIZABLE"
            with conn.execution_options(isolation_level=level).begin():
                return {
                    "outbox": operations.outbox_status(conn, tables),
                    "inbox": operations.inbox_status(conn, tables),
                }
    except SQLAlchemyError as exc:
        url = engine.url.render_as_string(hide_password=False)
        where, error = mask_url(url), mask_text(first_line(exc), url)
        log.warning("metrics: cannot read the outbox/inbox state from %s: %s", where, error)
        return None


__all__ = ["Metrics", "MetricsServer", "instrument"]
