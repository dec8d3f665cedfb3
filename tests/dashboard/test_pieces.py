"""The dashboard's pieces that need no server: rates, escaping, the bind and Host rules."""

from __future__ import annotations

import base64
import itertools
import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from outbox_inbox.dashboard import Guard, check_bind, views
from outbox_inbox.dashboard.charts import BOTTOM, SPAN, charts
from outbox_inbox.dashboard.markup import html
from outbox_inbox.dashboard.rates import RateTracker, Sample
from outbox_inbox.dashboard.views import trace_id
from outbox_inbox.dead_letters import DeadLetter
from outbox_inbox.errors import ConfigurationError
from outbox_inbox.svgchart import PLOT_LEFT, PLOT_RIGHT, PLOT_TOP

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _status(
    at: float, processed: int, dead: int = 0, pending: int = 0, lag: float | None = None
) -> dict[str, Any]:
    return {
        "database_time": (T0 + timedelta(seconds=at)).isoformat(),
        "outbox": {"unpublished": 0, "dead": 0, "oldest_age_seconds": None},
        "inbox": {
            "processed": processed,
            "dead": dead,
            "pending": pending,
            "in_progress": 0,
            "oldest_pending_age_seconds": lag,
        },
    }


def test_rates_are_the_change_per_second_between_snapshots_and_none_when_a_counter_fell() -> None:
    rates = RateTracker(window=300)
    assert rates.add("billing", _status(0, 100)) is None  # one snapshot: no rate yet
    later = rates.add("billing", _status(10, 150, dead=2, pending=5))
    assert later is not None
    assert (later.span, later.processed, later.dead, later.backlog) == (10, 5.0, 0.2, 0.5)
    archived = rates.add("billing", _status(20, 40))  # rows archived: processed went down
    assert archived is not None and archived.processed is None and archived.span == 20
    assert rates.add("shipping", _status(20, 7)) is None  # each service on its own


def test_history_keeps_an_hour_of_snapshots_at_most_one_per_spacing() -> None:
    rates = RateTracker(history=3600, spacing=5)
    for at in range(0, 4000, 2):  # a page every 2 s for more than an hour
        rates.add("billing", _status(at, at))
    kept = rates.history("billing")
    # Kept: one every 6 s (the first page at least 5 s after the last kept), the last hour.
    assert [(s.at - T0).total_seconds() for s in kept[:2]] == [402, 408]
    assert (kept[-1].at - kept[0].at).total_seconds() <= 3600
    assert all((b.at - a.at).total_seconds() >= 5 for a, b in itertools.pairwise(kept))


def _points(svg: ET.Element, chart: str, service: str) -> list[list[tuple[float, float]]]:
    """The (x, y) points of each line `service` has in chart `chart`."""
    ns = "{http://www.w3.org/2000/svg}"
    (element,) = [e for e in svg.iter(f"{ns}svg") if e.get("id") == f"chart-{chart}"]
    out = []
    for mark in element:
        if mark.get("class") != f"series series-{service}":
            continue
        if mark.tag == f"{ns}polyline":  # (a line of one point also has a dot drawn)
            pairs = (p.split(",") for p in str(mark.get("points")).split())
            out.append([(float(x), float(y)) for x, y in pairs])
    return out


def _scale_max(svg: ET.Element, chart: str) -> float:
    """The value at the top of a chart's y axis: its highest grid label."""
    ns = "{http://www.w3.org/2000/svg}"
    (element,) = [e for e in svg.iter(f"{ns}svg") if e.get("id") == f"chart-{chart}"]
    labels = [e for e in element if e.tag == f"{ns}text" and e.get("text-anchor") == "end"]
    return max(float(str(e.text).replace(",", "")) for e in labels)


def test_charts_draw_each_snapshot_where_its_time_and_value_put_it() -> None:
    """Read back from the SVG: every point's x is its time in the last hour, its y its value
    on the axis drawn; a gap of unwatched minutes splits the line."""
    end = T0 + timedelta(seconds=SPAN)

    def sample(minutes_ago: float, processed: int, backlog: int, lag: float, dead: int) -> Sample:
        return Sample(end - timedelta(minutes=minutes_ago), processed, dead, backlog, lag)

    billing = [
        sample(50, 100, 40, 12.0, 1),
        sample(49, 160, 30, 9.5, 1),
        sample(48, 220, 20, 4.0, 2),
        # nobody watched for 20 minutes
        sample(28, 500, 3, 0.0, 2),
        sample(27.5, 530, 0, 0.0, 3),
    ]
    shipping = [sample(1, 7, 55, 61.0, 0), sample(0, 7, 58, 75.0, 0)]
    svg = ET.fromstring(f"<div>{charts({'billing': billing, 'shipping': shipping})}</div>")

    def value_of(chart: str, y: float) -> float:
        return (BOTTOM - y) / (BOTTOM - PLOT_TOP) * _scale_max(svg, chart)

    def minutes_ago(x: float) -> float:
        return (PLOT_RIGHT - x) / (PLOT_RIGHT - PLOT_LEFT) * SPAN / 60

    def read(chart: str, service: str) -> list[list[tuple[float, float]]]:
        return [
            [(round(minutes_ago(x), 1), round(value_of(chart, y), 1)) for x, y in line]
            for line in _points(svg, chart, service)
        ]

    assert read("backlog", "billing") == [[(50, 40), (49, 30), (48, 20)], [(28, 3), (27.5, 0)]]
    assert read("backlog", "shipping") == [[(1, 55), (0, 58)]]
    assert read("lag", "billing") == [[(50, 12), (49, 9.5), (48, 4)], [(28, 0), (27.5, 0)]]
    assert read("lag", "shipping") == [[(1, 61), (0, 75)]]
    assert read("dead", "billing") == [[(50, 1), (49, 1), (48, 2)], [(28, 2), (27.5, 3)]]
    # Handled per minute, between snapshots of one line: 60/min, 60/min; then 30 in 30 s.
    assert read("handled", "billing") == [[(49, 60), (48, 60)], [(27.5, 60)]]
    assert read("handled", "shipping") == [[(0, 0)]]
    assert _scale_max(svg, "lag") == 80 and _scale_max(svg, "backlog") == 60


def test_every_value_is_escaped_in_markup_quotes_included() -> None:
    page = html('<a title="{}">{}</a>', '"><script>x</script>', "<b>&</b>")
    assert (
        page == '<a title="&quot;&gt;&lt;script&gt;x&lt;/script&gt;">&lt;b&gt;&amp;&lt;/b&gt;</a>'
    )
    assert html("<p>{}</p>", html("<b>{}</b>", "<i>")) == "<p><b>&lt;i&gt;</b></p>"


def test_a_trace_id_is_read_from_a_valid_traceparent_only() -> None:
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert trace_id({"traceparent": good}) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_id({"traceparent": good.encode()}) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_id({"traceparent": "<script>"}) is None
    assert trace_id({}) is None


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "localhost", "127.1.2.3"])
def test_loopback_addresses_are_served_without_a_token(host: str) -> None:
    check_bind(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.0.2.7"])
def test_other_addresses_need_a_token_of_16_characters(host: str) -> None:
    with pytest.raises(ConfigurationError, match="not a loopback address"):
        check_bind(host, None)
    with pytest.raises(ConfigurationError, match="at least 16"):
        check_bind(host, "short")
    check_bind(host, "x" * 16)


def test_host_header_must_be_a_loopback_literal_without_a_token() -> None:
    guard = Guard()
    for host in ("127.0.0.1:8089", "localhost:8089", "[::1]:8089", "localhost"):
        assert guard.host_allowed({"HTTP_HOST": host}), host
    for host in ("attacker.example:8089", "10.0.0.1", "", "127.0.0.1.attacker.example"):
        assert not guard.host_allowed({"HTTP_HOST": host}), host
    assert Guard(token="t" * 16).host_allowed({"HTTP_HOST": "dash.example.org"})


def test_basic_auth_takes_the_token_as_password_and_names_the_user() -> None:
    guard = Guard(token="t" * 20)

    def basic(text: str) -> dict[str, str]:
        return {"HTTP_AUTHORIZATION": "Basic " + base64.b64encode(text.encode()).decode()}

    assert guard.user(basic("ada:" + "t" * 20)) == "ada"
    assert guard.user(basic("ada:" + "t" * 19)) is None
    assert guard.user({"HTTP_AUTHORIZATION": "Bearer " + "t" * 20}) == "token"
    assert guard.user({"HTTP_AUTHORIZATION": "Basic !!!"}) is None
    assert guard.user({}) is None
    assert Guard().user({}) == "local"


def test_every_action_button_has_a_colour_and_a_replayed_letter_says_so() -> None:
    # A button of class "button <action>" without a rule for <action> is white on white.
    for action in views._WHAT:
        assert f".{action} {{ background: #" in views.STYLESHEET, action
    letter = DeadLetter(
        source="table",
        ref="1",
        message_id="m-1",
        type="billing.invoice.create",
        reason="rejected",
        error=None,
        dead_at=None,
        age_seconds=5.0,
        replays=1,
    )
    assert "rejected (after 1 replay)" in views.letters_table("billing", [letter])
