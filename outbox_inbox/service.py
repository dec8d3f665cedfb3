"""The `Service` facade: configuration, handlers, and the relay, receiver and worker roles."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from datetime import timedelta
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar, Unpack

from opentelemetry.trace import TracerProvider
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from . import migrate as migrations
from . import partitions, tenants
from .backoff import Backoff
from .broker import Broker
from .clock import as_timedelta
from .config import Settings, Tenant, Tenants, validate_service_name
from .database import business_engine, connect, is_sqlite, tables_for
from .errors import (
    BrokerAccessRefused,
    BrokerConnectionError,
    ConfigurationError,
    DatabaseUnavailable,
    OutboxInboxError,
    SchemaMissing,
    TopologyMissing,
    first_line,
    storage_error,
)
from .faults import FAULT, fault_routing_key
from .handlers import AsyncHandler, Handler, HandlerKeywords, HandlerOptions, Handlers, Subscription
from .listener import Listener, forwarded, forwarding
from .logsafe import mask_url
from .messages import COMMAND, COMMANDS_EXCHANGE, EVENT, EVENTS_EXCHANGE
from .outbox import Outbox
from .queries import roles
from .receiver import Receiver
from .relay import Relay
from .retry import RetryPolicy
from .supervisor import WorkerProcesses, available_cpus
from .tables import Tables, build_tables
from .topology import UNROUTABLE_QUEUE, Topology, command_routing_key, inbox_queue, service_topology
from .tracing import Tracing
from .waker import Waker, helpers_channel, notify_channel, psycopg_conninfo
from .webhooks import WebhookRole
from .worker import Worker, worker_name

log = logging.getLogger(__name__)
#: Roles run in threads: their names and their `run`.
_Roles = tuple[tuple[str, Callable[..., None]], ...]
#: The fewest seconds between two tenants' maintenance passes (360 tenants an hour), unless a
#: pass over all of them would then last more than a quarter of the partitions' lead.
TENANT_MAINTENANCE_GAP = 10.0

if TYPE_CHECKING:
    from .aio import AsyncWorker
    from .status import Health

H = TypeVar("H", bound=Handler | AsyncHandler)


class Service:
    """One microservice's end of the messaging: its outbox, inbox, handlers and topology.

    ``Service("billing", db_url=..., mq_url=...)`` with any `Settings` field as a keyword.
    Register handlers with `on_command` / `on_event` before `start()`. A Service is safe to
    share between threads: `outbox`, `session()` and `engine` may be used from any thread.
    Construction validates the settings and connects to nothing.

    `listener` hears what the roles do (`Listener`; `outbox_inbox.metrics.instrument` adds the
    Prometheus one). Spans go to `tracer_provider`, else to OpenTelemetry's global tracer
    provider once one is set; with neither, tracing costs nothing (docs/observability.md)."""

    def __init__(
        self,
        name: str,
        *,
        db_url: str | None = None,
        mq_url: str | None = None,
        engine: Engine | None = None,
        broker: Broker | None = None,
        listener: Listener | None = None,
        tracer_provider: TracerProvider | None = None,
        tenants: Tenants | None = None,
        **settings: Any,
    ) -> None:
        self.name = validate_service_name(name)
        try:
            self.settings = Settings(db_url=db_url, mq_url=mq_url, **settings)
        except TypeError as exc:
            raise ConfigurationError(f"unknown setting: {exc}") from exc
        if engine is None and not db_url:
            raise ConfigurationError(f"service {name!r} needs db_url or engine")
        url = db_url or (engine.url if engine is not None else "")
        self.sqlite = bool(url) and is_sqlite(url)
        self.tables: Tables = tables_for(url, self.settings.schema)
        self.handlers = Handlers()
        self.tracing = Tracing(self.name, tracer_provider)
        self.outbox = Outbox(self.name, self.tables, settings=self.settings, tracing=self.tracing)
        #: The tenant this Service serves (`tenant`); "" for the service itself.
        self.tenant_id = ""
        self._tenants = tenants
        self._tenant_services: dict[tuple[str, str, str], Service] = {}
        self._engines: dict[str, Engine] = {}  # the tenants' databases other than db_url
        self._engine, self._broker, self.listener = engine, broker, listener
        self._sessionmaker: sessionmaker[Session] | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._lock = threading.Lock()
        self._maintenance_failures: set[tuple[str, str]] = set()
        self._in_child = False  # a worker process's copy: its parent maintains the partitions
        #: Whether db_url keeps database sessions (see `_liveness_url`); None until probed.
        self._sessions_kept: bool | None = None

    def __repr__(self) -> str:
        return f"Service({self.name!r}, db={mask_url(self.settings.db_url)!r})"

    # --- wiring ---------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine of the service's database (created on first use)."""
        with self._lock:
            if self._engine is None:
                assert self.settings.db_url is not None
                self._engine = connect(
                    self.settings.db_url,
                    self.settings.schema,
                    pool_size=3 + self.settings.worker_threads,
                    prepare_threshold=self.settings.prepare_threshold,
                ).engine
            return self._engine

    @property
    def broker(self) -> Broker:
        """The message broker: RabbitMQ at mq_url, else the process's in-memory broker."""
        with self._lock:
            if self._broker is None:
                if not self.settings.mq_url:
                    from .brokers.memory import MemoryBroker

                    log.warning(
                        "service %s has no mq_url: using the in-memory broker of this process,"
                        " for development and demos only (nothing in it is durable)",
                        self.name,
                    )
                    self._broker = MemoryBroker.shared()
                else:
                    from .brokers import broker_at

                    self._broker = broker_at(
                        self.settings.mq_url,
                        heartbeat=self.settings.heartbeat,
                        blocked_connection_timeout=self.settings.blocked_connection_timeout,
                        publisher_connections=self.settings.publisher_connections,
                        publisher_checkout_timeout=self.settings.publisher_checkout_timeout,
                    )
            return self._broker

    def session(self) -> Session:
        """A new Session on the service's database. The caller begins and commits it; a commit
        that loses its connection raises `CommitOutcomeUnknown` (`database.business_engine`)."""
        if self._sessionmaker is None:
            self._sessionmaker = sessionmaker(business_engine(self.engine))
        return self._sessionmaker()

    def with_urls(self, *, db_url: str | None = None, mq_url: str | None = None) -> Service:
        """This service on the servers at `db_url` / `mq_url` (its own where one is not given):
        itself when neither is another, else a new Service, running no role, that shares the name,
        other settings, `handlers`, listener, tracer provider, tenant registry, and the engine or
        broker object this one was given unless a URL replaces it. Handlers that use this object's
        engine or session keep its database; those writing through the session they are given follow
        `db_url`. Connects to nothing; raises ConfigurationError for an invalid URL."""
        settings = self.settings
        if (not db_url or db_url == settings.db_url) and (not mq_url or mq_url == settings.mq_url):
            return self
        db_url, mq_url = db_url or settings.db_url, mq_url or settings.mq_url
        return self._copy(
            None if db_url else self.engine,
            None if mq_url else self.broker,
            db_url=db_url,
            mq_url=mq_url,
        )

    def _copy(self, engine: Engine | None, broker: Broker | None, **changes: Any) -> Service:
        values = {f.name: getattr(self.settings, f.name) for f in fields(Settings)} | changes
        copy = Service(
            self.name,
            engine=engine,
            broker=broker,
            listener=self.listener,
            tracer_provider=self.tracing.provider,
            tenants=self._tenants,
            **values,
        )
        copy.handlers = self.handlers
        return copy

    # --- tenants --------------------------------------------------------------------------

    def tenant_ids(self) -> list[str]:
        """The tenants registered now, sorted: the ``tenants`` mapping, or what its callable
        returns at this call. Raises ConfigurationError when the callable raises or returns
        anything but a mapping of non-empty strings to `Tenant`."""
        return sorted(self._registry())

    def _registry(self, only: str | None = None) -> Mapping[str, Tenant]:
        """The registry as read now, each entry checked, or only entry `only` (a lookup)."""
        try:
            found = self._tenants() if callable(self._tenants) else self._tenants
        except Exception as exc:
            raise ConfigurationError(
                f"service {self.name}: the tenant registry raised: {exc}"
            ) from exc
        if found is None:
            return {}
        checked = found
        if isinstance(found, Mapping) and only is not None:  # a lookup: its entry alone
            checked = {only: found[only]} if only in found else {}
        if not isinstance(found, Mapping) or not all(
            isinstance(t, str) and 0 < len(t) <= 255 and isinstance(v, Tenant)
            for t, v in checked.items()
        ):
            raise ConfigurationError(
                f"service {self.name}: tenants must map ids (1..255 characters) to Tenant"
            )
        return found

    def tenant(self, tenant_id: str) -> Service:
        """This service in tenant `tenant_id`'s database and schema (docs/tenants.md). A Service
        running no role that shares this one's name, other settings, handlers, broker, listener and
        tracer provider, and one engine per database URL among all the tenants (the service's own
        where a tenant's URL is db_url or none); its outbox writes carry the tenant (``x-tenant``)
        and refuse another. The same object while the tenant's entry is unchanged. Raises
        ConfigurationError for a tenant the registry does not name now, and for an invalid URL or
        schema."""
        entry = self._registry(tenant_id).get(tenant_id)
        if entry is None:
            raise ConfigurationError(f"service {self.name} has no tenant {tenant_id!r}")
        db_url = entry.db_url or self.settings.db_url or ""
        schema = entry.schema or self.settings.schema
        key = (tenant_id, db_url, schema)
        with self._lock:
            found = self._tenant_services.get(key)
        if found is not None:
            return found
        if not db_url or db_url == self.settings.db_url:
            engine = self.engine
        else:
            with self._lock:
                if db_url not in self._engines:
                    self._engines[db_url] = connect(
                        db_url,
                        schema,
                        pool_size=1 + self.settings.worker_threads,
                        prepare_threshold=self.settings.prepare_threshold,
                    ).engine
                engine = self._engines[db_url]
        copy = self._copy(engine, self.broker, db_url=db_url or None, schema=schema)
        copy.tenant_id = tenant_id
        copy.outbox = Outbox(
            self.name, copy.tables, settings=copy.settings, tracing=copy.tracing, tenant=tenant_id
        )
        if not self.sqlite:  # its relays are woken after the write commits
            copy.outbox.written = tenants.waking(
                self.engine, self.settings.schema, tenant_id, same=engine is self.engine
            )
        with self._lock:
            return self._tenant_services.setdefault(key, copy)

    # --- handlers -------------------------------------------------------------------------

    def on_command(self, command: str, **options: Unpack[HandlerKeywords]) -> Callable[[H], H]:
        """Register the handler of command ``<this service>.<command>``.

        The handler is called as ``handler(message, session)`` inside the transaction that
        marks the message processed; it must not commit. An ``async def`` handler gets an
        `AsyncSession` in that transaction and is awaited by the asyncio worker, which the
        service then runs instead of the thread worker (docs/async-services.md). Raise
        `Retry` or `Reject` to choose what happens to the message; any other exception is
        retried by `retry` (or the service's policy). `options` are `HandlerOptions`.

        With `batch`, the handler is called once for the messages of this command in a claimed
        batch, as ``handler(messages, session)`` (or ``handler(batch: BatchContext)``); if it
        raises, each message runs again alone (docs/concepts.md, "Handlers run in batches").
        `version`: the handler takes only messages of this payload version (the sender's
        ``send(..., version=)``); None takes every version (docs/migrating.md)."""
        if command.split(".", 1)[0] == FAULT:
            raise ConfigurationError(
                f"command {command!r}: commands named fault.… are faults; use on_fault"
            )
        return self._register(COMMAND, command_routing_key(self.name, command), options)

    def on_event(self, pattern: str, **options: Unpack[HandlerKeywords]) -> Callable[[H], H]:
        """Register a handler of events matching topic `pattern` (e.g. ``orders.order.*``). A
        message matching several event handlers runs them all, in registration order, in one
        savepoint: they succeed or are retried together. `batch` and `version`: as in `on_command`
        (a message runs every matching handler of its version or of none)."""
        if not pattern or any(not w for w in pattern.split(".")):
            raise ConfigurationError(f"invalid event pattern {pattern!r}")
        return self._register(EVENT, pattern, options)

    def on_fault(
        self, pattern: str, *, retry: RetryPolicy | None = None, batch: bool = False
    ) -> Callable[[H], H]:
        """Register a handler of the faults of what this service sent: commands (and events, where
        the receiver opts in) that ended dead at their receiver (docs/concepts.md, "Faults back to
        the sender"). `pattern` is the dead message's routing key (``billing.invoice.create``) or a
        topic pattern of it (``billing.#``). The fault is a command to this service whose payload is
        a `Fault`, run like any handler's message; several handlers matching one fault all run, in
        registration order. `retry`, `batch`: as in `on_command`."""
        if not pattern or any(not w for w in pattern.split(".")):
            raise ConfigurationError(f"invalid fault pattern {pattern!r}")
        options: HandlerKeywords = {"retry": retry, "batch": batch}
        return self._register(FAULT, fault_routing_key(self.name, pattern), options)

    def _register(self, kind: str, pattern: str, options: HandlerKeywords) -> Callable[[H], H]:
        """The decorator adding a handler of `kind` and `pattern` run with `options`."""
        checked = HandlerOptions(**options)  # at once: a wrong option fails before the def

        def register(handler: H) -> H:
            self.handlers.add(Subscription(kind, pattern, handler, self.outbox, checked))
            return handler

        return register

    # --- setup ----------------------------------------------------------------------------

    def topology(self) -> Topology:
        """Exchanges, queues and bindings this service needs."""
        s = self.settings
        return service_topology(
            self.name,
            self.handlers.event_patterns(),
            single_active_consumer=s.single_active_consumer,
            delay_tiers=s.delay_tiers,
            queue_type=s.queue_type,
            delivery_limit=s.delivery_limit,
            max_length=s.inbox_max_length,
            max_priority=s.max_priority,
        )

    def check_database(self) -> None:
        """Raise StorageError if the database cannot be reached, SchemaMissing without tables."""
        try:
            with self.engine.connect() as conn:
                present = migrations.tables_exist(conn, self.tables.metadata.schema)
        except SQLAlchemyError as exc:
            raise storage_error(exc, f"connecting to {mask_url(self.settings.db_url)}") from exc
        if not present:
            raise SchemaMissing(
                f"the outbox/inbox tables are missing in schema {self.settings.schema!r} of "
                f"{mask_url(self.settings.db_url)}: run `outbox-inbox db upgrade` or migrate()"
            )

    def declare_topology(self) -> None:
        """Declare the topology on the broker (idempotent)."""
        self.broker.declare(self.topology())

    def check_topology(self) -> None:
        """Raise TopologyMissing unless the broker holds every queue of this service. Declares
        nothing: passive declares only, which need no configure permission. What `start()` and
        `run_receiver()` do instead of `declare_topology()` when the ``declare`` setting is False.
        Raises BrokerConnectionError when the broker cannot be reached."""
        own = [q.name for q in self.topology().queues if q.name.startswith(f"{self.name}.")]
        missing = [name for name in own if self.broker.queue_depth(name) is None]
        if missing:
            raise TopologyMissing(
                f"service {self.name} does not declare its topology (declare=False) and "
                f"{self.broker.description} lacks {', '.join(missing)}: run "
                "`outbox-inbox topology apply` as a user allowed to declare them"
            )

    def record_subscriptions(self) -> None:
        """Record the inbox queue's bindings in the ``subscriptions`` table (idempotent), in a
        transaction of the library's own; a binding keeps the database time of its first
        recording (tables.py says what for). `start()` and `run_receiver()` call this after
        declaring the topology. Raises StorageError."""
        queue = inbox_queue(self.name)
        bindings = [
            (b.exchange, b.routing_key)
            for b in self.topology().bindings
            if b.queue == queue and b.exchange in (COMMANDS_EXCHANGE, EVENTS_EXCHANGE)
        ]
        try:
            with self.engine.begin() as conn:
                roles.record_subscriptions(conn, self.tables, self.name, bindings)
        except SQLAlchemyError as exc:
            raise storage_error(exc, "recording the service's subscriptions") from exc

    def _advertise_before_binding(self) -> None:
        """Advertise this process's handlers in the instances table before its bindings are
        declared, so that a message the new bindings route finds them before this process's workers
        advertise their own: an old worker leaves it instead of marking it dead. The row is not
        refreshed: it stops counting as live after ``no_handler_grace``. Raises StorageError."""
        grace = timedelta(seconds=self.settings.no_handler_grace)
        instance = f"{worker_name()} (receiver start)"
        try:
            with self.engine.begin() as conn:
                roles.advertise_instance(
                    conn, self.tables, self.name, instance, self.handlers.advertised(), 10 * grace
                )
        except SQLAlchemyError as exc:
            raise storage_error(exc, "advertising the service's handlers") from exc

    def migrate(self, revision: str = "heads") -> None:
        """Apply the shipped migrations to the service's database (``outbox-inbox db upgrade``)."""
        with self.engine.connect() as conn:
            migrations.upgrade(
                migrations.alembic_config(schema=self.settings.schema, connection=conn), revision
            )
            conn.commit()

    def maintain(self) -> partitions.MaintenanceResult:
        """One maintenance pass (docs/history.md, "The maintenance pass"; on SQLite, no partitions),
        then the ``payload_store``'s payloads past the retention are removed (on SQLite too, where
        no role runs it). Returns ``busy`` when another pass of the schema runs. Raises StorageError
        (a refused DDL statement: the service's role lacks the rights, docs/security.md)."""
        return self._maintain(self.engine, self.tables)

    def _maintain(self, engine: Engine, tables: Tables) -> partitions.MaintenanceResult:
        s, result = self.settings, partitions.MaintenanceResult()
        if not self.sqlite:
            exporter = None
            if s.archive_to:
                from .archive import partition_exporter

                exporter = partition_exporter(tables, self.name, s.archive_to)
            kept = partitions.Retention(as_timedelta(s.retention), as_timedelta(s.dead_retention))
            result = partitions.maintain(
                engine, tables, interval=s.partition_interval, retention=kept, exporter=exporter
            )
        if s.payload_store is not None and s.retention is not None and not result.busy:
            # The retention is at least the duplicate window (Settings): no copy of a message
            # can still arrive without its payload.
            result.pruned_payloads = s.payload_store.delete_older_than(s.retention)
        return result

    def _maintain_quietly(
        self, *, tenants: bool = True, stop: threading.Event | None = None
    ) -> None:
        """A maintenance pass of a running role, then one of each tenant's with `tenants`, spread
        over ``maintenance_interval`` with `stop` (docs/tenants.md): an unreachable database is
        the roles' concern (raised; a tenant's is logged); other failures, once per kind."""
        ids = []
        try:
            if tenants and self._tenants is not None and not self.tenant_id:
                ids = self.tenant_ids()
        except ConfigurationError as exc:
            self._maintenance_failed(exc, "")
        s, parts, every = self.settings, len(ids) + 1, self.settings.partition_interval
        lead = (partitions.INTERVALS[every] * partitions.AHEAD[every]).total_seconds()
        gap = max(s.maintenance_interval / parts, min(TENANT_MAINTENANCE_GAP, lead / 4 / parts))
        for tenant in ["", *ids]:
            try:
                if tenant and (idle := self._idle_schema(tenant)):
                    self._maintain(*idle)
                else:
                    (target := self.tenant(tenant) if tenant else self).maintain()
                    if target.engine is not self.engine:
                        target.engine.dispose()  # a tenant database keeps no connection
            except OutboxInboxError as exc:
                if isinstance(exc, DatabaseUnavailable) and not tenant and stop is None:
                    raise  # the start waits for it; a spread pass logs it and goes on
                self._maintenance_failed(exc, tenant)
            if stop is not None and stop.wait(gap):
                return

    def _idle_schema(self, tenant: str) -> tuple[Engine, Tables] | None:
        """For a schema tenant of this database whose `tenant` Service was never made (an idle
        one): the engine and tables of a pass nothing outlives, tables its own and statements
        compiled uncached (1,000 idle tenants' tables held ~265 MB: docs/tenants.md)."""
        kept = any(key[0] == tenant for key in self._tenant_services)  # `tenant` reads it then
        entry = None if kept else self._registry(tenant).get(tenant)
        if self.sqlite or not entry or entry.db_url not in (None, self.settings.db_url):
            return None
        schema = entry.schema or self.settings.schema
        return self.engine.execution_options(compiled_cache=None), build_tables.__wrapped__(schema)

    def _maintenance_failed(self, exc: OutboxInboxError, tenant: str) -> None:
        if (tenant, type(exc).__name__ + str(exc)[:80]) not in self._maintenance_failures:
            self._maintenance_failures.add((tenant, type(exc).__name__ + str(exc)[:80]))
            log.warning(
                "service %s%s: partition maintenance failed (%s); the roles go on, and "
                "`outbox-inbox partitions maintain` can run it as the tables' owner",
                self.name,
                f" tenant {tenant}" if tenant else "",
                first_line(exc),
            )

    def _maintenance(self, stop: threading.Event, *, on_started: Callable[[], None]) -> None:
        """The maintenance role: a pass every ``maintenance_interval`` seconds, and a warning
        when `unroutable` holds more commands than at the last pass (nothing else says so)."""
        on_started()
        unroutable, spread = 0, self._tenants is not None  # a pass as long as the interval
        while not stop.is_set() and (spread or not stop.wait(self.settings.maintenance_interval)):
            with contextlib.suppress(OutboxInboxError):  # the broker's roles report it
                before, unroutable = unroutable, self.broker.queue_depth(UNROUTABLE_QUEUE) or 0
                if unroutable > before:
                    log.warning(
                        "%d command(s) wait in the queue %s: sent to a service that has no queue "
                        "(outbox-inbox dead-letters list --source unroutable)",
                        unroutable,
                        UNROUTABLE_QUEUE,
                    )
            try:
                self._maintain_quietly(stop=stop if spread else None)
            except DatabaseUnavailable as exc:
                log.warning("service %s: maintenance waits: %s", self.name, first_line(exc))

    # --- roles ----------------------------------------------------------------------------

    def _waker(
        self, table: str, helpers: str | None = None
    ) -> Callable[[threading.Event], Waker | None]:
        def factory(stop: threading.Event) -> Waker | None:
            if self.engine.dialect.name != "postgresql":
                return None
            return Waker(
                psycopg_conninfo(self.settings.listen_url or self.engine.url),
                notify_channel(self.settings.schema, table),
                stop,
                probe=self.engine,
                helpers=helpers,
            )

        return factory

    def wakeups(self) -> bool | None:
        """Whether NOTIFY wake-ups reach this service's LISTEN path (``listen_url``, else
        db_url), proven by a probe now: False behind a pooler in transaction mode (the roles
        then poll), None when the database cannot be reached or is not PostgreSQL."""
        if self.sqlite:
            return None
        waker = self._waker(self.tables.outbox.name)(threading.Event())
        if waker is None:
            return None
        try:
            return waker.check()
        finally:
            waker.close()

    def health(self, *, max_lag: float | None = None, max_dead: int | None = None) -> Health:
        """What `outbox-inbox status` reports of this service now, its queues read on its broker
        (RabbitMQ or in memory), problems under `max_lag` (seconds) and `max_dead`: see
        outbox_inbox.status.health, whose errors it raises."""
        from .status import health

        return health(
            self.engine,
            self.tables,
            service=self.name,
            broker=self.broker,
            listen_url=self.settings.listen_url,
            max_lag=max_lag,
            max_dead=max_dead,
            tenants=None if self.tenant_id else self,
        )

    def _liveness_url(self) -> str | None:
        """Where workers hold their liveness locks: ``listen_url``, else db_url once a probe
        showed it keeps sessions (not a pooler in transaction mode), else nowhere."""
        if self.settings.listen_url:
            return self.settings.listen_url
        if self.engine.dialect.name != "postgresql":
            return None
        with self._lock:
            kept = self._sessions_kept
        if kept is None:
            kept = self.wakeups()
            if kept is None:
                # No verdict (the database is away): as before, on db_url; the connect fails.
                return self.engine.url.render_as_string(hide_password=False)
            with self._lock:
                self._sessions_kept = kept
        return self.engine.url.render_as_string(hide_password=False) if kept else None

    def relay(self) -> Relay:
        """A new relay for this service (run it with `Relay.run(stop)`)."""
        return Relay(
            service=self.name,
            engine=self.engine,
            tables=self.tables,
            broker=self.broker,
            settings=self.settings,
            waker_factory=self._waker(self.tables.outbox.name),
            listener=self.listener,
            tracing=self.tracing,
        )

    def receiver(self) -> Receiver:
        """A new receiver for this service's inbox queue; with tenants, a delivery naming one
        (``x-tenant``) is stored in its inbox (docs/tenants.md)."""
        return Receiver(
            service=self.name,
            engine=self.engine,
            tables=self.tables,
            broker=self.broker,
            settings=self.settings,
            listener=self.listener,
            tracing=self.tracing,
            declare=self.declare_topology if self.settings.declare else None,
            tenants=self if self._tenants is not None and not self.tenant_id else None,
        )

    def worker(self, name: str | None = None) -> Worker:
        """A new worker running this service's handlers. The workers of the service take turns
        at listening (`waker.Waker`'s `helpers`): a lone message wakes one of them."""
        helpers = helpers_channel(notify_channel(self.settings.schema, self.tables.inbox.name))
        return Worker(
            engine=self.engine,
            tables=self.tables,
            handlers=self.handlers,
            settings=self.settings,
            name=name,
            service=self.name,
            waker_factory=self._waker(self.tables.inbox.name, helpers),
            listener=self.listener,
            tracing=self.tracing,
            liveness_url=self._liveness_url,
            outbox=self.outbox,
            helpers=helpers if self.engine.dialect.name == "postgresql" else None,
        )

    def async_worker(self, name: str | None = None) -> AsyncWorker:
        """A new asyncio worker running this service's handlers, sync and async alike, on
        psycopg's async driver (the database URL's, as ``postgresql+psycopg``)."""
        from .aio import AsyncWorker, worker_engine

        engine = worker_engine(self.engine.url, prepare_threshold=self.settings.prepare_threshold)
        return AsyncWorker(self.worker(name), engine)

    def _worker_role(self) -> Callable[..., None]:
        """The run function of one worker: in a thread, or in a loop of its own if a handler
        is ``async def`` (the thread worker cannot give it an AsyncSession)."""
        if self.handlers.any_async:
            return self.async_worker().run_in_thread
        return self.worker().run

    def start(
        self,
        *,
        relay: bool = True,
        receiver: bool = True,
        workers: int | None = None,
        fail_fast: bool | None = None,
    ) -> None:
        """Declare the topology, then run the roles in background threads of this process. Returns
        once every role has started. While PostgreSQL or RabbitMQ cannot be reached it waits for
        them (docs/failures.md, "Startup and configuration"), or returns if `stop()` is called
        meanwhile; with `fail_fast` (default: the ``fail_fast`` setting) it raises
        DatabaseUnavailable or BrokerConnectionError at once instead. Configuration errors always
        raise at once: SchemaMissing, TopologyMismatch, TopologyMissing (with ``declare=False``),
        BrokerAccessRefused, a refused database login. `workers`: worker threads (default: the
        ``worker_threads`` setting). The topology is declared when the receiver runs. `run()` runs
        the workers in processes of their own instead (the ``processes`` setting); `start()` keeps
        them in this process, which embeds the service."""
        if self._threads:
            raise ConfigurationError("service already started")
        self._stop.clear()
        self._start_roles(relay=relay, receiver=receiver, workers=workers, fail_fast=fail_fast)

    def _start_roles(
        self,
        *,
        relay: bool,
        receiver: bool,
        workers: int | None,
        fail_fast: bool | None,
        ready: bool = False,
    ) -> None:
        """Start the roles in threads once the servers can be reached (`ready`: the caller
        has just checked them, and declared the topology if the receiver runs)."""
        if not ready and not self._wait_until_ready(topology=receiver, fail_fast=fail_fast):
            return
        roles: list[tuple[str, Callable[..., None]]] = []
        if relay:
            for n in range(self.settings.relay_threads):
                roles.append((f"relay-{n}" if n else "relay", self.relay().run))
            roles += self._webhooks()
        if receiver:
            roles.append(("receiver", self.receiver().run))
        workers = self.settings.worker_threads if workers is None else workers
        for n in range(workers):
            roles.append((f"worker-{n}", self._worker_role()))
        roles += tenants.fleet_roles(self, relay=relay, workers=workers)
        if not roles:
            return
        if not self.sqlite and not self._in_child:  # worker processes' parent runs it
            roles.append(("maintenance", self._maintenance))
        started = threading.Barrier(len(roles) + 1)
        for role, run in roles:
            thread = threading.Thread(
                target=self._supervise,
                args=(role, run, started),
                name=f"outbox-inbox-{self.name}-{role}",
                daemon=True,
            )
            self._threads.append(thread)
            thread.start()
        started.wait(timeout=30)
        log.info("service %s started: %s", self.name, ", ".join(r for r, _ in roles))

    def _supervise(self, role: str, run: Callable[..., None], started: threading.Barrier) -> None:
        """Run a role; if it dies of an unexpected error, log it and start it again. Whatever ends
        the role before the service stops, a `BaseException` included (``SystemExit`` from library
        code or a thread's own ``KeyboardInterrupt``), is such an error: a role never ends silently
        while the service runs."""
        announced = False

        def on_started() -> None:
            nonlocal announced
            if not announced:
                announced = True
                with contextlib.suppress(threading.BrokenBarrierError):
                    started.wait(timeout=30)

        try:
            while not self._stop.is_set():
                try:
                    run(self._stop, on_started=on_started)
                except BaseException as exc:
                    log.error(
                        "service %s: %s crashed (%s: %s); restarting in 1 s",
                        self.name,
                        role,
                        type(exc).__name__,
                        first_line(exc),
                        exc_info=True,
                    )
                    self._stop.wait(1.0)
                else:
                    if not self._stop.is_set():
                        log.error("service %s: %s ended; restarting in 1 s", self.name, role)
                        self._stop.wait(1.0)
        finally:
            on_started()  # stopped before it started: whoever waits for the start goes on

    def stop(self, timeout: float = 30.0) -> None:
        """Ask every role to stop after the work in hand and wait up to `timeout` seconds."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        alive = [t.name for t in self._threads if t.is_alive()]
        self._threads = []
        if alive:
            log.warning("service %s: threads still running after stop: %s", self.name, alive)

    def run(self, *, fail_fast: bool | None = None) -> None:
        """Run the service until SIGTERM or SIGINT, then stop it gracefully. The relay and the
        receiver run in threads of this process. The workers run in ``processes`` child processes
        (default: one per CPU this process may use), supervised by this one
        (outbox_inbox.supervisor: a child that dies is started again); with ``processes=1``, or on
        SQLite, in threads of this process, as `start()` runs them. Waits for unreachable servers as
        `start()` does; a signal ends the wait too."""
        self._run_with_workers(relay=True, receiver=True, fail_fast=fail_fast)

    def run_relay(self, *, fail_fast: bool | None = None) -> None:
        """Run only the relay in this thread until SIGTERM or SIGINT (waits as `start()`), and
        the webhooks role and the tenants' relay (outbox_inbox.tenants) in threads if any."""
        also = (*self._webhooks(), *tenants.fleet_roles(self, relay=True, workers=0))
        self._run_role(self.relay().run, topology=False, fail_fast=fail_fast, also=also)

    def _webhooks(self) -> _Roles:
        """The webhooks role where the relay runs, with `webhooks` (docs/concepts.md)."""
        if not self.settings.webhooks:
            return ()
        e, t, s = self.engine, self.tables, self.settings
        return (("webhooks", WebhookRole(service=self.name, engine=e, tables=t, settings=s).run),)

    def run_receiver(self, *, fail_fast: bool | None = None) -> None:
        """Run only the receiver in this thread until SIGTERM or SIGINT (waits as `start()`),
        after declaring (``declare=False``: checking) the topology and recording subscriptions."""
        self._run_role(self.receiver().run, topology=True, fail_fast=fail_fast)

    def run_worker(self, *, fail_fast: bool | None = None) -> None:
        """Run only the workers until SIGTERM or SIGINT (waits as `start()`): in
        ``processes`` child processes as `run()` does, or with ``processes=1`` (or on SQLite)
        one worker in this thread."""
        if self.worker_processes() == 1:
            also = tuple(tenants.fleet_roles(self, relay=False, workers=1))
            self._run_role(self._worker_role(), topology=False, fail_fast=fail_fast, also=also)
        else:
            self._run_with_workers(relay=False, receiver=False, fail_fast=fail_fast)

    def worker_processes(self) -> int:
        """How many worker processes `run()` and `run_worker()` start: the ``processes``
        setting, else `supervisor.available_cpus()`, or 1 for a service without handlers (its
        worker only marks what it is sent ``no_handler``); always 1 on SQLite (one process) and
        in a daemonic multiprocessing process (which may not have children)."""
        if self.sqlite or multiprocessing.current_process().daemon:
            return 1
        return self.settings.processes or (available_cpus() if self.handlers.subscriptions else 1)

    def _run_with_workers(self, *, relay: bool, receiver: bool, fail_fast: bool | None) -> None:
        count = self.worker_processes()
        self._stop.clear()
        with _stop_on_signals(self._stop):
            if count == 1:
                self._start_roles(relay=relay, receiver=receiver, workers=None, fail_fast=fail_fast)
                self._stop.wait()
            # Configuration errors raise here, before any process is forked.
            elif (
                self._wait_until_ready(topology=receiver, fail_fast=fail_fast)
                and not self._stop.is_set()
            ):
                pool = WorkerProcesses(
                    self.name, count, self._worker_process, forwarded(self.listener)
                )
                pool.start()  # before this process starts a thread of its own
                try:
                    self._start_roles(
                        relay=relay, receiver=receiver, workers=0, fail_fast=fail_fast, ready=True
                    )
                    pool.watch(self._stop)
                finally:
                    self._stop.set()
                    pool.stop()
        self.stop()

    def _worker_process(self, stop: threading.Event, forwarder: Listener | None) -> int:
        """What each worker process runs (`supervisor.ChildMain`): make this forked copy of the
        service its own (a new stop event and lock, no pooled connection of the parent's:
        dropped, not closed; `forwarder` instead of the listeners the parent serves), start
        ``worker_threads`` workers once the database can be reached, and run them until `stop`
        is set (exit code 0) or one of them ends (1); then stop and close."""
        self._stop = stop
        self._lock = threading.Lock()
        self._in_child = True
        self._threads = []
        self._tasks = []
        if self._engine is not None:
            self._engine.dispose(close=False)
        if forwarder is not None:
            self.listener = forwarding(self.listener, forwarder)
        try:
            self._start_roles(relay=False, receiver=False, workers=None, fail_fast=None)
            while not stop.wait(0.5):
                if not all(t.is_alive() for t in self._threads):
                    log.error("service %s: a worker of process %d ended", self.name, os.getpid())
                    return 1
            return 0
        finally:
            self.close()  # stops the workers, then closes this process's own connections

    # --- roles in an event loop ---------------------------------------------------------------

    async def start_async(
        self,
        *,
        relay: bool = True,
        receiver: bool = True,
        workers: int | None = None,
        fail_fast: bool | None = None,
    ) -> None:
        """`start()` for asyncio code: the workers run as tasks of the running loop. The relay and
        the receiver run in threads, as with `start()`; waiting for the servers happens in a thread
        too, so the loop runs on meanwhile. Returns once every role runs (or without starting any if
        `stop_async()` was called meanwhile). Raises what `start()` raises. Pair it with
        `stop_async()`, e.g. in a FastAPI lifespan."""
        if self._tasks or self._threads:
            raise ConfigurationError("service already started")
        count = self.settings.worker_threads if workers is None else workers
        aio_workers = [self.async_worker() for _ in range(count)]
        try:
            await asyncio.to_thread(
                self.start, relay=relay, receiver=receiver, workers=0, fail_fast=fail_fast
            )
        except asyncio.CancelledError:
            self._stop.set()  # the thread's wait for the servers ends at once
            raise
        if self._stop.is_set():
            return
        for n, aio_worker in enumerate(aio_workers):
            self._tasks.append(
                asyncio.create_task(
                    self._supervise_async(f"worker-{n}", aio_worker),
                    name=f"outbox-inbox-{self.name}-worker-{n}",
                )
            )
        log.info("service %s: %d asyncio workers started", self.name, count)

    async def _supervise_async(self, role: str, aio_worker: AsyncWorker) -> None:
        """Run an asyncio worker; if it dies of an unexpected error, log it and restart it."""
        while not self._stop.is_set():
            try:
                await aio_worker.run(self._stop)
            except Exception:
                log.exception("service %s: %s crashed; restarting in 1 s", self.name, role)
                await asyncio.to_thread(self._stop.wait, 1.0)
        await aio_worker.close()

    async def stop_async(self, timeout: float = 30.0) -> None:
        """Stop every role after the work in hand (each worker finishes its batch), waiting up
        to `timeout` seconds; then the worker tasks still running are cancelled, which rolls
        their batch back (the rows are handled again, as after a crash)."""
        self._stop.set()
        tasks, self._tasks = self._tasks, []
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=timeout)
            for task in late:
                task.cancel()
            if late:
                log.warning("service %s: %d asyncio workers cancelled", self.name, len(late))
                await asyncio.wait(late)
        await asyncio.to_thread(self.stop, timeout)

    async def run_async(
        self, *, relay: bool = True, receiver: bool = True, workers: int | None = None
    ) -> None:
        """`start_async()`, then run until the task is cancelled, then `stop_async()`. Cancellation
        is the stop signal (``asyncio.run`` cancels on Ctrl-C; a TaskGroup or lifespan cancels its
        tasks): the batch in hand is finished and committed first, then the cancellation goes on."""
        try:
            await self.start_async(relay=relay, receiver=receiver, workers=workers)
            await asyncio.Event().wait()  # until cancelled
        finally:
            await self.stop_async()

    def _run_role(
        self, run: Callable[..., None], *, topology: bool, fail_fast: bool | None, also: _Roles = ()
    ) -> None:
        self._stop.clear()
        with _stop_on_signals(self._stop):
            if self._wait_until_ready(topology=topology, fail_fast=fail_fast):
                if not self.sqlite and not self._in_child:
                    also = (("maintenance", self._maintenance), *also)
                for role, extra in also:  # in threads of their own
                    threading.Thread(
                        target=self._supervise,
                        args=(role, extra, threading.Barrier(1)),
                        name=f"outbox-inbox-{self.name}-{role}",
                        daemon=True,
                    ).start()
                self._supervise("role", run, threading.Barrier(1))

    def _wait_until_ready(self, *, topology: bool, fail_fast: bool | None) -> bool:
        """Check the database (and declare the topology) until it works; False if stopped. Only
        unreachable servers are waited for; anything else raises at once."""
        s = self.settings
        fail_fast = s.fail_fast if fail_fast is None else fail_fast
        what = f"service {self.name}: waiting for its servers"
        backoff = Backoff(s.reconnect_initial, s.reconnect_max, what=what, logger=log)
        while True:
            try:
                self.check_database()
                # Partitions ahead before anything is written; the tenants' by the maintenance
                # role, spread over its interval: a thousand tenants do not hold up the start.
                self._maintain_quietly(tenants=False)
                if topology:
                    self._advertise_before_binding()
                    if s.declare:
                        self.declare_topology()
                    else:
                        self.check_topology()
                    self.record_subscriptions()
            except (DatabaseUnavailable, BrokerConnectionError) as exc:
                if fail_fast or isinstance(exc, BrokerAccessRefused):
                    raise
                if self._stop.is_set():
                    return False
                backoff.failed(exc, self._stop)
                if self._stop.is_set():
                    return False
                continue
            backoff.succeeded()
            return True

    def close(self) -> None:
        """Stop the roles and release the database connections."""
        self.stop()
        for engine in [self._engine, *self._engines.values()]:
            if engine is not None:
                engine.dispose()
        if self._broker is not None and self.settings.mq_url:  # the memory broker is shared
            self._broker.close()


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Set `stop` on SIGTERM / SIGINT while the block runs (main thread only: a process run by
    the library); what the process holds when it begins (modules, settings, the tenant registry)
    is kept out of the garbage collector's full collections till it ends (`gc.freeze`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: FrameType | None) -> None:
        log.info("received signal %d, stopping", signum)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    gc.collect()  # after the handlers: a signal meanwhile stops the run, as any other time
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        for sig, old in previous.items():
            signal.signal(sig, old)
