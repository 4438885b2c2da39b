"""Headless Chromium driven over the DevTools protocol (websockets, which Prefect already needs): open a page of the
Prefect UI, wait until it has rendered, evaluate JavaScript in it, take a screenshot. Debian's `chromium` package;
no browser download (tests/test_ui.py skips without it)."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
INSTALL = "apt-get update && apt-get install -y chromium"


class Browser:
    def __init__(self, port: int, profile: Path, width: int = 1440, height: int = 1000):
        argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--mute-audio"]
        argv += [f"--remote-debugging-port={port}", f"--user-data-dir={profile}", f"--window-size={width},{height}"]
        self.proc = subprocess.Popen([*argv, "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.ids = itertools.count(1)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as response:
                    pages = [t for t in json.load(response) if t["type"] == "page"]
                if pages:
                    break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError("chromium did not start its DevTools endpoint") from None
            time.sleep(0.3)
        from websockets.sync.client import connect

        self.socket = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30)

    def call(self, method: str, **params) -> dict:
        ident = next(self.ids)
        self.socket.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:  # events arrive between the answers: skipped
            message = json.loads(self.socket.recv(timeout=60))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def open(self, url: str, ready: str, timeout: float = 60) -> None:
        """Navigate, then wait until the JavaScript expression ready is true (the single-page app has rendered)."""
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        while not self.evaluate(ready):
            if time.monotonic() > deadline:
                raise AssertionError(f"{url} did not render: {self.evaluate('document.body.innerText')!r:.2000}")
            time.sleep(0.3)
        time.sleep(0.5)  # the last layout pass

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        if getattr(self, "socket", None) is not None:
            self.socket.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# What the page shows, measured: every table cell whose right edge passes the visible box of its table (the
# nearest ancestor that clips or scrolls it), with its text; and the page's text as a person reads it.
OVERFLOWING_CELLS = """
(() => {
  const clipped = (el) => { const s = getComputedStyle(el); return s.overflowX !== 'visible'; };
  const out = [];
  for (const cell of document.querySelectorAll('main td, main th, td, th')) {
    let box = cell.closest('table');
    for (let el = box; el && el !== document.body; el = el.parentElement) { if (clipped(el)) { box = el; break; } }
    const right = Math.min(box.getBoundingClientRect().right, window.innerWidth);
    const r = cell.getBoundingClientRect();
    if (r.width > 0 && r.right > right + 1) out.push(cell.innerText.slice(0, 80));
  }
  return [...new Set(out)];
})()
"""


_TEXT_ON_SCREEN = """
(() => {
  const text = __TEXT__;
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const at = node.textContent.indexOf(text);
    if (at < 0) continue;
    const range = document.createRange();
    range.setStart(node, at); range.setEnd(node, at + text.length);
    const r = range.getBoundingClientRect();
    let right = window.innerWidth;
    for (let el = node.parentElement; el && el !== document.body; el = el.parentElement) {
      if (getComputedStyle(el).overflowX !== 'visible') right = Math.min(right, el.getBoundingClientRect().right);
    }
    return r.width > 0 && r.right <= right + 1;
  }
  return false;
})()
"""


def text_on_screen(text: str) -> str:
    """JavaScript: whether the text is laid out inside the window and inside every box that clips it (a code
    block that does not wrap scrolls the end of a long line out of sight)."""
    return _TEXT_ON_SCREEN.replace("__TEXT__", json.dumps(text))
