"""Rates from successive status snapshots: the dashboard asks nothing more of the database.

Each time a service's status is collected its counters are remembered with the database time
they were read at; a rate is the change between the newest snapshot and the oldest one kept
(within `window` seconds, at least `min_span` apart). A counter that went down (processed rows
archived, rows purged) gives no rate for that span rather than a wrong one.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class Sample:
    at: datetime
    processed: int
    dead: int
    backlog: int


@dataclass(frozen=True)
class Rates:
    """Per second, over `span` seconds; None where the counters do not allow a rate."""

    span: float
    processed: float | None
    dead: float | None
    backlog: float | None  # growth of unpublished + pending (negative: draining)


def sample_of(status: dict[str, Any]) -> Sample:
    """The counters of a `collect_status` result."""
    inbox, outbox = status["inbox"], status["outbox"]
    return Sample(
        at=datetime.fromisoformat(status["database_time"]),
        processed=int(inbox["processed"]),
        dead=int(inbox["dead"]) + int(outbox.get("dead", 0)),
        backlog=int(outbox["unpublished"]) + int(inbox["pending"]) + int(inbox["in_progress"]),
    )


class RateTracker:
    """Snapshots per service, kept for `window` seconds; safe to use from several threads."""

    def __init__(self, *, window: float = 300.0, min_span: float = 1.0) -> None:
        self._window = window
        self._min_span = min_span
        self._samples: dict[str, deque[Sample]] = {}
        self._lock = threading.Lock()

    def add(self, service: str, status: dict[str, Any]) -> Rates | None:
        """Remember the snapshot `status`; return the rates up to it (None until two
        snapshots at least `min_span` apart are known)."""
        new = sample_of(status)
        with self._lock:
            samples = self._samples.setdefault(service, deque())
            samples.append(new)
            while len(samples) > 2 and (new.at - samples[1].at).total_seconds() >= self._window:
                samples.popleft()
            oldest = samples[0]
        span = (new.at - oldest.at).total_seconds()
        if span < self._min_span:
            return None

        def rate(before: int, after: int, *, monotonic: bool) -> float | None:
            if monotonic and after < before:
                return None
            return (after - before) / span

        return Rates(
            span=span,
            processed=rate(oldest.processed, new.processed, monotonic=True),
            dead=rate(oldest.dead, new.dead, monotonic=True),
            backlog=rate(oldest.backlog, new.backlog, monotonic=False),
        )
