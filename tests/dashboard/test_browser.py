"""The dashboard in a real headless Chromium: an operator lists the dead letters, opens one,
replays it through the confirmation form, and sees it handled by the service's own worker."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from browser import Browser
from cli_support import base_env, command
from dash_support import INVOICE, RunningDashboard, set_failing, wait_dead

from helpers import rows, scalar, wait_until
from outbox_inbox import Service
from outbox_inbox.dashboard.charts import COLORS
from report_check import decode_png, near, rgb

REPLAY_BLUE = "#0969da"
PURGE_RED = "#cf222e"
HEALTHY_GREEN = "#1a7f37"
HOSTILE = '<script>document.title="owned"</script><img src=x onerror="document.title=1">'
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPACING = 5.0  # RateTracker keeps at most one snapshot per 5 s


def _status_json(dash_env: dict[str, str], tmp_path: Path) -> dict[str, Any]:
    done = subprocess.run(
        command("status", "--app", "cli_app:billing", "--json"),
        cwd=tmp_path,
        env=base_env(dash_env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode in (0, 4), done.stderr
    return dict(json.loads(done.stdout))


def _color_in_box(browser: Browser, png: bytes, selector: str, color: str) -> int:
    """How many pixels of `color` the screenshot has inside the box of `selector`."""
    left, top, width, height = browser.box(selector)
    image = decode_png(png)
    region = (int(left), int(top), int(left + width), int(top + height))
    return sum(1 for pixel in image.pixels(region) if near(pixel, rgb(color)))


def test_operator_replays_a_dead_letter_in_chromium_and_the_worker_handles_it(
    billing: Service,
    spawn: Callable[..., subprocess.Popen[str]],
    start_dashboard: Callable[..., RunningDashboard],
    browser: Browser,
    dash_env: dict[str, str],
    db_url: str,
    tmp_path: Path,
) -> None:
    set_failing(billing, INVOICE)
    spawn("run", "all", "--app", "cli_app:billing")
    with billing.session() as session, session.begin():
        billing.outbox.send(
            session,
            "billing",
            "invoice.create",
            {"invoice": 7, "note": HOSTILE},
            headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"},
        )
    (dead,) = wait_dead(db_url, 1)
    dashboard = start_dashboard()

    # The overview shows what `outbox-inbox status` shows.
    browser.navigate(dashboard.url)
    status = _status_json(dash_env, tmp_path)
    cells = browser.evaluate(
        "[...document.querySelectorAll('#services tbody tr:first-child td')]"
        ".map(td => td.textContent.trim())"
    )
    headers = browser.evaluate(
        "[...document.querySelectorAll('#services th')].map(th => th.textContent.trim())"
    )
    row = dict(zip(headers, cells, strict=True))
    assert row["service"] == "billing"
    assert row["dead"] == "1" == str(status["inbox"]["dead"])
    assert row["processed"] == str(status["inbox"]["processed"])
    assert row["outbox unpublished"] == str(status["outbox"]["unpublished"])
    assert row["inbox queue"] == str(status["broker"]["queues"]["billing.inbox"]["messages"])

    # The service page lists the dead letter; open it.
    browser.click("#services a")
    assert "1 dead letter(s)" in browser.text("#letter-count")
    assert browser.text("#letters a.letter") == dead
    browser.click("#letters a.letter")

    # Its details: payload, headers, error and trace id, every value as text.
    assert json.dumps(HOSTILE) in browser.text("#payload")
    assert "traceparent" in browser.text("#headers")
    assert "failing on purpose" in browser.text("#error")
    assert TRACE_ID in browser.text("#fields")
    assert browser.evaluate("document.querySelectorAll('script, img').length") == 0
    assert browser.evaluate("document.title").startswith("Dead letter")

    # Screenshot checked like the audit report's: the two actions drawn in their colours.
    shot = browser.screenshot(tmp_path / "letter.png")
    assert _color_in_box(browser, shot, "#replay", REPLAY_BLUE) > 300
    assert _color_in_box(browser, shot, "#purge", PURGE_RED) > 300

    # The bug is fixed; replay it: the confirmation page, then its form, in the browser.
    set_failing(billing)
    browser.click("#replay")
    assert "Replay 1 dead letter(s)" in browser.text("h1")
    assert dead in browser.text("#letters")
    assert scalar(db_url, "SELECT count(*) FROM effects") == 0  # nothing happens before confirming
    browser.click("#confirm-button")
    assert "Replayed 1 of 1" in browser.text("#result")
    assert dead in browser.text("#done")

    # The running service's worker handles it: the effect is committed, the row processed.
    wait_until(
        lambda: scalar(db_url, "SELECT count(*) FROM effects WHERE message_id = :m", m=dead) == 1,
        what="the replayed command handled",
    )
    assert rows(
        db_url, "SELECT status FROM outbox_inbox.inbox_messages WHERE message_id = :m", m=dead
    ) == [("processed",)]

    # And the operator sees it handled: no dead letter left, one more processed, healthy.
    browser.navigate(dashboard.url)
    cells = browser.evaluate(
        "[...document.querySelectorAll('#services tbody tr:first-child td')]"
        ".map(td => td.textContent.trim())"
    )
    row = dict(zip(headers, cells, strict=True))
    assert row["dead"] == "0"
    assert int(row["processed"]) == status["inbox"]["processed"] + 1
    shot = browser.screenshot(tmp_path / "overview.png")
    assert _color_in_box(browser, shot, ".badge", HEALTHY_GREEN) > 100

    (line,) = dashboard.audit()
    assert line["command"] == "dashboard replay"
    assert line["service"] == "billing" and line["source"] == "table"
    assert line["message_ids"] == [dead] and line["count"] == 1
    assert line["client"] == "local@127.0.0.1"


def test_the_overview_draws_the_last_hour_in_chromium(
    billing: Service,
    start_dashboard: Callable[..., RunningDashboard],
    browser: Browser,
    tmp_path: Path,
) -> None:
    with billing.session() as session, session.begin():  # no relay runs: a backlog of 3
        for n in range(3):
            billing.outbox.send(session, "billing", "invoice.create", {"n": n})
    dashboard = start_dashboard()
    browser.navigate(dashboard.url)
    time.sleep(SPACING + 0.5)  # the next snapshot is kept: a line of two points
    browser.navigate(dashboard.url)

    charts = browser.evaluate(
        "[...document.querySelectorAll('#charts svg.chart')].map(s => "
        "[s.id, s.getBoundingClientRect().width, s.querySelectorAll('polyline').length])"
    )
    assert [c[0] for c in charts] == [
        "chart-backlog",
        "chart-lag",
        "chart-handled",
        "chart-dead",
    ]
    assert all(width > 300 for _, width, _ in charts), charts
    assert all(lines == 1 for _, _, lines in charts), charts
    points = browser.evaluate(
        "document.querySelector('#chart-backlog polyline.series-billing').getAttribute('points')"
    )
    assert len(points.split()) == 2
    shot = browser.screenshot(tmp_path / "charts.png")
    assert _color_in_box(browser, shot, "#chart-backlog circle.latest", COLORS[0]) > 20
