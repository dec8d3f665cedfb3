"""The shipped contract asks for what the library's topology declares and nothing more: a third
broker that refuses everything else passes it whole. One that lacks a feature skips exactly
the cases needing it, and fails the ones it claims but breaks."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

THIRD_BROKER = '''
from collections.abc import Iterator

import pytest

from outbox_inbox.brokers.memory import MemoryBroker
from outbox_inbox.errors import BrokerError
from outbox_inbox.testing.broker_contract import BrokerContract
from outbox_inbox.topology import RETRY_EXCHANGE, service_topology

#: Everything `service_topology` can declare, with every option on.
DECLARED = [
    service_topology(
        "x", ["#"], delay_tiers=(1,), queue_type=kind, delivery_limit=2, max_length=5,
        max_priority=3,
    )
    for kind in ("classic", "quorum")
]
EXCHANGE_TYPES = {e.type for t in DECLARED for e in t.exchanges}
MODES = ("x-overflow", "x-queue-type", "x-dead-letter-exchange", "x-dead-letter-strategy")
QUEUES = [q for t in DECLARED for q in t.queues]
VALUES = {m: {q.arguments[m] for q in QUEUES if m in q.arguments} for m in MODES}


class TopologyOnlyBroker(MemoryBroker):
    """Refuses every mode the topology never declares: other exchange types, overflow modes,
    queue types and dead-letter exchanges, drop-head (a length limit with no overflow mode),
    and a TTL anywhere but a delay tier (dead-lettering to `retry`)."""

    def declare(self, topology):
        for exchange in topology.exchanges:
            if exchange.type not in EXCHANGE_TYPES:
                raise BrokerError(f"no {exchange.type} exchanges")
        for queue in topology.queues:
            args = queue.arguments
            for mode in MODES:
                if mode in args and args[mode] not in VALUES[mode]:
                    raise BrokerError(f"no {mode} {args[mode]!r}")
            if "x-max-length" in args and "x-overflow" not in args:
                raise BrokerError("no drop-head")
            if "x-message-ttl" in args and args.get("x-dead-letter-exchange") != RETRY_EXCHANGE:
                raise BrokerError("a TTL only on a delay tier")
        super().declare(topology)


class NoPriorityBroker(TopologyOnlyBroker):
    """Without priority queues either: it refuses to declare one, as such a broker would."""

    def declare(self, topology):
        if any("x-max-priority" in queue.arguments for queue in topology.queues):
            raise BrokerError("priority queues are not supported")
        super().declare(topology)


class TestThirdBroker(BrokerContract):
    unsupported = frozenset(UNSUPPORTED)

    @pytest.fixture
    def broker(self) -> Iterator[MemoryBroker]:
        with BROKER() as broker:
            yield broker
'''


def _run(pytester: pytest.Pytester, broker: str, unsupported: set[str]) -> pytest.RunResult:
    source = THIRD_BROKER.replace("UNSUPPORTED", repr(unsupported)).replace("BROKER", broker)
    pytester.makepyfile(test_third_broker=source)
    return pytester.runpytest_subprocess("-v", "-rsf", "-p", "no:cacheprovider")


def test_a_broker_with_only_what_the_topology_declares_passes_the_whole_contract(
    pytester: pytest.Pytester,
) -> None:
    result = _run(pytester, "TopologyOnlyBroker", set())
    outcomes = result.parseoutcomes()
    assert set(outcomes) == {"passed"}, result.stdout.str()
    assert outcomes["passed"] >= 25


def test_a_broker_without_priority_queues_skips_exactly_the_priority_case(
    pytester: pytest.Pytester,
) -> None:
    result = _run(pytester, "NoPriorityBroker", {"priority"})
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped") == 1, result.stdout.str()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("errors", 0) == 0, result.stdout.str()
    assert outcomes["passed"] >= 25
    result.stdout.fnmatch_lines(["*test_priority_queue_delivers_higher_priority_first SKIPPED*"])
    result.stdout.fnmatch_lines(["*the broker does not support priority*"])


def test_claiming_a_feature_the_broker_lacks_fails_its_case(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "NoPriorityBroker", set())
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 1, result.stdout.str()
    result.stdout.fnmatch_lines(["*test_priority_queue_delivers_higher_priority_first FAILED*"])
