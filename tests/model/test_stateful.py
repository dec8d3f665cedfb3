"""The model drives the code: a Hypothesis state machine over the real library (SQLite and the
in-memory broker) whose rules are the model's actions and whose invariants are the model's
(spec/outbox_inbox.qnt), checked on the real tables after every step.

Rules: a business transaction that writes commands to the service itself and commits or rolls
back; a relay pass and a receiver pass; a lost relay mark (the relay crashed after the broker's
confirm: the row is sent again, a duplicate on the wire); a worker pass, whose handler succeeds,
raises Retry, fails or rejects as each message's drawn plan says; the retry delays running out.
In-process the roles cannot be killed, so the crashes of the model other than the lost mark are
not driven here (the fault suites kill real processes).
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sqlalchemy import Column, Integer, MetaData, String, Table, select, update

from outbox_inbox import Reject, Retry, RetryPolicy, Service
from outbox_inbox.brokers.memory import MemoryBroker
from outbox_inbox.testing import ServiceHarness

COMMAND = "thing.do"
KEYS = ("k0", "k1")
OUTCOMES = ("fail", "ok", "retry", "reject")

metadata = MetaData()
business = Table("business", metadata, Column("n", Integer, primary_key=True))
effects = Table(
    "effects",
    metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("n", Integer, nullable=False),
    Column("key", String(8), nullable=False),
)


class Protocol(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = TemporaryDirectory()
        self.broker = MemoryBroker()
        self.service = Service(
            "billing",
            db_url=f"sqlite:///{Path(self.dir.name) / 'billing.db'}",
            broker=self.broker,
            retry=RetryPolicy(initial=60, max_attempts=3),  # retries wait for `retries_due`
        )
        self.plans: dict[int, list[str]] = {}
        self.calls: defaultdict[int, int] = defaultdict(int)
        self.keys: dict[int, str] = {}
        self.committed: set[int] = set()
        self.next_n = 0
        self.service.on_command(COMMAND)(self._handler)
        self.harness = ServiceHarness(self.service)
        metadata.create_all(self.service.engine)

    def _handler(self, message: Any, session: Any) -> None:
        n = int(message.payload["n"])
        plan = self.plans[n]
        outcome = plan[min(self.calls[n], len(plan) - 1)]
        self.calls[n] += 1
        session.execute(effects.insert().values(n=n, key=self.keys[n]))
        if outcome == "retry":
            raise Retry()
        if outcome == "fail":
            raise RuntimeError(f"message {n} fails")
        if outcome == "reject":
            raise Reject(f"message {n} is refused")

    def teardown(self) -> None:
        self.harness.close()
        self.service.close()
        self.broker.close()
        self.dir.cleanup()

    # ---- the model's actions -----------------------------------------------------------------

    @rule(
        key=st.sampled_from(KEYS),
        commit=st.sampled_from((True, True, False)),
        plans=st.lists(
            st.lists(st.sampled_from(OUTCOMES), min_size=1, max_size=3), min_size=1, max_size=3
        ),
    )
    def write(self, key: str, commit: bool, plans: list[list[str]]) -> None:
        """A business transaction writes its rows and a command for each (one to three of one
        key), then commits or rolls back."""
        with self.service.session() as session:
            session.begin()
            written = []
            for plan in plans:
                n = self.next_n
                self.next_n += 1
                self.plans[n] = plan
                self.keys[n] = key
                written.append(n)
                session.execute(business.insert().values(n=n))
                self.service.outbox.send(session, "billing", COMMAND, {"n": n}, key=key)
            if commit:
                session.commit()
                self.committed.update(written)
            else:
                session.rollback()

    @rule()
    def relay_and_receive(self) -> None:
        """The relay publishes what is due, the receiver stores what the queue holds."""
        self.harness.relay()
        self.harness.receive()

    @precondition(lambda self: self.committed)
    @rule(data=st.data())
    def lose_a_relay_mark(self, data: st.DataObject) -> None:
        """The relay crashed after the confirm, before its mark: the row goes out again."""
        o = self.service.tables.outbox
        with self.service.engine.begin() as conn:
            ids = conn.execute(select(o.c.id).where(o.c.published_at.is_not(None))).scalars().all()
            if ids:
                chosen = data.draw(st.sampled_from(sorted(ids)))
                conn.execute(update(o).where(o.c.id == chosen).values(published_at=None))

    @rule()
    def work(self) -> None:
        self.harness.work()

    @rule()
    def retries_due(self) -> None:
        self.harness.skip_delays()

    # ---- the model's invariants, on the real tables ------------------------------------------

    def _rows(self) -> tuple[dict[int, int], list[tuple[int, int, str]], dict[int, Any]]:
        i = self.service.tables.inbox
        with self.service.engine.connect() as conn:
            done = set(conn.execute(select(business.c.n)).scalars())
            ordered = conn.execute(select(effects).order_by(effects.c.seq))
            log = [(r.seq, r.n, r.key) for r in ordered]
            rows = {
                int(r.payload["n"]): r
                for r in conn.execute(
                    select(i.c.message_id, i.c.routing_key, i.c.payload, i.c.status)
                ).all()
                if r.routing_key == f"billing.{COMMAND}"
            }
        counts: dict[int, int] = defaultdict(int)
        for _, n, _ in log:
            counts[n] += 1
        assert done == self.committed, "the business rows are the committed transactions'"
        return counts, log, rows

    @invariant()
    def exactly_once_effect(self) -> None:
        counts, _, rows = self._rows()
        assert all(c <= 1 for c in counts.values()), counts
        for n, row in rows.items():
            if row.status == "processed":
                assert counts[n] == 1, (n, counts)

    @invariant()
    def no_effect_without_commit(self) -> None:
        counts, _, _ = self._rows()
        assert set(counts) <= self.committed

    @invariant()
    def key_order_of_effects(self) -> None:
        _, log, rows = self._rows()
        for _, n, key in log:
            for earlier in self.committed:
                if earlier < n and self.keys[earlier] == key:
                    assert earlier in rows and rows[earlier].status in ("processed", "dead"), (
                        f"message {n} had its effect before {earlier} of key {key} finished"
                    )

    @invariant()
    def dead_message_has_no_effect_and_its_fault(self) -> None:
        counts, _, rows = self._rows()
        dead = {n: row for n, row in rows.items() if row.status == "dead"}
        if not dead:
            return
        o = self.service.tables.outbox
        with self.service.engine.connect() as conn:
            causes = set(
                conn.execute(
                    select(o.c.causation_id).where(o.c.routing_key.like("billing.fault.%"))
                ).scalars()
            )
        for n, row in dead.items():
            assert counts[n] == 0, f"dead message {n} has an effect"
            assert str(uuid.UUID(str(row.message_id))) in causes, f"dead message {n} sent no fault"

    def check_liveness(self) -> None:
        """Once nothing more is injected, every committed message finishes."""
        self.harness.run_until_idle()
        _, _, rows = self._rows()
        for n in self.committed:
            assert n in rows and rows[n].status in ("processed", "dead"), (n, rows.get(n))


class ProtocolThenCalm(Protocol):
    def teardown(self) -> None:
        try:
            self.check_liveness()
            self.exactly_once_effect()
            self.key_order_of_effects()
            self.dead_message_has_no_effect_and_its_fault()
        finally:
            super().teardown()


# Derandomized: the same 40 sequences on every run, so a red run is red again; no shrinking,
# which takes minutes here (the failing sequence is printed as found).
ProtocolThenCalm.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestProtocolDrivenByTheModel = ProtocolThenCalm.TestCase
