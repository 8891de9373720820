"""A headless Chromium driven over the Chrome DevTools Protocol, for the tests of the page at ``/``.

Debian's ``chromium`` (``.ci/run`` installs it when missing); ``find_chromium()`` returns None
when there is none, and the browser tests skip. ``Browser.start(tmp)`` launches it with its own
profile in ``tmp`` and a DevTools port the browser picks itself (read back from its
``DevToolsActivePort`` file); ``await browser.page()`` attaches to its one tab with aiohttp's
websocket client: ``send(method, **params)`` returns the command's result, ``evaluate(js)`` the
value of an expression (awaiting promises), ``errors`` every console error, uncaught exception
and failed load the page reported. ``close()`` ends the browser and reaps it (process group).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    """The path of a Chromium on ``$PATH``, or None."""
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Page:
    """One tab over its DevTools websocket (module docstring)."""

    def __init__(self, session: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.session = session
        self.ws = ws
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.errors: list[str] = []
        self.events: list[dict] = []
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(msg.data)
            if "id" in data:
                fut = self.pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
                continue
            self.events.append(data)
            method, params = data.get("method"), data.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                self.errors.append("console: " + " ".join(str(a.get("value", a)) for a in params["args"]))
            elif method == "Runtime.exceptionThrown":
                self.errors.append("exception: " + json.dumps(params["exceptionDetails"])[:500])
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                self.errors.append("log: " + params["entry"].get("text", ""))

    async def send(self, method: str, timeout: float = 30.0, **params: Any) -> dict:
        """Run one DevTools command; its ``result``. Raises ``RuntimeError`` for a protocol error."""
        cid = next(self.ids)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self.pending[cid] = fut
        await self.ws.send_str(json.dumps({"id": cid, "method": method, "params": params}))
        reply = await asyncio.wait_for(fut, timeout)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` in the page (promises awaited). Raises ``RuntimeError`` if it
        throws."""
        r = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 30.0, what: str = "") -> Any:
        """Poll ``expression`` until it is truthy; its value. Raises ``TimeoutError``."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"not within {timeout} s: {what or expression}")
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        await self.ws.close()
        self.reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reader
        await self.session.close()


class Browser:
    """A headless Chromium process (module docstring)."""

    def __init__(self, proc: subprocess.Popen, port: int) -> None:
        self.proc = proc
        self.port = port

    @classmethod
    def start(cls, chromium: str, profile: Path, timeout: float = 60.0) -> Browser:
        profile.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            [
                chromium,
                "--headless=new",
                "--no-sandbox",  # tests run as root
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                "--window-size=1400,1200",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                cls(proc, 0).close()
                raise RuntimeError(f"chromium did not start (exit status {proc.returncode})")
            time.sleep(0.1)
        return cls(proc, int(port_file.read_text().split()[0]))

    async def page(self) -> Page:
        """The browser's tab, attached, with Runtime, Log and Page events on."""
        session = aiohttp.ClientSession()
        try:
            async with session.get(f"http://127.0.0.1:{self.port}/json/list") as r:
                targets = await r.json(content_type=None)
            target = next(t for t in targets if t["type"] == "page")
            ws = await session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        except BaseException:
            await session.close()
            raise
        page = Page(session, ws)
        for domain in ("Runtime", "Log", "Page"):
            await page.send(f"{domain}.enable")
        return page

    def close(self) -> None:
        """End the browser and every process it started; reap it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # helpers left in the group
            os.killpg(self.proc.pid, signal.SIGKILL)
