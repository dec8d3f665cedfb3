"""A real headless Chromium session driven over the DevTools protocol (a websocket).

Chromium is started with ``--remote-debugging-port=0`` on a fresh profile; the port it chose
is read from ``DevToolsActivePort`` in that profile, and the test talks to its one page:
navigate, evaluate script in the page, click with real mouse events at an element's centre
(so a link is followed and a form submitted by the browser itself), and screenshots.
"""

from __future__ import annotations

import base64
import json
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import websocket

from report_check import WINDOW, chromium_binary


class Browser:
    """One Chromium process and its page; `close()` ends the process."""

    def __init__(self, work: Path) -> None:
        self._profile = Path(tempfile.mkdtemp(prefix="chromium-profile-", dir=work))
        self._process = subprocess.Popen(
            [
                chromium_binary(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--no-first-run",
                f"--window-size={WINDOW[0]},1000",
                "--force-device-scale-factor=1",
                f"--user-data-dir={self._profile}",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        try:
            port = self._devtools_port()
            self._socket = websocket.create_connection(
                self._page_socket_url(port), timeout=30, suppress_origin=True
            )
            self.send("Page.enable")
            self.send("Runtime.enable")
        except BaseException:
            self.close()
            raise

    def _devtools_port(self) -> int:
        active = self._profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise AssertionError(f"chromium exited: {self._stderr()}")
            if active.exists():
                lines = active.read_text().splitlines()
                if lines and lines[0].strip().isdigit():
                    return int(lines[0])
            time.sleep(0.05)
        raise AssertionError(f"chromium opened no DevTools port in 30 s: {self._stderr()}")

    @staticmethod
    def _page_socket_url(port: int) -> str:
        deadline = time.monotonic() + 10
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as reply:
                targets = json.load(reply)
            pages = [t for t in targets if t.get("type") == "page"]
            if pages:
                return str(pages[0]["webSocketDebuggerUrl"])
            if time.monotonic() > deadline:
                raise AssertionError(f"chromium has no page: {targets}")
            time.sleep(0.05)

    def _stderr(self) -> str:
        if self._process.poll() is None or self._process.stderr is None:
            return ""
        return self._process.stderr.read().decode(errors="replace")[-2000:]

    # --- the protocol ----------------------------------------------------------------------

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Call `method`; return its result (events that arrive meanwhile are kept)."""
        self._next_id += 1
        call_id = self._next_id
        self._socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self._socket.recv())
            if message.get("id") == call_id:
                if "error" in message:
                    raise AssertionError(f"{method} failed: {message['error']}")
                return dict(message.get("result", {}))
            if "method" in message:
                self.events.append(message)

    def wait_event(self, method: str, timeout: float = 30) -> dict[str, Any]:
        """The first event `method` since the last call that cleared `events`."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events:
                if event["method"] == method:
                    return event
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {method} within {timeout}s")
            self._socket.settimeout(remaining)
            message = json.loads(self._socket.recv())
            if "method" in message:
                self.events.append(message)

    # --- what a person does ----------------------------------------------------------------

    def navigate(self, url: str) -> None:
        self.events.clear()
        self.send("Page.navigate", url=url)
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression!r} raised {result['exceptionDetails']}")
        return result["result"].get("value")

    def box(self, selector: str) -> tuple[float, float, float, float]:
        """Where the layout put the first element matching `selector` (left, top, w, h)."""
        found = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " if (!e) return null; e.scrollIntoView({block: 'center'});"
            " const b = e.getBoundingClientRect(); return [b.left, b.top, b.width, b.height]; })()"
        )
        assert found, f"no element {selector!r} on {self.evaluate('location.href')}"
        left, top, width, height = found
        return float(left), float(top), float(width), float(height)

    def click(self, selector: str) -> None:
        """Press and release the mouse at the centre of `selector`, then wait for the page
        the browser loads because of it (a followed link, a submitted form)."""
        left, top, width, height = self.box(selector)
        x, y = left + width / 2, top + height / 2
        self.events.clear()
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
        self.wait_event("Page.loadEventFired")

    def text(self, selector: str) -> str:
        value = self.evaluate(
            f"(document.querySelector({json.dumps(selector)}) || {{}}).textContent || null"
        )
        assert value is not None, f"no element {selector!r} on {self.evaluate('location.href')}"
        return str(value)

    def screenshot(self, path: Path) -> bytes:
        """A PNG of the viewport, also written to `path` (to look at when a test fails)."""
        data = base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(data)
        return data

    def close(self) -> None:
        sock = getattr(self, "_socket", None)
        if sock is not None:
            sock.close()
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait(timeout=10)
        if self._process.stderr is not None:
            self._process.stderr.close()
