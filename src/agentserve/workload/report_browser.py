"""Open a report in headless Chromium and look at it as a user would: the page's text, whether
every image decoded, console errors and uncaught exceptions, and a full-page screenshot.

Spoken over the DevTools protocol (CDP) with aiohttp's websocket client, so nothing beyond the
project's own dependencies and a Chromium binary is needed (`make browser` installs Debian's).
`agentserve report DIR --screenshot FILE` and the browser test use it. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")
# Headless, no sandbox (root in CI containers), and nothing that reaches out to Google's hosts
# (a closed network refuses those by the dozen).
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--remote-debugging-port=0", "--hide-scrollbars")


@dataclass
class PageCheck:
    """What the browser saw."""

    text: str  # document.body.innerText
    images: int  # <img> elements
    broken_images: int  # of them, not decoded (naturalWidth 0)
    errors: list[str] = field(default_factory=list)  # exceptions, console.error, log errors
    png: bytes = b""  # full-page screenshot
    size: tuple[int, int] = (0, 0)  # CSS pixels


def find_chromium() -> str | None:
    """$AGENTSERVE_CHROMIUM, else the first Chromium-like binary on PATH."""
    env = os.environ.get("AGENTSERVE_CHROMIUM")
    if env:
        return env if shutil.which(env) else None
    return next((p for c in CANDIDATES if (p := shutil.which(c))), None)


def _devtools_port(profile: Path, proc: subprocess.Popen, timeout: float) -> int:
    """Chromium writes its port to DevToolsActivePort in the profile once it listens."""
    deadline = time.monotonic() + timeout
    f = profile / "DevToolsActivePort"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with status {proc.returncode} before listening")
        if f.exists() and (lines := f.read_text().split()):
            return int(lines[0])
        time.sleep(0.1)
    raise RuntimeError(f"chromium did not open its DevTools port within {timeout:g} s")


class _Cdp:
    """One page target's websocket: commands by id, events kept for the caller."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self.ids, self.events = ws, itertools.count(1), []

    async def call(self, method: str, timeout: float = 30.0, **params: object) -> dict:
        i = next(self.ids)
        await self.ws.send_str(json.dumps({"id": i, "method": method, "params": params}))
        async with asyncio.timeout(timeout):
            while True:
                msg = json.loads((await self.ws.receive()).data)
                if msg.get("id") == i:
                    if "error" in msg:
                        raise RuntimeError(f"CDP {method}: {msg['error'].get('message')}")
                    return msg.get("result", {})
                if "method" in msg:
                    self.events.append(msg)

    async def wait_event(self, method: str, timeout: float) -> None:
        if any(e["method"] == method for e in self.events):
            return
        async with asyncio.timeout(timeout):
            while True:
                msg = json.loads((await self.ws.receive()).data)
                if "method" in msg:
                    self.events.append(msg)
                    if msg["method"] == method:
                        return


def _errors(events: list[dict]) -> list[str]:
    out = []
    for e in events:
        p = e.get("params", {})
        if e["method"] == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            out.append("exception: " + (d.get("exception", {}).get("description") or d.get("text", "?")))
        elif e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console.error: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"]))
        elif e["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            out.append("log: " + p["entry"].get("text", "?"))
    return out


JS_IMAGES = "JSON.stringify(Array.from(document.images).map(i => i.complete && i.naturalWidth > 0))"


async def _inspect(port: int, url: str, width: int, timeout: float) -> PageCheck:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/json/list", timeout=aiohttp.ClientTimeout(10)) as r:
            targets = await r.json()
        page = next(t for t in targets if t.get("type") == "page")
        async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=256 * 2**20) as ws:
            cdp = _Cdp(ws)
            for domain in ("Page", "Runtime", "Log"):
                await cdp.call(f"{domain}.enable")
            await cdp.call("Emulation.setDeviceMetricsOverride", width=width, height=900,
                           deviceScaleFactor=1, mobile=False)
            await cdp.call("Page.navigate", url=url)
            await cdp.wait_event("Page.loadEventFired", timeout)
            text = (await cdp.call("Runtime.evaluate", expression="document.body.innerText"))["result"]["value"]
            imgs = json.loads((await cdp.call("Runtime.evaluate", expression=JS_IMAGES))["result"]["value"])
            size = (await cdp.call("Page.getLayoutMetrics"))["cssContentSize"]
            w, h = int(size["width"]), int(size["height"])
            shot = await cdp.call("Page.captureScreenshot", timeout, format="png", captureBeyondViewport=True,
                                  clip={"x": 0, "y": 0, "width": w, "height": h, "scale": 1})
            return PageCheck(text, len(imgs), sum(not ok for ok in imgs), _errors(cdp.events),
                             base64.b64decode(shot["data"]), (w, h))


def check_page(path: Path, width: int = 1280, timeout: float = 60.0, chromium: str | None = None) -> PageCheck:
    """Load `path` in a fresh headless Chromium (own temporary profile) and report what it saw.
    RuntimeError when no Chromium is found or it does not answer in time."""
    exe = chromium or find_chromium()
    if exe is None:
        raise RuntimeError("no Chromium found (looked for $AGENTSERVE_CHROMIUM, "
                           f"{', '.join(CANDIDATES)}): `make browser` installs Debian's")
    with tempfile.TemporaryDirectory(prefix="agentserve-chromium-") as profile:
        proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            port = _devtools_port(Path(profile), proc, timeout)
            return asyncio.run(_inspect(port, Path(path).resolve().as_uri(), width, timeout))
        except (TimeoutError, asyncio.TimeoutError):
            raise RuntimeError(f"chromium did not finish loading {path} within {timeout:g} s") from None
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """End Chromium and its helpers (renderer, zygote): its own process group, started above."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
