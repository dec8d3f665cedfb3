"""The dashboard's pages: plain HTML and one stylesheet, no script. Every value is escaped
(`markup.html`); passwords in error texts are masked."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from ..dead_letters import DONE, FILTER_FIELDS, DeadLetter, Filters, Group, error_summary
from ..logsafe import mask_url
from ..queries.operations import WEBHOOK_FIELDS
from ..status import dead_count
from ..svgchart import CHART_CSS
from ..tracing import TRACEPARENT
from .markup import Safe, html, join
from .rates import Rates

STYLESHEET = (
    """
body { font: 14px/1.4 "Liberation Sans", "DejaVu Sans", sans-serif; margin: 0; color: #1f2328;
       background: #f6f8fa; }
header { background: #24292f; color: #fff; padding: 10px 24px; }
header a { color: #fff; text-decoration: none; font-weight: bold; }
main { padding: 16px 24px; }
h1 { font-size: 20px; margin: 8px 0 16px; }
h2 { font-size: 16px; margin: 24px 0 8px; }
table { border-collapse: collapse; background: #fff; margin-bottom: 8px; }
th, td { border: 1px solid #d0d7de; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #eaeef2; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #fff; border: 1px solid #d0d7de; padding: 8px; white-space: pre-wrap;
      word-break: break-all; max-width: 1100px; }
.badge { display: inline-block; padding: 2px 8px; border-radius: 10px; color: #fff; }
.healthy { background: #1a7f37; }
.unhealthy { background: #cf222e; }
.error { color: #cf222e; }
.note { color: #57606a; }
.button { display: inline-block; padding: 6px 14px; border: 0; border-radius: 6px; color: #fff;
          font: inherit; text-decoration: none; cursor: pointer; margin-right: 8px; }
.replay { background: #0969da; }
.purge { background: #cf222e; }
.park { background: #9a6700; }
.cancel { background: #6e7781; }
form.filters label { margin-right: 10px; }
form.filters input, form.filters select { font: inherit; }
dl.fields { display: grid; grid-template-columns: max-content auto; gap: 2px 16px;
            background: #fff; border: 1px solid #d0d7de; padding: 8px; max-width: 1100px; }
dl.fields dt { font-weight: bold; }
dl.fields dd { margin: 0; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(600px, 1fr)); gap: 12px;
          max-width: 1400px; margin: 16px 0; }
.charts figure { margin: 0; background: #fff; border: 1px solid #d0d7de; padding: 4px; }
"""
    + CHART_CSS
)


@dataclass(frozen=True)
class Shown:
    """One service as a page shows it: its status and rates, and what makes it unhealthy
    (`outbox_inbox.status.problems`); or the error that kept its status from being read."""

    name: str
    status: dict[str, Any] | None
    rates: Rates | None = None
    problems: list[str] = field(default_factory=list)
    error: str | None = None


_TRACEPARENT_RE = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")


def format_age(seconds: float | None) -> str:
    """A short duration: ``45s``, ``12m03s``, ``5h07m``, ``3d04h``; ``-`` for none."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def per_second(rates: Rates | None) -> list[str]:
    """Handled, new dead and backlog change, per second; ``-`` before there are rates."""
    values = (rates.processed, rates.dead, rates.backlog) if rates else (None, None, None)
    return ["-" if v is None else f"{v:.2f}/s" for v in values]


def trace_id(headers: dict[str, Any]) -> str | None:
    """The trace id of a W3C ``traceparent`` header, when the message carries a valid one."""
    value = headers.get(TRACEPARENT)
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str):
        return None
    match = _TRACEPARENT_RE.match(value.strip().lower())
    return match[1] if match else None


def link(path: str, **params: Any) -> str:
    """A dashboard URL with its query string (values of lists repeat the parameter)."""
    query = urlencode({k: v for k, v in params.items() if v is not None}, doseq=True)
    return f"{path}?{query}" if query else path


def page(title: str, body: Safe, *, refresh: int | None = None) -> Safe:
    head = html('<meta http-equiv="refresh" content="{}">', refresh) if refresh else Safe("")
    return html(
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        "<title>{} · outbox-inbox</title>{}"
        '<link rel=stylesheet href="/dashboard.css"></head>'
        '<body><header><a href="/">outbox-inbox dashboard</a></header>'
        "<main>{}</main></body></html>\n",
        title,
        head,
        body,
    )


def row(cells: Sequence[Any], numeric: Collection[int] = (), *, row_id: str = "") -> Safe:
    """A table row; the cells of the `numeric` columns are aligned right."""
    tds = join(
        html('<td class="num">{}</td>', cell) if i in numeric else html("<td>{}</td>", cell)
        for i, cell in enumerate(cells)
    )
    return html('<tr id="{}">{}</tr>', row_id, tds) if row_id else html("<tr>{}</tr>", tds)


def table(headers: Sequence[str], rows: Iterable[Safe], table_id: str = "") -> Safe:
    """A table of `rows` (`row`) under `headers`."""
    return html(
        "<table{}><thead><tr>{}</tr></thead><tbody>{}</tbody></table>",
        html(' id="{}"', table_id) if table_id else Safe(""),
        join(html("<th>{}</th>", h) for h in headers),
        join(rows),
    )


def error_text(message: str) -> Safe:
    return html('<p class="error">{}</p>', mask_url(message))


def health_badge(found: list[str]) -> Safe:
    if found:
        return html('<span class="badge unhealthy" title="{}">unhealthy</span>', "; ".join(found))
    return html('<span class="badge healthy">healthy</span>')


OVERVIEW_HEADERS = (
    "service", "health", "outbox unpublished", "outbox lag", "inbox pending", "in progress",
    "inbox lag", "processed", "dead", "handled", "new dead", "backlog change", "inbox queue",
)  # fmt: skip


def overview(entries: Sequence[Shown], charts: Safe, refresh: int | None) -> Safe:
    """One line per service (lag, backlog, rates, dead letters; or why it was not read), charts."""
    rows = []
    for entry in entries:
        name, status, rates = entry.name, entry.status, entry.rates
        page_link = link("/service", name=name)
        name_cell = html('<a href="{}">{}</a>', page_link, name)
        if status is None:
            failed = error_text(entry.error or "")
            rows.append(html('<tr><td>{}</td><td colspan="12">{}</td></tr>', name_cell, failed))
            continue
        outbox, inbox = status["outbox"], status["inbox"]
        queue = ((status.get("broker") or {}).get("queues") or {}).get(f"{name}.inbox")
        cells: list[Any] = [
            name_cell,
            health_badge(entry.problems),
            outbox["unpublished"],
            format_age(outbox["oldest_age_seconds"]),
            inbox["pending"],
            inbox["in_progress"],
            format_age(inbox["oldest_pending_age_seconds"]),
            inbox["processed"],
            html('<a href="{}#dead-letters">{}</a>', page_link, dead_count(status)),
            *per_second(rates),
            "-" if queue is None else queue["messages"],
        ]
        rows.append(row(cells, range(2, len(cells))))
    body = html(
        "<h1>Services</h1>{}"
        '<p class="note">Lag: age of the oldest unpublished outbox row and of the oldest pending '
        "inbox row (database clock). Rates: change per second since the oldest snapshot of the "
        "last five minutes (one is taken each time a page shows the service{}).</p>{}",
        table(OVERVIEW_HEADERS, rows, "services"),
        f"; this page reloads every {refresh}s" if refresh else "",
        charts,
    )
    return page("Services", body, refresh=refresh)


TENANT_HEADERS = ("tenant", "outbox", "inbox", "lag", "error")


def tenants_shown(tenants: dict[str, Any]) -> tuple[str, list[tuple[Any, ...]]]:
    """`outbox_inbox.status.tenant_status` as status and the dashboard show it: its totals in
    one line, and the ``top`` tenants as rows of tenant, outbox, inbox, lag, error."""
    totals = (
        "{count}, {waiting} waiting (outbox {outbox}, inbox {inbox}), {unreachable} unreachable,"
        " {never_drained} never drained for {drain_bound:g}s"
    ).format_map(tenants)
    return totals, [
        (t["tenant"], t["outbox"], t["inbox"], format_age(t["lag_seconds"]), t["error"] or "")
        for t in tenants["top"]
    ]


def service_status(entry: Shown, charts: Safe) -> Safe:
    """A service's status, the problems that make it unhealthy, and its charts."""
    name, status, rates, found = entry.name, entry.status, entry.rates, entry.problems
    if status is None:
        return html("<h1>{}</h1>{}", name, error_text(entry.error or ""))
    outbox, inbox = status["outbox"], status["inbox"]
    summary = html(
        "<h1>{} {}</h1>"
        '<dl class="fields" id=summary>'
        "<dt>outbox</dt><dd>unpublished {} (retrying {}), dead {}, oldest {}</dd>"
        "<dt>inbox</dt><dd>pending {}, in progress {}, dead {}, processed {}, "
        "oldest pending {}</dd>"
        "<dt>rates</dt><dd>handled {}, new dead {}, backlog change {}{}</dd>"
        "<dt>database time</dt><dd>{} (schema {})</dd>"
        "</dl>",
        name,
        health_badge(found),
        outbox["unpublished"],
        outbox["retrying"],
        outbox.get("dead", 0),
        format_age(outbox["oldest_age_seconds"]),
        inbox["pending"],
        inbox["in_progress"],
        inbox["dead"],
        inbox["processed"],
        format_age(inbox["oldest_pending_age_seconds"]),
        *per_second(rates),
        f" over {rates.span:.0f}s" if rates else " (after the next reload)",
        status["database_time"],
        status["schema"],
    )
    parts = [summary]
    if found:
        parts.append(join(error_text(p) for p in found))
    parts.append(charts)
    if inbox["by_type"]:
        parts.append(html("<h2>Inbox by type</h2>"))
        per_type = (
            (t["type"], t["pending"], t["in_progress"], t["dead"], cap_shown(t))
            for t in inbox["by_type"]
        )
        headers = ["type", "pending", "in progress", "dead", "cap"]
        parts.append(table(headers, (row(c, {1, 2, 3}) for c in per_type)))
    if inbox["by_tenant"]:
        parts.append(html("<h2>Tenants waiting: {}</h2>", inbox["tenants_waiting"]))
        cells = ((t["tenant"], t["pending"], t["in_progress"]) for t in inbox["by_tenant"])
        parts.append(table(["tenant", "pending", "in progress"], (row(c, {1, 2}) for c in cells)))
    if status.get("tenants"):
        totals, listed = tenants_shown(status["tenants"])
        parts.append(html("<h2 id=tenants>Tenants: {}</h2>", totals))
        parts.append(table(TENANT_HEADERS, (row(c, {1, 2}) for c in listed)))
    if outbox.get("webhooks"):
        parts.append(html("<h2>Webhook endpoints</h2>"))
        fields = ([w[f] for f in WEBHOOK_FIELDS] for w in outbox["webhooks"])  # None shows ""
        headers = ["endpoint", "waiting", "failing", "dead", "last error"]
        parts.append(table(headers, (row(c, {1, 2, 3}) for c in fields)))
    held = status["held_keys"]
    parts.append(html("<h2>Held-back keys: {}</h2>", held["count"]))
    if held["keys"]:
        columns = ("key", "message_id", "type", "failures", "waiting", "next_attempt_at")
        headers = ["key", "head message", "type", "failures", "waiting", "next attempt", "error"]
        rows = (row([*(k[c] for c in columns), k["last_error"]], {3, 4}) for k in held["keys"])
        parts.append(table(headers, rows))
    broker = status.get("broker")
    if broker is not None:
        parts.append(html("<h2>Queues</h2>"))
        queue_rows = [
            (q, "missing", "") if info is None else (q, info["messages"], info["consumers"])
            for q, info in broker["queues"].items()
        ]
        headers = ["queue", "messages", "consumers"]
        parts.append(table(headers, (row(r, {1, 2}) for r in queue_rows)))
        if broker.get("error"):
            parts.append(error_text(f"broker: {broker['error']}"))
    return join(parts)


def filter_form(name: str, sources: list[str], values: dict[str, str]) -> Safe:
    options = join(
        html("<option{}>{}</option>", Safe(" selected") if values.get("source") == s else "", s)
        for s in ["all", *sources]
    )
    fields = (
        html(
            '<label>{} <input name="{}" value="{}" placeholder="{}" size=14></label>',
            f.flag.replace("-", " "),
            f.key,
            values.get(f.key, ""),
            f.example,
        )
        for f in FILTER_FIELDS
        if f.example
    )
    return html(
        '<form class=filters method=get action="/service">'
        '<input type=hidden name=name value="{}">'
        "<label>source <select name=source>{}</select></label>{}"
        '<button class="button replay" type=submit>Filter</button></form>',
        name,
        options,
        join(fields),
    )


def cap_shown(by_type: dict[str, Any]) -> str:
    """A type's caps as status shows them: ``2`` (``max_concurrency``), ``10/1s`` (rate),
    ``2, 10/1s``, each followed by ``binding`` while they hold back work; nothing without."""
    cap, rate = by_type.get("cap"), by_type.get("rate")
    shown = ", ".join(str(c) for c in (cap, rate and f"{rate[0]}/{rate[1]:g}s") if c)
    return f"{shown} binding" if shown and by_type.get("cap_binding") else shown


def letters_table(name: str, letters: list[DeadLetter]) -> Safe:
    rows = []
    for d in letters:
        target = link("/letter", service=name, source=d.source, id=d.message_id)
        shown = html('<a class=letter href="{}">{}</a>', target, d.message_id or "(no message id)")
        attempts = "" if d.attempts is None else d.attempts
        error = error_summary(mask_url(d.error) if d.error else None) or ""
        age = format_age(d.age_seconds)
        cells = (d.source, shown, d.type, d.reason_shown, age, attempts, error)
        rows.append(row(cells, {4, 5}))
    headers = ("source", "message id", "type", "reason", "age", "attempts", "error")
    return table(headers, rows, "letters")


#: What each action does to the letters, on its confirmation page; and what it did.
_WHAT = {
    "replay": "sent back to be handled again",
    "purge": "deleted for good; this cannot be undone",
    "park": "set aside as parked: out of the dead letters, kept, replayable later",
}


def groups_section(name: str, dead: list[Group], parked: list[Group]) -> Safe:
    """The dead rows grouped by cause (replay, purge or park a group, per source), and the
    parked ones (replay or purge), as `outbox-inbox dead-letters groups` counts them."""
    parts = [html("<h2 id=groups>Dead-letter groups</h2>"), _groups_table(name, dead, False)]
    if parked:
        parts.append(html("<h2 id=parked>Parked</h2>"))
        parts.append(_groups_table(name, parked, True))
    return join(parts)


def _groups_table(name: str, groups: list[Group], parked: bool) -> Safe:
    if not groups:
        return html("<p>No dead letters in the table or the outbox.</p>")
    actions = ("replay", "purge") if parked else ("replay", "purge", "park")
    flag = "1" if parked else None
    rows = []
    for g in groups:
        links = join(
            _confirm_button(
                f"{action.capitalize()} ({source})", name, source, action, group=g.id, parked=flag
            )
            for source in g.sources
            for action in actions
        )
        seen = (t.isoformat(timespec="seconds") if t else "" for t in (g.first_seen, g.last_seen))
        types, sources = ", ".join(g.types), ", ".join(g.sources)
        cells = (g.id, g.count, types, sources, *seen, g.replayed, g.fingerprint, links)
        rows.append(row(cells, {1, 6}, row_id=f"group-{g.id}"))
    headers = ["group", "count", "types", "sources", "first seen", "last seen"]
    headers += ["dead again after a replay", "cause", ""]
    return table(headers, rows, "parked-groups" if parked else "dead-groups")


def bulk_links(name: str, by_source: dict[str, list[str]]) -> Safe:
    """Replay / purge every listed letter of one source (each confirmed on the next page)."""
    links = []
    for source, ids in by_source.items():
        if not ids:
            continue
        for action in ("replay", "purge"):
            label = f"{action.capitalize()} these {len(ids)} ({source})"
            links.append(_confirm_button(label, name, source, action, id=ids))
    return html("<p>{}</p>", join(links)) if links else Safe("")


def _confirm_button(
    label: str, name: str, source: str, action: str, element_id: str = "", **params: Any
) -> Safe:
    """A button to the confirmation page of `action` on the letters of `source` `params` pick
    (with the HTML id `element_id`, if one is given)."""
    target = link("/confirm", service=name, source=source, action=action, **params)
    attribute = html(' id="{}"', element_id) if element_id else Safe("")
    return html('<a class="button {}"{} href="{}">{}</a>', action, attribute, target, label)


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=str, sort_keys=True)


def letter_page(name: str, letter: DeadLetter) -> Safe:
    as_dict = letter.as_dict()
    trace = trace_id(dict(letter.headers))
    fields = [
        ("service", name),
        ("source", letter.source),
        ("ref", letter.ref),
        ("message id", letter.message_id),
        ("type", letter.type),
        ("kind", letter.kind),
        ("key", letter.key),
        ("correlation id", letter.correlation_id),
        ("trace id", trace or "-"),
        ("reason", letter.reason),
        ("dead at", letter.dead_at.isoformat() if letter.dead_at else None),
        ("age", format_age(letter.age_seconds)),
        ("attempts", letter.attempts),
    ]
    dl = join(html("<dt>{}</dt><dd>{}</dd>", k, "" if v is None else v) for k, v in fields)
    # Below the error, so that the actions keep their place at the top of the page.
    cause = [
        ("fingerprint", letter.fingerprint),
        ("group", as_dict["group"]),
        ("replays", letter.replays),
        ("replayed at", letter.replayed_at.isoformat() if letter.replayed_at else None),
    ]
    cause_dl = join(html("<dt>{}</dt><dd>{}</dd>", k, "" if v is None else v) for k, v in cause)
    actions = join(
        _confirm_button(
            f"{action.capitalize()}…", name, letter.source, action, action, id=letter.message_id
        )
        for action in ("replay", "purge")
    )
    body = html(
        "<h1>Dead letter {}</h1><dl class=fields id=fields>{}</dl><p>{}</p>"
        "<h2>Payload</h2><pre id=payload>{}</pre>"
        "<h2>Headers</h2><pre id=headers>{}</pre>"
        "<h2>Error</h2><pre id=error>{}</pre>"
        "<h2>Cause</h2><dl class=fields id=cause>{}</dl>",
        letter.message_id,
        dl,
        actions,
        _json(as_dict["payload"]),
        _json(as_dict["headers"]),
        mask_url(letter.error) if letter.error else "(none)",
        cause_dl,
    )
    return page(f"Dead letter {letter.message_id}", body)


def confirm_page(
    name: str,
    source: str,
    action: str,
    letters: list[DeadLetter],
    missing: list[str],
    csrf: str,
    *,
    group: Filters | None = None,
    more: bool = False,
) -> Safe:
    """What `action` would do to `letters`, and its form. `group`: the dead-letter group
    (fingerprint) and parked state the form keeps to; `more`: the group has more than these."""
    group = group or Filters()
    hidden = [("csrf", csrf), ("service", name), ("source", source), ("action", action)]
    hidden += [("id", d.message_id) for d in letters]
    if group.fingerprint is not None:
        hidden.append(("group", group.fingerprint))
    inputs = join(html('<input type=hidden name={} value="{}">', k, v) for k, v in hidden)
    if group.parked:
        inputs = join([inputs, html("<input type=hidden name=parked value=1>")])
    heading = "<h1>{} {} dead letter(s) of {} ({})?</h1><p>They will be {}.</p>"
    asked = html(heading, action.capitalize(), len(letters), name, source, _WHAT[action])
    parts = [asked, letters_table(name, letters)]
    if group.fingerprint is not None:
        parts.insert(1, html("<p id=group>Group: {}</p>", group.fingerprint))
    if more:
        parts.append(
            html(
                '<p class="note">The group has more than these {}: {} them, then again for '
                "the rest.</p>",
                len(letters),
                action,
            )
        )
    if missing:
        parts.append(
            html(
                '<p class="note">Not dead letters of {} any more (replayed, purged or never '
                "there): {}</p>",
                source,
                ", ".join(missing),
            )
        )
    back = link("/service", name=name)
    if letters:
        parts.append(
            html(
                '<form method=post action="/act" id=confirm>{}'
                '<button class="button {}" type=submit id=confirm-button>{} {}</button>'
                '<a class="button cancel" href="{}">Cancel</a></form>',
                inputs,
                action,
                action.capitalize(),
                f"{len(letters)} dead letter(s)",
                back,
            )
        )
    else:
        parts.append(html('<p>Nothing to {}. <a href="{}">Back</a></p>', action, back))
    return page(f"{action.capitalize()} dead letters", join(parts))


def result_page(
    name: str,
    action: str,
    source: str,
    done: list[str],
    kept: list[tuple[str, str]],
    missing: list[str],
    error: str | None,
) -> Safe:
    verb, total = DONE[action], len(done) + len(kept) + len(missing)
    heading = "<h1 id=result>{} {} of {} dead letter(s) ({})</h1>"
    parts = [html(heading, verb.capitalize(), len(done), total, source)]
    if error:
        parts.append(error_text(f"stopped by an error: {error}"))
    listed = (
        (verb.capitalize(), "done", done),
        ("Kept", "kept", [f"{m}: {why}" for m, why in kept]),
        ("Not found", "missing", missing),
    )
    for title, list_id, items in listed:
        if items:
            lines = join(html("<li>{}</li>", item) for item in items)
            parts.append(html("<h2>{}</h2><ul id={}>{}</ul>", title, list_id, lines))
    parts.append(html('<p><a href="{}">Back to {}</a></p>', link("/service", name=name), name))
    return page(f"{verb.capitalize()} dead letters", join(parts))


def message_page(title: str, message: str) -> Safe:
    return page(title, html("<h1>{}</h1>{}", title, error_text(message)))
