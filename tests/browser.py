"""Open an HTML file in headless Chromium with networking off; report what a reader would see.

Talks the DevTools protocol over a pipe (``--remote-debugging-pipe``), so no port is opened.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def require_chromium() -> str:
    """Chromium's path; without one a test fails on CI (``make test`` installs it) and is
    skipped elsewhere."""
    import pytest

    path = find_chromium()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: `make test` installs it (apt-get install chromium)")
        pytest.skip("no chromium here: `make test` installs it (apt-get install chromium)")
    return path


@dataclass
class PageReport:
    charts: list[dict] = field(default_factory=list)  # id, state, svg marks, width, height
    # Each chart panel with points: its x axis (Vega's aria-label) and the share of the
    # panel's width its points span.
    spreads: list[dict] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    console_warnings: list[str] = field(default_factory=list)
    network_requests: list[str] = field(default_factory=list)  # anything not file: or data:
    text: str = ""


class _DevTools:
    def __init__(self, chromium: str, profile: str):
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # The browser reads commands on fd 3 and answers on fd 4. The pipe ends go to fds of 10
        # and up first (so none sits on 3 or 4), then bash moves them (dash takes one-digit fds
        # only): no preexec_fn, which is unsafe in a process with threads (Dask clients).
        child_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD_CLOEXEC, 10)
        child_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD_CLOEXEC, 10)
        for fd in (to_browser_r, from_browser_w):
            os.close(fd)
        to_browser_r, from_browser_w = child_r, child_w
        launch = f'exec "$0" "$@" 3<&{child_r} 4>&{child_w} {child_r}<&- {child_w}>&-'
        self.process = subprocess.Popen(
            ["bash", "-c", launch, chromium, "--headless", "--no-sandbox", "--disable-gpu",
             "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--disable-extensions",
             "--disable-features=MediaRouter,OptimizationHints",
             # No name resolves: a request for anything remote fails here, never leaves.
             "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9",
             f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
            pass_fds=(child_r, child_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout_s: float = 30.0) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)
        raise TimeoutError(f"{method}: no answer in {timeout_s} s")

    def _read(self, deadline: float) -> dict:
        import select

        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._from_browser], [], [], max(0.0, left))
            if not ready:
                raise TimeoutError("the browser stopped answering")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("the browser exited")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout_s=5)
        except Exception:  # noqa: BLE001 - it may be gone already
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        os.close(self._to_browser)
        os.close(self._from_browser)


_CHART_STATE = """JSON.stringify(
Array.from(document.querySelectorAll('.quantdask-chart')).map(el => {
  const svg = el.querySelector('svg');
  const box = el.getBoundingClientRect();
  return {id: el.id, state: el.dataset.state,
          marks: svg ? svg.querySelectorAll('.mark-rect, .mark-symbol, .mark-line, .mark-rule,'
                                            + ' .mark-text, .mark-area').length : 0,
          width: box.width, height: box.height};
}))"""


_POINT_SPREADS = """JSON.stringify(
Array.from(document.querySelectorAll('.quantdask-chart g.mark-symbol')).map(marks => {
  const scope = marks.closest('g.mark-group.role-scope');
  const frame = scope && scope.querySelector(':scope > g > path.background');
  if (!frame) { return null; }
  const box = frame.getBoundingClientRect();
  const xs = Array.from(marks.querySelectorAll('path')).map(point => {
    const b = point.getBoundingClientRect(); return b.left + b.width / 2; });
  const axis = Array.from(scope.querySelectorAll('g.role-axis'))
    .map(a => a.getAttribute('aria-label') || '').find(label => label.startsWith('X-axis'));
  return {x_axis: axis || '', points: xs.length, width: box.width,
          spread: xs.length > 1 ? (Math.max(...xs) - Math.min(...xs)) / box.width : 0};
}).filter(panel => panel !== null))"""


def inspect_page(html_path: str | Path, screenshot: str | Path | None = None,
                 timeout_s: float = 60.0, chromium: str | None = None) -> PageReport:
    """Load ``html_path`` offline, wait for every ``.quantdask-chart`` to settle, and return
    what rendered and what the console said; save a full-page PNG to ``screenshot``."""
    chromium = chromium or find_chromium()
    if chromium is None:
        raise FileNotFoundError("no chromium on PATH (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="quantdask-chromium-") as profile:
        tools = _DevTools(chromium, profile)
        try:
            target = tools.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = tools.send("Target.attachToTarget",
                                 {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime", "Log", "Page", "Network"):
                tools.send(f"{domain}.enable", session=session)
            tools.send("Network.emulateNetworkConditions",
                       {"offline": True, "latency": 0, "downloadThroughput": -1,
                        "uploadThroughput": -1}, session=session)
            tools.send("Emulation.setDeviceMetricsOverride",
                       {"width": 1400, "height": 1000, "deviceScaleFactor": 1,
                        "mobile": False}, session=session)
            url = Path(html_path).resolve().as_uri()
            tools.send("Page.navigate", {"url": url}, session=session)
            # Until the new document has loaded, an evaluation may still see about:blank.
            loaded_expression = (f"location.href === {json.dumps(url)} "
                                 "&& document.readyState === 'complete'")
            deadline = time.monotonic() + timeout_s
            def evaluate(expression):
                return tools.send("Runtime.evaluate", {"expression": expression,
                                                       "returnByValue": True},
                                  session=session)["result"].get("value")

            while not evaluate(loaded_expression):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} did not load in {timeout_s} s")
                time.sleep(0.1)
            charts = json.loads(evaluate(_CHART_STATE))
            while any(c["state"] == "pending" for c in charts) and time.monotonic() < deadline:
                time.sleep(0.2)  # vegaEmbed renders asynchronously
                charts = json.loads(evaluate(_CHART_STATE))
            text = evaluate("document.body.innerText") or ""
            spreads = json.loads(evaluate(_POINT_SPREADS))
            if screenshot is not None:
                height = evaluate("document.documentElement.scrollHeight")
                tools.send("Emulation.setDeviceMetricsOverride",
                           {"width": 1400, "height": min(int(height), 16000),
                            "deviceScaleFactor": 1, "mobile": False}, session=session)
                shot = tools.send("Page.captureScreenshot", {"format": "png"}, session=session)
                Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
        finally:
            tools.close()
    report = PageReport(charts=charts, spreads=spreads, text=text)
    for event in tools.events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled":
            message = " ".join(str(a.get("value", a.get("description", "")))
                               for a in params.get("args", []))
            if params.get("type") == "error":
                report.console_errors.append(message)
            elif params.get("type") == "warning":
                report.console_warnings.append(message)
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            report.console_errors.append(
                details.get("exception", {}).get("description") or details.get("text", ""))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            report.console_errors.append(params["entry"].get("text", ""))
        elif method == "Network.requestWillBeSent":
            url = params.get("request", {}).get("url", "")
            if not url.startswith(("file:", "data:", "about:", "blob:")):
                report.network_requests.append(url)
    return report
