"""Charts drawn as inline SVG: one coordinate system, count ticks, a y axis, lines. What the audit
report (outbox_inbox.analytics.report) and the dashboard share. A chart is CHART_WIDTH wide in its
own units and scales to its box through its viewBox; the plot spans PLOT_LEFT..PLOT_RIGHT and starts
PLOT_TOP from the top. Colours are presentation attributes and the rest is styled by CHART_CSS, so a
page that forbids inline styles shows them. Every text given is escaped."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

CHART_WIDTH = 640
PLOT_LEFT = 64
PLOT_RIGHT = CHART_WIDTH - 20
PLOT_TOP = 44

CHART_CSS = """
svg.chart { width: 100%; height: auto; display: block; }
svg.chart text { font-family: system-ui, sans-serif; font-size: 11px; fill: #374151; }
svg.chart text.title { font-size: 15px; font-weight: 600; fill: #111827; }
svg.chart text.axis-label { font-size: 12px; fill: #4b5563; }
svg.chart text.no-data { font-size: 16px; fill: #9ca3af; }
svg.chart line.grid { stroke: #e5e7eb; stroke-width: 1; }
svg.chart line.axis { stroke: #6b7280; stroke-width: 1; }
"""


def fmt_count(value: int) -> str:
    return f"{value:,}"


def svg_open(chart_id: str, height: int, title: str) -> str:
    """The opening tag of a chart `height` units high, with its title."""
    title = escape(title, quote=True)
    return (
        f'<svg class="chart" id="{escape(chart_id, quote=True)}" '
        f'viewBox="0 0 {CHART_WIDTH} {height}" '
        f'role="img" aria-label="{title}" xmlns="http://www.w3.org/2000/svg">'
        f"<title>{title}</title>"
        f'<text class="title" x="{PLOT_LEFT}" y="22">{title}</text>'
    )


def no_data(height: int) -> str:
    return (
        f'<text class="no-data" x="{CHART_WIDTH / 2}" y="{height / 2}" '
        f'text-anchor="middle">no data</text>'
    )


def y_axis(ticks: Sequence[int], top: int, bottom: int, label: str) -> list[str]:
    """Horizontal grid lines with count labels, the axis line and the rotated axis label."""
    marks = []
    for tick in ticks:
        y = bottom - (bottom - top) * tick / ticks[-1]
        marks.append(
            f'<line class="grid" x1="{PLOT_LEFT}" x2="{PLOT_RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text x="{PLOT_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{fmt_count(tick)}</text>"
        )
    marks.append(f'<line class="axis" x1="{PLOT_LEFT}" x2="{PLOT_LEFT}" y1="{top}" y2="{bottom}"/>')
    marks.append(
        f'<line class="axis" x1="{PLOT_LEFT}" x2="{PLOT_RIGHT}" y1="{bottom}" y2="{bottom}"/>'
    )
    middle = (top + bottom) / 2
    marks.append(
        f'<text class="axis-label" x="16" y="{middle:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 16 {middle:.1f})">{escape(label)}</text>'
    )
    return marks


def x_axis_label(label: str, y: int) -> str:
    middle = (PLOT_LEFT + PLOT_RIGHT) / 2
    return (
        f'<text class="axis-label" x="{middle:.1f}" y="{y}" text-anchor="middle">'
        f"{escape(label)}</text>"
    )


def series_line(
    name: str,
    values: Sequence[float],
    color: str,
    xs: Sequence[float],
    scale_max: float,
    bottom: int,
) -> list[str]:
    """One series as a line through (xs[i], values[i]) on a y axis from 0 (at `bottom`) to
    `scale_max` (at PLOT_TOP); a single point is drawn as a dot."""

    def y_of(value: float) -> float:
        return bottom - (bottom - PLOT_TOP) * value / scale_max

    css = escape(f"series series-{name}", quote=True)
    points = " ".join(f"{x:.1f},{y_of(v):.1f}" for x, v in zip(xs, values, strict=True))
    parts = [
        f'<polyline class="{css}" points="{points}" fill="none" '
        f'stroke="{color}" stroke-width="2.5" stroke-linejoin="round"/>'
    ]
    if len(values) == 1:  # a polyline of one point draws nothing: a dot a reader can see
        parts.append(
            f'<circle class="{css}" cx="{xs[0]:.1f}" cy="{y_of(values[0]):.1f}" r="6" '
            f'fill="{color}"/>'
        )
    return parts


def count_ticks(max_value: float, target: int = 5) -> list[int]:
    """0 up to a round number at or above `max_value`, in steps of 1, 2 or 5 times 10^k."""
    if max_value <= 0:
        return [0, 1]
    raw = max_value / target
    magnitude = 10 ** max(math.floor(math.log10(raw)), 0)  # counts need no fractional steps
    step = next(factor * magnitude for factor in (1, 2, 5, 10) if factor * magnitude >= raw)
    return list(range(0, math.ceil(max_value / step) * step + 1, step))
