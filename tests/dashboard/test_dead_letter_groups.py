"""The dashboard's dead-letter groups over real HTTP: a group is shown with its count, types
and times, parked and replayed from the page, each action confirmed by id and audited."""

from __future__ import annotations

import re
import subprocess
import urllib.parse
from collections.abc import Callable

from dash_support import INVOICE, RunningDashboard, csrf_of, set_failing, wait_dead

from helpers import inbox_message_ids, wait_until
from outbox_inbox import Service


def _confirm(dashboard: RunningDashboard, **params: str) -> tuple[str, list[tuple[str, str]]]:
    """GET a group's confirmation page as a browser would: the cookie header, and the form's
    fields (its CSRF token, the ids and the group it keeps to)."""
    page = dashboard.request("/confirm?" + urllib.parse.urlencode(params))
    assert page.status == 200, page.body
    cookie = "; ".join(f"{k}={v}" for k, v in page.cookies.items())
    form = [(k, v) for k, v in params.items() if k in ("service", "source", "action")]
    form += [("id", m) for m in re.findall(r'name=id value="([^"]+)"', page.body)]
    form += [("group", g) for g in re.findall(r'name=group value="([^"]+)"', page.body)]
    form += [("parked", "1")] if "name=parked value=1" in page.body else []
    return cookie, [*form, ("csrf", csrf_of(page.body))]


def test_a_group_is_shown_parked_and_replayed_from_the_dashboard(
    billing: Service,
    spawn: Callable[..., subprocess.Popen[str]],
    start_dashboard: Callable[..., RunningDashboard],
    db_url: str,
) -> None:
    set_failing(billing, INVOICE)
    spawn("run", "all", "--app", "cli_app:billing")
    with billing.session() as session, session.begin():
        for n in range(3):
            billing.outbox.send(session, "billing", "invoice.create", {"n": n})
    dead = wait_dead(db_url, 3)
    dashboard = start_dashboard()

    page = dashboard.request("/service?name=billing").body
    (group,) = re.findall(r'<tr id="group-([0-9a-f]{8})">(.*?)</tr>', page)
    group_id, row = group
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
    assert cells[:4] == [group_id, "3", INVOICE, "table"]
    assert cells[4] and cells[5] and cells[6] == "0"  # first and last seen; none replayed
    assert cells[7].startswith("Reject at ") and cells[7].endswith("cli_app.py:_record")

    cookie, form = _confirm(
        dashboard, service="billing", source="table", action="park", group=group_id
    )
    assert sorted(v for k, v in form if k == "id") == sorted(dead)
    parked = dashboard.request("/act", data=form, headers={"Cookie": cookie})
    assert parked.status == 200 and "Parked 3 of 3" in parked.body, parked.body
    assert sorted(inbox_message_ids(db_url, "parked")) == sorted(dead)
    page = dashboard.request("/service?name=billing").body
    assert "No dead letters in the table or the outbox." in page
    assert f'id="group-{group_id}"' in page.split("id=parked>")[1]

    set_failing(billing)  # the bug is fixed: the parked group goes back
    cookie, form = _confirm(
        dashboard, service="billing", source="table", action="replay", group=group_id, parked="1"
    )
    replayed = dashboard.request("/act", data=form, headers={"Cookie": cookie})
    assert replayed.status == 200 and "Replayed 3 of 3" in replayed.body, replayed.body
    wait_until(
        lambda: set(dead) <= set(inbox_message_ids(db_url, "processed", INVOICE)),
        what="the replayed group handled",
    )
    park, replay = dashboard.audit()
    assert (park["command"], park["count"], park["filters"]["fingerprint"]) == (
        "dashboard park",
        3,
        cells[7],
    )
    assert (replay["command"], replay["count"], replay["filters"]["parked"]) == (
        "dashboard replay",
        3,
        True,
    )
