"""The Quint model of the protocol (spec/outbox_inbox.qnt) checked by its simulator.

- The model as built holds every named invariant over ``LONG_RUNS`` runs of ``LONG_STEPS``
  steps (seeded chunks, so that both CPUs can share them) and over ``DEEP_RUNS`` runs of
  ``STEPS`` steps, long enough for ``BoundedLiveness``'s bound on the calm phase; the premise of
  each invariant (a witness of the model) happens in at least 1 % of the runs of each: no
  invariant holds only because its case never came up.
- Each deliberate break of spec/breaks.qnt violates the invariant spec/README.md names for it,
  within ``LONG_RUNS`` runs of ``STEPS`` steps, checking that invariant alone (a break often
  violates others too, sometimes first; Quint stops at the first violation, so a break costs
  only the runs until then).

The simulations start in the background when the session's tests are collected (conftest.py)
and these tests, run last, read their reports. The runs are seeded, so a result is the same on
every machine with the pinned Quint; a violation's report names the invariant and the seed that
replays it.
"""

from __future__ import annotations

import time

import pytest

from model.quint import QUINT, Background, Job, Report, rare_premises

SEED = 0x42
STEPS = 180
DEEP_RUNS = 600
LONG_RUNS = 10_000
LONG_STEPS = 50
CHUNKS = 4
# How long a test waits for its reports (the whole background work is about 7 min of one CPU;
# a break no longer found runs all its runs, some 15 min).
WAIT = 1200

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
    "W_failoverLost": "(a failover lost a commit the primary had)",
    "W_failoverRecovered": "(a message unfinished at a failover finished after it)",
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
    "async_business_commit": "NoEffectWithoutCommit",
    "async_receiver_commit": "BoundedLiveness",
    "async_worker_commit": "DeadMessageHasNoEffectAndItsFault",
}
# The runs of a break start at SEED but for these: from SEED, `async_worker_commit` is first
# found in run 5,900 or so (about 330 s of CPU); its job starts at that run's seed instead.
BREAK_SEEDS = {"async_worker_commit": 0x212752C}


LONG = tuple(
    Job("none", LONG_RUNS // CHUNKS, LONG_STEPS, SEED + chunk, witnesses=tuple(WITNESSES))
    for chunk in range(CHUNKS)
)
DEEP = Job("none", DEEP_RUNS, STEPS, SEED, witnesses=tuple(WITNESSES))
BREAK_JOBS = {
    config: Job(config, LONG_RUNS, STEPS, BREAK_SEEDS.get(config, SEED), invariants=(invariant,))
    for config, invariant in BREAKS.items()
}


@pytest.fixture(scope="module", autouse=True)
def _quint_installed() -> None:
    if not QUINT.exists():
        pytest.fail(f"{QUINT} is missing: scripts/test installs it (npm ci in spec/)")


def _collect(quint_runs: Background, jobs: tuple[Job, ...]) -> list[Report]:
    started = time.monotonic()
    reports = []
    for job in jobs:
        try:
            reports.append(quint_runs.report(job, WAIT - (time.monotonic() - started)))
        except TimeoutError:
            pytest.fail(f"{job.config}: no report after {WAIT} s ({job.samples} runs still going)")
    print(f"waited {time.monotonic() - started:.0f} s for the background simulations")
    return reports


def _holds_everywhere(reports: list[Report], runs: int, steps: int) -> None:
    for report in reports:
        assert report.ok, report.failure()
    explored = sum(report.explored for report in reports)
    witnessed = {
        name: sum(report.witnessed.get(name, 0) for report in reports) for name in WITNESSES
    }
    shares = {n: f"{c} ({100 * c / max(explored, 1):.2f} %)" for n, c in witnessed.items()}
    cpu = sum(report.cpu_seconds for report in reports)
    print(f"none: {explored} runs of {steps} steps in {cpu:.0f} s of CPU; premises: {shares}")
    assert explored == runs
    assert min(report.min_length for report in reports) > steps  # states = steps + 1
    rare = rare_premises(witnessed, explored, WITNESSES)
    assert not rare, f"premises in under 1 % of the runs: {rare}"


@pytest.mark.timeout(WAIT + 60)
@pytest.mark.quint(*LONG)
def test_the_model_as_built_holds_every_invariant_over_10000_runs_and_each_premise_happens(
    quint_runs: Background,
) -> None:
    _holds_everywhere(_collect(quint_runs, LONG), LONG_RUNS, LONG_STEPS)


@pytest.mark.timeout(WAIT + 60)
@pytest.mark.quint(DEEP)
def test_the_model_as_built_holds_every_invariant_over_long_runs_and_each_premise_happens(
    quint_runs: Background,
) -> None:
    _holds_everywhere(_collect(quint_runs, (DEEP,)), DEEP_RUNS, STEPS)


def test_a_premise_in_under_1_percent_of_the_runs_is_reported() -> None:
    counts = {"W_processed": 4000, "W_twoHolding": 99, "W_dead": 0}
    assert rare_premises(
        counts, 10_000, ["W_processed", "W_twoHolding", "W_dead", "W_faulted"]
    ) == {
        "W_twoHolding": 99,
        "W_dead": 0,
        "W_faulted": 0,
    }
    assert rare_premises({"W_twoHolding": 100}, 10_000, ["W_twoHolding"]) == {}


@pytest.mark.timeout(WAIT + 60)
@pytest.mark.parametrize(
    ("config", "invariant"),
    [pytest.param(c, i, marks=pytest.mark.quint(BREAK_JOBS[c]), id=c) for c, i in BREAKS.items()],
)
def test_each_break_violates_its_named_invariant(
    config: str, invariant: str, quint_runs: Background
) -> None:
    (report,) = _collect(quint_runs, (BREAK_JOBS[config],))
    print(
        f"{config}: violated {sorted(report.violated)} (seed {report.seed}) in"
        f" {report.cpu_seconds:.0f} s of CPU"
    )
    assert not report.ok, f"{config} passed {LONG_RUNS} runs"
    assert invariant in report.violated, f"{config} violated {report.violated}, not {invariant}"
