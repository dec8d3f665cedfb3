"""The dashboard's charts: backlog, lag, handled and dead letters over the last hour, one
line per service, drawn as inline SVG (outbox_inbox.svgchart) from the snapshots the rates
are computed from (rates.RateTracker): docs/dashboard.md ("Charts")."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from html import escape

from ..svgchart import (
    PLOT_LEFT,
    PLOT_RIGHT,
    PLOT_TOP,
    count_ticks,
    no_data,
    series_line,
    svg_open,
    y_axis,
)
from .markup import Safe
from .rates import Sample

#: The time the charts span, in seconds, ending at the newest snapshot.
SPAN = 3600.0
#: Snapshots further apart than this are drawn as separate lines.
GAP = 90.0
HEIGHT = 230
BOTTOM = HEIGHT - 56  # room for the time labels and the legend
#: One colour per service, in the order of the dashboard's services.
COLORS = ("#0969da", "#1a7f37", "#cf222e", "#8250df", "#bf8700", "#1b7c83", "#57606a", "#e16f24")


def _handled_per_minute(sample: Sample, previous: Sample | None) -> float | None:
    if previous is None or sample.processed < previous.processed:
        return None  # the first snapshot of a run, or processed rows archived meanwhile
    span = (sample.at - previous.at).total_seconds()
    return (sample.processed - previous.processed) / span * 60 if span > 0 else None


@dataclass(frozen=True)
class Metric:
    """One chart: its id (``chart-<key>``), title, y axis label, and the value of a snapshot
    given the snapshot before it in the same run (None for the first)."""

    key: str
    title: str
    unit: str
    value: Callable[[Sample, Sample | None], float | None]


METRICS = (
    Metric("backlog", "Backlog", "rows waiting", lambda s, _: float(s.backlog)),
    Metric("lag", "Lag", "seconds", lambda s, _: s.lag),
    Metric("handled", "Handled", "per minute", _handled_per_minute),
    Metric("dead", "Dead letters", "dead", lambda s, _: float(s.dead)),
)


def runs(metric: Metric, samples: Sequence[Sample]) -> list[list[tuple[datetime, float]]]:
    """The (time, value) points of `metric`, split where snapshots are more than GAP apart
    or a value is unknown: each run is drawn as one line."""
    out: list[list[tuple[datetime, float]]] = []
    current: list[tuple[datetime, float]] = []
    previous: Sample | None = None
    for sample in samples:
        joined = previous is not None and (sample.at - previous.at).total_seconds() <= GAP
        value = metric.value(sample, previous if joined else None)
        if (value is None or not joined) and current:
            out.append(current)
            current = []
        if value is not None:
            current.append((sample.at, value))
        previous = sample
    if current:
        out.append(current)
    return out


def x_of(at: datetime, end: datetime) -> float:
    """Where the time `at` is drawn on a chart whose right edge is `end`."""
    before = (end - at).total_seconds()
    return PLOT_RIGHT - (PLOT_RIGHT - PLOT_LEFT) * before / SPAN


def chart(metric: Metric, histories: Mapping[str, Sequence[Sample]], end: datetime) -> str:
    """One chart of `metric`, a line per service, for the SPAN seconds up to `end`."""
    parts = [svg_open(f"chart-{metric.key}", HEIGHT, metric.title)]
    recent = {
        name: runs(metric, [s for s in samples if (end - s.at).total_seconds() <= SPAN])
        for name, samples in histories.items()
    }
    values = [v for lines in recent.values() for run in lines for _, v in run]
    if not values:
        return "".join([*parts, no_data(HEIGHT), "</svg>"])
    ticks = count_ticks(max(values))
    parts.extend(y_axis(ticks, PLOT_TOP, BOTTOM, metric.unit))
    for index, (name, lines) in enumerate(recent.items()):
        color = COLORS[index % len(COLORS)]
        for run in lines:
            xs = [x_of(at, end) for at, _ in run]
            parts.extend(series_line(name, [v for _, v in run], color, xs, ticks[-1], BOTTOM))
        if lines:  # the newest value, visible even while the line is a few pixels long
            at, value = lines[-1][-1]
            y = BOTTOM - (BOTTOM - PLOT_TOP) * value / ticks[-1]
            parts.append(
                f'<circle class="latest" cx="{x_of(at, end):.1f}" cy="{y:.1f}" r="4" '
                f'fill="{color}"><title>{escape(name)}: {value:g}</title></circle>'
            )
    for minutes in (60, 45, 30, 15, 0):
        x = PLOT_RIGHT - (PLOT_RIGHT - PLOT_LEFT) * minutes * 60 / SPAN
        label = f"-{minutes}m" if minutes else "now"
        parts.append(f'<text x="{x:.1f}" y="{BOTTOM + 16}" text-anchor="middle">{label}</text>')
    x = PLOT_LEFT
    for index, name in enumerate(recent):
        color = COLORS[index % len(COLORS)]
        parts.append(
            f'<g class="legend"><rect x="{x}" y="{HEIGHT - 22}" width="12" height="12" '
            f'fill="{color}"/><text x="{x + 16}" y="{HEIGHT - 12}">{escape(name)}</text></g>'
        )
        x += 30 + 7 * len(name)
    parts.append("</svg>")
    return "".join(parts)


def charts(histories: Mapping[str, Sequence[Sample]]) -> Safe:
    """The four charts of these services' snapshots, up to the newest of them."""
    newest = [samples[-1].at for samples in histories.values() if samples]
    if not newest:
        return Safe("")
    end = max(newest)
    drawn = "".join(f"<figure>{chart(m, histories, end)}</figure>" for m in METRICS)
    # Every text in it is escaped by svgchart or here; the rest are numbers.
    return Safe(f'<div class="charts" id="charts">{drawn}</div>')
