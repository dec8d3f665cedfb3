"""`outbox-inbox topology plan | apply | verify`: the broker objects a service needs."""

from __future__ import annotations

import sys

import click

from outbox_inbox.broker import DIFFERS, MISSING, PRESENT
from outbox_inbox.management import ManagementAPI, default_management_url, vhost_of
from outbox_inbox.topology_check import EXTRA, UNVERIFIED, Plan, apply_topology, check_topology

from .output import (
    EXIT_UNHEALTHY,
    EXIT_UNVERIFIED,
    echo,
    echo_json,
    one_line,
    plural,
    remember_secret,
    render_table,
)
from .target import Target, json_option, mq_url_option, resolve

MANAGEMENT_URL_ENV = "OUTBOX_INBOX_MANAGEMENT_URL"

app_required = click.option(
    "--app",
    "app",
    required=True,
    metavar="MODULE:ATTR",
    help="Your Service: its name, handlers (event bindings) and queue settings.",
)
management_url_option = click.option(
    "--management-url",
    metavar="URL",
    envvar=MANAGEMENT_URL_ENV,
    help=(
        "RabbitMQ management API, for bindings and arguments "
        f"[env {MANAGEMENT_URL_ENV}; default: http://<mq host>:15672 with the mq credentials]."
    ),
)


@click.group()
def topology() -> None:
    """Plan, apply and verify the exchanges, queues and bindings a service needs.

    Bindings cannot be listed over AMQP, so plan and verify read them from the RabbitMQ
    management API. When it does not answer, exchanges and queues are still checked over
    AMQP and bindings are reported as unverified.
    """


def _api(target: Target, management_url: str | None) -> ManagementAPI | None:
    url = management_url or (default_management_url(target.mq_url) if target.mq_url else None)
    if url is None:
        return None
    remember_secret(url)
    return ManagementAPI(url, vhost_of(target.mq_url or "amqp:///"))


def _show_plan(app: str, mq_url: str | None, management_url: str | None, as_json: bool) -> Plan:
    """Check the topology of the service `app` on its broker and print the plan."""
    target = resolve(app=app, mq_url=mq_url)
    with target.broker().operator() as admin:
        plan = check_topology(target.topology(), admin, _api(target, management_url))
    if as_json:
        echo_json({"service": target.name, **plan.as_dict()})
        return plan
    echo(f"service {target.name} on {target.broker().description}")
    if plan.management_problem:
        echo(f"management API not used: {plan.management_problem}", err=True)
    rows = [(i.kind, i.name, i.state, one_line(i.detail, 100)) for i in plan.items]
    echo(render_table(["KIND", "NAME", "STATE", "DETAIL"], rows))
    missing, differs = plan.having(MISSING), plan.having(DIFFERS)
    unverified, extra = plan.having(UNVERIFIED), plan.having(EXTRA)
    echo(
        f"{len(plan.having(PRESENT))} present, {len(missing)} missing, {len(differs)} differ, "
        f"{len(unverified)} unverified, {len(extra)} extra"
    )
    if missing:
        echo("run `outbox-inbox topology apply` to declare what is missing")
    if differs:
        echo("objects that differ cannot be changed in place: drain and delete them, then apply")
    return plan


@topology.command()
@app_required
@mq_url_option
@management_url_option
@json_option
def plan(app: str, mq_url: str | None, management_url: str | None, as_json: bool) -> None:
    """List every exchange, queue and binding the service needs and what the broker lacks.

    Read-only. States: present, missing, differs (declared with other arguments),
    unverified (a binding, without the management API), extra (a binding on the service's
    queues that it does not declare: it still routes messages there).
    """
    _show_plan(app, mq_url, management_url, as_json)


@topology.command()
@app_required
@mq_url_option
@management_url_option
@json_option
def apply(app: str, mq_url: str | None, management_url: str | None, as_json: bool) -> None:
    """Declare the exchanges, queues and bindings the service needs (idempotent).

    Refuses, declaring nothing, when an exchange or queue exists with other arguments:
    RabbitMQ cannot change them in place. Extra bindings are left alone.
    """
    target = resolve(app=app, mq_url=mq_url)
    with target.broker().operator() as admin:
        before, after = apply_topology(
            target.topology(), target.broker(), admin, _api(target, management_url)
        )
    # Without the management API a binding between an exchange and a queue that were both
    # there is `unverified` before: it was declared all the same, so it is listed and counted.
    declared = before.having(MISSING, UNVERIFIED)
    if as_json:
        echo_json(
            {
                "service": target.name,
                "declared": [i.as_dict() for i in declared],
                "after": after.as_dict(),
            }
        )
    else:
        echo(f"service {target.name} on {target.broker().description}")
        if declared:
            rows = [
                (i.kind, i.name, "declared" if i.state == MISSING else "declared (unverified)")
                for i in declared
            ]
            echo(render_table(["KIND", "NAME", "STATE"], rows))
        unchecked = before.having(UNVERIFIED)
        declared_line = f"declared {plural(len(before.having(MISSING)), 'missing object')}"
        if unchecked:
            declared_line += f" and {plural(len(unchecked), 'unverified binding')}"
        present = len(before.having(PRESENT))
        echo(f"{declared_line}; {present} {'was' if present == 1 else 'were'} present")
        if after.having(UNVERIFIED):
            echo(
                f"bindings were declared but cannot be verified: {after.management_problem}",
                err=True,
            )
    if not after.complete:
        sys.exit(EXIT_UNHEALTHY)


@topology.command()
@app_required
@mq_url_option
@management_url_option
@json_option
def verify(app: str, mq_url: str | None, management_url: str | None, as_json: bool) -> None:
    """Exit 0 when the broker holds everything the service needs, as declared.

    \b
    Exit codes:
      0  everything present with the expected arguments
      4  something is missing or declared with other arguments
      3  nothing missing found, but bindings could not be checked
         (management API unreachable)
      1  error (broker unreachable, bad URL, unknown app)
    """
    result = _show_plan(app, mq_url, management_url, as_json)
    if not result.complete:
        if not as_json:
            echo("verify failed: the topology is incomplete", err=True)
        sys.exit(EXIT_UNHEALTHY)
    if result.having(UNVERIFIED):
        unverified = result.having(UNVERIFIED)
        are = "is" if len(unverified) == 1 else "are"
        echo(
            f"verify incomplete: {plural(len(unverified), 'binding')} {are} unverified "
            "(no management API)",
            err=True,
        )
        sys.exit(EXIT_UNVERIFIED)
    if not as_json:
        echo("verified: the broker holds the service's topology")
