"""A generator of synthetic message history with known numbers, for tests and benchmarks.

It writes archive roots laid out exactly as `outbox-inbox archive` writes them, one per service
(``<directory>/<service>``), for three services that talk to each other:

=========================  =========  ==========================================================
type                       kind       expected at
=========================  =========  ==========================================================
orders.order.placed        event      billing (``orders.order.*``) and shipping (``orders.#``)
billing.invoice.create     command    billing
billing.invoice.created    event      shipping (``billing.invoice.*``), subscribed a tenth of
                                      the way into the window: earlier ones go nowhere
shipping.parcel.ship       command    shipping
shipping.parcel.shipped    event      nobody
=========================  =========  ==========================================================

and injects exact numbers of lost deliveries, deliveries still in flight, messages handled
twice, expired messages, receipts from outside the mesh, absorbed duplicates, retried and dead
messages. `generate` returns what an audit must report, computed from the generated rows
themselves. Vectorised with numpy and Arrow: ten million messages take a few minutes. Its
command line: docs/history.md, "Trying it without a history".
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from ..archive import INBOX, OUTBOX, SUBSCRIPTIONS, arrow_schema, require_pyarrow
from .audit import TOTALS

pa: Any = require_pyarrow()
pc: Any = importlib.import_module("pyarrow.compute")

SERVICES = ("orders", "billing", "shipping")
_US = 1_000_000  # microseconds in a second: times are integer microseconds
# (routing key, kind, producer, share of the messages)
TYPES = (
    ("orders.order.placed", "event", "orders", 0.35),
    ("billing.invoice.create", "command", "orders", 0.20),
    ("billing.invoice.created", "event", "billing", 0.20),
    ("shipping.parcel.ship", "command", "billing", 0.15),
    ("shipping.parcel.shipped", "event", "shipping", 0.10),
)
PLACED, CREATE, CREATED, SHIP, SHIPPED = range(len(TYPES))
SUBSCRIPTIONS_OF = {
    "orders": [],
    "billing": [("commands", "billing.#"), ("events", "orders.order.*")],
    "shipping": [
        ("commands", "shipping.#"),
        ("events", "orders.#"),
        ("events", "billing.invoice.*"),
    ],
}
LATE_PATTERN = ("shipping", "billing.invoice.*")  # subscribed at LATE_SHARE of the window
LATE_SHARE = 0.1
MESSAGE_FAULTS = ("lost", "in_flight", "handled_twice", "expired")  # on whole messages
ROW_FAULTS = ("duplicates", "retried", "dead")  # injected on deliveries, not messages
DEAD_REASONS = ("max_attempts", "rejected", "abandoned", "expired")
DEAD_ERRORS = {
    "max_attempts": (
        'Traceback (most recent call last):\n  File "app.py", line 9\nValueError: card declined'
    ),
    "rejected": "Reject: order total is negative",
    "abandoned": "claimed 3 times without finishing",
    "expired": "expired before it was handled",
}


@dataclass
class Faults:
    """How many of each fault to inject (each a count of messages or deliveries)."""

    lost: int = 0  # deliveries that never reached the consumer
    in_flight: int = 0  # deliveries published inside the grace period, not received yet
    handled_twice: int = 0  # deliveries stored in two inbox rows
    expired: int = 0  # outbox rows that expired unpublished
    unexpected: int = 0  # inbox rows with no sent message (a producer outside the mesh)
    duplicates: int = 0  # deliveries absorbed by the inbox as duplicates
    retried: int = 0  # processed deliveries that took 2 to 4 attempts
    dead: int = 0  # deliveries that ended dead, reasons in turn


@dataclass
class Expected:
    """What the audit of the generated history must report."""

    totals: dict[str, int] = field(default_factory=dict)
    dead_by_type_reason: dict[tuple[str, str], int] = field(default_factory=dict)
    retries_by_type: dict[str, int] = field(default_factory=dict)
    end_to_end_p50: float | None = None
    roots: list[str] = field(default_factory=list)
    now: datetime | None = None
    grace: timedelta = timedelta(minutes=5)


def generate(
    directory: str | Path,
    messages: int,
    faults: Faults | None = None,
    *,
    seed: int = 7,
    start: datetime = datetime(2026, 11, 1, tzinfo=UTC),
    span: timedelta = timedelta(days=3),
    chunk: int = 1_000_000,
) -> Expected:
    """Write `messages` messages of history under `directory`; return what the audit must
    report when run with ``now=Expected.now`` and ``grace=Expected.grace``."""
    faults = faults or Faults()
    rng = np.random.default_rng(seed)
    start_us = int(start.timestamp() * _US)
    span_us = int(span.total_seconds() * _US)
    now = start + span + timedelta(minutes=1)
    grace = timedelta(minutes=5)
    history = _History(
        root=Path(directory),
        messages=messages,
        chunk=chunk,
        rng=rng,
        start_us=start_us,
        span_us=span_us,
        now=now,
        grace=grace,
        horizon_us=int((now - grace).timestamp() * _US),
        late_us=start_us + int(span_us * LATE_SHARE),
        fault_index=_pick_fault_messages(rng, faults, messages, chunk),
        row_faults={name: getattr(faults, name) for name in ROW_FAULTS},
    )
    _write_subscriptions(history.root, start, history.late_us)
    for first in range(0, messages, chunk):
        batch = _chunk_messages(history, first)
        _write_outbox(history, batch)
        deliveries = _handle_deliveries(history, batch, *_expected_deliveries(history, batch))
        _count_handlings(history, deliveries)
        _write_inbox(history, batch, deliveries)
    if faults.unexpected:
        _write_unexpected(history, faults.unexpected)
    return _expected(history, faults)


@dataclass
class _History:
    """What `generate` carries from one chunk of messages to the next."""

    root: Path
    messages: int
    chunk: int
    rng: Any
    start_us: int
    span_us: int
    now: datetime
    grace: timedelta
    horizon_us: int
    late_us: int
    fault_index: dict[str, Any]
    row_faults: dict[str, int]
    totals: Counter[str] = field(default_factory=Counter)
    dead_by: Counter[tuple[str, str]] = field(default_factory=Counter)
    retries_by: Counter[str] = field(default_factory=Counter)
    samples: list[Any] = field(default_factory=list)
    inbox_ids: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SERVICES, 0))


@dataclass
class _Chunk:
    """One chunk of sent messages, by position in the chunk."""

    first: int
    n: int
    index: Any
    kind_of: Any
    created: Any
    published: Any
    expired: Any
    message_id: Any


@dataclass
class _Deliveries:
    """The received deliveries of one chunk: message position, consumer and how it went."""

    pos: Any
    consumer: Any
    twice: Any
    routing: Any
    received: Any
    attempts: Any
    status: Any
    dead_reason: Any
    last_error: Any
    duplicates: Any
    processed: Any


def _pick_fault_messages(rng: Any, faults: Faults, messages: int, chunk: int) -> dict[str, Any]:
    """The positions of each message fault's messages."""
    # Fault messages are commands to billing (one delivery each, always expected) taken from
    # the first chunk's indices; each fault has its own messages.
    sizes = [getattr(faults, name) for name in MESSAGE_FAULTS]
    if sum(sizes) > min(messages, chunk) // 2:
        raise ValueError("too many message faults for the number of messages")
    picked = rng.choice(min(messages, chunk), size=sum(sizes), replace=False)
    parts = np.split(picked, np.cumsum(sizes)[:-1])
    return {name: np.sort(part) for name, part in zip(MESSAGE_FAULTS, parts, strict=True)}


def _chunk_messages(h: _History, first: int) -> _Chunk:
    """The messages from position `first` on: their types and times, with the message faults
    placed in the first chunk."""
    n = min(h.chunk, h.messages - first)
    index = np.arange(first, first + n, dtype=np.int64)
    shares = np.array([t[3] for t in TYPES])
    kind_of = h.rng.choice(len(TYPES), size=n, p=shares / shares.sum())
    created = h.start_us + h.rng.integers(0, h.span_us, size=n)
    published = created + h.rng.exponential(50_000, size=n).astype(np.int64) + 1
    expired = np.zeros(n, dtype=bool)
    if first == 0:
        for name in MESSAGE_FAULTS:
            kind_of[h.fault_index[name]] = CREATE
        expired[h.fault_index["expired"]] = True
        # In flight: published a minute before the audit, inside its grace period.
        late = h.fault_index["in_flight"]
        published[late] = h.horizon_us + 60 * _US
        created[late] = published[late] - 1000
    message_id = _ids("0", index)
    return _Chunk(first, n, index, kind_of, created, published, expired, message_id)


def _write_outbox(h: _History, c: _Chunk) -> None:
    """The chunk's outbox rows, by producer, and their counts."""
    kinds = np.array([TYPES[k][1] for k in range(len(TYPES))])
    for producer in SERVICES:
        mask = np.isin(c.kind_of, [i for i, t in enumerate(TYPES) if t[2] == producer])
        if not mask.any():
            continue
        rows = {
            "id": c.index[mask] + 1,
            "message_id": pc.filter(c.message_id, pa.array(mask)),
            "kind": kinds[c.kind_of[mask]],
            "exchange": np.where(kinds[c.kind_of[mask]] == "event", "events", "commands"),
            "routing_key": np.array([t[0] for t in TYPES])[c.kind_of[mask]],
            "created_at": c.created[mask],
            "available_at": c.created[mask],
            "published_at": np.where(c.expired[mask], -1, c.published[mask]),
            "expired_at": np.where(c.expired[mask], c.published[mask], -1),
            "attempts": np.where(h.rng.random(mask.sum()) < 0.01, 1, 0).astype(np.int32),
        }
        h.totals["publish_retries"] += int(rows["attempts"][~c.expired[mask]].sum())
        _write(h.root / producer, OUTBOX, producer, rows, c.published[mask], c.first)
        h.totals["sent"] += int(mask.sum())
    h.totals["commands"] += int(np.isin(c.kind_of, [CREATE, SHIP]).sum())
    h.totals["events"] += int(np.isin(c.kind_of, [PLACED, CREATED, SHIPPED]).sum())
    h.totals["expired"] += int(c.expired.sum())
    h.totals["published"] += int((~c.expired).sum())


def _expected_deliveries(h: _History, c: _Chunk) -> tuple[Any, Any, Any]:
    """The chunk's deliveries that reached their consumer: (message position, consumer,
    handled twice), with the expected, lost and in-flight ones counted."""
    routes = (
        ("billing", np.isin(c.kind_of, [PLACED, CREATE]) & ~c.expired),
        ("shipping", np.isin(c.kind_of, [PLACED, SHIP]) & ~c.expired),
        ("shipping", (c.kind_of == CREATED) & ~c.expired & (c.published >= h.late_us)),
    )
    pos = np.concatenate([np.flatnonzero(mask) for _, mask in routes])
    consumer = np.concatenate([np.full(np.count_nonzero(mask), target) for target, mask in routes])
    h.totals["expected_deliveries"] += pos.size

    keep = np.ones(pos.size, dtype=bool)
    twice = np.zeros(pos.size, dtype=bool)
    if c.first == 0:
        lost, in_flight = h.fault_index["lost"], h.fault_index["in_flight"]
        keep &= ~np.isin(pos, lost) & ~np.isin(pos, in_flight)
        twice = np.isin(pos, h.fault_index["handled_twice"])
        h.totals["lost"] += int(np.isin(pos, lost).sum())
        h.totals["in_flight"] += int(np.isin(pos, in_flight).sum())
    pos, consumer, twice = pos[keep], consumer[keep], twice[keep]
    h.totals["delivered"] += pos.size
    h.totals["handled_more_than_once"] += int(twice.sum())
    return pos, consumer, twice


def _handle_deliveries(h: _History, c: _Chunk, pos: Any, consumer: Any, twice: Any) -> _Deliveries:
    """How each delivery went: received, handled (with the row faults injected), processed."""
    m = pos.size
    d = _Deliveries(
        pos=pos,
        consumer=consumer,
        twice=twice,
        routing=np.array([t[0] for t in TYPES])[c.kind_of[pos]],
        received=c.published[pos] + h.rng.exponential(20_000, size=m).astype(np.int64) + 1,
        attempts=np.ones(m, dtype=np.int32),
        status=np.full(m, "processed", dtype=object),
        dead_reason=np.full(m, None, dtype=object),
        last_error=np.full(m, None, dtype=object),
        duplicates=np.zeros(m, dtype=np.int32),
        processed=None,
    )
    _inject_row_faults(h, c, d)
    processing = h.rng.exponential(100_000, size=m).astype(np.int64) + 1
    d.processed = d.received + processing + (d.attempts.astype(np.int64) - 1) * 2 * _US
    e2e = (d.processed - c.created[pos]) / _US
    if len(h.samples) < 5:
        h.samples.append(e2e[d.status == "processed"])
    return d


def _inject_row_faults(h: _History, c: _Chunk, d: _Deliveries) -> None:
    """This chunk's share of the duplicates, retries and dead letters, on deliveries not
    handled twice."""
    share = c.n / h.messages
    candidates = h.rng.permutation(np.flatnonzero(~d.twice))
    cursor = 0
    for name, total in h.row_faults.items():
        k = min(
            _portion(total, share, c.first + c.n >= h.messages, h.totals, name),
            candidates.size - cursor,
        )
        chosen = candidates[cursor : cursor + k]
        cursor += k
        h.totals[f"_injected_{name}"] += k
        if name == "duplicates":
            d.duplicates[chosen] = 1
        elif name == "retried":
            d.attempts[chosen] = h.rng.integers(2, 5, size=k)
        else:
            reasons = np.array(DEAD_REASONS)[np.arange(k) % len(DEAD_REASONS)]
            d.status[chosen] = "dead"
            d.dead_reason[chosen] = reasons
            d.last_error[chosen] = [DEAD_ERRORS[r] for r in reasons]
            d.attempts[chosen] = np.where(reasons == "max_attempts", 5, 1)


def _count_handlings(h: _History, d: _Deliveries) -> None:
    """The chunk's handling counts: processed, dead (by type and reason), retries (by type)."""
    ok = d.status == "processed"
    h.totals["duplicates_absorbed"] += int(d.duplicates.sum())
    h.totals["processed"] += int(ok.sum())
    h.totals["dead"] += int((~ok).sum())
    h.totals["retried_messages"] += int((d.attempts > 1).sum())
    h.totals["retries"] += int((d.attempts - 1).sum())
    for (t, r), count in Counter(zip(d.routing[~ok], d.dead_reason[~ok], strict=True)).items():
        h.dead_by[(str(t), str(r))] += count
    retried = d.attempts > 1
    for t in np.unique(d.routing[retried]):
        h.retries_by[str(t)] += int((d.attempts[retried & (d.routing == t)] - 1).sum())


def _write_inbox(h: _History, c: _Chunk, d: _Deliveries) -> None:
    """The chunk's inbox rows, by consumer."""
    for service in ("billing", "shipping"):
        mine = np.asarray(d.consumer == service)
        # A message handled twice gets a second inbox row, a day later (after the first
        # left the inbox), with the same message id.
        again = mine & d.twice
        take = np.concatenate([np.flatnonzero(mine), np.flatnonzero(again)])
        shift = np.concatenate([np.zeros(mine.sum(), np.int64), np.full(again.sum(), 86400 * _US)])
        count = take.size
        ids = h.inbox_ids[service] + np.arange(1, count + 1, dtype=np.int64)
        h.inbox_ids[service] += count
        p = d.pos[take]
        rows = {
            "id": ids,
            "message_id": pc.take(c.message_id, pa.array(p)),
            "source": np.array([t[2] for t in TYPES])[c.kind_of[p]],
            "kind": np.array([t[1] for t in TYPES])[c.kind_of[p]],
            "routing_key": d.routing[take],
            "created_at": c.created[p],
            "received_at": d.received[take] + shift,
            "status": d.status[take],
            "attempts": d.attempts[take],
            "finished": d.attempts[take],
            "processed_at": d.processed[take] + shift,
            "last_error": d.last_error[take],
            "dead_reason": d.dead_reason[take],
            "deliveries": np.zeros(count, np.int32),
            "duplicates": np.where(shift > 0, 0, d.duplicates[take]).astype(np.int32),
        }
        _write(h.root / service, INBOX, service, rows, rows["received_at"], c.first)


def _write_unexpected(h: _History, k: int) -> None:
    """Receipts of messages nobody in the mesh sent: a producer outside it."""
    stamps = h.start_us + h.rng.integers(0, h.span_us, size=k)
    rows = {
        "id": h.inbox_ids["billing"] + np.arange(1, k + 1, dtype=np.int64),
        "message_id": _ids("f", np.arange(k, dtype=np.int64)),
        "source": np.full(k, "legacy"),
        "kind": np.full(k, "event"),
        "routing_key": np.full(k, "legacy.customer.updated"),
        "created_at": stamps,
        "received_at": stamps + 1000,
        "status": np.full(k, "processed", dtype=object),
        "attempts": np.ones(k, np.int32),
        "finished": np.ones(k, np.int32),
        "processed_at": stamps + 2000,
        "deliveries": np.zeros(k, np.int32),
        "duplicates": np.zeros(k, np.int32),
    }
    _write(h.root / "billing", INBOX, "billing", rows, stamps + 1000, h.messages)
    h.totals["unexpected"] += k
    h.totals["processed"] += k


def _expected(h: _History, faults: Faults) -> Expected:
    """What the audit must report, from the counts taken while writing."""
    for name in ROW_FAULTS:
        if h.totals.pop(f"_injected_{name}", 0) != getattr(faults, name):
            raise ValueError(f"not enough deliveries to inject {getattr(faults, name)} {name}")
    # Every count the audit reports, zero where nothing of the kind was generated.
    for name in TOTALS:
        h.totals.setdefault(name, 0)
    e2e_all = np.concatenate(h.samples) if h.samples else np.array([])
    return Expected(
        totals=dict(h.totals),
        dead_by_type_reason=dict(h.dead_by),
        retries_by_type=dict(h.retries_by),
        end_to_end_p50=float(np.percentile(e2e_all, 50)) if e2e_all.size else None,
        roots=[str(h.root / s) for s in SERVICES],
        now=h.now,
        grace=h.grace,
    )


def _portion(total: int, share: float, last: bool, totals: Counter[str], name: str) -> int:
    """This chunk's part of `total` row faults; the last chunk takes what is left."""
    done = totals[f"_injected_{name}"]
    return total - done if last else min(total - done, round(total * share))


def _ids(prefix: str, index: Any) -> Any:
    """UUID-shaped message ids from integers, built by Arrow without a Python loop."""
    digits = pc.utf8_lpad(pc.cast(pa.array(index), pa.string()), 12, "0")
    return pc.binary_join_element_wise(f"{prefix * 8}-0000-4000-8000-", digits, "")


def _write(
    root: Path, source: str, service: str, columns: dict[str, Any], dated_by: Any, part: int
) -> None:
    """Write `columns` as `source` files of `service` under `root`, one file per date."""
    schema = arrow_schema(source)
    size = len(dated_by)
    arrays = []
    for f in schema:
        value = columns.get(f.name)
        if f.name == "archived_at":
            value = np.full(size, int(datetime(2026, 12, 1, tzinfo=UTC).timestamp() * 1e6))
        if value is None:
            arrays.append(pa.nulls(size, f.type))
        elif pa.types.is_timestamp(f.type):
            raw = np.asarray(value, dtype=np.int64)
            arrays.append(pa.array(raw, pa.int64(), mask=raw < 0).cast(f.type))
        elif isinstance(value, pa.Array | pa.ChunkedArray):
            arrays.append(value)
        else:
            arrays.append(pa.array(value, f.type, from_pandas=True))
    table = pa.Table.from_arrays(arrays, schema=schema)
    days = (np.asarray(dated_by) // (86400 * 1_000_000)).astype(np.int64)
    for day in np.unique(days):
        date = (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(days=int(day))).date()
        directory = root / source / f"service={service}" / f"date={date.isoformat()}"
        directory.mkdir(parents=True, exist_ok=True)
        pa.parquet.write_table(
            table.filter(pa.array(days == day)),
            directory / f"part-{part:012d}.parquet",
            compression="zstd",
        )


def _write_subscriptions(root: Path, start: datetime, late_us: int) -> None:
    late, early = datetime.fromtimestamp(late_us / 1e6, UTC), start - timedelta(days=1)
    for service, patterns in SUBSCRIPTIONS_OF.items():
        at = {p: late if (service, p) == LATE_PATTERN else early for _, p in patterns}
        records = [{"exchange": e, "pattern": p, "subscribed_at": at[p]} for e, p in patterns]
        directory = root / service / SUBSCRIPTIONS / f"service={service}"
        directory.mkdir(parents=True, exist_ok=True)
        table = pa.Table.from_pylist(records, schema=arrow_schema(SUBSCRIPTIONS))
        pa.parquet.write_table(table, directory / "subscriptions.parquet")


def main(argv: list[str] | None = None) -> None:
    """Command line: write a synthetic history and print what its audit must report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("directory")
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=7)
    for name in Faults.__dataclass_fields__:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=0)
    args = parser.parse_args(argv)
    faults = Faults(**{name: getattr(args, name) for name in Faults.__dataclass_fields__})
    expected = generate(args.directory, args.messages, faults, seed=args.seed)
    printed = {
        "roots": expected.roots,
        "now": expected.now.isoformat() if expected.now else None,
        "grace_seconds": expected.grace.total_seconds(),
        "totals": expected.totals,
    }
    print(json.dumps(printed, indent=2))


if __name__ == "__main__":
    main()
