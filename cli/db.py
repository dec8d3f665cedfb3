"""`outbox-inbox db upgrade | downgrade | current | check | history`: the shipped migrations."""

from __future__ import annotations

import sys

import click

from outbox_inbox import migrate as migrations
from outbox_inbox.logsafe import mask_url

from .output import EXIT_UNHEALTHY, echo, echo_json, render_table
from .target import app_option, db_url_option, json_option, resolve, schema_option


@click.group()
def db() -> None:
    """Create, upgrade and inspect the outbox/inbox tables.

    Runs the alembic migrations shipped inside the package; their version table is
    outbox_inbox_version in the library's schema, apart from your own alembic_version.
    """


def _migrate(action: str, app: str | None, db_url: str | None, schema: str | None, rev: str) -> str:
    target = resolve(app=app, db_url=db_url, schema=schema)
    run = migrations.upgrade if action == "upgrade" else migrations.downgrade
    try:
        if target.db_url:
            run(migrations.alembic_config(target.db_url, schema=target.schema), rev)
            return f"{action}d {mask_url(target.db_url)} schema {target.schema} to {rev}"
        # An app built with engine= only: migrate on a connection of that engine.
        with target.engine().connect() as conn:
            run(migrations.alembic_config(schema=target.schema, connection=conn), rev)
            conn.commit()
        return f"{action}d {target.name}'s database schema {target.schema} to {rev}"
    finally:
        target.close()


@db.command()
@app_option
@db_url_option
@schema_option
@click.argument("revision", default="heads")
def upgrade(app: str | None, db_url: str | None, schema: str | None, revision: str) -> None:
    """Apply the migrations up to REVISION (default: the newest)."""
    echo(_migrate("upgrade", app, db_url, schema, revision))


@db.command()
@app_option
@db_url_option
@schema_option
@click.argument("revision")
def downgrade(app: str | None, db_url: str | None, schema: str | None, revision: str) -> None:
    """Revert the migrations down to REVISION (`base` drops the tables and their data)."""
    echo(_migrate("downgrade", app, db_url, schema, revision))


@db.command()
@app_option
@db_url_option
@schema_option
@json_option
def current(app: str | None, db_url: str | None, schema: str | None, as_json: bool) -> None:
    """Show the revision the database is at (changes nothing)."""
    target = resolve(app=app, db_url=db_url, schema=schema)
    try:
        with target.engine().connect() as conn:
            state = migrations.current(conn, target.schema)
    finally:
        target.close()
    if as_json:
        echo_json(state.as_dict())
        return
    if not state.revisions:
        echo(f"schema {target.schema}: no revision (run `outbox-inbox db upgrade`)")
    for revision in state.revisions:
        echo(f"{revision}{' (head)' if revision in state.heads else ''}")


@db.command()
@app_option
@db_url_option
@schema_option
@json_option
def check(app: str | None, db_url: str | None, schema: str | None, as_json: bool) -> None:
    """Check that the tables equal the newest migration; exit 4 when they differ."""
    target = resolve(app=app, db_url=db_url, schema=schema)
    try:
        with target.engine().connect() as conn:
            differences = migrations.check(conn, target.schema)
    finally:
        target.close()
    if as_json:
        echo_json({"schema": target.schema, "differences": differences, "ok": not differences})
    elif not differences:
        echo(f"schema {target.schema}: the tables are those of the newest migration")
    for difference in differences if not as_json else ():
        echo(f"differs: {difference}")
    if differences:
        sys.exit(EXIT_UNHEALTHY)


@db.command()
@json_option
def history(as_json: bool) -> None:
    """List the migrations shipped in the package, newest first."""
    revisions = migrations.history()
    if as_json:
        echo_json([r.as_dict() for r in revisions])
        return
    rows = [
        (r.revision, r.down_revision or "(base)", "yes" if r.head else "", r.message)
        for r in revisions
    ]
    echo(render_table(["REVISION", "DOWN FROM", "HEAD", "MESSAGE"], rows))
