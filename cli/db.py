"""`outbox-inbox db upgrade | downgrade | current | check | history`: the shipped migrations."""

from __future__ import annotations

import sys
from dataclasses import asdict
from functools import partial
from typing import Any

import click

from outbox_inbox import migrate as migrations
from outbox_inbox.errors import first_line
from outbox_inbox.logsafe import mask_url

from .output import EXIT_UNHEALTHY, echo, echo_json, render_table
from .target import Target, app_option, db_url_option, fail, json_option, resolve, schema_option


@click.group()
def db() -> None:
    """Create, upgrade and inspect the outbox/inbox tables.

    Runs the alembic migrations shipped inside the package; their version table is
    outbox_inbox_version in the library's schema, apart from your own alembic_version.
    """


role_option = click.option("--runtime-role", help="Name the GRANTs this role lacks.")


def _on_database(
    app: str | None, db_url: str | None, schema: str | None, work: Any, tenants: Any = None
) -> Any:
    """`work(connection, target)` on a connection of the command's database; with `tenants`,
    its line is printed, then `tenants(connection, target)`'s on each tenant's of an --app (but
    for --schema), exit 1 naming those that failed once all were tried."""
    target, failed = resolve(app=app, db_url=db_url, schema=schema), []
    try:
        with target.engine().connect() as conn:
            done = work(conn, target)
        if tenants is None:
            return done
        echo(done)
        if (service := target.service) is None or schema:
            return None
        for tenant in service.tenant_ids():
            try:
                found = service.tenant(tenant)
                with found.engine.connect() as conn:
                    at = Target(found.name, found.settings.schema, found.settings.db_url, None)
                    echo(f"tenant {tenant}: {tenants(conn, at)}")
            except Exception as exc:  # one tenant's failure, reported: the others go on
                echo(f"tenant {tenant}: failed: {first_line(exc)}")
                failed.append(tenant)
    finally:
        target.close()
    if failed:
        fail(f"{len(failed)} tenant(s) failed: {', '.join(failed)}")


def _migrate(action: str, rev: str, role: str | None, conn: Any, target: Target) -> str:
    """Migrate; name the tables it made (a runtime role needs grants on them), what `role` lacks."""
    before = migrations.table_oids(conn, target.schema)
    config = migrations.alembic_config(target.db_url, schema=target.schema, connection=conn)
    (migrations.upgrade if action == "upgrade" else migrations.downgrade)(config, rev)
    conn.commit()
    after = migrations.table_oids(conn, target.schema)
    where = mask_url(target.db_url) if target.db_url else f"{target.name}'s database"
    lines = [f"{action}d {where} schema {target.schema} to {rev}"]
    made = sorted(name for name, oid in after.items() if before.get(name) != oid)
    if before and made:  # the first upgrade comes before any grant (security.md)
        lines.append(
            f"tables made: {', '.join(made)}; a runtime role needs SELECT, INSERT, UPDATE, DELETE"
            " on them unless default privileges gave it (`db check --runtime-role ROLE`)"
        )
    return "\n".join(lines + _lacks(conn, target, role))


def _upgrade_tenant(rev: str, role: str | None, conn: Any, target: Target) -> str:
    if rev == "heads" and migrations.current(conn, target.schema).up_to_date:
        return f"schema {target.schema} is at the newest revision"
    return _migrate("upgrade", rev, role, conn, target)


def _checked(role: str | None, conn: Any, target: Target) -> tuple[str, list[str]]:
    return target.schema, migrations.check(conn, target.schema) + _lacks(conn, target, role)


def _lacks(conn: Any, target: Target, role: str | None) -> list[str]:
    grants = migrations.runtime_grants(conn, role, target.schema) if role else []
    return [f"runtime role {role} lacks: {grant}" for grant in grants]


@db.command()
@app_option
@db_url_option
@schema_option
@role_option
@click.argument("revision", default="heads")
def upgrade(
    app: str | None, db_url: str | None, schema: str | None, runtime_role: str | None, revision: str
) -> None:
    """Apply the migrations up to REVISION (default: the newest); with an --app that has
    tenants (and no --schema), then on every tenant's database and schema, skipping those
    already at the newest revision (docs/tenants.md)."""
    work = partial(_migrate, "upgrade", revision, runtime_role)
    tenants = partial(_upgrade_tenant, revision, runtime_role)
    _on_database(app, db_url, schema, work, tenants)


@db.command()
@app_option
@db_url_option
@schema_option
@click.argument("revision")
def downgrade(app: str | None, db_url: str | None, schema: str | None, revision: str) -> None:
    """Revert the migrations down to REVISION (`base` drops the tables and their data)."""
    echo(_on_database(app, db_url, schema, partial(_migrate, "downgrade", revision, None)))


@db.command()
@app_option
@db_url_option
@schema_option
@json_option
def current(app: str | None, db_url: str | None, schema: str | None, as_json: bool) -> None:
    """Show the revision the database is at (changes nothing)."""
    state = _on_database(app, db_url, schema, lambda conn, t: migrations.current(conn, t.schema))
    if as_json:
        echo_json(state.as_dict())
        return
    if not state.revisions:
        echo(f"schema {state.schema}: no revision (run `outbox-inbox db upgrade`)")
    for revision in state.revisions:
        echo(f"{revision}{' (head)' if revision in state.heads else ''}")


@db.command()
@app_option
@db_url_option
@schema_option
@role_option
@json_option
def check(
    app: str | None, db_url: str | None, schema: str | None, runtime_role: str | None, as_json: bool
) -> None:
    """Check that the tables equal the newest migration, and with --runtime-role that the role
    holds its grants on them; exit 4 when they differ or it lacks one."""
    name, differences = _on_database(app, db_url, schema, partial(_checked, runtime_role))
    if as_json:
        echo_json({"schema": name, "differences": differences, "ok": not differences})
    elif not differences:
        echo(f"schema {name}: the tables are those of the newest migration")
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
        echo_json([asdict(r) for r in revisions])
        return
    rows = [
        (r.revision, r.down_revision or "(base)", "yes" if r.head else "", r.message)
        for r in revisions
    ]
    echo(render_table(["REVISION", "DOWN FROM", "HEAD", "MESSAGE"], rows))
