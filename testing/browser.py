"""A real headless Chromium for tests of the status page, driven over the Chrome DevTools
Protocol on a pipe (``--remote-debugging-pipe``): no debugging port, no driver download,
nothing beyond Debian's ``chromium`` package and the standard library.

The protocol on the pipe: each message is one JSON object ending in a NUL byte; the browser
reads commands on its fd 3 and writes replies and events on its fd 4. Commands for a page
carry the ``sessionId`` of a flattened attachment to it (``Target.attachToTarget``).

    with Browser.launch(profile_dir) as browser:
        page = browser.open("http://127.0.0.1:8000/ui")
        page.wait_for("document.querySelector('#workers tbody tr') !== null", timeout=10)
        page.screenshot(path)
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from itertools import count
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


class BrowserError(RuntimeError):
    pass


class Browser:
    def __init__(self, process: subprocess.Popen, to_browser: int, from_browser: int):
        self.process, self._to_browser, self._from_browser = process, to_browser, from_browser
        self._ids = count(1)
        self._buffer = b""

    @classmethod
    def launch(cls, profile_dir: Path, width: int = 1400, height: int = 1000, executable: str | None = None,
               log_path: Path | None = None) -> Browser:
        executable = executable or find_chromium()
        if executable is None:
            raise BrowserError(f"no Chromium found (looked for {', '.join(CHROMIUM_NAMES)}); `make setup` "
                               f"installs Debian's: apt-get install --no-install-recommends chromium")
        command_read, command_write = _pipe()  # we write commands, the browser reads them on fd 3
        reply_read, reply_write = _pipe()  # the browser writes replies on fd 4, we read them
        flags = ["--headless", "--remote-debugging-pipe", f"--user-data-dir={profile_dir}",
                 f"--window-size={width},{height}", "--hide-scrollbars", "--no-first-run", "--no-default-browser-check",
                 "--disable-gpu", "--disable-extensions", "--disable-background-networking", "--mute-audio"]
        if os.geteuid() == 0:
            # Chromium refuses to start its sandbox as root ("Running as root without --no-sandbox
            # is not supported"); test machines and containers often run as root. The page it
            # loads is our own, from loopback.
            flags.append("--no-sandbox")

        def give_pipes() -> None:
            # In the child, before exec: the pipe ends on the fds Chromium expects. dup2 makes them
            # inheritable; every other descriptor of ours is close-on-exec (PEP 446), so
            # close_fds=False passes exactly these two (pass_fds would close them after this hook).
            os.dup2(command_read, 3)
            os.dup2(reply_write, 4)

        log = open(log_path or os.devnull, "ab")
        try:
            process = subprocess.Popen([executable, *flags, "about:blank"], stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, close_fds=False, preexec_fn=give_pipes,
                                       start_new_session=True)
        finally:
            log.close()
            os.close(command_read)
            os.close(reply_write)
        return cls(process, command_write, reply_read)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def call(self, method: str, session_id: str | None = None, timeout: float = 30, **params) -> dict:
        """Send one command and return its result; events that arrive meanwhile are dropped."""
        message_id = next(self._ids)
        message = {"id": message_id, "method": method, "params": params}
        if session_id:
            message["sessionId"] = session_id
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline - time.monotonic(), method)
            if reply.get("id") == message_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def open(self, url: str, timeout: float = 30) -> Page:
        """A new tab at ``url``, once its document has loaded (its scripts may still be fetching)."""
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        page = Page(self, session)
        page.call("Page.enable")
        page.call("Page.navigate", url=url)
        page.wait_for("location.href !== 'about:blank' && document.readyState === 'complete'", timeout)
        return page

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.call("Browser.close", timeout=5)
            except (BrowserError, OSError):
                pass
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass

    def _read(self, timeout: float, waiting_for: str) -> dict:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from_browser], [], [], max(0.0, timeout))
            if not ready:
                raise BrowserError(f"no answer from Chromium to {waiting_for}")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium closed its pipe (exit code {self.process.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)


def _pipe() -> tuple[int, int]:
    """A pipe whose ends are above fd 4, so that moving them onto 3 and 4 in the child
    cannot overwrite one with the other. Both close on exec."""
    ends = os.pipe()
    moved = tuple(fcntl.fcntl(end, fcntl.F_DUPFD_CLOEXEC, 10) for end in ends)
    for end in ends:
        os.close(end)
    return moved


class Page:
    def __init__(self, browser: Browser, session_id: str):
        self.browser, self.session_id = browser, session_id

    def call(self, method: str, **params) -> dict:
        return self.browser.call(method, self.session_id, **params)

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-able values only)."""
        reply = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in reply:
            raise BrowserError(f"{expression}: {reply['exceptionDetails'].get('text')}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, timeout: float, interval: float = 0.1):
        """Until ``expression`` is truthy in the page; returns its value."""
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise BrowserError(f"still false after {timeout:.0f} s: {expression}")
            time.sleep(interval)
        return value

    def screenshot(self, path: Path) -> Path:
        """A PNG of the whole page, beyond the window's height too."""
        size = self.call("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True, clip=clip)["data"]
        path.write_bytes(base64.b64decode(data))
        return path
