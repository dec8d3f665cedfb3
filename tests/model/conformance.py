"""The fault suites' recorded runs, replayed against the model (spec/outbox_inbox.qnt).

A run is what the real role processes of one fault test did: the events their `Listener` hooks
wrote (`EventLog` of tests/e2e/apps.py, one JSON line per event), and what the tables hold
once the run is over. `check` maps each message's events to the model's steps and returns every
step the model does not allow, by rule; `RULES` names the Quint action or invariant each rule
mirrors. spec/README.md ("Fault runs replayed") says what is recorded, what is derived from the
tables, and what is not checked.

The events of one process are in the order it wrote them. Across processes they are ordered by
`time.monotonic_ns()` (one clock for every process of the host) only where the database orders
them: a handler runs while its worker holds the row lock, so two runs of one message, or a run
and another worker's commit, cannot overlap. The receiver's ``stored`` hook and the worker's
claim both follow the insert's commit and are not ordered: a handler run is checked against
the stored row, not against the time of that hook.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

# Events, by the hook that writes them (tests/e2e/apps.py, EventLog):
CONFIRMED = "confirmed"  # relay_confirmed: the relay published it; detail: the broker's outcome
MARKED = "marked"  # relay_committed: its outbox row marked published and committed
STORED = "stored"  # stored: the receiver committed its inbox row
RAN = "ran"  # handler_ran: its handlers ran (in the worker's open transaction); detail: ok | error
PROCESSED = "processed"  # handled: the worker's transaction committed it processed
RETRY = "retry"  # failed(dead=False): a failure recorded, to be retried
DEAD = "dead"  # failed(dead=True): marked dead by its handler's failure

#: A worker's dead reasons (`Listener.dead`); those only a handler's failure gives (its `DEAD`
#: event, `failed(dead=True)`), and the claim's own (no handler ran in that claim).
DEAD_REASONS = frozenset(
    [
        "rejected",
        "max_attempts",
        "abandoned",
        "interrupted",
        "expired",
        "no_handler",
        "payload_missing",
    ]
)
AFTER_FAILURE = frozenset(("rejected", "max_attempts"))

#: The worker's events: a run, and the outcomes that end it.
WORK = (RAN, PROCESSED, RETRY, DEAD)
#: Publish outcomes after which the relay marks a row published (`PublishOutcome`).
SENT = ("confirmed", "returned")

#: What each kind of fault may leave unfinished: ``kill`` (a role process SIGKILLed: its last
#: steps had no sequel) and ``session`` (database sessions cut or the server gone: a commit or
#: its answer lost, claims given back uncounted).
FAULT_KINDS: dict[str, frozenset[str]] = {
    name: frozenset(kinds.split())
    for name, kinds in {
        # the fault kit's faults (outbox_inbox.testing.faultkit.FAULTS)
        "kill": "kill",
        "postgres-restart": "session",
        "rabbitmq-restart": "",
        "terminate-sessions": "session",
        "memory-alarm": "",
        "disk-alarm": "",
        "disk-full": "session",
        "blackhole": "session",
        "duplicate": "",
        "clock-skew": "",
        # the cases of tests/faults (flow.TwoServices.finish)
        "rabbitmq-sigkill": "",
        "postgres-immediate-stop": "session",
        "pg-terminate-backend": "session",
        "rabbitmq-memory-alarm": "",
        "rabbitmq-disk-alarm": "",
        "rabbitmq-blackhole": "",
        "postgres-failover": "session",
        "standby-in-host-list": "session",
        "postgres-disk-full": "session",
        "handlers-table-disk-full": "session",
        "postgres-partition": "session",
        # tests/cluster (flow.TwoServices.finish too)
        "cluster-node-sigkill": "",
    }.items()
}

#: rule -> (the Quint action or invariant of spec/outbox_inbox.qnt it mirrors, what it says)
RULES: dict[str, tuple[str, str]] = {
    "only-committed-leave": (
        "commitTx, relayClaim",
        "the relay publishes, and the inbox stores, only messages whose outbox row committed",
    ),
    "no-effect-without-commit": (
        "NoEffectWithoutCommit",
        "an effect only for a message whose business transaction committed",
    ),
    "marked-after-confirm": (
        "relayMark (break mark_before_confirm)",
        "a relay marks a row published only after the broker confirmed it to that relay",
    ),
    "stored-once": (
        "store (INSERT ON CONFLICT DO NOTHING; break no_inbox_dedup)",
        "a message is stored once, and only after a relay published it",
    ),
    "run-after-stored": (
        "claim, lock, handle",
        "a handler runs only for a stored message",
    ),
    "claim-counted": (
        "claim (break attempts_in_handler_txn)",
        "each claim a handler ran under was counted in attempts before it ran",
    ),
    "one-holder": (
        "lock, NothingClaimedByTwoLiveWorkers",
        "no other process runs a message between a worker's run of it and that run's outcome",
    ),
    "no-run-after-processed": (
        "lock (mine: pending and still its own), ExactlyOnceEffect",
        "a message is committed processed once, and no handler runs it after that",
    ),
    "exactly-once-effect": (
        "commitWork, ExactlyOnceEffect",
        "at most one effect; a processed message has exactly one",
    ),
    "dead-has-no-effect": (
        "markDead, DeadMessageHasNoEffectAndItsFault",
        "a dead message has no effect",
    ),
    "dead-sends-its-fault": (
        "markDead, DeadMessageHasNoEffectAndItsFault",
        "a command that ends dead sends its sender one fault, and no other message sends one",
    ),
    "dead-once": (
        "markDead (status dead, never claimed again)",
        "a message is marked dead once, never also processed, and no handler runs it after",
    ),
    "dead-reason": (
        "commitWork (reject, attempts >= MAX_ATTEMPTS), claim (abandoned: ABANDON_AFTER)",
        "a dead row's reason is a worker's and matches its counts: max_attempts after that"
        " many counted attempts, abandoned after abandon_after unfinished claims, rejected and"
        " max_attempts after a handler failed",
    ),
    "dead-lettered": (
        "countDelivery (count > MAX_REDELIVERIES: dlq)",
        "the receiver dead-letters a message only past max_redeliveries counted deliveries,"
        " and a message it dead-lettered and never stored has no effect and no run",
    ),
    "dropped-finished": (
        "dropPartition (droppable: processed or dead)",
        "retention drops a message's inbox row only after it finished, and nothing runs it after",
    ),
    "dropped-outside-window": (
        "dropPartition, NothingDroppedInsideDuplicateWindow (windowPassed)",
        "retention drops a message's inbox row only once its outbox row was marked and no"
        " copy of it was on its way: none confirmed or stored after the drop",
    ),
    "key-order": (
        "relayEligible, claimable (per-key hold), KeyOrderOfEffects",
        "a message runs only after every earlier message of its key finished",
    ),
    "run-ends": (
        "commitWork, workerCrash, tick (session ended)",
        "a handler run ends in a commit or a recorded failure, unless its process was killed"
        " or its session cut by the fault",
    ),
    "finished": (
        "BoundedLiveness",
        "once the run is over, every committed message is processed or dead",
    ),
}


@dataclass(frozen=True)
class Event:
    """One line of an event log."""

    t: int  # time.monotonic_ns() when written
    pid: int
    event: str
    message: str
    detail: str = ""


@dataclass
class Message:
    """What the tables say of one message once the run is over."""

    order: int  # its producer's outbox id: a key's commit order
    key: str | None = None
    committed: bool = True  # its business transaction committed
    published: bool = True  # its outbox row is marked published
    status: str | None = None  # its inbox row's status; None: no inbox row
    attempts: int = 0
    finished: int = 0
    effects: int = 0
    command: bool = True  # a command (a dead one sends a fault), not an event
    faults: int = 0  # the faults of it the consumer wrote to its outbox
    dead_reason: str | None = None  # its inbox row's, when dead
    deliveries: int = 0  # the receiver's count of its redelivered copies (inbox_deliveries)
    dead_lettered: int = 0  # its copies the receiver sent to the dead-letter queue
    dropped: int | None = None  # when (the events' clock) retention dropped its inbox row


@dataclass
class Run:
    """One fault test's run: the faults injected, the tables' messages, the events."""

    name: str
    faults: tuple[str, ...]
    messages: dict[str, Message]
    events: list[Event]
    #: The consumer's settings the dead reasons are checked against (None: not known).
    max_attempts: int | None = None
    abandon_after: int | None = None
    max_redeliveries: int | None = None

    def kinds(self) -> frozenset[str]:
        """What the run's faults may leave unfinished (`FAULT_KINDS`)."""
        unknown = [f for f in self.faults if f not in FAULT_KINDS]
        if unknown:
            raise ValueError(f"faults not in FAULT_KINDS: {unknown}")
        return frozenset().union(*(FAULT_KINDS[f] for f in self.faults))


@dataclass
class Replay:
    """The verdict on one run: violations by rule, and how often each rule's premise came up."""

    run: str
    faults: tuple[str, ...]
    messages: int
    events: int
    violations: list[tuple[str, str]] = field(default_factory=list)
    premises: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    broken: bool = False  # a buggy service's run, expected to be rejected

    @property
    def conforms(self) -> bool:
        return not self.violations

    @property
    def counts(self) -> bool:
        """Whether the run counts toward coverage: a fault was injected in it."""
        return bool(self.faults)

    def report(self, limit: int = 10) -> str:
        head = f"{self.run}: {self.messages} messages, {self.events} events, faults {self.faults}"
        lines = [f"  {rule} ({RULES[rule][0]}): {what}" for rule, what in self.violations[:limit]]
        more = len(self.violations) - limit
        return "\n".join([head, *lines, *([f"  ... {more} more"] if more > 0 else [])])


def read_events(directory: Path) -> list[Event]:
    """Every event of the logs in `directory` (``*.jsonl``), in time order. A line cut by a
    SIGKILL (no newline at its end) is left out."""
    events = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().split("\n")[:-1]:
            raw = json.loads(line)
            events.append(Event(raw["t"], raw["pid"], raw["e"], raw["m"], raw.get("x", "")))
    return sorted(events, key=lambda e: e.t)


def check(run: Run) -> Replay:
    """Map each message's events to the model's steps; every step it does not allow is a
    violation of the rule (`RULES`) that says so."""
    kinds = run.kinds()
    replay = Replay(run.name, run.faults, len(run.messages), len(run.events))
    bad, seen = replay.violations.append, replay.premises
    by_message: dict[str, list[Event]] = defaultdict(list)
    for event in run.events:
        by_message[event.message].append(event)
    # when each process last ended a transaction of its worker: a run after that had no sequel
    last_outcome = {e.pid: e.t for e in run.events if e.event in (PROCESSED, RETRY, DEAD)}

    for mid, events in by_message.items():
        if mid not in run.messages:
            bad(("only-committed-leave", f"{mid}: {events[0].event} with no outbox row"))
    for mid, m in run.messages.items():
        events = by_message.get(mid, [])
        kind = [e.event for e in events]
        runs = [e for e in events if e.event == RAN]
        # a row retention dropped: its status when it went, by the events
        status = m.status
        if m.dropped is not None and status is None:
            status = DEAD if DEAD in kind else PROCESSED if PROCESSED in kind else None

        if m.effects and not m.committed:
            bad(("no-effect-without-commit", f"{mid}: {m.effects} effects, rolled back"))
        if not m.committed:
            seen["no-effect-without-commit"] += 1

        confirmed_by = {e.pid for e in events if e.event == CONFIRMED and e.detail in SENT}
        for e in events:
            if e.event == MARKED and e.pid not in confirmed_by:
                bad(("marked-after-confirm", f"{mid}: marked by {e.pid}, not confirmed to it"))
        if m.published and not confirmed_by:
            bad(("marked-after-confirm", f"{mid}: published, never confirmed to a relay"))
        seen["marked-after-confirm"] += kind.count(CONFIRMED) > 1

        stores = kind.count(STORED)
        if stores > 1:
            bad(("stored-once", f"{mid}: stored {stores} times"))
        if stores and CONFIRMED not in kind:
            bad(("stored-once", f"{mid}: stored, never published by a relay"))
        if status is not None and not stores and not kinds & {"kill", "session"}:
            bad(("stored-once", f"{mid}: an inbox row, no stored event, no fault to lose it"))

        if runs and status is None:
            bad(("run-after-stored", f"{mid}: its handler ran, no inbox row"))
        if runs and not stores and not kinds & {"kill", "session"}:
            bad(("run-after-stored", f"{mid}: its handler ran, never stored"))

        # Claims: runs in one process with no outcome between them are one claim (a failed
        # batch is run again message by message under the same claim). Each was counted
        # before its run; where sessions were cut, a claim the worker gave back (its process
        # alive, no commit) is uncounted again: only those committed processed, and those of
        # a process that died (killed by the fault, no outcome after), are sure to be counted.
        claims: list[tuple[Event, str]] = []
        holding: dict[int, int] = {}  # process -> its open claim
        for e in events:
            if e.event == RAN and e.pid not in holding:
                holding[e.pid] = len(claims)
                claims.append((e, ""))
            elif e.event in (PROCESSED, RETRY, DEAD) and e.pid in holding:
                i = holding.pop(e.pid)
                claims[i] = (claims[i][0], e.event)
        sure = [
            (first, end)
            for first, end in claims
            if "session" not in kinds
            or end == PROCESSED
            or (not end and "kill" in kinds and last_outcome.get(first.pid, -1) < first.t)
        ]
        seen["claim-counted"] += len(sure) > 1
        if len(sure) > m.attempts:
            bad(("claim-counted", f"{mid}: {len(sure)} claims ran, {m.attempts} attempts counted"))

        for i, e in enumerate(events):
            if e.event != RAN:
                continue
            sequel = next((x for x in events[i + 1 :] if x.pid == e.pid and x.event in WORK), None)
            if sequel is not None and sequel.event != RAN:
                between = [x for x in runs if e.t < x.t < sequel.t and x.pid != e.pid]
                if between:
                    bad(("one-holder", f"{mid}: run by {between[0].pid} while {e.pid} held it"))
            if sequel is None:  # no outcome and no run again in this process
                killed = "kill" in kinds and last_outcome.get(e.pid, -1) < e.t
                if not (killed or "session" in kinds):
                    bad(("run-ends", f"{mid}: a run by {e.pid} neither committed nor failed"))
                seen["run-ends"] += 1
        seen["one-holder"] += len({e.pid for e in runs}) > 1

        processed = [e for e in events if e.event == PROCESSED]
        if len(processed) > 1:
            bad(("no-run-after-processed", f"{mid}: committed processed {len(processed)} times"))
        if processed and any(e.t > processed[0].t for e in runs):
            bad(("no-run-after-processed", f"{mid}: its handler ran after it was processed"))
        seen["no-run-after-processed"] += bool(processed) and len(runs) > 1

        if m.effects > 1:
            bad(("exactly-once-effect", f"{mid}: {m.effects} effects"))
        if status == "processed" and m.effects != 1:
            bad(("exactly-once-effect", f"{mid}: processed with {m.effects} effects"))
        if processed and status != "processed":
            bad(("exactly-once-effect", f"{mid}: committed processed, the row is {status}"))
        seen["exactly-once-effect"] += status == "processed" and (stores > 1 or len(runs) > 1)
        if status == "dead":
            seen["dead-has-no-effect"] += 1
            if m.effects:
                bad(("dead-has-no-effect", f"{mid}: dead with {m.effects} effects"))
        due = int(status == "dead" and m.command)
        seen["dead-sends-its-fault"] += due
        if m.faults != due:
            bad(("dead-sends-its-fault", f"{mid}: {m.status}, {m.faults} faults written"))
        _check_dead_ends(run, mid, m, events, bad, seen)
        ended = m.status in ("processed", "dead") or m.dropped is not None or m.dead_lettered
        if m.committed and not ended:
            bad(("finished", f"{mid}: committed, its inbox row is {m.status or 'missing'}"))

    _check_key_order(run, by_message, bad, seen)
    return replay


def _check_dead_ends(
    run: Run,
    mid: str,
    m: Message,
    events: list[Event],
    bad: Callable[[tuple[str, str]], None],
    seen: dict[str, int],
) -> None:
    """The dead mark, the receiver's dead-lettering and retention's drop of one message."""
    kinds = run.kinds()
    dead = [e for e in events if e.event == DEAD]
    runs = [e for e in events if e.event == RAN]
    if len(dead) > 1:
        bad(("dead-once", f"{mid}: marked dead {len(dead)} times"))
    if dead and any(e.event == PROCESSED for e in events):
        bad(("dead-once", f"{mid}: marked dead and committed processed"))
    if dead and any(e.t > dead[0].t for e in runs):
        bad(("dead-once", f"{mid}: its handler ran after its dead mark"))
    seen["dead-once"] += bool(dead)

    if m.status == "dead":
        reason, unfinished = m.dead_reason, m.attempts - m.finished
        seen["dead-reason"] += 1
        if reason not in DEAD_REASONS:
            bad(("dead-reason", f"{mid}: dead for {reason!r}, not a worker's reason"))
        if reason == "max_attempts" and run.max_attempts and m.attempts < run.max_attempts:
            bad(("dead-reason", f"{mid}: max_attempts after {m.attempts} attempts"))
        if reason == "abandoned" and run.abandon_after and unfinished < run.abandon_after:
            bad(("dead-reason", f"{mid}: abandoned after {unfinished} unfinished claims"))
        if reason in AFTER_FAILURE and not dead and not kinds & {"kill", "session"}:
            bad(("dead-reason", f"{mid}: {reason}, no handler failure recorded"))

    if m.dead_lettered:
        seen["dead-lettered"] += 1
        limit = run.max_redeliveries
        if limit is not None and m.deliveries <= limit:
            bad(("dead-lettered", f"{mid}: dead-lettered after {m.deliveries} deliveries"))
        if m.status is None and m.dropped is None and (m.effects or runs):
            bad(("dead-lettered", f"{mid}: dead-lettered, never stored, {len(runs)} runs"))

    if m.dropped is not None:
        seen["dropped-finished"] += 1
        ends = [e.t for e in events if e.event in (PROCESSED, DEAD)]
        if not ends or min(ends) > m.dropped:
            bad(("dropped-finished", f"{mid}: its inbox row dropped unfinished"))
        if any(e.t > m.dropped for e in runs):
            bad(("dropped-finished", f"{mid}: its handler ran after its row was dropped"))
        marks = [e.t for e in events if e.event == MARKED]
        late = [e for e in events if e.event in (CONFIRMED, STORED) and e.t > m.dropped]
        if not marks or min(marks) > m.dropped or late:
            what = f"a copy {late[0].event} after" if late else "not marked before"
            bad(("dropped-outside-window", f"{mid}: its inbox row dropped, {what}"))
        seen["dropped-outside-window"] += 1


def _check_key_order(
    run: Run,
    by_message: dict[str, list[Event]],
    bad: Callable[[tuple[str, str]], None],
    seen: dict[str, int],
) -> None:
    """KeyOrderOfEffects: each run of a message comes after the last run (or the dead mark) of
    every earlier committed message of its key that has an inbox row."""
    keys: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for mid, m in run.messages.items():
        if m.key is not None and m.committed and (m.status or m.dropped) is not None:
            keys[m.key].append((m.order, mid))
    for members in keys.values():
        members.sort()
        finished_at = -1  # when every earlier message of the key had finished
        for _, mid in members:
            events = by_message.get(mid, [])
            runs = [e.t for e in events if e.event == RAN]
            early = [t for t in runs if t < finished_at]
            if early:
                bad(("key-order", f"{mid}: ran before an earlier message of its key finished"))
            if runs and finished_at >= 0:
                seen["key-order"] += 1
            ends = [e.t for e in events if e.event in (RAN, DEAD)]
            finished_at = max([finished_at, *ends])


def conforming(replays: Iterable[Replay]) -> tuple[int, int]:
    """(runs of a correct service with a fault injected, of those the conforming ones)."""
    counted = [r for r in replays if r.counts and not r.broken]
    return len(counted), sum(r.conforms for r in counted)
