"""The operator's page at ``/`` (``transport.http.opsview``) on a real daemon (the C reference
engine, slow ticks) with an API key: the page and its files are public, its JSON needs the key,
Ollama's ``GET /`` still answers non-browsers; then in a real headless Chromium (over the DevTools
protocol): the page loads with no console error, the charts and lane table follow eight streams
while they run (a screenshot goes to /tmp/opsview-screenshot.png), and the playground streams a
reply equal to the same greedy request made with the openai client."""

from __future__ import annotations

import asyncio
import base64
import threading
from pathlib import Path

import httpx
import openai
import pytest
from cdp import Browser, find_chromium
from daemon_harness import Daemon
from serving_harness import ref_toml

KEY = "sk-opsview-test"
STREAMS = 8
SCREENSHOT = Path("/tmp/opsview-screenshot.png")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    base = tmp_path_factory.mktemp("opsview")
    keys = base / "keys"
    keys.write_text(f"{KEY}\n")
    cfg = ref_toml(lanes=STREAMS, context=1024, grant=1, ref={"tick_delay_us": 20000, "eos_period": 0}) + (
        f'[http]\nlisten = ["127.0.0.1:0"]\napi_key_file = "{keys}"\n'
    )
    with Daemon(cfg) as d:
        d.http_url = "http://" + d.http_addresses()[0]
        yield d


def test_page_is_public_its_data_needs_the_key_and_ollama_root_stays(daemon):
    url = daemon.http_url
    with httpx.Client(base_url=url, timeout=30) as h:
        page = h.get("/", headers={"Accept": "text/html,application/xhtml+xml"})
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="/ui/opsview.js">' in page.text
        for name, kind in (("opsview.js", "application/javascript"), ("opsview.css", "text/css")):
            r = h.get(f"/ui/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
        assert h.get("/ui/..%2Fapp.py").status_code == 404  # only the listed files
        assert h.get("/ui/secret.txt").status_code == 404
        ollama = h.get("/")  # no Accept: text/html, as Ollama's clients probe it
        assert ollama.status_code == 200 and ollama.text == "Ollama is running"
        denied = h.get("/v1/basertd/overview")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert h.get("/v1/basertd/overview", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        doc = h.get("/v1/basertd/overview?history_s=30", headers=auth).json()
        assert doc["state"] == "ready" and [w["worker_id"] for w in doc["workers"]] == [0]
        assert len(doc["history"]["tokens_out"]) == 30 and len(doc["history"]["ttft_s"]) == 30
        assert [q["qos"] for q in doc["queue"]] == ["interactive", "batch", "background"]
        for bad in ("-1", "601", "x"):
            r = h.get(f"/v1/basertd/overview?history_s={bad}", headers=auth)
            assert r.status_code == 400 and "history_s" in r.json()["error"]["message"], bad


def _stream_all(url: str, prompts: list[str], started: threading.Event, out: list) -> None:
    """Stream one completion per prompt, concurrently, each to its end."""

    def one(prompt: str) -> None:
        with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            text = ""
            for chunk in c.completions.create(
                model="", prompt=prompt, max_tokens=200, temperature=0, stream=True
            ):
                started.set()
                text += chunk.choices[0].text if chunk.choices else ""
            out.append(text)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.slow
def test_page_in_a_browser_follows_streams_and_the_playground_streams(daemon, tmp_path):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no chromium on PATH (.ci/run installs Debian's chromium)")
    url = daemon.http_url
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        expected = c.completions.create(model="", prompt="The playground says", max_tokens=40, temperature=0)
    expected_text = expected.choices[0].text
    assert expected_text

    browser = Browser.start(chromium, tmp_path / "profile")
    try:
        asyncio.run(_drive(browser, url, expected_text))
    finally:
        browser.close()


async def _drive(browser: Browser, url: str, expected_text: str) -> None:
    page = await browser.page()
    try:
        await page.send("Page.navigate", url=f"{url}/#key={KEY}")
        await page.wait_for("document.querySelectorAll('#workers tbody tr').length === 1", what="worker row")
        assert await page.evaluate("localStorage.getItem('basertd.api_key')") == KEY
        assert await page.evaluate("document.getElementById('error').hidden") is True
        # the model list of the playground came through the same key
        assert await page.wait_for("document.getElementById('p-model').options.length") == 1

        # eight streams: the charts and the lane table follow them while they run
        started, done, texts = threading.Event(), threading.Event(), []
        runner = threading.Thread(
            target=lambda: (
                _stream_all(url, [f"stream {i}" for i in range(STREAMS)], started, texts),
                done.set(),
            )
        )
        runner.start()
        try:
            await asyncio.to_thread(started.wait, 60)
            rows = "[...document.querySelectorAll('#lanes tbody tr')]"
            lanes = await page.wait_for(
                f"{rows}.length >= {STREAMS} && {rows}.every(r => r.cells[4].textContent == 'decode')"
                f" && {rows}.length",
                timeout=60,
                what="eight decoding lanes in the table",
            )
            assert lanes == STREAMS
            first = float(
                await page.wait_for("Number(document.getElementById('chart-tokens').dataset.recent)")
            )
            later = float(
                await page.wait_for(
                    f"Number(document.getElementById('chart-tokens').dataset.recent) > {first} && "
                    "Number(document.getElementById('chart-tokens').dataset.recent)",
                    timeout=30,
                    what="the tokens/s chart growing",
                )
            )
            assert later > first > 0
            assert not done.is_set(), "the streams ended before the chart was seen moving"
            assert (
                float(await page.evaluate("Number(document.getElementById('chart-ttft').dataset.recent)")) > 0
            )
            shot = await page.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
            SCREENSHOT.write_bytes(base64.b64decode(shot["data"]))
        finally:
            await asyncio.to_thread(runner.join, 180)
        assert len(texts) == STREAMS and all(texts), texts

        # the playground: a greedy completion, streamed in several chunks, equal to the client's
        await page.evaluate(
            "document.getElementById('p-prompt').value = 'The playground says';"
            "document.getElementById('p-max_tokens').value = '40';"
            "document.getElementById('p-temperature').value = '0';"
            "document.getElementById('p-send').click(); true"
        )
        status = await page.wait_for(
            "document.getElementById('p-status').textContent.startsWith('done') && "
            "document.getElementById('p-status').textContent",
            timeout=60,
            what="the playground's reply",
        )
        assert status == "done: length", status
        assert await page.evaluate("document.getElementById('p-output').textContent") == expected_text
        assert int(await page.evaluate("Number(document.getElementById('p-output').dataset.chunks)")) > 1
        assert page.errors == [], page.errors
    finally:
        await page.close()
