"""The bench's services, and what its spawned child processes run.

Service A only writes events ``<A>.order.placed`` to its outbox; service B subscribes to them and
its handler inserts one row per message; service M (the memory figure) subscribes to its own
events, so one service has both a backlog to relay and one to handle. The functions a child
process runs take (…, ready, stop) multiprocessing events: they set `ready` once connected, and
end when `stop` is set.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Identity,
    Integer,
    MetaData,
    Table,
    Uuid,
    insert,
    text,
)
from sqlalchemy.orm import DeclarativeBase

from bench.wire import EVENT_NAME
from outbox_inbox import HandlerContext, Service
from outbox_inbox.messages import Message


def service_names(tag: str) -> tuple[str, str]:
    return f"bench-{tag}-a", f"bench-{tag}-b"


def memory_service_name(tag: str) -> str:
    return f"bench-{tag}-m"


def effects_table(schema: str) -> Table:
    """The handler's table: one row per handled message, stamped with the database clock."""
    return Table(
        "bench_effects",
        MetaData(schema=schema),
        Column("id", BigInteger, Identity(), primary_key=True),
        Column("message_id", Uuid(as_uuid=True), nullable=False),
        Column("order_id", Integer, nullable=False),
        Column(
            "handled_at",
            DateTime(timezone=True),
            nullable=False,
            server_default=text("clock_timestamp()"),
        ),
    )


#: How the bench's handler writes its row, per figure (bench/README.md, "The library").
HANDLERS = {
    "execute": "session.execute(insert(effects), {...}) per message",
    "noop": "a no-op handler",
    "orm": "session.add(Effect(...)) per message (flushed once per batch)",
    "write": "ctx.write(INSERT, {...}) per message (one executemany per batch)",
    "batch": "a batch handler: one multi-row INSERT per batch",
}


#: The handler of service B as `serve` runs it (figures h and L): ``ctx.write``, the
#: documented way for a handler to write a row it does not read back (docs/concepts.md). It
#: sends what the hand-written worker of h_raw and L_raw sends, one INSERT per row in one
#: round trip a batch; a handler with a round trip per message is figure g.
SERVED_HANDLER = "write"


def _subscribe(svc: Service, pattern: str, effects: Table, style: str = "execute") -> None:
    if style == "noop":
        svc.on_event(pattern)(lambda message, session: None)
    elif style == "orm":

        class Base(DeclarativeBase):
            pass

        effect = type("Effect", (Base,), {"__table__": effects})

        @svc.on_event(pattern)
        def add(message: Message, session: Any) -> None:
            session.add(effect(message_id=message.message_id, order_id=message.payload["order_id"]))

    elif style == "write":
        statement = insert(effects)

        @svc.on_event(pattern)
        def write(ctx: HandlerContext) -> None:
            ctx.write(
                statement,
                {"message_id": ctx.message.message_id, "order_id": ctx.payload["order_id"]},
            )

    elif style == "batch":

        @svc.on_event(pattern, batch=True)
        def on_batch(messages: list[Message], session: Any) -> None:
            session.execute(
                insert(effects),
                [{"message_id": m.message_id, "order_id": m.payload["order_id"]} for m in messages],
            )

    else:

        @svc.on_event(pattern)
        def on_order_placed(message: Message, session: Any) -> None:
            session.execute(
                insert(effects),
                {"message_id": message.message_id, "order_id": message.payload["order_id"]},
            )


def build_service_a(tag: str, db_url: str, mq_url: str, **settings: Any) -> Service:
    """Service A: only writes to its outbox (events ``<A>.order.placed``); `settings`: more
    keyword settings of its `Service`."""
    name = service_names(tag)[0]
    return Service(name, db_url=db_url, mq_url=mq_url, schema=f"bench_{tag}_a", **settings)


def build_service_b(
    tag: str, db_url: str, mq_url: str, style: str = "execute", **settings: Any
) -> tuple[Service, Table]:
    """Service B: subscribes to A's events; its handler inserts one row per message, written
    the way `style` says (`HANDLERS`); `settings`: more keyword settings of its `Service`."""
    a_name, b_name = service_names(tag)
    svc = Service(b_name, db_url=db_url, mq_url=mq_url, schema=f"bench_{tag}_b", **settings)
    effects = effects_table(svc.settings.schema)
    _subscribe(svc, f"{a_name}.{EVENT_NAME}", effects, style)
    return svc, effects


def build_service_m(tag: str, db_url: str, mq_url: str, **settings: Any) -> tuple[Service, Table]:
    """Service M: handles its own events ``<M>.order.placed`` (backlogs seeded in SQL);
    `settings`: more keyword settings of its `Service`."""
    name = memory_service_name(tag)
    svc = Service(name, db_url=db_url, mq_url=mq_url, schema=f"bench_{tag}_m", **settings)
    effects = effects_table(svc.settings.schema)
    _subscribe(svc, f"{name}.{EVENT_NAME}", effects)
    return svc, effects


def _child_logging(label: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when a child ends
    logging.basicConfig(
        level=logging.WARNING, format=f"%(levelname)s [{label}] %(name)s: %(message)s"
    )


def serve(
    which: str, tag: str, db_url: str, mq_url: str, processes: int | None, ready: Any, stop: Any
) -> None:
    """Child process: service A or B (`which`) as users run it, `svc.run()` with its default
    settings (relay and receiver here, the workers in one process per CPU; `processes` if
    given, as ``outbox-inbox run --processes``), until `stop`. B's handler writes its row
    the `SERVED_HANDLER` way."""
    _child_logging(which.upper())
    settings: dict[str, Any] = {} if processes is None else {"processes": processes}
    svc = (
        build_service_a(tag, db_url, mq_url, **settings)
        if which == "a"
        else build_service_b(tag, db_url, mq_url, SERVED_HANDLER, **settings)[0]
    )

    def stop_on_event() -> None:
        stop.wait()
        os.kill(os.getpid(), signal.SIGTERM)  # what run() stops on

    threading.Thread(target=stop_on_event, daemon=True).start()
    ready.set()
    try:
        svc.run()
    finally:
        svc.close()


def run_worker_processes(tag: str, db_url: str, mq_url: str, ready: Any, stop: Any) -> None:
    """Child process: service B's `svc.run_worker()` with its default settings (one worker
    process per CPU), until `stop`."""
    _child_logging("workers")
    svc, _ = build_service_b(tag, db_url, mq_url)

    def stop_on_event() -> None:
        stop.wait()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_on_event, daemon=True).start()
    ready.set()
    try:
        svc.run_worker()
    finally:
        svc.close()


#: The roles `run_role` can run: (service builder, role).
ROLES = {
    "worker": ("b", "worker"),
    "memory-relay": ("m", "relay"),
    "memory-worker": ("m", "worker"),
}


def run_role(
    role: str,
    tag: str,
    db_url: str,
    mq_url: str,
    go: Any,
    progress: Any,
    ready: Any,
    stop: Any,
) -> None:
    """Child process: one role (`ROLES`) of service B or M in a thread, from `go` until `stop`.

    It connects to the database before `ready`, so the clock started at `go` does not pay for
    the interpreter's start, and copies the role's count (messages published or processed,
    after their commit) into the shared `progress` value every 20 ms.
    """
    _child_logging(role)
    which, kind = ROLES[role]
    if which == "b":
        svc, _ = build_service_b(tag, db_url, mq_url)
    else:
        svc, _ = build_service_m(tag, db_url, mq_url)
    try:
        with svc.engine.connect():
            pass
        runner = svc.relay() if kind == "relay" else svc.worker()

        def count() -> int:
            return int(getattr(runner, "published" if kind == "relay" else "processed"))

        ready.set()
        while not go.wait(0.1):
            if stop.is_set():
                return
        inner = threading.Event()
        thread = threading.Thread(target=runner.run, args=(inner,), name=role, daemon=True)
        thread.start()
        while not stop.wait(0.02):
            progress.value = count()
            if not thread.is_alive():
                return  # the role failed; the parent sees the process end
        inner.set()
        thread.join(30)
        progress.value = count()
    finally:
        svc.close()
