"""The checker of a faulty run: what was committed against what took effect, message by message. A
`History` records each transaction's expected effects (any hashable values) and what its commit
answered; `check` sorts every expected and found effect (a row written twice is found twice) into a
`Verdict`, as docs/testing.md ("The checker") says. Nothing here touches a server: the fault kit
(`outbox_inbox.testing.faultkit`) records the history and reads the effects."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

#: A transaction's commit returned.
OK = "ok"
#: Its commit raised: it may or may not have committed.
UNKNOWN = "unknown"
#: It failed before its commit, or was rolled back on purpose: it did not commit.
FAILED = "failed"
OUTCOMES = (OK, UNKNOWN, FAILED)


@dataclass
class Fault:
    """One injected fault: when it was in force, and how long everything took afterwards."""

    name: str
    began: float  # time.monotonic()
    over: float | None = None
    #: From `over` until every effect committed by then was found; None: not (yet) measured.
    recovered_s: float | None = None

    @property
    def seconds(self) -> float:
        """How long the fault lasted (0 for an instant one)."""
        return 0.0 if self.over is None else self.over - self.began


class History:
    """What a run did: each transaction's expected effects and outcome, and each fault.
    Thread-safe: writers record from their threads, faults from the test's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._effects: dict[str, list[tuple[float, tuple[Hashable, ...]]]] = {
            o: [] for o in OUTCOMES
        }
        self.faults: list[Fault] = []

    def record(self, expects: Iterable[Hashable], outcome: str) -> None:
        """One transaction: the effects it expects downstream, and its commit's `outcome`."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        with self._lock:
            self._effects[outcome].append((time.monotonic(), tuple(expects)))

    def expected(self, outcome: str = OK, *, until: float | None = None) -> set[Hashable]:
        """The effects of the transactions with `outcome`, recorded before `until` if given."""
        with self._lock:
            entries = [keys for at, keys in self._effects[outcome] if until is None or at <= until]
            return {key for keys in entries for key in keys}

    def transactions(self) -> list[tuple[str, tuple[Hashable, ...]]]:
        """Every transaction recorded: (outcome, expected effects)."""
        with self._lock:
            return [(o, keys) for o, entries in self._effects.items() for _, keys in entries]

    def count(self, outcome: str = OK) -> int:
        """How many transactions had `outcome`."""
        with self._lock:
            return len(self._effects[outcome])

    def begin_fault(self, name: str) -> Fault:
        """Record that the fault `name` is in force from now; `end_fault` when it is over."""
        fault = Fault(name, time.monotonic())
        with self._lock:
            self.faults.append(fault)
        return fault

    @staticmethod
    def end_fault(fault: Fault) -> None:
        fault.over = time.monotonic()

    def overlapped(self, fault: Fault) -> bool:
        """True when the load ran across `fault`: a transaction was recorded before its end
        and one committed after it."""
        if fault.over is None:
            return False
        with self._lock:
            before = any(at <= fault.over for e in self._effects.values() for at, _ in e)
            after = any(at > fault.over for at, _ in self._effects[OK])
        return before and after


@dataclass(frozen=True)
class Verdict:
    """The checker's result (each category: docs/testing.md, "The checker")."""

    transactions: dict[str, int]
    committed: int
    lost: frozenset[Hashable]
    duplicated: dict[Hashable, int]  # effect -> times found (2 or more)
    recovered: frozenset[Hashable]
    unexpected: frozenset[Hashable]
    unknown: int  # effects of transactions whose outcome was unknown, not found: not committed
    faults: tuple[Fault, ...] = field(default=())
    #: Why the run proves nothing, whatever it found (a fault outside the load, ...).
    refused: tuple[str, ...] = ()

    @property
    def valid(self) -> bool:
        """Not refused, and nothing lost, nothing duplicated, nothing unexpected."""
        return not (self.refused or self.lost or self.duplicated or self.unexpected)

    def report(self) -> str:
        """A few lines for a log or a test failure: the counts, examples, the recoveries."""

        def sample(keys: Iterable[Hashable]) -> str:
            shown = sorted(map(repr, keys))[:5]
            return f"  e.g. {', '.join(shown)}" if shown else ""

        tx = ", ".join(f"{n} {outcome}" for outcome, n in self.transactions.items())
        lines = [
            f"{'valid' if self.valid else 'INVALID'}: transactions {tx}",
            *(f"REFUSED: {reason}" for reason in self.refused),
            f"committed {self.committed}",
            f"lost {len(self.lost)}{sample(self.lost)}",
            f"duplicated {len(self.duplicated)}{sample(self.duplicated)}",
            f"recovered {len(self.recovered)}",
            f"unexpected {len(self.unexpected)}{sample(self.unexpected)}",
            f"unknown, not committed {self.unknown}",
        ]
        for fault in self.faults:
            took = "not measured" if fault.recovered_s is None else f"{fault.recovered_s:.1f} s"
            lines.append(f"fault {fault.name}: lasted {fault.seconds:.1f} s, recovered in {took}")
        return "\n".join(lines)


def check(history: History, effects: Iterable[Hashable]) -> Verdict:
    """Compare `history` with the `effects` found (one item per effect row written)."""
    found = Counter(effects)
    committed = history.expected(OK)
    maybe = history.expected(UNKNOWN) - committed
    return Verdict(
        transactions={outcome: history.count(outcome) for outcome in OUTCOMES},
        committed=len(committed),
        lost=frozenset(committed - found.keys()),
        duplicated={key: n for key, n in found.items() if n > 1},
        recovered=frozenset(maybe & found.keys()),
        unexpected=frozenset(found.keys() - committed - maybe),
        unknown=len(maybe - found.keys()),
        faults=tuple(history.faults),
        refused=tuple(
            f"fault {f.name} did not overlap the load (nothing written before its end, or"
            " nothing committed after it): inject it inside `with kit.load(...)`"
            for f in history.faults
            if not history.overlapped(f)
        ),
    )
