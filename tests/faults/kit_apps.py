"""The services of test_fault_kit.py: a jobs service and its producers, correct and buggy.

Importable by the kit's role processes (``--app kit_apps:correct``), which read the URLs from
``OUTBOX_INBOX_DB_URL`` and ``OUTBOX_INBOX_MQ_URL``. Each ``job.run`` command's effect is one row
of ``job_effects`` holding the job's number: written through the handler's session by the
correct service, through a connection of its own (committed at once) by the buggy one.

With ``KIT_EVENT_LOG`` set to a directory, each role records its events there (`EventLog` of
tests/e2e/apps.py), which replay.py reads to check the run against the model. `produce_keyed`
gives each job an ordering key (its number modulo `KEYS`), so that a run holds keys whose order
the model checks. Every `REJECTED`-th job is refused by its handler: it ends dead and sends
the producer its fault, the model's dead end, and no effect is expected of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

from sqlalchemy import Connection, create_engine, text
from sqlalchemy.orm import Session

from outbox_inbox import Message, Reject, Service
from outbox_inbox.listener import Listener

Produce = Callable[[Service, Session, int], list[int]]
_INSERT = text("INSERT INTO job_effects (n) VALUES (:n)")
EVENT_LOG_ENV = "KIT_EVENT_LOG"
KEYS = 4
REJECTED = 50


def _role_service(name: str) -> Service:
    """The service `name` as a role process of the kit runs it, recording its events."""
    events = os.environ.get(EVENT_LOG_ENV)
    listener: Listener | None = None
    if events:  # tests/ is then importable (test_fault_kit.py puts it on the kit's path)
        from e2e.apps import EventLog

        listener = EventLog(Path(events))
    return Service(
        name,
        db_url=os.environ["OUTBOX_INBOX_DB_URL"],
        mq_url=os.environ["OUTBOX_INBOX_MQ_URL"],
        listener=listener,
    )


def producer() -> Service:
    """The producers' service, whose relay the kit runs."""
    return _role_service("producer")


def _jobs(outside: bool) -> Service:
    service = _role_service("jobs")
    own = create_engine(os.environ["OUTBOX_INBOX_DB_URL"]) if outside else None

    @service.on_command("job.run")
    def run(message: Message, session: Session) -> None:
        if message.payload["n"] % REJECTED == REJECTED - 1:
            raise Reject("job refused")
        if own is None:
            session.execute(_INSERT, {"n": message.payload["n"]})
        else:  # the bug: the effect commits whether or not the message is marked processed
            with own.begin() as conn:
                conn.execute(_INSERT, {"n": message.payload["n"]})

    return service


def correct() -> Service:
    return _jobs(outside=False)


def outside_the_session() -> Service:
    return _jobs(outside=True)


def prepare(db_url: str, mq_url: str) -> Service:
    """Migrate the jobs database, create its effect table and declare its topology."""
    service = Service("jobs", db_url=db_url, mq_url=mq_url)
    service.migrate()
    with service.engine.begin() as conn:
        conn.execute(text("CREATE TABLE job_effects (id bigserial PRIMARY KEY, n bigint NOT NULL)"))
    service.on_command("job.run")(lambda message, session: None)
    service.declare_topology()
    return service


def produce(producer: Service, session: Session, n: int) -> list[int]:
    producer.outbox.send(session, "jobs", "job.run", {"n": n})
    return [] if n % REJECTED == REJECTED - 1 else [n]


def produce_keyed(producer: Service, session: Session, n: int) -> list[int]:
    """`produce`, the job with ordering key ``k<n % KEYS>``."""
    producer.outbox.send(session, "jobs", "job.run", {"n": n}, key=f"k{n % KEYS}")
    return [] if n % REJECTED == REJECTED - 1 else [n]


def produce_outside(producer: Service, session: Session, n: int) -> list[int]:
    """The bug: the outbox row is written in a transaction of its own, committed at once, so
    it leaves even when the business transaction (`session`) rolls back."""
    with producer.session() as own, own.begin():
        producer.outbox.send(own, "jobs", "job.run", {"n": n})
    return [] if n % REJECTED == REJECTED - 1 else [n]


def effects(conn: Connection) -> Iterator[int]:
    for (n,) in conn.execute(text("SELECT n FROM job_effects")):
        yield n
