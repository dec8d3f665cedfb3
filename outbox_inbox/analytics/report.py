"""The audit summary (JSON, schema version 1) as one self-contained HTML page; `write_audit` runs
the audit and writes both into a directory (docs/history.md, "The audit"). The page has one inline
``<style>`` and inline ``<svg>`` charts: no scripts, fonts, images or network. Every string taken
from the summary is user data and is escaped."""

from __future__ import annotations

import html
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from ..logsafe import mask_url
from ..svgchart import (
    CHART_CSS,
    PLOT_LEFT,
    PLOT_RIGHT,
    PLOT_TOP,
    count_ticks,
    fmt_count,
    no_data,
    series_line,
    svg_open,
    x_axis_label,
    y_axis,
)
from . import server
from .audit import (
    PERCENTILES,
    SCHEMA_VERSION,
    STAGES,
    AuditError,
    Window,
    _first_line,
    _iso,
    check_archives,
    combine,
    read_live,
    require_pyspark,
    run_audit,
    spark_session,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

LATENCY_COLOR = "#7c3aed"
PUBLISHED_COLOR = "#2563eb"
PROCESSED_COLOR = "#16a34a"
DEAD_LETTER_COLOR = "#dc2626"
OK_COLOR = "#15803d"
BAD_COLOR = "#b91c1c"
PAGE_BACKGROUND = "#f3f4f6"

SERVICE_COUNTS = ("sent", "received", "processed", "dead", "lost", "duplicates_absorbed")
RETRY_COUNTS = ("messages", "retried_messages", "retries", "max_attempts")
COUNTS = {*SERVICE_COUNTS, *RETRY_COUNTS, "count", "copies"}  # the numeric table columns
HEADLINE = (  # the totals shown as tiles above the charts
    "sent", "expected_deliveries", "delivered", "lost", "in_flight", "duplicates_absorbed",
    "handled_more_than_once", "unexpected", "dead", "retries",
)  # fmt: skip

# Every chart shares one coordinate system (outbox_inbox.svgchart).
DEAD_LETTER_LABEL_WIDTH = 330
DEAD_LETTER_ROW_HEIGHT = 28
DEAD_LETTER_ERROR_CHARS = 40
# About what fits left of the bars at 11px; the label column also clips, for wide glyphs.
DEAD_LETTER_LABEL_CHARS = 54
MAX_X_LABELS = 8
TABLE_ERROR_CHARS = 300
NO_DATA = "\N{EN DASH}"  # a null or unknown value in a table

_STYLE = f"""
* {{ box-sizing: border-box; }}
body {{ margin: 0; padding: 24px 32px; background: {PAGE_BACKGROUND}; color: #111827;
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }}
header, section {{ background: #ffffff; border: 1px solid #e5e7eb; border-radius: 8px;
  padding: 16px 20px; margin-bottom: 16px; }}
h1 {{ margin: 0 0 8px; font-size: 32px; }}
h1.ok {{ color: {OK_COLOR}; }}
h1.bad {{ color: {BAD_COLOR}; }}
h2 {{ margin: 0 0 12px; font-size: 18px; }}
dl.inputs {{ display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; margin: 0; }}
dl.inputs dt {{ color: #6b7280; }}
dl.inputs dd {{ margin: 0; font-family: ui-monospace, monospace; word-break: break-all; }}
.headline {{ display: grid; grid-template-columns: repeat(5, minmax(0, 1fr));
  gap: 12px; margin-bottom: 16px; }}
@media (max-width: 900px) {{
  .headline {{ grid-template-columns: repeat(auto-fit, minmax(150px, 1fr)); }}
}}
.tile {{ background: #ffffff; border: 1px solid #e5e7eb; border-radius: 8px; padding: 10px 14px; }}
.tile .value {{ font-size: 24px; font-weight: 600; font-variant-numeric: tabular-nums; }}
.tile .label {{ color: #6b7280; font-size: 12px; }}
.tile.bad {{ border-color: {BAD_COLOR}; }}
.tile.bad .value {{ color: {BAD_COLOR}; }}
.charts {{ display: grid; grid-template-columns: repeat(auto-fit, minmax(600px, 1fr));
  gap: 16px; margin-bottom: 16px; }}
.charts section {{ margin: 0; }}
section {{ overflow-x: auto; }}  /* the latency table is wider than a phone */
table {{ border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }}
th, td {{ padding: 4px 8px; border-bottom: 1px solid #e5e7eb; text-align: left;
  vertical-align: top; }}
th {{ background: #f9fafb; font-weight: 600; }}
th.stage {{ text-align: center; border-left: 1px solid #e5e7eb; }}
td.num, th.num {{ text-align: right; }}
td.code {{ font-family: ui-monospace, monospace; font-size: 12px; word-break: break-all; }}
p.none {{ color: #6b7280; margin: 0; }}
p.note {{ color: #6b7280; margin: 8px 0 0; }}
"""
_STYLE += CHART_CSS


def write_audit(
    directory: str | Path,
    archives: Sequence[str],
    *,
    db_urls: Sequence[str] = (),
    schema: str | None = None,
    master: str | None = None,
    driver_memory: str | None = None,
    config: Mapping[str, str] | None = None,
    grace: timedelta = timedelta(minutes=5),
    window: Window | None = None,
    results: str | Path | None = None,
    warm: bool = False,
    verbose: bool = False,
    note: Callable[[str], None] = lambda _line: None,
) -> tuple[dict[str, Any], Path]:
    """`audit.run_audit` of `archives` and of the live tables of `db_urls`, written as
    ``summary.json`` and ``report.html`` into `directory`; returns the summary and the directory.
    How it runs (`warm`, `verbose`; `note` gets the line that says which) and what it raises:
    docs/history.md, "The audit" and "A warm Spark between runs". With `results`, `window` is
    whole UTC days: one day's result is stored there too, several days' are combined from
    those stored (`combine_days`; "Day results that add up")."""
    days = _days(window) if results is not None else []
    if window is not None and results is not None and len(days) > 1:
        return combine_days(directory, results, window)
    roots = [p if "://" in p else str(Path(p).absolute()) for p in archives]
    check_archives(roots, window, live=bool(db_urls))
    require_pyspark()
    live = [read_live(url, schema) for url in db_urls]
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # spark-submit started the JVM already
    warm = warm and master is None and not config and not submitted
    log = None if verbose or submitted else server.state_dir() / "one-shot.log"
    session = (
        server.warm_session(driver_memory)
        if warm
        else _one_shot(master, driver_memory, config, log)
    )
    with session as (spark, line):
        note(line)
        try:
            summary = run_audit(
                spark,
                roots,
                live=live,
                grace=grace,
                inputs={"live_databases": [mask_url(u) for u in db_urls]},
                window=window,
                keep=bool(days),
            )
        except AuditError:
            raise
        except Exception as exc:  # Spark's failures come as py4j and pyspark errors of many kinds
            raise AuditError(
                f"the Spark job failed: {type(exc).__name__}: {_first_line(exc)}"
            ) from exc
    if results is not None:
        record = {"inputs": summary["inputs"], "parts": summary.pop("parts")}
        Path(results).mkdir(parents=True, exist_ok=True)
        tmp = Path(results) / f".{days[0]}.json.tmp"  # a reader never sees half a result
        tmp.write_text(json.dumps(record, default=_iso))
        tmp.replace(Path(results) / f"{days[0]}.json")
    return summary, _write(directory, summary)


def combine_days(
    directory: str | Path, results: str | Path, window: Window
) -> tuple[dict[str, Any], Path]:
    """The report of `window`'s whole days combined from their results stored in `results`
    (`write_audit`), without Spark or any archive row; written and returned as `write_audit`
    does. Raises AuditError when a day has no result, OSError when a file cannot be read."""
    stored = []
    for day in _days(window):
        try:
            stored.append(json.loads((Path(results) / f"{day}.json").read_text()))
        except FileNotFoundError:
            raise AuditError(
                f"no result of {day} in {results}: run outbox-inbox audit --day {day} "
                f"--results {results}"
            ) from None
    inputs = {**stored[-1]["inputs"], "window": window.describe()}  # the last day's grace
    now = datetime.now(UTC).isoformat()
    summary = combine([p for s in stored for p in s["parts"]], now, inputs)
    return summary, _write(directory, summary)


def _days(window: Window | None) -> list[str]:
    """`window`'s days; ConfigurationError unless it is whole UTC days."""
    if window is None or window.since.timestamp() % 86400 or window.until.timestamp() % 86400:
        raise ConfigurationError("day results are of whole UTC days: --day, or --since DAY")
    return window.days()


def _write(directory: str | Path, summary: Mapping[str, Any]) -> Path:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "report.html").write_text(render_html(summary), encoding="utf-8")
    return out


@contextmanager
def _one_shot(
    master: str | None,
    driver_memory: str | None,
    config: Mapping[str, str] | None,
    log: Path | None,
) -> Iterator[tuple[SparkSession, str]]:
    """A Spark session started for one audit, stopped after; and the line that says so."""
    spark = spark_session(master, driver_memory=driver_memory, config=config, log=log)
    try:
        output = f" (Spark's output: {log})" if log else ""
        yield spark, f"Spark: a one-shot session on {spark.conf.get('spark.master')}{output}"
    finally:
        spark.stop()


def render_html(summary: Mapping[str, Any]) -> str:
    """The audit summary (schema version 1) as a self-contained HTML page, every string
    escaped; missing sections and keys render as zero or empty. Thread-safe. Raises ValueError
    when ``schema_version`` is not 1 or a count is not a number."""
    version = summary.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ValueError(f"audit summary schema_version {version!r} is not {SCHEMA_VERSION}")
    totals: Mapping[str, Any] = summary.get("totals") or {}
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>Message audit report</title>",
        f"<style>{_STYLE}</style>",
        "</head><body>",
        _header(summary, totals),
        _headline(totals),
        _charts(summary),
        *_tables(summary, totals),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _charts(summary: Mapping[str, Any]) -> str:
    """The three charts, side by side."""
    throughput: Mapping[str, Any] = summary.get("throughput") or {}
    charts = (
        _latency_chart(summary.get("latency_histogram") or []),
        _throughput_chart(throughput.get("series") or [], throughput.get("bucket_seconds")),
        _dead_letter_chart(summary.get("dead_letter_causes") or []),
    )
    return "\n".join(
        ['<div class="charts">', *(f"<section>{c}</section>" for c in charts), "</div>"]
    )


def _tables(summary: Mapping[str, Any], totals: Mapping[str, Any]) -> list[str]:
    """The tables under the charts, in reading order."""
    return [
        _latency_table(summary.get("latency") or []),
        _table("Services", ("service", *SERVICE_COUNTS), summary.get("services")),
        _table("Retries per type", ("type", *RETRY_COUNTS), summary.get("retries")),
        _table(
            "Dead letters by type and reason",
            ("type", "reason", "count", "example_error"),
            summary.get("dead_letters"),
        ),
        _table(
            "Lost messages",
            ("message_id", "type", "producer", "consumer", "published_at"),
            summary.get("lost"),
            _count(totals.get("lost")),
        ),
        _table(
            "Handled more than once",
            ("message_id", "type", "consumer", "copies"),
            summary.get("handled_more_than_once"),
            _count(totals.get("handled_more_than_once")),
        ),
    ]


def _header(summary: Mapping[str, Any], totals: Mapping[str, Any]) -> str:
    lost = _count(totals.get("lost"))
    handled_twice = _count(totals.get("handled_more_than_once"))
    if lost == 0 and handled_twice == 0:
        verdict = '<h1 class="verdict ok">OK: nothing lost</h1>'
    else:
        verdict = (
            f'<h1 class="verdict bad">{fmt_count(lost)} lost, '
            f"{fmt_count(handled_twice)} handled more than once</h1>"
        )
    inputs: Mapping[str, Any] = summary.get("inputs") or {}
    window: Mapping[str, Any] = summary.get("window") or {}
    archives = [_esc(path) for path in inputs.get("archives") or []]
    # The job masks these already; masking again costs nothing and keeps a password that slipped
    # through out of a file that gets mailed around.
    databases = [_esc(mask_url(str(url))) for url in inputs.get("live_databases") or []]
    audited: Mapping[str, Any] = inputs.get("window") or {}
    published = f"{_fmt_time(audited.get('since'))} → {_fmt_time(audited.get('until'))}"
    rows = [
        ("Archives", "<br>".join(archives) or "none"),
        ("Live databases", "<br>".join(databases) or "none"),
        *([("Messages published", published)] if audited else []),
        ("Spark master", _esc_or_dash(inputs.get("master"))),
        ("Horizon", _fmt_time(inputs.get("horizon"))),
        ("Grace period", _fmt_duration(inputs.get("grace_seconds"))),
        (
            "Window",
            f"{_fmt_time(window.get('first_created_at'))} → "
            f"{_fmt_time(window.get('last_processed_at'))}",
        ),
        ("Generated", _fmt_time(summary.get("generated_at"))),
    ]
    items = "".join(f"<dt>{label}</dt><dd>{value}</dd>" for label, value in rows)
    return f'<header>{verdict}<dl class="inputs">{items}</dl></header>'


def _headline(totals: Mapping[str, Any]) -> str:
    tiles = []
    for key in HEADLINE:
        value = _count(totals.get(key))
        # A lost message or one handled twice is a failure of the delivery guarantee.
        failed = value > 0 and key in ("lost", "handled_more_than_once")
        tiles.append(
            f'<div class="{"tile bad" if failed else "tile"}" id="total-{key.replace("_", "-")}">'
            f'<div class="value">{fmt_count(value)}</div>'
            f'<div class="label">{key.replace("_", " ")}</div></div>'
        )
    return f'<div class="headline">{"".join(tiles)}</div>'


def _latency_chart(histogram: Sequence[Mapping[str, Any]]) -> str:
    height = 320
    bottom = height - 56
    parts = [svg_open("chart-latency", height, "End-to-end latency")]
    counts = [_count(bucket.get("count")) for bucket in histogram]
    if not histogram or sum(counts) == 0:
        return "".join([*parts, no_data(height), "</svg>"])

    ticks = count_ticks(max(counts))
    parts.extend(y_axis(ticks, PLOT_TOP, bottom, "messages"))
    # The buckets are logarithmic, so equal-width slots in bucket order already give a log axis.
    slot = (PLOT_RIGHT - PLOT_LEFT) / len(histogram)
    labelled = _latency_labelled_buckets([bucket.get("le_seconds") for bucket in histogram])
    previous_bound = "0"
    for index, (bucket, count) in enumerate(zip(histogram, counts, strict=True)):
        upper = bucket.get("le_seconds")
        bound = "+∞" if upper is None else _fmt_duration(upper)
        left = PLOT_LEFT + index * slot
        if count > 0:
            bar_height = (bottom - PLOT_TOP) * count / ticks[-1]
            parts.append(
                f'<rect class="bar" x="{left + 1:.1f}" y="{bottom - bar_height:.1f}" '
                f'width="{max(slot - 2, 1):.1f}" height="{bar_height:.1f}" '
                f'fill="{LATENCY_COLOR}"><title>{previous_bound} to {bound}: '
                f"{fmt_count(count)} messages</title></rect>"
            )
        # A bucket's bound is its upper edge, so the label sits at the right edge of its slot.
        if index in labelled:
            parts.append(
                f'<text x="{left + slot:.1f}" y="{bottom + 16}" text-anchor="middle">{bound}</text>'
            )
        previous_bound = bound
    x_label = x_axis_label("end-to-end latency (bucket upper bound, log scale)", height - 12)
    return "".join([*parts, x_label, "</svg>"])


def _latency_labelled_buckets(bounds: Sequence[Any]) -> set[int]:
    """The buckets whose upper bound gets an x axis label: powers of ten when there are enough of
    them (1ms, 10ms, 1s), else every n-th counted back from the last, which is always labelled."""
    last = len(bounds) - 1
    logs = {index: math.log10(b) for index, b in enumerate(bounds) if _is_number(b) and b > 0}
    decades = {index for index, log in logs.items() if abs(log - round(log)) < 0.01}
    if 2 <= len(decades) <= MAX_X_LABELS:
        return decades | {last}
    stride = math.ceil(len(bounds) / MAX_X_LABELS)
    return {index for index in range(len(bounds)) if (last - index) % stride == 0}


def _throughput_chart(series: Sequence[Mapping[str, Any]], bucket_seconds: Any) -> str:
    height = 320
    bottom = height - 56
    parts = [svg_open("chart-throughput", height, "Throughput: published and processed")]
    if not series:
        return "".join([*parts, no_data(height), "</svg>"])

    published = [_count(point.get("published")) for point in series]
    processed = [_count(point.get("processed")) for point in series]
    ticks = count_ticks(max(*published, *processed))
    parts.extend(y_axis(ticks, PLOT_TOP, bottom, "messages per bucket"))
    # One point sits in the middle; more points span the plot from edge to edge.
    step = (PLOT_RIGHT - PLOT_LEFT) / max(len(series) - 1, 1)
    xs = [
        PLOT_LEFT + step * i if len(series) > 1 else (PLOT_LEFT + PLOT_RIGHT) / 2
        for i in range(len(series))
    ]
    lines = (("published", published, PUBLISHED_COLOR), ("processed", processed, PROCESSED_COLOR))
    for name, values, color in lines:
        parts.extend(series_line(name, values, color, xs, ticks[-1], bottom))
    # At most MAX_X_LABELS bucket start times, with the date when the window spans days.
    times = [_parse_time(point.get("start")) for point in series]
    known = [time for time in times if time is not None]
    time_format = "%m-%d %H:%M" if known and known[0].date() != known[-1].date() else "%H:%M"
    for index in range(0, len(series), math.ceil(len(series) / MAX_X_LABELS)):
        time = times[index]
        label = (
            _esc_or_dash(series[index].get("start")) if time is None else time.strftime(time_format)
        )
        parts.append(
            f'<text x="{xs[index]:.1f}" y="{bottom + 16}" text-anchor="middle">{label}</text>'
        )
    for offset, (name, _, color) in enumerate(lines):  # the legend
        x = PLOT_RIGHT - 190 + offset * 100
        parts.append(
            f'<g class="legend"><rect x="{x}" y="12" width="14" height="14" fill="{color}"/>'
            f'<text x="{x + 20}" y="23">{name}</text></g>'
        )
    x_label = x_axis_label(f"time (UTC), buckets of {_fmt_duration(bucket_seconds)}", height - 12)
    return "".join([*parts, x_label, "</svg>"])


def _dead_letter_chart(causes: Sequence[Mapping[str, Any]]) -> str:
    causes = list(causes)[:10]  # the spec promises the top 10; more would not fit anyway
    if not causes:
        return (
            svg_open("chart-dead-letters", 200, "Dead letters by cause") + no_data(200) + "</svg>"
        )
    top = PLOT_TOP + 6
    bottom = top + DEAD_LETTER_ROW_HEIGHT * len(causes)
    height = bottom + 44
    parts = [svg_open("chart-dead-letters", height, "Dead letters by cause")]
    counts = [_count(cause.get("count")) for cause in causes]
    ticks = count_ticks(max(counts))
    bars_left = DEAD_LETTER_LABEL_WIDTH
    width = PLOT_RIGHT - 40 - bars_left  # room for the count after the longest bar
    for tick in ticks:  # vertical grid lines with count labels
        x = bars_left + width * tick / ticks[-1]
        parts.append(
            f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom}"/>'
            f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{fmt_count(tick)}</text>'
        )
    parts.append(f'<line class="axis" x1="{bars_left}" x2="{bars_left}" y1="{top}" y2="{bottom}"/>')
    # Labels start at the left edge and are clipped short of the bars: text metrics are the
    # browser's, so a label too wide is cut at its end, not run off the chart or over the bars.
    parts.append(
        f'<clipPath id="dead-letter-labels"><rect x="0" y="0" width="{bars_left - 8}" '
        f'height="{height}"/></clipPath>'
    )
    for index, (cause, count) in enumerate(zip(causes, counts, strict=True)):
        y = top + index * DEAD_LETTER_ROW_HEIGHT
        text_y = y + DEAD_LETTER_ROW_HEIGHT / 2 + 4
        bar_width = width * count / ticks[-1]
        reason = str(cause.get("reason") or "")
        error = str(cause.get("error") or "")
        label = f"{reason}: {_truncate(error, DEAD_LETTER_ERROR_CHARS)}" if error else reason
        parts.append(
            f'<text x="8" y="{text_y:.1f}" clip-path="url(#dead-letter-labels)">'
            f"<title>{_esc(reason)}: {_esc(error)}</title>"
            f"{_esc(_truncate(label, DEAD_LETTER_LABEL_CHARS))}</text>"
        )
        if count > 0:
            parts.append(
                f'<rect class="bar" x="{bars_left}" y="{y + 4}" width="{bar_width:.1f}" '
                f'height="{DEAD_LETTER_ROW_HEIGHT - 8}" fill="{DEAD_LETTER_COLOR}"/>'
            )
        parts.append(
            f'<text x="{bars_left + bar_width + 4:.1f}" y="{text_y:.1f}">{fmt_count(count)}</text>'
        )
    return "".join([*parts, x_axis_label("dead letters", height - 12), "</svg>"])


def _table_section(title: str, head: str, rows: Sequence[str], note: str = "") -> str:
    if not rows:
        return f'<section><h2>{title}</h2><p class="none">none</p></section>'
    note_html = f'<p class="note">{note}</p>' if note else ""
    return (
        f"<section><h2>{title}</h2><table><thead>{head}</thead>"
        f"<tbody>{''.join(rows)}</tbody></table>{note_html}</section>"
    )


def _cell(key: str, value: Any) -> str:
    """The table cell of a summary entry's `key`."""
    if key in COUNTS:
        return f'<td class="num">{fmt_count(_count(value))}</td>'
    if key == "published_at":
        return f"<td>{_fmt_time(value)}</td>"
    if key == "example_error":
        value = _truncate(str(value or ""), TABLE_ERROR_CHARS)
    css = ' class="code"' if key in ("message_id", "example_error") else ""
    return f"<td{css}>{_esc_or_dash(value)}</td>"


def _latency_table(latency: Sequence[Mapping[str, Any]]) -> str:
    stage_heads = "".join(
        f'<th colspan="{len(PERCENTILES)}" class="stage">{stage.replace("_", " ")}</th>'
        for stage in STAGES
    )
    percentile_heads = "".join(
        f'<th class="num">{name}</th>' for _ in STAGES for name in PERCENTILES
    )
    head = (
        f'<tr><th rowspan="2">type</th><th rowspan="2" class="num">messages</th>{stage_heads}</tr>'
        f"<tr>{percentile_heads}</tr>"
    )
    rows = []
    for entry in latency:
        stages: Mapping[str, Any] = entry.get("stages") or {}
        cells = [_cell("type", entry.get("type")), _cell("count", entry.get("count"))]
        for stage in STAGES:
            values: Mapping[str, Any] = stages.get(stage) or {}
            cells.extend(
                f'<td class="num">{_fmt_duration(values.get(name))}</td>' for name in PERCENTILES
            )
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return _table_section("Latency per type", head, rows)


def _table(
    title: str, keys: Sequence[str], entries: Sequence[Mapping[str, Any]] | None, total: int = 0
) -> str:
    """A table of one row per entry, a column per key; `total`: how many there are in all."""
    numeric = ' class="num"'
    heads = "".join(f"<th{numeric if k in COUNTS else ''}>{k.replace('_', ' ')}</th>" for k in keys)
    rows = [
        "<tr>" + "".join(_cell(k, entry.get(k)) for k in keys) + "</tr>" for entry in entries or []
    ]
    note = f"Showing {fmt_count(len(rows))} of {fmt_count(total)}." if total > len(rows) else ""
    return _table_section(title, f"<tr>{heads}</tr>", rows, note)


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _esc_or_dash(value: Any) -> str:
    return NO_DATA if value is None or value == "" else _esc(value)


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _count(value: Any) -> int:
    """A count from the summary; a missing count is 0, anything but a number is an error."""
    if value is None:
        return 0
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"expected a count in the audit summary, got {value!r}")
    return round(float(value))


def _fmt_duration(seconds: Any) -> str:
    """Seconds as a short human duration with three significant digits: 1.78ms, 31.6s, 2m."""
    if not _is_number(seconds) or not math.isfinite(seconds):
        return NO_DATA
    # Round first, so that 0.0009999 s becomes 1ms rather than 1e+03µs.
    value = float(f"{float(seconds):.3g}")
    if value == 0:
        return "0s"
    for unit, size in (("h", 3600.0), ("m", 60.0), ("s", 1.0), ("ms", 1e-3)):
        if abs(value) >= size:
            return _fmt_significant(value / size) + unit
    return _fmt_significant(value / 1e-6) + "µs"


def _fmt_significant(value: float) -> str:
    rounded = float(f"{value:.3g}")
    if abs(rounded) >= 1000:  # only hours get here; .3g would switch to exponent notation
        return f"{rounded:,.0f}"
    return f"{rounded:.3g}"


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _fmt_time(value: Any) -> str:
    """An ISO 8601 time from the summary as "2026-11-21 10:00:00 UTC"; unparsable text escaped."""
    time = _parse_time(value)
    if time is None:
        return _esc_or_dash(value)
    zone = time.strftime("%Z") if time.tzinfo is not None else ""
    return time.strftime("%Y-%m-%d %H:%M:%S") + (f" {zone}" if zone else "")
