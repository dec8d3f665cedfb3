"""Two services with messages flowing between them, and the measure of a fault's recovery.

``orders`` commits messages (a writer thread in the test process, half commands to billing and
half events billing subscribes to) and runs a relay; ``billing`` runs a receiver and a worker.
The three roles are separate ``tests/e2e/apps.py`` processes, with the library's default
settings (not apps.py's faster test settings): the bounds are those of a deployed service.

A test starts the flow, injects its fault between `fault_begins()` and `fault_over()`, and
calls `finish()`, which measures how long after the fault was over every message committed
before it, and then every one committed until its end, was handled; waits for the writer's
last message; and checks that every committed message had exactly one effect. The role
processes record their events (`EventLog`), and `finish` replays the run against the model
(replay.py): a step the model does not allow is a problem too. The test records the figures,
then fails on any problem found.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from e2e import apps
from e2e.harness import INBOX, OUTBOX, Database, Processes, queue_depth
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from outbox_inbox import Service
from outbox_inbox.config import Settings

from .replay import effects_by_message_id, read_run, replayed

_DEFAULTS = Settings()
#: The library's defaults for every setting apps.py would otherwise make faster.
DEFAULT_ROLE_SETTINGS: dict[str, Any] = {key: getattr(_DEFAULTS, key) for key in apps.FAST_SETTINGS}

#: Messages the writer commits in all, how many per second, and per transaction.
TOTAL = 2400
RATE = 150.0
PER_TRANSACTION = 15
#: Messages billing must have handled before a fault is injected: the flow is established.
FLOWING = 300
#: Every message committed before the fault, and until its end, must be handled this long
#: after it is over.
RECOVERY_BOUND = 15.0
#: How long a test keeps measuring past the bound, to report how late it was.
MEASURE_LIMIT = 60.0
#: How long the last messages may take after the writer's end (and the measure's).
DRAIN_LIMIT = 30.0
#: The log levels that count as a role's warnings about a fault.
WARNING_LEVELS = (" WARNING ", " ERROR ", " CRITICAL ")


class Writer(threading.Thread):
    """Commits TOTAL messages from orders at RATE a second, PER_TRANSACTION per transaction.

    A transaction that fails (the database is down or the connection was cut) is counted in
    `failed_commits` and written again, new message ids and all, after 0.2 s; only commits
    that returned are in `committed`. (A commit whose answer was lost may have committed all
    the same: the outbox table, not this list, says what was committed.)
    """

    def __init__(self, orders: Service, total: int = TOTAL, rate: float = RATE) -> None:
        super().__init__(name="faults-writer", daemon=True)
        self._orders = orders
        self._total = total
        self._interval = PER_TRANSACTION / rate
        self._lock = threading.Lock()
        self._committed: list[uuid.UUID] = []
        self._stopping = threading.Event()
        self.failed_commits = 0
        self.errors: list[str] = []
        self.crashed: BaseException | None = None
        self.started_at: float | None = None
        self.finished_at: float | None = None

    def committed(self) -> list[uuid.UUID]:
        """Ids of the messages whose transaction has committed so far."""
        with self._lock:
            return list(self._committed)

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        self.started_at = time.monotonic()
        next_at = self.started_at
        written = 0
        try:
            while written < self._total and not self._stopping.is_set():
                count = min(PER_TRANSACTION, self._total - written)
                try:
                    ids = self._write(written, count)
                except Exception as exc:  # the fault: this transaction did not (surely) commit
                    self.failed_commits += 1
                    if len(self.errors) < 20:
                        self.errors.append(str(exc).splitlines()[0] if str(exc) else repr(exc))
                    self._stopping.wait(0.2)
                    next_at = time.monotonic()
                    continue
                with self._lock:
                    self._committed.extend(ids)
                written += count
                next_at += self._interval
                now = time.monotonic()
                if next_at > now:
                    self._stopping.wait(next_at - now)
                else:  # behind: no burst to catch up, keep the rate from here
                    next_at = now
        except BaseException as exc:
            self.crashed = exc
        finally:
            self.finished_at = time.monotonic()

    def _write(self, first: int, count: int) -> list[uuid.UUID]:
        orders = self._orders
        ids: list[uuid.UUID] = []
        with orders.session() as session, session.begin():
            for seq in range(first, first + count):
                if seq % 2:
                    ids.append(orders.outbox.publish(session, "order.placed", {"seq": seq}))
                else:
                    ids.append(
                        orders.outbox.send(session, "billing", "invoice.create", {"seq": seq})
                    )
        return ids


@dataclass
class Recovery:
    """What one fault did to the flow; the figures the suite reports."""

    case: str
    fault_seconds: float = 0.0  # from the fault's injection to its end
    before_fault: int = 0  # messages committed before the fault
    during_fault: int = 0  # messages committed while it lasted
    handled_during_fault: int = 0  # of those, handled by its end (-1: could not be read)
    recovered_seconds: float | None = None  # fault over -> every pre-fault message handled
    caught_up_seconds: float | None = None  # fault over -> every message of the fault handled
    drained_seconds: float | None = None  # fault over -> every message handled
    total: int = 0
    lost: int = 0
    duplicates: int = 0
    writer_failed_commits: int = 0
    retried_publishes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        return {
            "fault_s": round(self.fault_seconds, 2),
            "recovered_s": _round(self.recovered_seconds),
            "caught_up_s": _round(self.caught_up_seconds),
            "drained_s": _round(self.drained_seconds),
            "before_fault": self.before_fault,
            "during_fault": self.during_fault,
            "handled_during_fault": self.handled_during_fault,
            "total": self.total,
            "lost": self.lost,
            "duplicates": self.duplicates,
            "writer_failed_commits": self.writer_failed_commits,
            "retried_publishes": self.retried_publishes,
            **self.extra,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


class TwoServices:
    """orders (writer + relay process) -> RabbitMQ -> billing (receiver and worker processes)."""

    def __init__(
        self,
        *,
        orders_url: str,
        billing_url: str,
        mq_url: str,
        make_service: Callable[..., Service],
        prepare_db: Callable[[str, str], Database],
        processes: Processes,
        settings: dict[str, Any] | None = None,
    ) -> None:
        self.settings = dict(settings or {})  # for both services, over the library's defaults
        self.orders_url = orders_url
        self.billing_url = billing_url
        self.mq_url = mq_url
        self._make_service = make_service
        self._prepare_db = prepare_db
        self.processes = processes
        self.orders_db: Database | None = None
        self.billing_db: Database | None = None
        self.writer: Writer | None = None
        self._fault_began: float | None = None
        self._fault_over: float | None = None
        self._before: list[uuid.UUID] = []
        self._by_over: list[uuid.UUID] = []
        self._handled_during = 0
        #: The role processes' event logs, replayed against the model by `finish`.
        self.events = processes.log_dir / f"events-{len(processes.started)}-{uuid.uuid4().hex[:8]}"

    @property
    def databases(self) -> list[str]:
        """Names of the two service databases."""
        return [str(make_url(url).database) for url in (self.orders_url, self.billing_url)]

    # -- the flow ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the three role processes and the writer; return once messages flow through."""
        self.orders_db = self._prepare_db("orders", self.orders_url)
        self.billing_db = self._prepare_db("billing", self.billing_url)
        orders = self._make_service("orders", self.orders_url, settings=self.settings)
        billing = self._make_service("billing", self.billing_url, settings=self.settings)
        # billing's queue and bindings exist before orders' relay publishes anything for it.
        orders.declare_topology()
        billing.declare_topology()
        settings = {**DEFAULT_ROLE_SETTINGS, **self.settings}
        self.events.mkdir()
        roles = (("relay", "orders", self.orders_url), ("receiver", "billing", self.billing_url))
        for role, service, url in (*roles, ("worker", "billing", self.billing_url)):
            self.processes.start(
                role, service=service, db_url=url, settings=settings, event_log=self.events
            )
        self.processes.wait_started()
        self.writer = Writer(orders)
        self.writer.start()
        self.processes.wait_until(
            lambda: self._count(self.billing_db, "SELECT count(*) FROM effects") >= FLOWING,
            timeout=60,
            what=f"billing to handle its first {FLOWING} messages",
        )

    def stop_writer(self) -> None:
        if self.writer is not None:
            self.writer.stop()
            self.writer.join(timeout=30)

    def fault_begins(self) -> None:
        """Call once the fault is in force (a server is down, a rule in place) or, for an
        instant fault, right before it: what is committed now is 'before the fault'."""
        assert self.writer is not None
        assert self.writer.is_alive(), "the writer ended before the fault: nothing would flow"
        self._before = self.writer.committed()
        self._fault_began = time.monotonic()

    def fault_over(self) -> None:
        """Call as soon as the server is back or the fault is removed."""
        assert self.writer is not None
        self._fault_over = time.monotonic()
        self._by_over = self.writer.committed()
        during = self._by_over[len(self._before) :]
        self._handled_during = self._handled(during) if during else 0

    # -- the roles' logs ---------------------------------------------------------------------------

    def log_sizes(self) -> dict[str, int]:
        """Where each role process's log ends now: `warned_more_than_once` reads from there."""
        return {p.name: p.log_path.stat().st_size for p in self.processes.started}

    def warned_more_than_once(self, since: dict[str, int], result: Recovery) -> None:
        """Add a problem for each role process that logged more than one warning, or any
        traceback, after the log sizes `since` (a worker role's log holds the lines of each
        worker process it runs, as ``worker[pid]``); keep each log's warnings in the figures."""
        for process in self.processes.started:
            with open(process.log_path, "rb") as log:
                log.seek(since[process.name])
                lines = log.read().decode(errors="replace").splitlines()
            warnings = [line for line in lines if any(level in line for level in WARNING_LEVELS)]
            result.extra[f"{process.name}_warnings"] = len(warnings)
            per_process = Counter(line.split()[2] for line in warnings)
            if max(per_process.values(), default=0) > 1 or any("Traceback" in x for x in lines):
                result.problems.append(
                    f"{process.name} logged {len(warnings)} warnings for one fault: {warnings[:4]}"
                )

    # -- probes that survive a database outage -------------------------------------------------

    @staticmethod
    def _count(db: Database | None, sql: str, **params: Any) -> int:
        """A count, or -1 while the database cannot answer (it is restarting, or the probe's
        pooled connections were cut: the engine drops them and reconnects on the next call)."""
        assert db is not None
        try:
            return int(db.scalar(sql, **params))
        except SQLAlchemyError:
            return -1

    def _handled(self, ids: list[uuid.UUID]) -> int:
        return self._count(
            self.billing_db, "SELECT count(*) FROM effects WHERE message_id = ANY(:ids)", ids=ids
        )

    # -- the measure ---------------------------------------------------------------------------

    def finish(self, case: str) -> Recovery:
        """Measure the recovery, let every message through, and check the effects.

        Returns the figures with `problems` filled in; the caller records them, then asserts
        that there are none."""
        assert self.writer is not None and self.billing_db and self.orders_db
        assert self._fault_began is not None and self._fault_over is not None
        over = self._fault_over
        result = Recovery(
            case=case,
            fault_seconds=over - self._fault_began,
            before_fault=len(self._before),
            during_fault=len(self._by_over) - len(self._before),
            handled_during_fault=self._handled_during,
        )

        # 1. Every message committed before the fault, then before its end: how long after it.
        # (The second set holds the first: it is only looked at once the first is done.)
        pending = [("recovered", self._before), ("caught_up", self._by_over)]
        deadline = over + MEASURE_LIMIT
        while pending and time.monotonic() < deadline:
            self.processes.check()
            name, ids = pending[0]
            if self._handled(ids) == len(ids):
                setattr(result, f"{name}_seconds", time.monotonic() - over)
                pending.pop(0)
                continue
            time.sleep(0.1)

        # 2. The writer's last messages, then every message in the outbox.
        self.writer.join(timeout=max(MEASURE_LIMIT - (time.monotonic() - over), 30))
        if self.writer.is_alive() or self.writer.crashed is not None:
            result.problems.append(f"the writer did not finish: {self.writer.crashed!r}")
            self.writer.stop()
            self.writer.join(timeout=10)
        drain_deadline = time.monotonic() + DRAIN_LIMIT
        outbox_count = "SELECT count(*) FROM " + OUTBOX
        while time.monotonic() < drain_deadline:
            self.processes.check()
            total = self._count(self.orders_db, outbox_count)
            if total > 0 and self._count(self.billing_db, "SELECT count(*) FROM effects") == total:
                result.drained_seconds = time.monotonic() - over
                break
            time.sleep(0.2)
        time.sleep(1.0)  # anything handled a second time would show up by now

        # 3. Lost, duplicated, or handled other than once.
        committed = {m for (m,) in self.orders_db.rows(f"SELECT message_id FROM {OUTBOX}")}
        effect_rows = [m for (m,) in self.billing_db.rows("SELECT message_id FROM effects")]
        effects = set(effect_rows)
        result.total = len(committed)
        result.lost = len(committed - effects)
        result.duplicates = len(effect_rows) - len(effects)
        result.writer_failed_commits = self.writer.failed_commits
        result.retried_publishes = self.orders_db.count(OUTBOX, "attempts > 0")
        inbox_states = sorted(
            tuple(row)
            for row in self.billing_db.rows(
                f"SELECT status, attempts, finished, count(*) FROM {INBOX} GROUP BY 1, 2, 3"
            )
        )
        result.extra["inbox_states"] = inbox_states
        problems = result.problems
        for seconds, count, when in (
            (result.recovered_seconds, len(self._before), "before the fault"),
            (result.caught_up_seconds, len(self._by_over), "before the fault was over"),
        ):
            if seconds is None or seconds > RECOVERY_BOUND:
                took = f"{seconds:.1f} s" if seconds is not None else "not within"
                problems.append(
                    f"the {count} messages committed {when} were handled {took} "
                    f"{'' if seconds is not None else f'{MEASURE_LIMIT:.0f} s '}after the fault "
                    f"was over (bound {RECOVERY_BOUND:.0f} s)"
                )
        if result.drained_seconds is None:
            problems.append(
                f"not every message was handled within {DRAIN_LIMIT:.0f} s of the writer's end "
                f"({len(effects)} effects of {len(committed)} committed)"
            )
        if result.lost:
            sample = sorted(map(str, committed - effects))[:5]
            problems.append(f"{result.lost} committed messages have no effect, e.g. {sample}")
        if effects - committed:
            problems.append(f"{len(effects - committed)} effects of messages nobody committed")
        if result.duplicates:
            problems.append(f"{result.duplicates} messages have more than one effect")
        missing = set(self.writer.committed()) - committed
        if missing:
            problems.append(f"{len(missing)} commits the writer saw succeed are not in the outbox")
        if self.orders_db.count(OUTBOX, "published_at IS NULL"):
            problems.append("outbox rows are still unpublished")
        # Each message was stored once and its handler ran to completion once: a second run
        # would have hit effects' unique key and counted a failed, finished attempt.
        not_once = [s for s in inbox_states if s[0] != "processed" or s[2] != 1]
        inbox_total = sum(s[3] for s in inbox_states)
        if not_once or inbox_total != len(committed):
            problems.append(
                f"inbox rows (status, attempts, finished, count): {inbox_states}, "
                f"for {len(committed)} committed messages"
            )
        dead_letters = queue_depth(self.mq_url, "billing.dead_letter")
        if dead_letters:
            problems.append(f"{dead_letters} messages in billing.dead_letter")

        # 4. The run replayed against the model.
        run = read_run(
            case,
            [case],
            self.events,
            producer_url=self.orders_url,
            consumer_url=self.billing_url,
            effects=effects_by_message_id(self.billing_url),
        )
        replay = replayed(run)
        result.extra["replayed_events"] = replay.events
        if not replay.conforms:
            problems.append(f"steps the model does not allow:\n{replay.report()}")
        return result
