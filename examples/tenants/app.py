"""A service with two tenants, each in a schema of its own (docs/tenants.md).

    python examples/tenants/app.py --db-url postgresql+psycopg://postgres@127.0.0.1/postgres \
        --mq-url amqp://guest:guest@127.0.0.1/

The `notes` service keeps the outbox, the inbox and the notes of tenant `acme` in schema
`acme`, and those of `globex` in schema `globex`, of the database given. Each tenant sends
itself a command in its own transaction; the service's fleet publishes it, stamped with the
tenant (``x-tenant``); the service's one receiver stores each in its tenant's inbox, and the
fleet's worker runs the handler in a session of the tenant's schema. It prints a trace and
exits 0 once each tenant holds its note and only its own; exit 1 after 30 s without.
"""

from __future__ import annotations

import argparse
import logging
import time
import uuid
from typing import Any

from sqlalchemy import Column, Integer, MetaData, Table, Text, insert, select

from outbox_inbox import Message, Service, Tenant

T0 = time.monotonic()
TENANTS = {"acme": Tenant(schema="acme"), "globex": Tenant(schema="globex")}


def trace(who: str, what: str) -> None:
    print(f"{time.monotonic() - T0:6.2f}s  {who:<7} {what}", flush=True)


def notes_table(schema: str) -> Table:
    """The tenant's own table of notes, in its schema."""
    return Table(
        "notes",
        MetaData(schema=schema),
        Column("id", Integer, primary_key=True),
        Column("text", Text, nullable=False),
    )


NOTES = {tenant: notes_table(entry.schema or "") for tenant, entry in TENANTS.items()}


def build(db_url: str, mq_url: str) -> Service:
    fast = {"relay_poll_interval": 0.2, "worker_poll_interval": 0.2}
    notes = Service("notes", db_url=db_url, mq_url=mq_url, tenants=TENANTS, **fast)

    @notes.on_command("note.add")
    def add_note(message: Message, session: Any) -> None:
        # The worker of the message's tenant: the session is on the tenant's schema.
        session.execute(insert(NOTES[message.tenant]).values(text=message.payload["text"]))
        trace(message.tenant, f"handled {message.type} {message.payload}")

    return notes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db-url", required=True)
    parser.add_argument("--mq-url", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    notes = build(args.db_url, args.mq_url)
    notes.migrate()  # the service's own schema: messages with no tenant
    for tenant in notes.tenant_ids():  # what `outbox-inbox db upgrade --app` does for each
        notes.tenant(tenant).migrate()
        NOTES[tenant].metadata.create_all(notes.tenant(tenant).engine)
    notes.declare_topology()

    run = str(uuid.uuid4())[:8]
    for tenant in notes.tenant_ids():
        copy = notes.tenant(tenant)
        with copy.session() as session, session.begin():
            copy.outbox.send(session, "notes", "note.add", {"text": f"{tenant}'s note, run {run}"})
        trace(tenant, "sent itself note.add in its own transaction")

    # The service's roles and the fleet that drains every tenant (docs/tenants.md, "The fleet").
    notes.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            found = {}
            for tenant in notes.tenant_ids():
                with notes.tenant(tenant).engine.connect() as conn:
                    found[tenant] = conn.execute(select(NOTES[tenant].c.text)).scalars().all()
            if all(any(run in text for text in texts) for texts in found.values()):
                for tenant, texts in found.items():
                    trace(tenant, f"its notes: {[t for t in texts if run in t]}")
                ok = all(tenant in text for tenant, texts in found.items() for text in texts)
                trace("demo", "done" if ok else "a note in another tenant's table")
                return 0 if ok else 1
            time.sleep(0.2)
        trace("demo", "timed out")
        return 1
    finally:
        notes.close()


if __name__ == "__main__":
    raise SystemExit(main())
