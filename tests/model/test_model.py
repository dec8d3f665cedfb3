"""The Quint model of the protocol (spec/outbox_inbox.qnt) checked by its simulator.

- The model as built holds every named invariant over ``UNBROKEN_SAMPLES`` runs, and the premise
  of each invariant (a witness of the model) happens in at least 1 % of them: no invariant holds
  only because its case never came up.
- Each deliberate break of spec/breaks.qnt violates the invariant spec/README.md names for it,
  found by the same simulator with the same seed and run length, checking that invariant alone
  (a break often violates others too, sometimes first; Quint stops at the first violation, so a
  break costs only the runs until then).

The runs are seeded, so a result is the same on every machine with the pinned Quint.
"""

from __future__ import annotations

import pytest

from model.quint import QUINT, simulate

SEED = 0x42
STEPS = 180
UNBROKEN_SAMPLES = 600
BREAK_SAMPLES = 600

# premise witness -> the invariant whose premise it is
WITNESSES = {
    "W_processed": "ExactlyOnceEffect",
    "W_duplicateAbsorbed": "ExactlyOnceEffect",
    "W_effect": "NoEffectWithoutCommit",
    "W_keyFollower": "KeyOrderOfEffects",
    "W_dead": "DeadMessageHasNoEffectAndItsFault",
    "W_twoHolding": "NothingClaimedByTwoLiveWorkers",
    "W_dropped": "NothingDroppedInsideDuplicateWindow",
    "W_quiescent": "BoundedLiveness",
    "W_faulted": "(faults injected)",
}

# break -> the invariant it must violate (spec/README.md, "The breaks")
BREAKS = {
    "mark_before_handler": "ExactlyOnceEffect",
    "claim_without_skip_locked": "NothingClaimedByTwoLiveWorkers",
    "redelivery_counter_after_decode": "BoundedLiveness",
    "no_liveness_lock": "NothingClaimedByTwoLiveWorkers",
    "ack_before_commit": "BoundedLiveness",
    "effect_outside_mark_txn": "ExactlyOnceEffect",
    "attempts_in_handler_txn": "BoundedLiveness",
    "no_inbox_dedup": "ExactlyOnceEffect",
    "mark_before_confirm": "BoundedLiveness",
    "library_commits_caller_txn": "NoEffectWithoutCommit",
    "async_replication": "NoEffectWithoutCommit",
    "retention_shorter_than_window": "NothingDroppedInsideDuplicateWindow",
    "no_key_hold": "KeyOrderOfEffects",
    "retry_wait_releases_key": "KeyOrderOfEffects",
    "relay_ignores_key_order": "KeyOrderOfEffects",
    "fault_after_dead_mark": "DeadMessageHasNoEffectAndItsFault",
    "reject_keeps_effects": "DeadMessageHasNoEffectAndItsFault",
    "no_claimant_check_at_lock": "ExactlyOnceEffect",
    "drop_head_overflow": "BoundedLiveness",
}


@pytest.fixture(scope="module", autouse=True)
def _quint_installed() -> None:
    if not QUINT.exists():
        pytest.fail(f"{QUINT} is missing: scripts/test installs it (npm ci in spec/)")


def test_the_model_as_built_holds_every_invariant_and_each_premise_happens() -> None:
    report = simulate(
        "none", samples=UNBROKEN_SAMPLES, steps=STEPS, seed=SEED, witnesses=tuple(WITNESSES)
    )
    print(
        f"none: {report.explored} runs of {report.min_length - 1} steps in {report.seconds:.0f} s;"
        f" premises: {report.witnessed}"
    )
    assert report.ok, f"violated {report.violated}:\n{report.output[-4000:]}"
    assert report.explored == UNBROKEN_SAMPLES
    assert report.min_length > STEPS  # every run went the whole length (states = steps + 1)
    rare = {
        name: count for name, count in report.witnessed.items() if count < 0.01 * report.explored
    }
    assert not rare, f"premises in under 1 % of the runs: {rare}"
    assert set(report.witnessed) == set(WITNESSES)


@pytest.mark.parametrize(("config", "invariant"), BREAKS.items(), ids=list(BREAKS))
def test_each_break_violates_its_named_invariant(config: str, invariant: str) -> None:
    report = simulate(
        config, samples=BREAK_SAMPLES, steps=STEPS, seed=SEED, invariants=(invariant,)
    )
    print(f"{config}: violated {sorted(report.violated)} in {report.seconds:.0f} s")
    assert not report.ok, f"{config} passed {BREAK_SAMPLES} runs"
    assert invariant in report.violated, f"{config} violated {report.violated}, not {invariant}"
