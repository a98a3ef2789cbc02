"""A minimal Chrome DevTools Protocol client over `--remote-debugging-pipe` (stdlib only).

Why: the report and the trajectory viewer must be checked in a real browser (no console
errors, sections present, injected scripts inert). The pipe transport needs no open port, no
websocket library and no driver binary: Chromium reads NUL-terminated JSON commands on fd 3 and
writes replies and events on fd 4."""
from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lhd_train.report.chromium import find_chromium

FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--no-default-browser-check",
    "--disable-extensions", "--disable-dev-shm-usage", "--mute-audio", "--remote-debugging-pipe",
)


class CDPError(RuntimeError):
    """A protocol command failed, or the browser did not answer in time."""


@dataclass
class PageReport:
    """What happened while a page loaded: console errors, exceptions, dialogs, requests."""

    url: str
    console: list[dict[str, Any]] = field(default_factory=list)  # {level, text, source}
    exceptions: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    title: str = ""

    @property
    def errors(self) -> list[str]:
        out = [f"{c['source']}: {c['text']}" for c in self.console if c["level"] in ("error", "assert")]
        return out + [f"exception: {e}" for e in self.exceptions]


class Browser:
    """One headless Chromium process driven over the DevTools pipe.

    Use as a context manager; `open(path)` loads a page and returns a `Page`."""

    def __init__(self, binary: str | None = None, timeout_s: float = 30.0):
        self.binary = binary or find_chromium()
        if not self.binary:
            raise FileNotFoundError("no chromium binary found (apt-get install chromium)")
        self.timeout_s = timeout_s
        self._profile = tempfile.mkdtemp(prefix="lhd-chromium-")
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        # Move the child's ends above 10 so dup2 onto 3/4 can never clobber one another.
        hi_r = _dup_high(to_child_r)
        hi_w = _dup_high(from_child_w)
        os.close(to_child_r)
        os.close(from_child_w)

        def child_fds() -> None:  # runs in the child between fork and exec
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        cmd = [self.binary, *FLAGS, f"--user-data-dir={self._profile}", "about:blank"]
        # Chromium's own log goes to a file: an unread pipe could fill up and stall the browser.
        self._log_path = Path(self._profile) / "chromium-stderr.log"
        with open(self._log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         preexec_fn=child_fds, close_fds=False)
        os.close(hi_r)
        os.close(hi_w)
        self._w = to_child_w
        self._r = from_child_r
        self._buf = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []

    # -- transport -------------------------------------------------------------------------
    def _send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> int:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        data = json.dumps(msg).encode() + b"\0"
        while data:
            n = os.write(self._w, data)
            data = data[n:]
        return self._next_id

    def _read_one(self, deadline: float) -> dict[str, Any] | None:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._r], [], [], left)
            if not ready:
                return None
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise CDPError("chromium closed the DevTools pipe: " + self._stderr_tail())
            self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        msg = json.loads(raw)
        if msg.get("method") == "Page.javascriptDialogOpening":
            # A dialog blocks the page (and its load event) until answered: accept it at once; the
            # event stays queued so the page's report records it.
            self._send("Page.handleJavaScriptDialog", {"accept": True}, msg.get("sessionId"))
        return msg

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        """Send a command and wait for its reply; events that arrive meanwhile are queued."""
        mid = self._send(method, params, session)
        deadline = time.monotonic() + self.timeout_s
        while True:
            msg = self._read_one(deadline)
            if msg is None:
                raise CDPError(f"{method}: no reply within {self.timeout_s}s")
            if msg.get("id") == mid:
                if "error" in msg:
                    raise CDPError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self._events.append(msg)

    def wait_event(self, method: str, session: str | None = None, timeout_s: float | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            for i, ev in enumerate(self._events):
                if ev["method"] == method and (session is None or ev.get("sessionId") == session):
                    return self._events.pop(i)
            msg = self._read_one(deadline)
            if msg is None:
                raise CDPError(f"no {method} event within the timeout")
            if "method" in msg:
                self._events.append(msg)

    def drain(self, wait_s: float = 0.2) -> None:
        """Collect events already sent (console messages can trail the load event)."""
        deadline = time.monotonic() + wait_s
        while (msg := self._read_one(deadline)) is not None:
            if "method" in msg:
                self._events.append(msg)

    def _stderr_tail(self) -> str:
        try:
            self.proc.wait(timeout=2)
            return self._log_path.read_bytes()[-2000:].decode(errors="replace")
        except Exception:  # noqa: BLE001 - diagnostics only
            return ""

    # -- pages -----------------------------------------------------------------------------
    def open(self, path: str | Path, settle_s: float = 0.3) -> Page:
        """Open a fresh tab, load `path` (a file path or URL) and wait for its load event."""
        url = (path if isinstance(path, str) and re.match(r"^[a-z][a-z0-9+.-]*:", path)
               else Path(path).resolve().as_uri())
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, target, session, PageReport(url))
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", {}, session)
        self._events = [e for e in self._events if e.get("sessionId") != session]
        self.call("Page.navigate", {"url": url}, session)
        self.wait_event("Page.loadEventFired", session)
        self.drain(settle_s)
        page.collect()
        page.report.title = page.eval("document.title")
        return page

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self.call("Browser.close")
                except (CDPError, OSError):
                    pass
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=5)
        finally:
            for fd in (self._r, self._w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dup_high(fd: int, floor: int = 10) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor)


@dataclass
class Page:
    browser: Browser
    target: str
    session: str
    report: PageReport

    def collect(self) -> None:
        """Move this page's queued events into its report."""
        keep = []
        for ev in self.browser._events:
            if ev.get("sessionId") != self.session:
                keep.append(ev)
                continue
            m, p = ev["method"], ev.get("params", {})
            if m == "Runtime.consoleAPICalled":
                text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
                level = {"warning": "warning", "error": "error", "assert": "assert"}.get(p.get("type"), "info")
                self.report.console.append({"level": level, "text": text, "source": "console"})
            elif m == "Log.entryAdded":
                e = p.get("entry", {})
                self.report.console.append({"level": e.get("level", "info"), "text": e.get("text", ""),
                                            "source": e.get("source", "log")})
            elif m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                self.report.exceptions.append(d.get("exception", {}).get("description") or d.get("text", ""))
            elif m == "Page.javascriptDialogOpening":
                self.report.dialogs.append(p.get("message", ""))
            elif m == "Network.requestWillBeSent":
                self.report.requests.append(p.get("request", {}).get("url", ""))
        self.browser._events = keep

    def eval(self, expression: str) -> Any:
        """Evaluate JavaScript in the page and return its JSON value."""
        res = self.browser.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                     "awaitPromise": True}, self.session)
        if "exceptionDetails" in res:
            raise CDPError(f"evaluate failed: {res['exceptionDetails'].get('text')}: {expression[:80]}")
        self.browser.drain(0.05)
        self.collect()
        return res.get("result", {}).get("value")

    def screenshot(self, out: Path) -> Path:
        import base64

        data = self.browser.call("Page.captureScreenshot", {"format": "png"}, self.session)["data"]
        out.write_bytes(base64.b64decode(data))
        return out

    def close(self) -> None:
        self.browser.call("Target.closeTarget", {"targetId": self.target})
