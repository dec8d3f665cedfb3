"""Opening an audit report in headless Chromium: the rendered DOM and a decoded screenshot.

Shared by the report's unit tests, the end-to-end pipeline test and the dashboard's browser
tests. Standard library only (the PNG decoder included), plus the Chromium binary, which these
tests fail without (scripts/test installs it).
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

CHART_IDS = ("chart-latency", "chart-throughput", "chart-dead-letters")
WINDOW = (1400, 3000)
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


# --- reading the HTML back -------------------------------------------------------------------


@dataclass
class Chart:
    """What one chart svg holds: its drawn marks with their attributes, and its text."""

    attrs: dict[str, str]
    marks: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def bars(self) -> list[dict[str, str]]:
        return [
            attrs
            for tag, attrs in self.marks
            if tag == "rect" and "bar" in attrs.get("class", "").split()
        ]

    def polylines(self) -> list[dict[str, str]]:
        return [attrs for tag, attrs in self.marks if tag == "polyline"]


class ReportParser(HTMLParser):
    """Collects the chart svgs, the verdict heading and every element name of a page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.charts: dict[str, Chart] = {}
        self.tags: list[str] = []
        self.verdict_class = ""
        self.verdict = ""
        self._chart: Chart | None = None
        self._in_verdict = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        self.tags.append(tag)
        if tag == "svg" and values.get("id") in CHART_IDS:
            self._chart = self.charts[values["id"]] = Chart(values)
        elif self._chart is not None and tag in ("rect", "polyline", "path", "circle"):
            self._chart.marks.append((tag, values))
        if tag == "h1" and "verdict" in values.get("class", ""):
            self._in_verdict = True
            self.verdict_class = values["class"]

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._chart = None
        if tag == "h1":
            self._in_verdict = False

    def handle_data(self, data: str) -> None:
        if self._chart is not None:
            self._chart.text.append(data)
        if self._in_verdict:
            self.verdict += data


def parse(page: str) -> ReportParser:
    parser = ReportParser()
    parser.feed(page)
    parser.close()
    return parser


# --- headless Chromium -----------------------------------------------------------------------


def chromium_binary() -> str:
    """The Chromium binary on PATH. Fails the test without one: scripts/test installs Debian's
    `chromium` (tests/servers.py ensure_chromium_installed), so a missing browser is a broken
    setup, never a reason to skip the browser checks."""
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(
        f"no Chromium binary found on PATH (looked for {', '.join(CHROMIUM_NAMES)}): run "
        "scripts/test, which installs Debian's chromium, or `apt-get install chromium` as root"
    )


def run_chromium(binary: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # A fresh profile per run: parallel or leftover runs must not share Chromium's profile lock.
    profile = tempfile.mkdtemp(prefix="chromium-profile-", dir=tmp_path)
    return subprocess.run(
        [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--window-size={WINDOW[0]},{WINDOW[1]}",
            "--force-device-scale-factor=1",
            f"--user-data-dir={profile}",
            *args,
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# Added to a copy of the page only, so that the DOM dump tells where the layout put each chart;
# the screenshot is taken of the page as shipped, which has no script.
_BOX_SCRIPT = """<script>
for (const svg of document.querySelectorAll("svg.chart")) {
  const box = svg.getBoundingClientRect();
  svg.setAttribute("data-box", [box.left, box.top, box.width, box.height].join(","));
}
</script>"""


# --- PNG decoding (standard library only) ----------------------------------------------------


@dataclass
class Image:
    width: int
    height: int
    rows: list[bytes]  # RGB, 3 bytes a pixel

    def pixels(self, box: tuple[int, int, int, int] | None = None) -> Iterator[tuple[int, ...]]:
        left, top, right, bottom = box or (0, 0, self.width, self.height)
        for row in self.rows[max(top, 0) : min(bottom, self.height)]:
            for x in range(max(left, 0), min(right, self.width)):
                yield tuple(row[3 * x : 3 * x + 3])


def _paeth(left: int, up: int, up_left: int) -> int:
    estimate = left + up - up_left
    distance_left = abs(estimate - left)
    distance_up = abs(estimate - up)
    distance_up_left = abs(estimate - up_left)
    if distance_left <= distance_up and distance_left <= distance_up_left:
        return left
    if distance_up <= distance_up_left:
        return up
    return up_left


def decode_png(data: bytes) -> Image:
    """8-bit RGB or RGBA, non-interlaced PNG to RGB rows (alpha dropped; Chromium's is opaque)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    offset = 8
    idat = bytearray()
    width = height = channels = 0
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        offset += 12 + length
        if kind == b"IHDR":
            width, height, depth, color_type, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color_type in (2, 6) and interlace == 0, (
                f"unsupported PNG: depth {depth}, color type {color_type}, interlace {interlace}"
            )
            channels = 3 if color_type == 2 else 4
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    raw = zlib.decompress(bytes(idat))
    stride = width * channels
    assert len(raw) == height * (stride + 1), "IDAT size does not match the image size"

    rows: list[bytes] = []
    previous = bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        filter_type = raw[start]
        line = bytearray(raw[start + 1 : start + 1 + stride])
        if filter_type == 1:  # Sub
            for i in range(channels, stride):
                line[i] = (line[i] + line[i - channels]) & 0xFF
        elif filter_type == 2:  # Up
            line = bytearray((a + b) & 0xFF for a, b in zip(line, previous, strict=True))
        elif filter_type == 3:  # Average
            for i in range(stride):
                left = line[i - channels] if i >= channels else 0
                line[i] = (line[i] + (left + previous[i]) // 2) & 0xFF
        elif filter_type == 4:  # Paeth
            for i in range(stride):
                left = line[i - channels] if i >= channels else 0
                up_left = previous[i - channels] if i >= channels else 0
                line[i] = (line[i] + _paeth(left, previous[i], up_left)) & 0xFF
        else:
            assert filter_type == 0, f"unknown PNG filter type {filter_type} in row {y}"
        previous = bytes(line)
        if channels == 4:
            del line[3::4]
        rows.append(bytes(line))
    return Image(width, height, rows)


def rgb(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


def near(pixel: tuple[int, ...], color: tuple[int, int, int], tolerance: int = 12) -> bool:
    return all(abs(a - b) <= tolerance for a, b in zip(pixel, color, strict=True))


# --- rendering a report ------------------------------------------------------------------------


def render_in_chromium(
    report: Path, work: Path
) -> tuple[ReportParser, dict[str, list[float]], Image]:
    """Open `report` in headless Chromium: its rendered DOM, where the layout put each chart
    (left, top, width, height), and a screenshot of the page as shipped. Fails without
    Chromium."""
    binary = chromium_binary()
    work.mkdir(parents=True, exist_ok=True)
    page = report.read_text(encoding="utf-8")
    measured = work / "report-measured.html"
    measured.write_text(page.replace("</body>", _BOX_SCRIPT + "</body>"), encoding="utf-8")
    dump = run_chromium(binary, work, "--dump-dom", measured.as_uri())
    assert dump.returncode == 0, f"chromium --dump-dom failed:\n{dump.stderr}"
    dom = parse(dump.stdout)

    screenshot = work / "report.png"
    shot = run_chromium(binary, work, f"--screenshot={screenshot}", report.as_uri())
    assert shot.returncode == 0 and screenshot.exists(), (
        f"chromium --screenshot failed:\n{shot.stderr}"
    )
    boxes = {
        chart_id: [float(v) for v in chart.attrs["data-box"].split(",")]
        for chart_id, chart in dom.charts.items()
    }
    return dom, boxes, decode_png(screenshot.read_bytes())


def assert_report_renders(report: Path, work: Path, colors: dict[str, str]) -> ReportParser:
    """The report opens in Chromium with its three charts drawn: each chart has marks in the
    DOM and pixels of its colour (`colors`: chart id -> colour) on the screenshot, inside the
    box the layout gave it. Returns the rendered DOM for further checks."""
    dom, boxes, image = render_in_chromium(report, work)
    assert set(dom.charts) == set(CHART_IDS), f"charts rendered: {sorted(dom.charts)}"
    for chart_id, color in colors.items():
        assert dom.charts[chart_id].marks, f"{chart_id} has nothing drawn"
        left, top, width, height = boxes[chart_id]
        assert width > 300 and height > 100, f"{chart_id} laid out at {boxes[chart_id]}"
        region = (int(left), int(top), int(left + width), int(top + height))
        matching = sum(1 for pixel in image.pixels(region) if near(pixel, rgb(color)))
        assert matching > 250, f"{chart_id}: only {matching} pixels of {color} on screen"
    return dom
