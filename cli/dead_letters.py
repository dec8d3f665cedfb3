"""`outbox-inbox dead-letters list | count | show | groups | replay | purge | park`.

Sources: ``table`` (dead inbox rows), ``outbox`` (outbox rows the broker refused), ``queue``
(``<service>.dead_letter``) and ``unroutable`` (commands no service had a queue for). See
outbox_inbox.dead_letters for what each action does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import click

from outbox_inbox.dashboard.views import format_age
from outbox_inbox.dead_letters import (
    DONE,
    FILTER_FIELDS,
    OUTBOX,
    PARK,
    SOURCES,
    TABLE,
    ActionReport,
    DeadLetter,
    DeadLetters,
    FilterError,
    Filters,
    Selection,
    TableSelection,
    error_summary,
    parse_message_id,
)

from .audit import audit_log_option
from .output import EXIT_UNHEALTHY, echo, echo_json, mask, one_line, plural, progress, render_table
from .target import Target, fail, json_option, resolve, target_options

#: How many rows of a selection replay and purge print before acting.
SHOWN = 50


@click.group("dead-letters")
def dead_letters() -> None:
    """List, show, group, replay, purge and park dead letters.

    \b
    Sources (--source):
      table       inbox rows with status dead (the worker gave up on them)
      outbox      outbox rows the broker refused on every attempt (the relay gave up)
      queue       the broker queue <service>.dead_letter (the receiver could not store them)
      unroutable  the broker queue unroutable (commands for a service with no queue)
      all         the four, in that order

    Reading a broker queue takes up to --limit messages without acknowledging them and then
    releases them: they stay in the queue, in their place, flagged redelivered.

    Each dead letter has a fingerprint of its cause; `groups` counts them by it, and --group
    selects one group (by its fingerprint or the ID `groups` prints). `park` sets dead rows
    aside (table and outbox): --parked selects them again.
    """


def filter_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add the options of `FILTER_FIELDS` to `command`, which gets them as one `Filters`, its
    ``filters`` argument (--group as given: `_resolved` reads its fingerprint). A filter that
    does not read is a usage error (exit 2) before the command runs."""

    @functools.wraps(command)
    def with_filters(**options: Any) -> Any:
        try:
            filters = Filters.read({f.name: options.pop(f.name) for f in FILTER_FIELDS})
        except FilterError as exc:
            raise click.BadParameter(str(exc), param_hint=f"--{exc.flag}") from exc
        return command(filters=filters, **options)

    for f in reversed(FILTER_FIELDS):
        kind = {"is_flag": True} if f.switch else {"multiple": f.many, "metavar": f.metavar}
        with_filters = click.option(f"--{f.flag}", f.name, help=f.help, **kind)(with_filters)
    return with_filters


def _resolved(target: Target, filters: Filters) -> Filters:
    """`filters` with a --group ID replaced by its group's fingerprint (read from the
    database when there is one; else the value is the fingerprint)."""
    if filters.fingerprint is None or not target.has_database:
        return filters
    fingerprint = _dead_letters(target).group(filters.fingerprint, parked=filters.parked)
    return dataclasses.replace(filters, fingerprint=fingerprint)


def _dead_letters(target: Target) -> DeadLetters:
    """The library's view of the target's dead letters (what it can reach; the app's
    retention, else the default one)."""
    letters = DeadLetters(
        engine=target.engine() if target.has_database else None,
        tables=target.tables if target.has_database else None,
        broker=target.broker() if target.has_broker else None,
        service=target.name,
    )
    if target.service is not None:
        seconds = target.service.settings.retention
        letters.retention = None if seconds is None else timedelta(seconds=seconds)
    return letters


def _sources(target: Target, source: str, *, strict: bool, tables_only: bool = False) -> list[str]:
    """The sources to read. `strict`: every source asked for must be reachable (actions).
    `tables_only` (parked rows, park): "all" means the table and outbox sources."""
    if tables_only and source not in ("all", TABLE, OUTBOX):
        fail(f"--source {source} has no parked letters: only table and outbox can be parked")
    chosen, missing = _dead_letters(target).reachable(source)
    if tables_only:
        chosen = [s for s in chosen if s in (TABLE, OUTBOX)]
        missing = [(s, why) for s, why in missing if s in (TABLE, OUTBOX)]
    for name, why in missing:
        why = {
            "no database": "no database (--db-url)",
            "no RabbitMQ broker": "no broker (--mq-url)",
            "no service name": "no service (--app or --service)",
        }.get(why, why)
        if strict or source != "all":
            fail(f"--source {name} needs {why}")
        echo(f"note: skipping {name}: {why}", err=True)
    return chosen


@contextlib.contextmanager
def _selections(
    target: Target, sources: list[str], filters: Filters, limit: int | None
) -> Iterator[list[Selection]]:
    """Open one selection per source; close them all (releasing queue messages) at the end."""
    with contextlib.ExitStack() as stack:
        stack.callback(target.close)
        yield stack.enter_context(_dead_letters(target).select(sources, filters, limit))


def _letters_table(letters: list[DeadLetter]) -> str:
    rows = [
        (
            d.source,
            d.ref,
            d.message_id,
            d.type,
            d.reason_shown,
            format_age(d.age_seconds),
            "" if d.attempts is None else d.attempts,
            one_line(error_summary(d.error), 60),
        )
        for d in letters
    ]
    headers = ["SOURCE", "REF", "MESSAGE ID", "TYPE", "REASON", "AGE", "ATTEMPTS", "ERROR"]
    return render_table(headers, rows)


def _counts(selections: list[Selection]) -> str:
    """Per source, by the name --source gives it (as `count` prints them)."""
    return ", ".join(f"{s.source} {len(s.letters)}" for s in selections) or "no sources"


def _more_note(selections: list[Selection], limit: int | None) -> None:
    for s in selections:
        if s.more:
            where = s.source if isinstance(s, TableSelection) else f"{s.source} ({s.queue})"
            echo(
                f"note: {where} has more than --limit {limit}; raise --limit to see them", err=True
            )


#: --source of the commands that read (list, count, show).
source_option = click.option(
    "--source",
    type=click.Choice([*SOURCES, "all"]),
    default="all",
    show_default=True,
    help="Where to look.",
)


@dead_letters.command("list", short_help="List dead letters matching the filters.")
@target_options
@source_option
@filter_options
@click.option(
    "--limit",
    default=100,
    show_default=True,
    type=click.IntRange(min=1),
    metavar="N",
    help="At most N per source (broker queues: messages read).",
)
@json_option
def list_command(
    source: str, filters: Filters, limit: int, as_json: bool, **target_options: str | None
) -> None:
    """List dead letters matching the filters, oldest first within each source (--parked:
    the parked rows)."""
    target = resolve(**target_options)
    sources = _sources(target, source, strict=False, tables_only=filters.parked)
    filters = _resolved(target, filters)
    with _selections(target, sources, filters, limit) as selections:
        letters = [d for s in selections for d in s.letters]
        if as_json:
            echo_json(
                {
                    "filters": filters.as_dict(),
                    "sources": {
                        s.source: {"count": len(s.letters), "more": s.more} for s in selections
                    },
                    "dead_letters": [d.as_dict() for d in letters],
                }
            )
            return
        if letters:
            echo(_letters_table(letters))
        echo(f"{plural(len(letters), 'dead letter')}: {_counts(selections)}")
        _more_note(selections, limit)


@dead_letters.command(short_help="Count dead letters matching the filters.")
@target_options
@source_option
@filter_options
@json_option
def count(source: str, filters: Filters, as_json: bool, **target_options: str | None) -> None:
    """Count dead letters per source without loading them (tables: one query each).

    A broker queue is counted by its depth, or, with a filter, by reading it (its messages
    are given back, flagged redelivered).
    """
    target = resolve(**target_options)
    try:
        sources = _sources(target, source, strict=False, tables_only=filters.parked)
        filters = _resolved(target, filters)
        counts = _dead_letters(target).count(sources, filters)
    finally:
        target.close()
    if as_json:
        echo_json({"filters": filters.as_dict(), "counts": counts, "total": sum(counts.values())})
        return
    echo(render_table(["SOURCE", "DEAD LETTERS"], [[s, n] for s, n in counts.items()]))
    echo(plural(sum(counts.values()), "dead letter"))


@dead_letters.command(short_help="Show one dead letter in full.")
@click.argument("message_id")
@target_options
@source_option
@click.option(
    "--limit",
    default=1000,
    show_default=True,
    type=click.IntRange(min=1),
    metavar="N",
    help="Broker queues: at most N messages are read looking for it.",
)
@json_option
def show(
    message_id: str, source: str, limit: int, as_json: bool, **target_options: str | None
) -> None:
    """Show everything about the dead letter MESSAGE_ID: payload, headers, full error."""
    filters = Filters(message_ids=(parse_message_id(message_id),))
    target = resolve(**target_options)
    sources = _sources(target, source, strict=False)
    with _selections(target, sources, filters, limit) as selections:
        letters = [d for s in selections for d in s.letters]
        searched = ", ".join(s.source for s in selections)
    if not letters:
        fail(f"no dead letter with message id {message_id} in {searched or 'no source'}")
    if as_json:
        echo_json([d.as_dict() for d in letters])
        return
    for index, letter in enumerate(letters):
        if index:
            echo()
        _print_letter(letter)


def _print_letter(letter: DeadLetter) -> None:
    where = (
        f"row {letter.ref}"
        if letter.source in (TABLE, OUTBOX)
        else f"position {letter.ref} as read"
    )
    fields = [
        ("source", f"{letter.source} ({where})"),
        ("message id", letter.message_id),
        ("type", letter.type),
        ("kind", letter.kind),
        ("key", letter.key),
        ("correlation id", letter.correlation_id),
        ("reason", letter.reason),
        ("dead at", letter.dead_at.isoformat() if letter.dead_at else None),
        ("age", format_age(letter.age_seconds)),
        ("attempts", letter.attempts),
        ("fingerprint", letter.fingerprint),
        ("group", letter.as_dict()["group"]),
        ("replays", letter.replays or None),
        ("replayed at", letter.replayed_at.isoformat() if letter.replayed_at else None),
    ]
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        echo(f"{name.ljust(width)}  {'' if value is None else value}")
    echo("headers:")
    echo(_indent(json.dumps(letter.as_dict()["headers"], indent=2, ensure_ascii=False)))
    echo("payload:")
    echo(_indent(json.dumps(letter.payload, indent=2, ensure_ascii=False, default=str)))
    if letter.error:
        echo("error:")
        echo(_indent(letter.error.rstrip()))


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _action_options(function: Callable[..., Any]) -> Callable[..., Any]:
    options: list[Callable[[Any], Any]] = [
        target_options,
        click.option(
            "--source",
            type=click.Choice([*SOURCES, "all"]),
            required=True,
            help="Where to act: table, outbox, queue, unroutable, or all four.",
        ),
        filter_options,
        click.option(
            "--all",
            "everything",
            is_flag=True,
            help="Act on every dead letter of the source(s) (needed when no filter is given).",
        ),
        click.option(
            "--limit",
            type=click.IntRange(min=1),
            metavar="N",
            help="At most N per source, oldest first [default: all].",
        ),
        click.option(
            "--rate",
            type=click.FloatRange(min=0, min_open=True),
            metavar="N",
            help="At most N messages per second [default: no limit].",
        ),
        click.option("--dry-run", is_flag=True, help="Show what would be done; change nothing."),
        audit_log_option,
        json_option,
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _act(
    action: str,
    *,
    source: str,
    filters: Filters,
    everything: bool,
    limit: int | None,
    rate: float | None,
    dry_run: bool,
    audit_log: str,
    as_json: bool,
    yes: bool = True,
    **target_options: str | None,
) -> None:
    """Select, show, (confirm,) act and audit (DeadLetters.run): replay's and purge's body,
    with the options of `_action_options` as click gives them."""
    if filters.empty and not everything:
        given = ", ".join(f"--{f.flag}" for f in FILTER_FIELDS if f.flag != "id")
        raise click.UsageError(f"choose what to {action}: --id, a filter ({given}), or --all")
    target = resolve(**target_options)
    tables_only = filters.parked or action == PARK
    sources = _sources(target, source, strict=True, tables_only=tables_only)
    filters = _resolved(target, filters)
    with _selections(target, sources, filters, limit) as selections:
        total = sum(len(s.letters) for s in selections)
        if not as_json:
            _show_selected(selections, limit)
        if total and not dry_run and not yes:
            click.confirm(
                f"{action.capitalize()} {plural(total, 'dead letter')} ({_counts(selections)})? "
                "This cannot be undone.",
                abort=True,
                err=True,
            )
        try:
            with progress(total if total and not dry_run else 0, f"{action} {total}") as advance:
                report = _dead_letters(target).run(
                    action,
                    selections,
                    filters=filters,
                    source=source,
                    rate=rate,
                    progress=advance,
                    dry_run=dry_run,
                    audit_log=audit_log,
                    mask=mask,
                )
        except BaseException:
            _print_partial(action, selections)
            raise
    _print_report(report, selections, as_json)


def _print_partial(action: str, selections: list[Selection]) -> None:
    """On stderr, what an action that failed did before it failed (the audit line has it)."""
    verb = DONE[action]
    for selection in selections:
        if selection.outcome is not None:
            outcome = selection.outcome
            echo(
                f"{selection.source}: {verb} {len(outcome.done)} of {outcome.selected} "
                "before the error",
                err=True,
            )


def _show_selected(selections: list[Selection], limit: int | None) -> None:
    letters = [d for s in selections for d in s.letters]
    if letters:
        echo(_letters_table(letters[:SHOWN]))
        if len(letters) > SHOWN:
            echo(f"... and {len(letters) - SHOWN} more")
    echo(f"selected {plural(len(letters), 'dead letter')}: {_counts(selections)}")
    _more_note(selections, limit)


def _print_report(report: ActionReport, selections: list[Selection], as_json: bool) -> None:
    verb = DONE[report.action]
    if as_json:
        shown: dict[str, Any] = {"dry_run": report.dry_run}
        if report.dry_run or not report.selected:
            shown["selected"] = [d.as_dict() for d in report.selected]
        shown["results"] = [o.as_dict() for o in report.outcomes]
        shown["audit"] = report.audit
        shown["warnings"] = report.warnings
        echo_json(shown)
    elif report.dry_run:
        echo(f"dry run: nothing {verb}")
    elif not report.selected:
        echo(f"nothing to {report.action}")
    for selection, outcome in zip(selections, report.outcomes, strict=False):
        if as_json:
            break
        echo(f"{selection.source}: {verb} {len(outcome.done)} of {outcome.selected}")
        for message_id, why in outcome.kept:
            echo(f"  kept {message_id}: {why}")
    for warning in report.warnings if not as_json else ():
        echo(f"warning: {warning}", err=True)
    if report.kept:
        sys.exit(EXIT_UNHEALTHY)


@dead_letters.command(short_help="Send dead letters back to be handled, in order.")
@_action_options
def replay(**options: Any) -> None:
    """Send dead letters back to be handled again, in their original order.

    \b
    table       rows become pending, due now, with fresh attempt counters (id order)
    queue       each message is republished (confirmed) to <service>.inbox without its
                failure headers, then removed from <service>.dead_letter (queue order)
    unroutable  each command is republished to the exchange and routing key it was sent
                with; one that still has no queue lands back in `unroutable` and is
                reported as kept

    Choose one (--id), by filter, or --all. Writes one audit line (--audit-log).
    Exit 4 when some selected dead letters were kept where they were.
    """
    _act("replay", **options)


@dead_letters.command(short_help="Delete dead letters for good (asks first).")
@_action_options
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
def purge(yes: bool, **options: Any) -> None:
    """Delete dead letters for good: exactly the ones selected and shown.

    Table rows are deleted (only those still dead); queue messages are acknowledged. Asks
    for confirmation unless --yes. Writes one audit line (--audit-log).
    """
    _act("purge", yes=yes or options["dry_run"], **options)


@dead_letters.command(short_help="Set dead rows aside: out of the dead letters, kept.")
@_action_options
def park(**options: Any) -> None:
    """Set dead rows aside as parked: out of `list`, `count`, `groups` and of every replay
    and purge, kept for inspection. `list --parked` lists them; `replay --parked` and
    `purge --parked` act on them later.

    Table and outbox rows only (--source all means these two). Choose by --group, another
    filter or --all. Writes one audit line (--audit-log).
    """
    _act(PARK, **options)


@dead_letters.command(short_help="Dead letters grouped by cause.")
@target_options
@click.option("--parked", is_flag=True, help="Group the parked rows instead.")
@json_option
def groups(parked: bool, as_json: bool, **target_options: str | None) -> None:
    """The dead rows of the table and outbox sources grouped by the fingerprint of their
    cause (the exception's type and the handler's function, or the reason), largest first,
    counted by the database: ID (for --group), count, types, sources, when the first and
    last died, and how many died again after a replay. The broker queues are not counted:
    `list --source queue --json` shows each message's fingerprint.
    """
    target = resolve(**target_options)
    try:
        if not target.has_database:
            fail("groups needs a database (--db-url)")
        found = _dead_letters(target).groups(parked=parked)
    finally:
        target.close()
    if as_json:
        echo_json({"parked": parked, "groups": [g.as_dict() for g in found]})
        return
    rows = [
        (
            g.id,
            g.count,
            one_line(", ".join(g.types), 40),
            ",".join(g.sources),
            g.first_seen.isoformat(timespec="seconds") if g.first_seen else "",
            g.last_seen.isoformat(timespec="seconds") if g.last_seen else "",
            g.replayed,
            g.fingerprint,
        )
        for g in found
    ]
    headers = ["ID", "COUNT", "TYPES", "SOURCES", "FIRST SEEN", "LAST SEEN", "REPLAYED"]
    if rows:
        echo(render_table([*headers, "FINGERPRINT"], rows))
    what = "parked letter" if parked else "dead letter"
    total = sum(g.count for g in found)
    echo(f"{plural(len(found), 'group')}, {plural(total, what)}")
