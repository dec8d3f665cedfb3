"""The services the end-to-end tests run, in the test process or as separate processes.

As a process: ``python tests/e2e/apps.py ROLE --service NAME [options]`` with the database and
broker URLs in ``E2E_DB_URL`` / ``E2E_MQ_URL`` (not on the command line, where ``ps`` shows
passwords). ROLE is ``relay``, ``receiver``, ``worker`` or ``run`` (all three in threads); each
runs until SIGTERM / SIGINT, like a deployed service. The options inject the faults the tests
need at exact points:

* ``--pause-after-confirm PATH``: the relay's listener writes PATH once the broker confirmed a
  batch and then sleeps for ever, before the rows are marked published (the test SIGKILLs it);
* ``--hang-marker PATH``: the first handler call writes PATH (with the row's lease, read on the
  database clock) and sleeps for ever; a call that finds PATH there handles normally;
* ``--handle-delay S``: every handler call sleeps S seconds first (work in flight at a signal);
* ``--record-relayed``: the relay writes which process published each message (``relayed``);
* ``--event-log DIR``: the role's listener appends each message's events to ``DIR/<pid>.jsonl``
  (`EventLog`: what tests/model/conformance.py replays against the model);
* ``--batch``: the handlers are batch handlers (``batch=True``), called once per claimed batch
  with a `BatchContext`: the same effects, one multi-row INSERT per call, the same faults.

As a process, a handler given a message whose payload has ``"poison": true`` SIGKILLs its own
process before it writes anything: a poison message, which kills every worker that runs it.

Every handler records its effect as one row of ``effects`` in the service's database, written
through the session it is given, so the effect commits exactly when the message is marked
processed. ``effects.message_id`` is unique, as an idempotent business table would be.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from outbox_inbox import BatchContext, Message, Reject, Service
from outbox_inbox.broker import PublishOutcome
from outbox_inbox.listener import Listener, combine
from outbox_inbox.messages import OutgoingMessage

DB_URL_ENV = "E2E_DB_URL"
MQ_URL_ENV = "E2E_MQ_URL"
PARENT_PID_ENV = "E2E_PARENT_PID"
ROLES = ("relay", "receiver", "worker", "run")
STARTING = "entering role"  # logged once the imports are done and the role begins

#: What each test service handles. `billing` is the consumer in every test; `orders` produces
#: orders events and listens to billing's invoice events (the reply leg of test 1).
COMMANDS: dict[str, tuple[str, ...]] = {
    "billing": ("invoice.create", "ledger.append"),
    "orders": (),
}
EVENTS: dict[str, tuple[str, ...]] = {
    "billing": ("orders.order.*",),
    "orders": ("billing.invoice.*",),
}

#: Settings that keep the tests fast: short polls and quick reconnects.
FAST_SETTINGS: dict[str, Any] = {
    "relay_poll_interval": 0.2,
    "worker_poll_interval": 0.2,
    "reconnect_initial": 0.2,
    "reconnect_max": 2.0,
    "relay_retry_initial": 0.2,
    "relay_retry_max": 2.0,
    # One process per role, as the tests start them (tests/e2e/test_worker_processes.py
    # runs the supervised worker processes).
    "processes": 1,
}

EFFECTS_DDL = """
CREATE TABLE effects (
    handled_order bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id uuid NOT NULL UNIQUE,
    type text NOT NULL,
    key text,
    seq integer,
    correlation_id text,
    causation_id text,
    handled_by integer NOT NULL,
    handled_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""
# handled_order comes from a sequence, which is not transactional: its order is the order in
# which handlers ran, not the order in which their transactions committed.

RELAYED_DDL = """
CREATE TABLE relayed (
    message_id uuid NOT NULL,
    relay_pid integer NOT NULL,
    batch integer NOT NULL,
    position integer NOT NULL,
    confirmed_at timestamptz NOT NULL,
    committed_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""
# No unique constraint: a message two relays both committed as published must show up twice.
# batch, position and confirmed_at (host clock) say when and how a relay published it, to
# explain an ordering failure.

log = logging.getLogger("e2e.apps")


def create_test_tables(engine: Engine) -> None:
    """Create `effects` (written by the handlers) and `relayed` (by RecordRelayed)."""
    with engine.begin() as conn:
        conn.execute(text(EFFECTS_DDL))
        conn.execute(text(RELAYED_DDL))


class RecordRelayed(Listener):
    """Writes which relay process committed each message as published, in table `relayed`."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._batches = 0
        self._confirmed: dict[Any, tuple[int, int, datetime]] = {}

    def relay_confirmed(
        self, messages: Sequence[OutgoingMessage], outcomes: Sequence[PublishOutcome]
    ) -> None:
        self._batches += 1
        now = datetime.now(UTC)
        self._confirmed = {m.message_id: (self._batches, n, now) for n, m in enumerate(messages)}

    def relay_committed(self, messages: Sequence[OutgoingMessage]) -> None:
        if not messages:
            return
        rows = []
        for m in messages:
            batch, position, confirmed_at = self._confirmed[m.message_id]
            rows.append(
                {
                    "message_id": m.message_id,
                    "pid": os.getpid(),
                    "batch": batch,
                    "position": position,
                    "confirmed_at": confirmed_at,
                }
            )
        with self._engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO relayed (message_id, relay_pid, batch, position, confirmed_at)"
                    " VALUES (:message_id, :pid, :batch, :position, :confirmed_at)"
                ),
                rows,
            )


class EventLog(Listener):
    """Appends one JSON line per event of a message to ``<directory>/<pid>.jsonl``: its time
    (``time.monotonic_ns()``), the process, the event, the message id and a detail.

    Each hook's lines go in one unbuffered ``write``: a SIGKILLed process loses at most the
    hook it was in. A forked worker process writes a file of its own. The events and what
    each stands for are those of tests/model/conformance.py."""

    def __init__(self, directory: Path) -> None:
        self._directory = Path(directory)
        self._lock = threading.Lock()
        self._pid = 0
        self._fd = -1

    def _write(self, event: str, ids: Sequence[Any], details: Sequence[str] = ()) -> None:
        pid, now = os.getpid(), time.monotonic_ns()
        lines = "".join(
            json.dumps({"t": now, "pid": pid, "e": event, "m": str(i), "x": x}) + "\n"
            for i, x in zip(ids, details or [""] * len(ids), strict=True)
        )
        with self._lock:
            if pid != self._pid:  # the first event, or the first in a forked process
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
                self._fd, self._pid = os.open(self._directory / f"{pid}.jsonl", flags, 0o644), pid
            os.write(self._fd, lines.encode())

    def relay_confirmed(
        self, messages: Sequence[OutgoingMessage], outcomes: Sequence[PublishOutcome]
    ) -> None:
        self._write("confirmed", [m.message_id for m in messages], [o.value for o in outcomes])

    def relay_committed(self, messages: Sequence[OutgoingMessage]) -> None:
        self._write("marked", [m.message_id for m in messages])

    def stored(self, messages: Sequence[Message]) -> None:
        self._write("stored", [m.message_id for m in messages])

    def handler_ran(self, message: Message, seconds: float, error: BaseException | None) -> None:
        self._write("ran", [message.message_id], ["ok" if error is None else type(error).__name__])

    def handled(self, message: Message) -> None:
        self._write("processed", [message.message_id])

    def failed(self, message: Message, error: BaseException, *, dead: bool) -> None:
        self._write("dead" if dead else "retry", [message.message_id])


class PauseAfterConfirm(Listener):
    """Stops the relay between the broker's confirm and the marking of the rows."""

    def __init__(self, marker: Path) -> None:
        self._marker = marker

    def relay_confirmed(
        self, messages: Sequence[OutgoingMessage], outcomes: Sequence[PublishOutcome]
    ) -> None:
        _write_atomically(
            self._marker,
            {
                "pid": os.getpid(),
                "message_ids": [str(m.message_id) for m in messages],
                "outcomes": [o.value for o in outcomes],
            },
        )
        log.info("paused after the confirm of %d messages", len(messages))
        while True:  # the transaction that would mark the rows stays open until we are killed
            time.sleep(60)


def build_service(
    name: str,
    *,
    db_url: str,
    mq_url: str,
    settings: dict[str, Any] | None = None,
    listener: Listener | None = None,
    hang_marker: Path | None = None,
    handle_delay: float = 0.0,
    die_on_poison: bool = False,
    batch: bool = False,
) -> Service:
    """The service `name` with the handlers of COMMANDS / EVENTS, each recording its effect.

    A handled message whose payload has ``"publish": "<entity.event>"`` also publishes that
    event from the handler (to check causation and correlation ids); one with
    ``"reject": "<reason>"`` is rejected (dead at once, no effect). With `die_on_poison` (as
    every role process has it), one with ``"poison": true`` SIGKILLs this process.
    """
    service = Service(
        name,
        db_url=db_url,
        mq_url=mq_url,
        listener=listener,
        **{**FAST_SETTINGS, **(settings or {})},
    )

    def record(message: Message, session: Session) -> None:
        record_batch(BatchContext([message], [message.payload], session, service.outbox))

    def record_batch(batch: BatchContext) -> None:
        if hang_marker is not None and not hang_marker.exists():
            _hang(batch.messages[0], batch.session, hang_marker)
        rows = []
        for ctx in batch:
            if handle_delay:
                time.sleep(handle_delay)
            message = ctx.message
            payload = message.payload if isinstance(message.payload, dict) else {}
            if die_on_poison and payload.get("poison"):
                log.info("handler got poison message %s: killing this process", message.message_id)
                os.kill(os.getpid(), signal.SIGKILL)
            if payload.get("reject"):  # bad input: dead at once, nothing written
                raise Reject(payload["reject"])
            rows.append(
                {
                    "message_id": message.message_id,
                    "type": message.type,
                    "key": message.key,
                    "seq": payload.get("seq"),
                    "correlation_id": message.correlation_id,
                    "causation_id": message.causation_id,
                    "pid": os.getpid(),
                }
            )
            if payload.get("publish"):
                ctx.publish(payload["publish"], {"for": str(message.message_id)})
        batch.session.execute(
            text(
                "INSERT INTO effects"
                " (message_id, type, key, seq, correlation_id, causation_id, handled_by)"
                " VALUES (:message_id, :type, :key, :seq, :correlation_id, :causation_id, :pid)"
            ),
            rows,
        )

    handler = record_batch if batch else record
    for command in COMMANDS[name]:
        service.on_command(command, batch=batch)(handler)
    for pattern in EVENTS[name]:
        service.on_event(pattern, batch=batch)(handler)
    return service


def _hang(message: Message, session: Session, marker: Path) -> None:
    """Write `marker` with the lease of the message's inbox row, then never return."""
    lease = session.execute(
        text(
            "SELECT locked_until, locked_by, attempts, now() AS claimed_at"
            " FROM outbox_inbox.inbox_messages WHERE message_id = :message_id"
        ),
        {"message_id": message.message_id},
    ).one()
    _write_atomically(
        marker,
        {
            "pid": os.getpid(),
            "message_id": str(message.message_id),
            "locked_until": lease.locked_until.isoformat(),
            "locked_by": lease.locked_by,
            "attempts": lease.attempts,
        },
    )
    log.info("handler hangs on %s", message.message_id)
    while True:
        time.sleep(60)


def _write_atomically(path: Path, content: dict[str, Any]) -> None:
    """Write JSON to `path` so that a reader never sees half of it."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(content))
    partial.replace(path)


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process if the test process dies without cleaning up.

    A safety net only: the tests' fixtures kill what they start. The signal follows the death of
    the parent *thread* that forked us, so the tests start processes from their main thread.
    """
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    expected = os.environ.get(PARENT_PID_ENV)
    if expected and os.getppid() != int(expected):  # the parent died before the prctl
        os._exit(1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--service", required=True, choices=sorted(COMMANDS))
    parser.add_argument("--settings", default="{}", help="JSON object of Service settings")
    parser.add_argument("--pause-after-confirm", type=Path)
    parser.add_argument("--hang-marker", type=Path)
    parser.add_argument("--handle-delay", type=float, default=0.0)
    parser.add_argument("--record-relayed", action="store_true")
    parser.add_argument("--batch", action="store_true")
    parser.add_argument("--event-log", type=Path)
    args = parser.parse_args(argv)

    _die_with_parent()
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {args.role}[%(process)d] %(threadName)s %(levelname)s %(name)s:"
        " %(message)s",
    )
    listener: Listener | None = None
    if args.pause_after_confirm:
        listener = PauseAfterConfirm(args.pause_after_confirm)
    elif args.record_relayed:
        listener = RecordRelayed(create_engine(os.environ[DB_URL_ENV], pool_size=1))
    if args.event_log:
        listener = combine(EventLog(args.event_log), listener)
    service = build_service(
        args.service,
        db_url=os.environ[DB_URL_ENV],
        mq_url=os.environ[MQ_URL_ENV],
        settings=json.loads(args.settings),
        listener=listener,
        hang_marker=args.hang_marker,
        handle_delay=args.handle_delay,
        die_on_poison=True,
        batch=args.batch,
    )
    log.info("%s %s of %s", STARTING, args.role, args.service)
    if args.role == "relay":
        service.run_relay()
    elif args.role == "receiver":
        service.run_receiver()
    elif args.role == "worker":
        service.run_worker()
    else:
        service.run()
    service.close()
    log.info("%s of %s stopped", args.role, args.service)
    return 0


if __name__ == "__main__":
    sys.exit(main())
