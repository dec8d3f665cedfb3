"""The HTML audit report: what a person sees in a real browser, and that data cannot inject markup.

The browser tests render a realistic summary, open it in headless Chromium and check both the
rendered DOM (the chart marks match the data) and the screenshot pixels (the charts are drawn,
in their colours, where the layout puts them).
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from outbox_inbox.analytics.report import (
    DEAD_LETTER_COLOR,
    LATENCY_COLOR,
    PAGE_BACKGROUND,
    PROCESSED_COLOR,
    PUBLISHED_COLOR,
    render_html,
)
from report_check import (
    CHART_IDS,
    WINDOW,
    Image,
    ReportParser,
    near,
    parse,
    render_in_chromium,
    rgb,
)

XSS = "<script>alert(1)</script>"

# --- summaries ---------------------------------------------------------------------------------


def _stage(p50: float | None, scale: float = 1.0) -> dict[str, float | None]:
    if p50 is None:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    return {"p50": p50 * scale, "p90": p50 * 3 * scale, "p99": p50 * 9 * scale, "max": p50 * 40}


def _histogram() -> list[dict[str, Any]]:
    """Quarter-decade buckets from 1 ms to 56 s and +inf, shaped like a log-normal around 30 ms,
    with two empty buckets in the middle of the tail."""
    buckets: list[dict[str, Any]] = []
    for index in range(20):
        bound = float(f"{0.001 * 10 ** (index / 4):.3g}")
        count = round(5000 * math.exp(-((index - 6) ** 2) / 8))
        if index in (13, 15):
            count = 0
        buckets.append({"le_seconds": bound, "count": count})
    buckets.append({"le_seconds": None, "count": 2})
    return buckets


def _throughput(buckets: int = 36) -> list[dict[str, Any]]:
    start = datetime(2026, 11, 21, 10, 0, tzinfo=UTC)
    series = []
    for index in range(buckets):
        published = 400 + round(300 * math.sin(index / 5)) + 10 * (index % 4)
        processed = published - 20 if index % 7 else published + 60  # catching up now and then
        series.append(
            {
                "start": (start + timedelta(minutes=index)).isoformat(),
                "published": published,
                "processed": processed,
            }
        )
    return series


def realistic_summary() -> dict[str, Any]:
    types = ["orders.order.placed", "billing.invoice.create", "shipping.parcel.dispatched"]
    return {
        "schema_version": 1,
        "generated_at": "2026-11-21T12:00:00+00:00",
        "ok": False,
        "inputs": {
            "archives": ["/data/archive/orders", "/data/archive/billing"],
            "live_databases": ["postgresql+psycopg://app:***@db/orders"],
            "master": "local[*]",
            "grace_seconds": 300.0,
            "horizon": "2026-11-21T11:55:00+00:00",
        },
        "window": {
            "first_created_at": "2026-11-21T10:00:00.123456+00:00",
            "last_processed_at": "2026-11-21T10:35:59.5+00:00",
        },
        "totals": {
            "sent": 1_234_567,
            "commands": 234_567,
            "events": 1_000_000,
            "published": 1_234_560,
            "expired": 3,
            "unpublished": 4,
            "expected_deliveries": 2_469_120,
            "delivered": 2_469_000,
            "lost": 7,
            "in_flight": 113,
            "duplicates_absorbed": 5_432,
            "handled_more_than_once": 2,
            "unexpected": 0,
            "processed": 2_468_900,
            "pending": 42,
            "dead": 58,
            "retried_messages": 1_500,
            "retries": 2_100,
            "publish_retries": 17,
        },
        "services": [
            {
                "service": name,
                "sent": 400_000 + index,
                "received": 800_000,
                "processed": 799_990,
                "dead": 10 * index,
                "lost": index,
                "duplicates_absorbed": 1_000 * index,
            }
            for index, name in enumerate(["orders", "billing", "shipping"])
        ],
        "lost": [
            {
                "message_id": f"00000000-0000-4000-8000-00000000000{index}",
                "type": types[index % 3],
                "producer": "orders",
                "consumer": "billing",
                "published_at": "2026-11-21T10:12:00+00:00",
            }
            for index in range(7)
        ],
        "handled_more_than_once": [
            {
                "message_id": "00000000-0000-4000-8000-0000000000aa",
                "type": types[1],
                "consumer": "billing",
                "copies": 2,
            },
        ],
        "latency": [
            {
                "type": name,
                "count": 400_000 + index,
                "stages": {
                    "publish": _stage(None if index == 2 else 0.004),
                    "transit": _stage(0.002, 1 + index),
                    "processing": _stage(0.012, 1 + index),
                    "end_to_end": _stage(0.03, 1 + index),
                },
            }
            for index, name in enumerate(types)
        ],
        "latency_histogram": _histogram(),
        "retries": [
            {
                "type": name,
                "messages": 400_000,
                "retried_messages": 500,
                "retries": 700,
                "max_attempts": 3 + index,
            }
            for index, name in enumerate(types)
        ],
        "dead_letters": [
            {
                "type": types[1],
                "reason": "max_attempts",
                "count": 40,
                "example_error": "ValueError: bad",
            },
            {
                "type": types[2],
                "reason": "handler_error",
                "count": 12,
                "example_error": "KeyError: 'x'",
            },
            {
                "type": types[0],
                "reason": "undecodable",
                "count": 6,
                "example_error": "json.decoder.JSONDecodeError: " + "Expecting value " * 20,
            },
        ],
        "dead_letter_causes": [
            {"reason": "max_attempts", "error": "ValueError: bad", "count": 40},
            {"reason": "handler_error", "error": "KeyError: 'x'", "count": 12},
            {
                "reason": "undecodable",
                "error": "json.decoder.JSONDecodeError: " + "Expecting value " * 20,
                "count": 5,
            },
            {"reason": "expired", "error": "", "count": 1},
        ],
        "throughput": {"bucket_seconds": 60, "series": _throughput()},
    }


def empty_summary() -> dict[str, Any]:
    summary = realistic_summary()
    summary["ok"] = True
    summary["inputs"]["live_databases"] = []
    summary["window"] = {"first_created_at": None, "last_processed_at": None}
    summary["totals"] = {key: 0 for key in summary["totals"]}
    for key in (
        "services",
        "lost",
        "handled_more_than_once",
        "latency",
        "latency_histogram",
        "retries",
        "dead_letters",
        "dead_letter_causes",
    ):
        summary[key] = []
    summary["throughput"] = {"bucket_seconds": 60, "series": []}
    return summary


# --- the browser test ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[ReportParser, dict[str, Any], Image]:
    """The realistic report as Chromium rendered it: parsed DOM, chart boxes, screenshot."""
    tmp_path = tmp_path_factory.mktemp("audit-report")
    report = tmp_path / "report.html"
    report.write_text(render_html(realistic_summary()), encoding="utf-8")
    return render_in_chromium(report, tmp_path)


def test_browser_dom_has_every_chart_with_marks_matching_the_data(
    rendered: tuple[ReportParser, dict[str, Any], Image],
) -> None:
    dom, _, _ = rendered
    summary = realistic_summary()
    assert set(dom.charts) == set(CHART_IDS)

    histogram = summary["latency_histogram"]
    latency_bars = dom.charts["chart-latency"].bars()
    assert len(latency_bars) == sum(1 for bucket in histogram if bucket["count"] > 0)
    _assert_proportional(
        [float(bar["height"]) for bar in latency_bars],
        [bucket["count"] for bucket in histogram if bucket["count"] > 0],
    )
    assert {"1ms", "10ms", "100ms", "1s", "10s"} <= set(dom.charts["chart-latency"].text)

    series = summary["throughput"]["series"]
    lines = dom.charts["chart-throughput"].polylines()
    assert len(lines) == 2
    for line, key in zip(lines, ("published", "processed"), strict=True):
        points = [tuple(map(float, point.split(","))) for point in line["points"].split()]
        assert len(points) == len(series)
        assert [x for x, _ in points] == sorted(x for x, _ in points), "time runs left to right"
        # Heights above the x axis (at y = bottom) are proportional to the values; the axis
        # position follows from the two extreme points.
        values = [point[key] for point in series]
        low, high = values.index(min(values)), values.index(max(values))
        per_message = (points[low][1] - points[high][1]) / (values[high] - values[low])
        bottom = points[low][1] + values[low] * per_message
        _assert_proportional([bottom - y for _, y in points], values)
    assert "10:00" in dom.charts["chart-throughput"].text

    causes = summary["dead_letter_causes"]
    dead_bars = dom.charts["chart-dead-letters"].bars()
    assert len(dead_bars) == len(causes)
    _assert_proportional([float(bar["width"]) for bar in dead_bars], [c["count"] for c in causes])
    # A long cause is cut to fit beside its bar, and says so.
    labels = "".join(dom.charts["chart-dead-letters"].text)
    assert "undecodable: json.decoder.JSONDecodeError: Expecting…" in labels


def _assert_proportional(sizes: list[float], values: list[int]) -> None:
    scale = max(sizes) / max(values)
    for size, value in zip(sizes, values, strict=True):
        assert size == pytest.approx(value * scale, abs=0.6), (sizes, values)


def test_browser_screenshot_shows_the_charts_in_their_colours(
    rendered: tuple[ReportParser, dict[str, Any], Image],
) -> None:
    _, boxes, image = rendered
    assert (image.width, image.height) == WINDOW

    white, background = (255, 255, 255), rgb(PAGE_BACKGROUND)
    drawn = sum(1 for pixel in image.pixels() if pixel not in (white, background))
    assert drawn > 0.02 * image.width * image.height, f"only {drawn} pixels drawn: blank page?"

    expected_colors = {
        "chart-latency": [LATENCY_COLOR],
        "chart-throughput": [PUBLISHED_COLOR, PROCESSED_COLOR],
        "chart-dead-letters": [DEAD_LETTER_COLOR],
    }
    for chart_id, colors in expected_colors.items():
        left, top, width, height = boxes[chart_id]
        assert width > 300 and height > 150, f"{chart_id} laid out at {boxes[chart_id]}"
        assert top + height <= image.height, f"{chart_id} is below the screenshot"
        region = (int(left), int(top), int(left + width), int(top + height))
        pixels = list(image.pixels(region))
        for color in colors:
            matching = sum(1 for pixel in pixels if near(pixel, rgb(color)))
            # More than the 14x14 legend swatch (196 pixels): the marks themselves are on
            # screen; a two-pixel line across the chart covers some hundreds.
            assert matching > 250, f"{chart_id}: {matching} pixels of {color}"
        # The charts sit where the layout says: outside their boxes their colours are rare.
        outside = sum(1 for pixel in image.pixels() if near(pixel, rgb(colors[0])))
        assert outside - sum(1 for p in pixels if near(p, rgb(colors[0]))) < 0.1 * outside


# --- tests without a browser -----------------------------------------------------------------


def test_data_strings_are_escaped_not_rendered_as_markup() -> None:
    summary = realistic_summary()
    for section in ("latency", "retries", "dead_letters", "lost", "handled_more_than_once"):
        summary[section][0]["type"] = XSS
    summary["services"][0]["service"] = XSS
    summary["dead_letter_causes"][0]["reason"] = '<img src=x onerror="alert(2)">'
    summary["dead_letter_causes"][0]["error"] = XSS
    summary["inputs"]["archives"] = [XSS]

    page = render_html(summary)

    assert "<script" not in page
    assert "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    tags = set(parse(page).tags)
    assert "script" not in tags and "img" not in tags


def test_empty_summary_shows_no_data_in_each_chart_and_the_green_verdict() -> None:
    page = render_html(empty_summary())

    report = parse(page)
    assert report.verdict == "OK: nothing lost"
    assert "ok" in report.verdict_class.split()
    assert set(report.charts) == set(CHART_IDS)
    for chart_id, chart in report.charts.items():
        assert "no data" in chart.text, chart_id
        assert not chart.bars() and not chart.polylines(), chart_id
    assert page.count('<p class="none">none</p>') == 6  # every table


def test_summary_without_any_section_renders_like_an_empty_one() -> None:
    report = parse(render_html({"schema_version": 1}))

    assert report.verdict == "OK: nothing lost"
    assert all("no data" in chart.text for chart in report.charts.values())


def test_lost_messages_turn_the_verdict_red_with_the_numbers() -> None:
    summary = empty_summary()
    summary["totals"]["lost"] = 1234
    summary["totals"]["handled_more_than_once"] = 5

    report = parse(render_html(summary))

    assert report.verdict == "1,234 lost, 5 handled more than once"
    assert "bad" in report.verdict_class.split()


def test_tables_show_human_durations_dashes_for_unknown_and_thousands_separators() -> None:
    page = render_html(realistic_summary())

    assert "1,234,567" in page  # totals.sent
    assert "12ms" in page and "30ms" in page  # p50 of processing and end to end, first type
    assert '<td class="num">\N{EN DASH}</td>' in page  # the unknown publish stage of one type


def test_an_incremental_audit_says_which_messages_it_covered() -> None:
    summary = realistic_summary()
    assert "Messages published" not in render_html(summary)
    summary["inputs"]["window"] = {
        "since": "2026-11-25T00:00:00+00:00",
        "until": "2026-11-26T00:00:00+00:00",
    }

    shown = re.search(r"<dt>Messages published</dt><dd>(.*?)</dd>", render_html(summary))

    assert shown is not None
    assert shown[1] == "2026-11-25 00:00:00 UTC → 2026-11-26 00:00:00 UTC"


def test_lost_examples_say_how_many_of_the_total_they_show() -> None:
    summary = realistic_summary()
    summary["totals"]["lost"] = 1500  # the job lists at most 100 examples

    page = render_html(summary)

    assert "Showing 7 of 1,500." in page


def test_summary_of_another_schema_version_is_refused() -> None:
    with pytest.raises(ValueError, match="schema_version 2"):
        render_html({"schema_version": 2})
