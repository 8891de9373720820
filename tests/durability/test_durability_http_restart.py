"""An HTTP stream survives a restart of the daemon (README "Resuming a stream: Last-Event-ID"): a
chat stream read part-way, the coordinator stopped by SIGTERM (its drain times out: the request is
handed over) or killed by SIGKILL, a new daemon on the same state directory and the same Unix
HTTP socket; ``Last-Event-ID`` then answers the rest — exactly the text of an uninterrupted run,
numbered on from the client's count — and the request is not run again. The dialect's resume
context (response id, model, options) and the requester come from the write-ahead log."""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from daemon_harness import Daemon
from proc_testutil import pid_alive
from serving_harness import ref_toml
from sse_testutil import sse_fields

MAX_TOKENS = 60
CHAT = {
    "messages": [{"role": "user", "content": "keep going across a restart"}],
    "max_tokens": MAX_TOKENS,
    "temperature": 0,
    "stream": True,
}
URL = "http://basertd/v1/chat/completions"


def text_of(evs: list[dict[str, str]]) -> str:
    out = []
    for e in evs:
        if e.get("data", "[DONE]") == "[DONE]":
            continue
        d = json.loads(e["data"])
        if d.get("choices"):
            out.append(d["choices"][0]["delta"].get("content") or "")
    return "".join(out)


def stop(d: Daemon, how: str) -> None:
    """Stop the coordinator with ``how`` (its workers follow it) and drop its files."""
    kids = d.track_children()
    if how == "sigterm":
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0
    else:
        d.proc.kill()
        d.proc.wait()
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in kids):
        assert time.monotonic() < deadline, "orphan workers"
        time.sleep(0.02)
    d.cleanup()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_last_event_id_resumes_an_http_stream_after_a_restart(how):
    base = Path(tempfile.mkdtemp(prefix="brt-httprs-", dir="/tmp"))
    sock = base / "http.sock"
    cfg = (
        ref_toml(
            lanes=2,
            context=512,
            grant=1,
            ref={"eos_period": 0, "tick_delay_us": 20000},
            worker='chat_template = "chatml"',
        )
        + "[operators]\ndrain_timeout_s = 0.1\n"
        + f'[http]\nlisten = ["unix:{sock}"]\n'
    )
    state = base / "state"
    d = Daemon(cfg, state_dir=state)
    try:
        head: list[dict[str, str]] = []
        with (
            httpx.Client(transport=httpx.HTTPTransport(uds=str(sock))) as c,
            c.stream("POST", URL, json=CHAT, timeout=30) as r,
        ):
            assert r.status_code == 200
            key = r.headers["X-Basertd-Resume-Key"]
            buf = ""
            try:
                for chunk in r.iter_text():
                    buf += chunk
                    while "\n\n" in buf:
                        block, buf = buf.split("\n\n", 1)
                        head += [e for e in sse_fields(block + "\n\n") if "error" not in e.get("data", "")]
                    if len(head) >= 4 and d.proc.poll() is None:
                        stop(d, how)  # the stream is live: 3 tokens of 60 delivered
            except httpx.HTTPError:
                pass  # SIGKILL: the connection drops
        last = [e["id"] for e in head if "id" in e][-1]
        after = int(last.rsplit(":", 1)[1])
        assert last.startswith(key + ":") and 0 < after < MAX_TOKENS
        d = Daemon(cfg, state_dir=state)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock))) as c:
            rest = c.post(URL, json=CHAT, headers={"Last-Event-ID": last}, timeout=60)
            assert rest.status_code == 200, rest.text
            tail = sse_fields(rest.text)
            assert tail[-1]["data"] == "[DONE]"
            assert [e["id"] for e in tail if "id" in e][-1] == f"{key}:{MAX_TOKENS}"
            assert json.loads(tail[0]["data"])["id"] == json.loads(head[0]["data"])["id"]  # same response
            whole = sse_fields(c.post(URL, json={**CHAT, "stream": True}, timeout=60).text)
        assert text_of(head) + text_of(tail) == text_of(whole)
        access = [e for e in d.log_events() if e.get("event") == "access"]
        assert sorted(e["completion_tokens"] for e in access) == [MAX_TOKENS, MAX_TOKENS]  # not re-run
        assert {e["api"] for e in access} == {"openai"}  # the recovered request keeps its API
        d.stop()
    except BaseException:
        d.kill()
        raise
    finally:
        shutil.rmtree(base, ignore_errors=True)
