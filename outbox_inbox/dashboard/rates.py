"""Rates and the last hour's history from successive status snapshots (`RateTracker`): the
dashboard asks nothing more of the database. A counter that went down (rows archived or
purged) gives no rate rather than a wrong one."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One snapshot: `backlog` is unpublished + pending + in-progress rows, `lag` the age of
    the oldest unpublished outbox or pending inbox row (0 without one), in seconds."""

    at: datetime
    processed: int
    dead: int
    backlog: int
    lag: float


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
    ages = (outbox.get("oldest_age_seconds"), inbox.get("oldest_pending_age_seconds"))
    return Sample(
        at=datetime.fromisoformat(status["database_time"]),
        processed=int(inbox["processed"]),
        dead=int(inbox["dead"]) + int(outbox.get("dead", 0)),
        backlog=int(outbox["unpublished"]) + int(inbox["pending"]) + int(inbox["in_progress"]),
        lag=max((float(a) for a in ages if a is not None), default=0.0),
    )


class RateTracker:
    """Snapshots per service (one every `spacing` seconds at most, kept `history` seconds); a
    rate spans about `window` seconds. Safe to use from several threads."""

    def __init__(
        self,
        *,
        window: float = 300.0,
        min_span: float = 1.0,
        history: float = 3600.0,
        spacing: float = 5.0,
    ) -> None:
        self._window, self._min_span = window, min_span
        self._history, self._spacing = history, spacing
        self._samples: dict[str, deque[Sample]] = {}
        self._lock = threading.Lock()

    def add(self, service: str, status: dict[str, Any]) -> Rates | None:
        """Remember the snapshot `status`; return the rates up to it (None until two
        snapshots at least `min_span` apart are known)."""
        new = sample_of(status)
        with self._lock:
            samples = self._samples.setdefault(service, deque())
            earlier = list(samples)
            if not samples or (new.at - samples[-1].at).total_seconds() >= self._spacing:
                samples.append(new)
            while (new.at - samples[0].at).total_seconds() > self._history:
                samples.popleft()
        if not earlier:
            return None
        # The newest snapshot at least `window` old, else the oldest: a span of about `window`.
        oldest = earlier[0]
        for sample in earlier[1:]:
            if (new.at - sample.at).total_seconds() < self._window:
                break
            oldest = sample
        span = (new.at - oldest.at).total_seconds()
        if span < self._min_span:
            return None

        def rate(before: int, after: int, *, monotonic: bool = True) -> float | None:
            return None if monotonic and after < before else (after - before) / span

        processed, dead = rate(oldest.processed, new.processed), rate(oldest.dead, new.dead)
        return Rates(span, processed, dead, rate(oldest.backlog, new.backlog, monotonic=False))

    def history(self, service: str) -> list[Sample]:
        """The snapshots of `service` kept (the last `history` seconds), oldest first."""
        with self._lock:
            return list(self._samples.get(service, ()))
