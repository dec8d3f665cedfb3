"""The dashboard as a WSGI application: a few routes over `WatchedService`, those of
docs/dashboard.md ("What it shows") and ``/dashboard.css``.

Each request runs in its own thread of the server and opens its own broker connections; the database
engines are shared (SQLAlchemy pools are thread-safe). The overview reads its services at the same
time, each in a thread of its own: a page takes as long as the slowest service, not the sum of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qs

from ..dead_letters import ACTIONS, FILTER_FIELDS, OUTBOX, PARK, TABLE, Filters, parse_message_id
from ..errors import ConfigurationError, OutboxInboxError
from ..logsafe import mask_url
from . import views
from .charts import charts
from .letters import AuditWriter, WatchedService, act
from .markup import Safe, html, join
from .rates import RateTracker
from .security import CSRF_FIELD, Guard

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]

#: The most a form may send, and the most ids one action takes.
MAX_BODY = 256 * 1024
MAX_IDS = 1000
#: Dead letters listed per source on a service's page (broker queues: messages read).
LIST_LIMIT = 100

SECURITY_HEADERS = [
    (
        "Content-Security-Policy",
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "same-origin"),
    ("Cache-Control", "no-store"),
]


class BadRequest(Exception):
    """The request's parameters are wrong: shown to the user with status 400."""


class NotFound(Exception):
    """No such page, service or dead letter: status 404."""


#: The answer to each error a request may end in: its status and its page's title.
_ERROR_PAGES: dict[type[Exception], tuple[str, str]] = {
    BadRequest: ("400 Bad Request", "Bad request"),
    NotFound: ("404 Not Found", "Not found"),
    PermissionError: ("403 Forbidden", "Refused"),
    OutboxInboxError: ("503 Service Unavailable", "Server unavailable"),
}


def parse_filters(query: dict[str, str]) -> Filters:
    """The filters of a service page's form (`FILTER_FIELDS` that have an example)."""
    shown = (f for f in FILTER_FIELDS if f.example)
    given = {f.name: query.get(f.key, "").split(",") if f.many else query.get(f.key) for f in shown}
    try:
        return Filters.read(given)
    except ConfigurationError as exc:
        raise BadRequest(str(exc)) from exc


class Dashboard:
    """The WSGI application. `audit` writes one line per action (cli/audit.py, `write_audit`);
    `refresh` reloads the overview every so many seconds (0: never); `max_lag` (seconds) is
    the lag bound of the health, as `outbox-inbox status --max-lag` (None: no lag limit, and
    a stalled inbox after outbox_inbox.status.STALLED_AFTER)."""

    def __init__(
        self,
        services: list[WatchedService],
        *,
        audit: AuditWriter,
        guard: Guard | None = None,
        refresh: int = 10,
        max_lag: float | None = None,
    ) -> None:
        if not services:
            raise ValueError("the dashboard needs at least one service")
        self.services = {s.name: s for s in services}
        if len(self.services) != len(services):
            raise ValueError("two services have the same name")
        self.guard = guard or Guard()
        self.audit, self.refresh, self.max_lag = audit, refresh, max_lag
        self.rates = RateTracker()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        headers = list(SECURITY_HEADERS)
        if not self.guard.host_allowed(environ):
            wrong_host = views.message_page(
                "Wrong host", "this dashboard answers on a loopback address only"
            )
            return self._respond(start_response, "421 Misdirected Request", headers, wrong_host)
        user = self.guard.user(environ)
        if user is None:
            realm = 'Basic realm="outbox-inbox dashboard", charset="UTF-8"'
            headers.append(("WWW-Authenticate", realm))
            log_in = views.message_page("Log in", "this dashboard needs its token")
            return self._respond(start_response, "401 Unauthorized", headers, log_in)
        cookie = self.guard.csrf_cookie(environ)
        if cookie is None:
            cookie, set_cookie = self.guard.new_cookie()
            headers.append(set_cookie)
        method = str(environ.get("REQUEST_METHOD", "GET"))
        path = str(environ.get("PATH_INFO", "/"))
        try:
            if path == "/dashboard.css" and method in ("GET", "HEAD"):
                headers.append(("Content-Type", "text/css; charset=utf-8"))
                start_response("200 OK", headers)
                return [views.STYLESHEET.encode("utf-8")]
            query = _single(parse_qs(str(environ.get("QUERY_STRING", ""))))
            if method in ("GET", "HEAD"):
                body = self._get(path, query, environ, cookie)
            elif method == "POST" and path == "/act":
                body = self._post_act(environ, user)
            else:
                raise NotFound(f"no page {method} {path}")
            return self._respond(start_response, "200 OK", headers, body)
        except tuple(_ERROR_PAGES) as exc:
            if isinstance(exc, OutboxInboxError):
                log.warning("dashboard: %s", mask_url(str(exc)))
            status, title = next(p for e, p in _ERROR_PAGES.items() if isinstance(exc, e))
            page = views.message_page(title, str(exc))
            return self._respond(start_response, status, headers, page)

    @staticmethod
    def _respond(
        start_response: StartResponse, status: str, headers: list[tuple[str, str]], body: Safe
    ) -> list[bytes]:
        data = body.encode("utf-8")
        length = ("Content-Length", str(len(data)))
        start_response(status, [*headers, ("Content-Type", "text/html; charset=utf-8"), length])
        return [data]

    def _service(self, name: str | None) -> WatchedService:
        service = self.services.get(name or "")
        if service is None:
            raise NotFound(f"no service {name!r} on this dashboard")
        return service

    @staticmethod
    def _source(service: WatchedService, source: str | None) -> str:
        if source not in service.sources():
            raise BadRequest(
                f"{service.name} has no dead-letter source {source!r}; "
                f"it has {', '.join(service.sources())}"
            )
        return source

    def _get(self, path: str, query: dict[str, str], environ: dict[str, Any], cookie: str) -> Safe:
        if path == "/":
            return self._overview()
        if path == "/service":
            return self._service_page(self._service(query.get("name")), query)
        if path == "/letter":
            return self._letter(query)
        if path == "/confirm":
            return self._confirm(environ, cookie)
        raise NotFound(f"no page {path}")

    def _status(self, service: WatchedService) -> views.Shown:
        """The service's status, its snapshot taken for the rates and charts, its health."""
        try:
            found = service.health(max_lag=self.max_lag)
        except OutboxInboxError as exc:
            return views.Shown(service.name, None, error=str(exc))
        status = found.as_dict()
        return views.Shown(
            service.name, status, self.rates.add(service.name, status), list(found.problems)
        )

    def _charts(self, names: Iterable[str]) -> Safe:
        return charts({name: self.rates.history(name) for name in names})

    def _overview(self) -> Safe:
        with ThreadPoolExecutor(max_workers=len(self.services)) as pool:
            entries = list(pool.map(self._status, self.services.values()))
        return views.overview(entries, self._charts(self.services), self.refresh or None)

    def _service_page(self, service: WatchedService, query: dict[str, str]) -> Safe:
        parts = [views.service_status(self._status(service), self._charts([service.name]))]
        filters = parse_filters(query)
        wanted = query.get("source") or "all"
        sources = service.sources() if wanted == "all" else [self._source(service, wanted)]
        parts.append(self._groups(service))
        parts.append(html("<h2 id=dead-letters>Dead letters</h2>"))
        parts.append(
            views.filter_form(service.name, service.sources(), {**query, "source": wanted})
        )
        try:
            with service.dead_letters.select(sources, filters, LIST_LIMIT) as selections:
                letters = [d for s in selections for d in s.letters]
                cut = [s.source for s in selections if s.more]
                counts = ", ".join(f"{s.source} {len(s.letters)}" for s in selections)
                by_source = {
                    s.source: [d.message_id for d in s.letters if d.message_id] for s in selections
                }
        except OutboxInboxError as exc:
            parts.append(views.error_text(str(exc)))
        else:
            parts.append(html("<p id=letter-count>{} dead letter(s): {}</p>", len(letters), counts))
            note = '<p class="note">More than {} in {}: narrow the filters to see the rest.</p>'
            if cut:
                parts.append(html(note, LIST_LIMIT, ", ".join(cut)))
            if letters:
                parts.append(views.letters_table(service.name, letters))
                if not filters.empty or wanted != "all":
                    parts.append(views.bulk_links(service.name, by_source))
        return views.page(service.name, join(parts))

    @staticmethod
    def _groups(service: WatchedService) -> Safe:
        """The dead and the parked rows of the service grouped by cause, with their actions."""
        try:
            dead = service.dead_letters.groups()
            parked = service.dead_letters.groups(parked=True)
        except OutboxInboxError as exc:
            return join([html("<h2 id=groups>Dead-letter groups</h2>"), views.error_text(str(exc))])
        return views.groups_section(service.name, dead, parked)

    def _find(
        self, service: WatchedService, source: str, message_ids: list[str], filters: Filters
    ) -> tuple[list[Any], list[str]]:
        # Broker queues are read up to their depth: the letter may be anywhere in them.
        chosen = Filters(
            message_ids=tuple(message_ids), fingerprint=filters.fingerprint, parked=filters.parked
        )
        with service.dead_letters.select([source], chosen) as (selection,):
            letters = list(selection.letters)
        found = {d.message_id for d in letters}
        return letters, [m for m in message_ids if m not in found]

    def _letter(self, query: dict[str, str]) -> Safe:
        service = self._service(query.get("service"))
        source = self._source(service, query.get("source"))
        message_id = parse_message_id(query.get("id", ""))
        if not message_id:
            raise BadRequest("no message id given")
        letters, _ = self._find(service, source, [message_id], Filters())
        if not letters:
            raise NotFound(f"no dead letter {message_id} in {service.name}'s {source}")
        return views.letter_page(service.name, letters[0])

    def _action_params(
        self, fields: dict[str, list[str]], *, by_group: bool = False
    ) -> tuple[WatchedService, str, str, list[str], Filters]:
        """The service, source, action and ids of a form, and the group (fingerprint) and
        parked state it keeps to. `by_group`: a group may stand for the ids (confirm)."""
        first = _single(fields)
        service = self._service(first.get("service"))
        source = self._source(service, first.get("source"))
        action = first.get("action", "")
        if action not in ACTIONS:
            raise BadRequest(f"unknown action {action!r}")
        group = first.get("group", "").strip() or None
        parked = first.get("parked", "") == "1"
        if (action == PARK or parked) and source not in (TABLE, OUTBOX):
            raise BadRequest(f"the {source} source has no parked letters: only table and outbox")
        if action == PARK and parked:
            raise BadRequest("these letters are parked already")
        ids = list(dict.fromkeys(parse_message_id(i) for i in fields.get("id", []) if i))
        if not ids and not (by_group and group):
            raise BadRequest("no message id given: choose the dead letters first")
        if len(ids) > MAX_IDS:
            raise BadRequest(f"at most {MAX_IDS} dead letters at once")
        if group is not None:
            group = service.dead_letters.group(group, parked=parked)
        return service, source, action, ids, Filters(fingerprint=group, parked=parked)

    def _confirm(self, environ: dict[str, Any], cookie: str) -> Safe:
        fields = parse_qs(str(environ.get("QUERY_STRING", "")))
        service, source, action, ids, group = self._action_params(fields, by_group=True)
        more = False
        if ids:
            letters, missing = self._find(service, source, ids, group)
        else:  # a whole group: its first MAX_IDS letters, confirmed by id like any others
            with service.dead_letters.select([source], group, MAX_IDS) as (selection,):
                letters, missing, more = list(selection.letters), [], selection.more
        token = self.guard.csrf_token(cookie)
        return views.confirm_page(
            service.name, source, action, letters, missing, token, group=group, more=more
        )

    def _post_act(self, environ: dict[str, Any], user: str) -> Safe:
        fields = _read_form(environ)
        problem = self.guard.csrf_problem(environ, _single(fields).get(CSRF_FIELD))
        if problem is not None:
            raise PermissionError(problem)
        service, source, action, ids, group = self._action_params(fields)
        result = act(
            service,
            action,
            source,
            ids,
            audit=self.audit,
            client=f"{user}@{environ.get('REMOTE_ADDR', '?')}",
            fingerprint=group.fingerprint,
            parked=group.parked,
        )
        return views.result_page(
            service.name, action, source, result.done, result.kept, result.missing, result.error
        )


def _single(values: dict[str, list[str]]) -> dict[str, str]:
    return {k: v[0] for k, v in values.items() if v}


def _read_form(environ: dict[str, Any]) -> dict[str, list[str]]:
    content_type = str(environ.get("CONTENT_TYPE", "")).split(";")[0].strip().lower()
    if content_type != "application/x-www-form-urlencoded":
        raise BadRequest("expected a form (application/x-www-form-urlencoded)")
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError as exc:
        raise BadRequest("bad Content-Length") from exc
    if length > MAX_BODY:
        raise BadRequest(f"the form is larger than {MAX_BODY} bytes")
    body = environ["wsgi.input"].read(length) if length > 0 else b""
    try:
        return parse_qs(body.decode("utf-8"), strict_parsing=False)
    except UnicodeDecodeError as exc:
        raise BadRequest("the form is not UTF-8") from exc
