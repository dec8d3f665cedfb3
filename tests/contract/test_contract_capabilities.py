"""A third broker that lacks a feature passes the shipped contract, skipping exactly the cases
that need the feature, and fails the ones it claims but breaks."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

THIRD_BROKER = '''
from collections.abc import Iterator

import pytest

from outbox_inbox.brokers.memory import MemoryBroker
from outbox_inbox.errors import BrokerError
from outbox_inbox.testing.broker_contract import BrokerContract


class NoPriorityBroker(MemoryBroker):
    """A broker without priority queues: it refuses to declare one, as such a broker would."""

    def declare(self, topology):
        if any("x-max-priority" in queue.arguments for queue in topology.queues):
            raise BrokerError("priority queues are not supported")
        super().declare(topology)


class TestNoPriorityBroker(BrokerContract):
    unsupported = frozenset(UNSUPPORTED)

    @pytest.fixture
    def broker(self) -> Iterator[MemoryBroker]:
        with NoPriorityBroker() as broker:
            yield broker
'''


def _run(pytester: pytest.Pytester, unsupported: set[str]) -> pytest.RunResult:
    pytester.makepyfile(test_third_broker=THIRD_BROKER.replace("UNSUPPORTED", repr(unsupported)))
    return pytester.runpytest_subprocess("-v", "-rsf", "-p", "no:cacheprovider")


def test_a_broker_without_priority_queues_skips_exactly_the_priority_case(
    pytester: pytest.Pytester,
) -> None:
    result = _run(pytester, {"priority"})
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped") == 1, result.stdout.str()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("errors", 0) == 0, result.stdout.str()
    assert outcomes["passed"] >= 20
    result.stdout.fnmatch_lines(["*test_priority_queue_delivers_higher_priority_first SKIPPED*"])
    result.stdout.fnmatch_lines(["*the broker does not support priority*"])


def test_claiming_a_feature_the_broker_lacks_fails_its_case(pytester: pytest.Pytester) -> None:
    result = _run(pytester, set())
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 1, result.stdout.str()
    result.stdout.fnmatch_lines(["*test_priority_queue_delivers_higher_priority_first FAILED*"])
