"""A headless Chromium driven over the DevTools protocol on a pipe (no extra dependency).

``--remote-debugging-pipe`` makes Chromium read protocol commands from fd 3 and write replies
and events to fd 4, each a JSON message ended by a NUL byte. :class:`Browser` opens a page,
collects every console error, uncaught exception and log entry of level error (a refused load,
a Content-Security-Policy violation), evaluates expressions and takes screenshots.

Without Chromium the tests that need it skip, unless ``TRAJTRACK_REQUIRE_BROWSER=1`` (CI),
where they fail.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

REQUIRE_VAR = "TRAJTRACK_REQUIRE_BROWSER"
EXECUTABLES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium_or_skip() -> str:
    """The Chromium executable; skips (or fails under ``TRAJTRACK_REQUIRE_BROWSER=1``)."""
    for name in EXECUTABLES:
        found = shutil.which(name)
        if found:
            return found
    reason = f"no Chromium found (looked for {', '.join(EXECUTABLES)})"
    if os.environ.get(REQUIRE_VAR) == "1":
        pytest.fail(f"a browser is required ({REQUIRE_VAR}=1) but {reason}", pytrace=False)
    pytest.skip(f"{reason}: apt-get install chromium")


class Browser:
    """One headless Chromium process and one page in it."""

    def __init__(self, executable: str, profile: Path, *, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.errors: list[str] = []
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._replies: dict[int, dict[str, Any]] = {}
        self._next_id = 0
        commands_r, self._commands_w = os.pipe()
        self._replies_r, replies_w = os.pipe()
        # Away from 3 and 4, so that placing them there in the child clobbers neither.
        child_in = fcntl.fcntl(commands_r, fcntl.F_DUPFD_CLOEXEC, 10)
        child_out = fcntl.fcntl(replies_w, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(commands_r)
        os.close(replies_w)

        def fds_3_and_4() -> None:  # in the child, before exec: dup2'd fds are inherited
            os.dup2(child_in, 3)
            os.dup2(child_out, 4)

        self._process = subprocess.Popen(
            [
                executable,
                "--headless",
                "--no-sandbox",  # Chromium refuses to run as root with its sandbox
                "--disable-gpu",
                "--hide-scrollbars",
                "--no-first-run",
                "--no-default-browser-check",
                "--remote-debugging-pipe",
                f"--user-data-dir={profile}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=False,  # our fds are close-on-exec; only 3 and 4 are meant to pass
            preexec_fn=fds_3_and_4,  # no thread of ours runs yet
        )
        os.close(child_in)
        os.close(child_out)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._session = ""

    # ------------------------------------------------------------------ protocol

    def _read(self) -> None:
        buffer = b""
        while True:
            chunk = os.read(self._replies_r, 1 << 16)
            if not chunk:
                self._events.put({"method": "closed"})
                return
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for message in messages:
                self._events.put(json.loads(message))

    def send(self, method: str, params: dict[str, Any] | None = None, **kw: Any) -> Any:
        """Send one command (to the page's session once there is one) and wait for its reply."""
        self._next_id += 1
        command: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        session = kw.get("session", self._session)
        if session:
            command["sessionId"] = session
        os.write(self._commands_w, json.dumps(command).encode() + b"\0")
        reply = self._wait(lambda m: m.get("id") == command["id"])
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def _wait(self, matches: Any) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no reply from Chromium")
            message = self._events.get(timeout=left)
            if message.get("method") == "closed":
                raise RuntimeError("Chromium closed the pipe")
            self._note(message)
            if matches(message):
                return message

    def _note(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append(f"exception: {details.get('exception', details).get('description')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            text = " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
            self.errors.append(f"console.{params['type']}: {text}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            entry = params["entry"]
            self.errors.append(f"log ({entry['source']}): {entry['text']} {entry.get('url', '')}")

    # ------------------------------------------------------------------ page

    def open(self, url: str, *, width: int = 1200, height: int = 900) -> None:
        """Open *url* in a new page and wait for its load event."""
        target = self.send("Target.createTarget", {"url": "about:blank"}, session="")["targetId"]
        attached = self.send(
            "Target.attachToTarget", {"targetId": target, "flatten": True}, session=""
        )
        self._session = attached["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.send(f"{domain}.enable")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        self.send("Page.navigate", {"url": url})
        self._wait(lambda m: m.get("method") == "Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, width: int, height: int) -> bytes:
        """A PNG of the page's top *width* x *height* pixels (beyond the viewport too)."""
        clip = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
        shot = self.send(
            "Page.captureScreenshot",
            {"format": "png", "clip": clip, "captureBeyondViewport": True},
        )
        return base64.b64decode(shot["data"])

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        try:
            if self._process.poll() is None:
                self.send("Browser.close", session="")
        except (RuntimeError, TimeoutError, OSError):
            pass
        finally:
            try:
                self._process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            os.close(self._commands_w)
            self._reader.join(timeout=5)
            os.close(self._replies_r)

    def __enter__(self) -> Browser:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
