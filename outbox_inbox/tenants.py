"""The tenants fleet: the relays and workers of a service with ``tenants`` drain every tenant.

A `Hub` per process knows the registry and which tenants have work, in the order they were woken
(`wake`: a NOTIFY on ``<schema>.tenants`` in the service's own database; a sweep of at most
`SWEEP` tenants a second). `Fleet` threads take them in turn, each under a lease on the database
clock in ``tenant_leases``, drain them with the tenant's own `Relay.relay_once` /
`Worker.work_once` and move on after `QUANTUM` batches (docs/tenants.md, "The fleet")."""

from __future__ import annotations

import contextlib
import heapq
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import psycopg
from psycopg import sql
from sqlalchemy import Engine, delete, event, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from sqlalchemy.pool import QueuePool

from .backoff import Backoff
from .clock import db_now
from .config import Tenant
from .errors import ConfigurationError, first_line
from .queries import roles
from .role_loop import DRIVER_OUTAGES, UNAVAILABLE
from .waker import notify_channel, psycopg_conninfo
from .worker import worker_name

if TYPE_CHECKING:
    from .relay import Relay
    from .service import Service
    from .worker import Worker

log = logging.getLogger(__name__)

RELAY, WORKER = "relay", "worker"
#: Seconds between two reads of the registry: tenants added or removed are served from then on.
REFRESH = 5.0
#: Tenants the sweep probes for work each second, whatever their count (the fallback of `wake`).
SWEEP = 20
#: Batches a fleet thread drains of one tenant before it serves the next one with work.
QUANTUM = 8
#: Seconds after which a tenant's idle worker connection is closed, and an idle database's pool.
IDLE = 5.0
#: The fewest seconds before a tenant leased by another holder is tried again (when it passes).
BUSY = 0.5
_TICK = 0.5
_WAKE = "outbox_inbox.tenants.wake"  # Session.info: the tenants to wake after its commit
_TENANT_DOWN: tuple[type[Exception], ...] = (SQLAlchemyError, *DRIVER_OUTAGES)
#: The sweep's probes: whether a tenant's schema holds rows to send (the predicate of the relay's
#: index ``ix_outbox_messages_relayed``, tables.py) or due rows to handle.
_PROBES = {
    RELAY: sql.SQL(
        "SELECT {tag} WHERE EXISTS (SELECT FROM {schema}.outbox_messages WHERE published_at IS"
        " NULL AND expired_at IS NULL AND dead_at IS NULL AND NOT (exchange LIKE 'webhook:%')"
        " AND available_at <= now())"
    ),
    WORKER: sql.SQL(
        "SELECT {tag} WHERE EXISTS (SELECT FROM {schema}.inbox_messages"
        " WHERE status = 'pending' AND next_attempt_at <= now())"
    ),
}


def wake(engine: Engine, schema: str, role: str, tenants: set[str] | list[str]) -> None:
    """Wake the fleets of the service whose database `engine` is: `tenants` have work for
    `role` (RELAY: outbox rows; WORKER: inbox rows). Call it after the rows' commit; a failure
    is only logged (the sweep finds the rows later)."""
    try:
        with engine.begin() as conn:
            for tenant in tenants:
                roles.notify(conn, notify_channel(schema, "tenants"), f"{role}:{tenant}")
    except SQLAlchemyError as exc:
        log.debug("waking the tenants fleet failed: %s", first_line(exc))


def waking(
    engine: Engine, schema: str, tenant: str, *, same: bool = False
) -> Callable[[Session | Any], None]:
    """What a tenant's `Outbox` calls on each write: the relays are woken for `tenant` once the
    write's transaction commits (`wake`); a rollback wakes nobody. In the service's database
    (`same`: a schema tenant) the wake-up rides in that transaction, one NOTIFY per transaction
    and tenant, delivered by its commit. In another database it is sent after a `Session`'s
    commit; a `Connection`'s write there wakes nobody (the sweep finds it)."""
    payload = f"{RELAY}:{tenant}"

    def written(session: Session | Any) -> None:
        if same:
            key, txn = (_WAKE, tenant), session.get_transaction()
            if session.info.get(key) is not txn:
                roles.notify(session, notify_channel(schema, "tenants"), payload)
                session.info[key] = txn
            return
        if not isinstance(session, Session):
            return
        if _WAKE not in session.info:
            session.info[_WAKE] = set()
            event.listen(session, "after_commit", _committed)
            event.listen(session, "after_rollback", lambda s: s.info[_WAKE].clear())
        session.info[_WAKE].add((engine, schema, tenant))

    return written


def _committed(session: Session) -> None:
    woken, session.info[_WAKE] = session.info[_WAKE], set()
    for engine, schema, tenant in woken:
        wake(engine, schema, RELAY, [tenant])


class _Later(Backoff):
    """A tenant's `Backoff`: its outage logged once, its next try a time instead of a wait."""

    retry_at = 0.0

    def sleep(self, stop: threading.Event) -> None:
        self.retry_at = time.monotonic() + self._next * random.uniform(0.5, 1.0)
        self._next = min(self._next * 2, self._maximum)


class Hub:
    """What the fleet threads of one process share: the registry, the tenants with work for each
    role (in the order they were woken: round robin), the tenants' outages, the leases held, and
    when each tenant database's pool was last used. `run` is its thread: the LISTEN connection,
    the registry's refresh, the sweep, the idle leases' release and the idle pools' disposal."""

    def __init__(self, service: Service, served: tuple[str, ...]) -> None:
        self.service, self.served, self._ids, self._warned = service, served, list[str](), ""
        self._entries: Mapping[str, Tenant] = {}
        self._services: dict[str, Service] = {}  # `tenant`'s, until the registry is read again
        self._cursor, self._swept, self._read = 0, time.monotonic(), -REFRESH
        self._conn: psycopg.Connection[Any] | None = None  # LISTEN, and the sweep's probes
        self._work: dict[str, dict[str, None]] = {role: {} for role in served}
        self._later: dict[tuple[str, str], float] = {}
        self._due: list[tuple[float, str, str]] = []  # (when, role, tenant): a retry due then
        self._outages: dict[tuple[str, str], _Later] = {}
        self._used: dict[Engine, float] = {}  # a tenant database's engine -> last use
        self._probes: dict[tuple[str, str, str], str] = {}  # (role, tenant, schema) -> its text
        #: (holder, tenant) -> until when the lease is held, and its last use. A holder is this
        #: process's threads of one role: a lease kept by one serves the others.
        self.leases: dict[tuple[str, str], tuple[float, float]] = {}
        self._cond, self.holder = threading.Condition(), worker_name()

    def run(self, stop: threading.Event, *, on_started: Callable[[], None] | None = None) -> None:
        """Listen for wake-ups, refresh the registry, sweep and dispose idle pools until `stop`."""
        retry = 0.0  # when to LISTEN again after a failure
        try:
            while not stop.is_set():
                self._tick()
                if self._conn is None and time.monotonic() >= retry:
                    try:
                        self._conn = self._listen()
                    except psycopg.Error as exc:
                        log.warning("tenants fleet: no wake-ups (%s): sweep only", first_line(exc))
                    retry = time.monotonic() + 10 * REFRESH  # if it has none
                if on_started:  # once it listens or cannot: a commit after that wakes it
                    on_started()
                if self._conn is None:
                    stop.wait(_TICK)
                    continue
                try:  # what came during a sweep on it too (psycopg keeps it for `notifies`)
                    for n in self._conn.notifies(timeout=_TICK):
                        role, _, tenant = n.payload.partition(":")
                        self.mark(role, tenant)
                except psycopg.Error as exc:
                    log.warning("tenants fleet: wake-ups lost (%s)", first_line(exc))
                    self._conn.close()
                    self._conn = None
        finally:
            self._release(list(self.leases))  # handed over at once
            if self._conn is not None:
                self._conn.close()

    def _listen(self) -> psycopg.Connection[Any] | None:
        s = self.service.settings
        if not self.service.wakeups():  # proven first (warned once): behind a pooler in
            return None  # transaction mode LISTEN and the prepared sweep would have no session
        conn = psycopg.connect(psycopg_conninfo(s.listen_url or self.service.engine.url))
        conn.autocommit = True
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(s.schema + ".tenants")))
        return conn

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._read >= REFRESH:
            self._read = now
            self._refresh()
        if now - self._swept >= 1.0 and self._ids:  # a group of SWEEP tenants a second
            self._swept, group = now, self._ids[self._cursor : self._cursor + SWEEP]
            self._cursor = self._cursor + SWEEP if self._cursor + SWEEP < len(self._ids) else 0
            self._sweep(group)
        with self._cond:
            while self._due and self._due[0][0] <= now:
                self.mark(*heapq.heappop(self._due)[1:])
        self._release([k for k, (_, used) in list(self.leases.items()) if now - used > IDLE])
        for engine, used in list(self._used.items()):  # none checked out: none is orphaned
            if now - used > IDLE and not cast(QueuePool, engine.pool).checkedout():
                del self._used[engine]
                engine.dispose()

    def _refresh(self) -> None:
        try:
            entries = self.service._registry()
            ids = sorted(entries)
        except ConfigurationError as exc:
            if str(exc) != self._warned:
                self._warned = str(exc)
                log.warning("tenants fleet: keeps the tenants it had: %s", exc)
            return
        added = set(ids) - set(self._ids) if self._ids else set()  # the first: by the sweep
        if set(ids) != set(self._ids):
            self._probes = {}  # none kept for a tenant no longer served
        self._ids, self._entries, self._services = ids, entries, {}
        with self._cond:
            for work in self._work.values():
                for gone in set(work) - set(ids):
                    del work[gone]
                work.update(dict.fromkeys(sorted(added)))
            self._cond.notify_all()

    def _release(self, keys: list[tuple[str, str]]) -> None:
        """Delete the leases of `keys` (holder, tenant) held by this process's fleet threads:
        another holder may take them at once. A failure is only logged: they pass in time."""
        svc, leases = self.service, self.service.tables.tenant_leases
        for key in keys:
            self.leases.pop(key, None)
        if not keys:
            return
        try:
            with svc.engine.begin() as conn:
                for holder in {holder for holder, _ in keys}:
                    held = leases.c.tenant.in_([t for h, t in keys if h == holder])
                    mine = leases.c.holder == holder
                    conn.execute(delete(leases).where(leases.c.service == svc.name, mine, held))
        except SQLAlchemyError as exc:
            log.debug("tenants fleet: leases not released: %s", first_line(exc))

    def tenant(self, tenant: str) -> Service:
        """`Service.tenant` as of the last read of the registry (not read again per call)."""
        found = self._services.get(tenant)
        if found is None:
            if tenant not in self._entries:
                raise ConfigurationError(f"service {self.service.name} has no tenant {tenant!r}")
            found = self._services[tenant] = self.service.tenant(tenant)
        return found

    def _sweep(self, batch: list[str]) -> None:
        """Probe `batch` for work, one query per database, and mark the tenants that have it.
        A schema tenant in the service's database costs no object of its own until it has work."""
        svc, by_engine = self.service, dict[Engine, list[tuple[str, str]]]()
        for tenant in batch:
            entry = self._entries.get(tenant)
            if entry is None or all((role, tenant) in self._outages for role in self.served):
                continue  # in an outage: tried again by the fleet, at its backoff's pace
            if entry.db_url and entry.db_url != svc.settings.db_url:
                with contextlib.suppress(ConfigurationError):
                    t = self.tenant(tenant)
                    by_engine.setdefault(t.engine, []).append((tenant, t.settings.schema))
            else:
                schema = entry.schema or svc.settings.schema
                by_engine.setdefault(svc.engine, []).append((tenant, schema))
        for engine, found in by_engine.items():
            text = " UNION ALL ".join(self._probe(r, t, s) for t, s in found for r in self.served)
            try:
                if engine is not svc.engine or self._conn is None:
                    with engine.connect() as conn:  # its '%' is no placeholder
                        hits = conn.exec_driver_sql(text, None, {"no_parameters": True}).all()
                else:  # on the LISTEN session, prepared: one server session keeps the plans and
                    self._conn.prepared_max = len(self._ids) // SWEEP + 2  # catalogue warm; a
                    hits = self._conn.execute(text, prepare=True).fetchall()  # plan per group
            except (SQLAlchemyError, psycopg.Error) as exc:  # the tenants' outage: warned, retried
                for tenant, role in ((t, r) for t, _ in found for r in self.served):
                    self.failed(role, tenant, exc)
                continue
            finally:
                if engine is not self.service.engine:  # not in use: disposed at the next tick
                    self._used.setdefault(engine, 0.0)
            for (hit,) in hits:
                role, _, tenant = hit.partition(":")
                self.mark(role, tenant)

    def _probe(self, role: str, tenant: str, schema: str) -> str:
        """The text of `tenant`'s probe for `role` (`_PROBES`), composed at its first sweep."""
        if (text := self._probes.get((role, tenant, schema))) is None:
            probe = _PROBES[role].format(
                tag=sql.Literal(f"{role}:{tenant}"), schema=sql.Identifier(schema)
            )
            text = self._probes[(role, tenant, schema)] = probe.as_string(None)
        return text

    def mark(self, role: str, tenant: str, delay: float = 0.0) -> None:
        """`tenant` has work for `role`: served after the tenants marked before it, and not
        before `delay` seconds."""
        with self._cond:
            if delay:
                self._later[(role, tenant)] = time.monotonic() + delay
            if (work := self._work.get(role)) is not None and tenant not in work:
                work[tenant] = None
                self._cond.notify()

    def take(self, role: str, stop: threading.Event) -> str | None:
        """The next tenant with work for `role` that is not backed off, waiting up to a tick."""
        deadline = time.monotonic() + _TICK
        with self._cond:
            while not stop.is_set():
                now = time.monotonic()
                for tenant in self._work[role]:
                    if self._later.get((role, tenant), 0.0) <= now:
                        del self._work[role][tenant]
                        return tenant
                if now >= deadline:
                    return None
                self._cond.wait(min(deadline - now, 0.1))
        return None

    def failed(self, role: str, tenant: str, exc: BaseException | None) -> None:
        """`tenant`'s database failed (`exc`): back it off, one warning per outage (`Backoff`);
        or it worked (None): its outage, if any, is over."""
        s, key = self.service.settings, (role, tenant)
        with self._cond:  # the hub's sweep and the fleet threads: one outage, one warning
            outage = self._outages.pop(key, None)
            if exc is None:
                self._later.pop(key, None)
                return outage.succeeded() if outage else None
            if outage is None:
                what = f"tenants fleet of {self.service.name}: {role} of tenant {tenant}"
                outage = _Later(s.reconnect_initial, s.reconnect_max, what=what, logger=log)
            self._outages[key] = outage
            outage.failed(f"database unavailable: {first_line(exc)}", threading.Event())
            self.mark(role, tenant, outage.retry_at - time.monotonic())

    def used(self, engine: Engine) -> None:
        """A tenant database's pool was used now (disposed after `IDLE` seconds without use)."""
        if engine is not self.service.engine:
            self._used[engine] = time.monotonic()


class Fleet:
    """One thread of the fleet: drains the tenants with work for `role`, each in turn."""

    def __init__(self, hub: Hub, role: str) -> None:
        self.hub, self.role, self.holder = hub, role, f"{hub.holder}/{role}"
        self._relays: dict[Service, Relay] = {}  # by tenant Service (a changed entry: another)
        #: Per database: this thread's worker connection (one liveness lock and claimant for all
        #: its schemas), the tenants' workers on it (the first opened it), its last use.
        self._open: dict[Engine, tuple[Any, dict[Service, Worker], float]] = {}

    def run(self, stop: threading.Event, *, on_started: Callable[[], None] | None = None) -> None:
        """Serve tenants until `stop` is set; the control database's outages are backed off."""
        s, name = self.hub.service.settings, self.hub.service.name
        what = f"tenants fleet of {name}: {self.role}"
        backoff = Backoff(s.reconnect_initial, s.reconnect_max, what=what, logger=log)
        if on_started:
            on_started()
        try:
            while not stop.is_set():
                tenant = self.hub.take(self.role, stop)
                try:
                    if tenant is not None:
                        self.serve(tenant)
                except UNAVAILABLE as exc:
                    if tenant is not None:
                        self.hub.mark(self.role, tenant)
                    backoff.failed(exc, stop)
                    continue
                backoff.succeeded()
                for engine, (*_, used) in list(self._open.items()):
                    if used < time.monotonic() - IDLE:
                        self._close(engine)
        finally:
            for engine in list(self._open):
                self._close(engine)

    def serve(self, tenant: str) -> None:
        """Drain `tenant` for up to `QUANTUM` batches under its lease. Raises what the control
        database or the broker raise; the tenant's database failing backs the tenant off."""
        try:
            t = self.hub.tenant(tenant)
        except ConfigurationError:
            return  # removed from the registry meanwhile
        if busy := self._lease(tenant):
            return self.hub.mark(self.role, tenant, busy)
        more = False
        self.hub.used(t.engine)  # not disposed meanwhile (and after: `finally`)
        try:
            more = self._drain(tenant, t)
            self.hub.failed(self.role, tenant, None)
        except _TENANT_DOWN as exc:
            self._close(t.engine, retire=False)
            self.hub.failed(self.role, tenant, exc)
        finally:
            self.hub.used(t.engine)
        if more:
            self.hub.mark(self.role, tenant)  # after the others with work

    def _lease(self, tenant: str) -> float:
        """Take `tenant`'s lease, or renew it once half has passed (released idle: `Hub._release`):
        0.0, or the seconds before another holder's lease passes (at least `BUSY`)."""
        svc, key, now = self.hub.service, (self.holder, tenant), time.monotonic()
        held = self.hub.leases.get(key, (0.0, 0.0))[0]
        if held - now > svc.settings.lease / 2:
            self.hub.leases[key] = (held, now)
            return 0.0
        leases = svc.tables.tenant_leases
        until = db_now() + timedelta(seconds=svc.settings.lease)
        row = {"service": svc.name, "role": self.role, "tenant": tenant}
        stmt = insert(leases).values(**row, holder=self.holder, locked_until=until)
        stmt = stmt.on_conflict_do_update(
            index_elements=list(row),
            set_={"holder": self.holder, "locked_until": until},
            where=(leases.c.locked_until < db_now()) | (leases.c.holder == self.holder),
        )
        with svc.engine.begin() as conn:
            if conn.execute(stmt.returning(leases.c.holder)).first() is not None:
                self.hub.leases[key] = (now + svc.settings.lease, now)
                return 0.0
            left = func.extract("epoch", leases.c.locked_until - db_now())
            found = select(left).where(*(leases.c[k] == v for k, v in row.items()))
            seconds = float(conn.execute(found).scalar() or 0.0)
        return max(seconds, BUSY)

    def _drain(self, tenant: str, t: Service) -> bool:
        """Up to `QUANTUM` batches of `tenant`; whether more may be waiting."""
        for n in range(QUANTUM):
            if n and self._lease(tenant):
                return False
            if self.role == RELAY:
                relay = self._relays.get(t) or self._relay(t)
                try:
                    if relay.relay_once() < t.settings.relay_batch_size:
                        return False
                finally:
                    relay._drop_publisher()  # back to the broker's pool
                continue
            worker, conn = self._worker(t)
            count = worker.work_once(conn)
            if (soonest := worker.retry_soonest) is not None:  # served then, not at the sweep
                with self.hub._cond:
                    heapq.heappush(self.hub._due, (time.monotonic() + soonest, WORKER, tenant))
                worker.retry_soonest = None
            if count < t.settings.worker_batch_size and not worker.claimed_next:
                return False
        if self.role == WORKER:
            self._worker(t)[0].give_back(self._worker(t)[1])  # the next turn claims them
        return True

    def _relay(self, t: Service) -> Relay:
        """A new relay of `t`, told the broker's size limit the others know (one probe for all)."""
        relay = t.relay()
        if known := next(iter(self._relays.values()), None):
            relay._limit_probed, relay._max_body = known._limit_probed, known._max_body
        return self._relays.setdefault(t, relay)

    def _worker(self, t: Service) -> tuple[Worker, Any]:
        """`t`'s worker on this thread's connection to `t`'s database, opened with its liveness
        lock if not open: the tenants of one database share it and its claimant."""
        conn, workers, _ = self._open.get(t.engine) or (None, {}, 0.0)
        worker = workers.get(t) or workers.setdefault(t, t.worker())
        worker.claims_after_short = False
        svc = self.hub.service
        if conn is None and t.engine is svc.engine and t._sessions_kept is None:
            svc._liveness_url()  # one probe of the database for all its schemas
            t._sessions_kept = svc._sessions_kept
        conn = conn or worker.connect()
        worker.claimant = next(iter(workers.values())).claimant
        self._open[t.engine] = (conn, workers, time.monotonic())
        return worker, conn

    def _close(self, engine: Engine, *, retire: bool = True) -> None:
        """Close this thread's connection to `engine`'s database (its claims free with its
        liveness lock), its tenants' workers retired."""
        conn, workers, _ = self._open.pop(engine, (None, {}, 0.0))
        if conn is not None:
            with contextlib.suppress(*_TENANT_DOWN), contextlib.closing(conn):
                for worker in workers.values() if retire else ():
                    worker.give_back(conn)
                    worker.retire(conn)
            next(iter(workers.values())).close_liveness()


def fleet_roles(service: Service, *, relay: bool, workers: int) -> list[tuple[str, Any]]:
    """The role threads serving the tenants of `service` beside its own relay and workers:
    the hub, one relay thread if `relay`, and `workers` worker threads. None without tenants,
    on SQLite, or for a role with nothing to serve."""
    if service._tenants is None or service.sqlite:
        return []
    if workers and service.handlers.any_async:
        log.warning("service %s: the tenants fleet runs no async handlers", service.name)
        workers = 0
    served = ((RELAY,) if relay else ()) + ((WORKER,) if workers else ())
    if not served:
        return []
    hub = Hub(service, served)
    threads: list[tuple[str, Any]] = [("tenants", hub.run)]
    if relay:
        threads.append(("tenants-relay", Fleet(hub, RELAY).run))
    threads += [(f"tenants-worker-{n}", Fleet(hub, WORKER).run) for n in range(workers)]
    return threads
