"""Who may read whose stream (README "Who may resume what"): a request is bound to its requester
— the peer uid on a Unix socket (native or HTTP), the API key on TCP — and only that requester
(or, natively, an operator) may ``Resume`` it or follow it with ``Last-Event-ID``; neither the
resume key nor an API key reaches the logs; a flood of resumes of one long result is rate-limited
and answered from a cached text while other requests keep their latency. A real daemon on the
reference engine, the second user a forked child that dropped to ``nobody`` (needs root)."""

from __future__ import annotations

import grp
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from daemon_harness import Daemon
from ops_harness import run_as
from serving_harness import ref_toml
from sse_testutil import read_events, sse_fields

from basertd.client import Client, ClientError, ErrorCode

NOBODY = 65534
KEY_A = "sk-tenant-a-0123456789"
KEY_B = "sk-tenant-b-9876543210"
CONTEXT = 4096
LONG = 3000
"""Tokens of the finished result the resume flood asks for."""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")


def _spare_group() -> grp.struct_group:
    for g in grp.getgrall():
        if g.gr_gid not in (0, NOBODY) and "nobody" not in g.gr_mem:
            return g
    pytest.skip("no spare group on this system")


@pytest.fixture(scope="module")
def daemon():
    group = _spare_group()
    base = Path(tempfile.mkdtemp(prefix="brt-tenancy-", dir="/tmp"))
    os.chmod(base, 0o755)  # nobody reaches the Unix HTTP socket in it
    keys = base / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    cfg = (
        ref_toml(
            lanes=4,
            context=CONTEXT,
            grant=4,
            ref={"eos_period": 0, "tick_delay_us": 5000},
            worker='chat_template = "chatml"',
        )
        + f'[operators]\noperator_group = "{group.gr_name}"\n'
        + "[durability]\nresumes_per_s = 5.0\nresume_burst = 10\n"
        + f'[http]\nlisten = ["127.0.0.1:0", "unix:{base}/http.sock"]\n'
        + f'api_key_file = "{keys}"\nresume_grace_s = 30.0\n'
    )
    try:
        with Daemon(cfg, open_to_all=True) as d:
            d.group = group
            d.http_url = "http://" + next(a for a in d.http_addresses() if not a.startswith("unix:"))
            d.http_sock = str(base / "http.sock")
            yield d
    finally:
        shutil.rmtree(base, ignore_errors=True)


def read_some(client: httpx.Client, url: str, body: dict, headers: dict, n: int) -> tuple[str, str]:
    """Start a stream, read ``n`` events, drop it: (resume key header, last event id)."""
    with client.stream("POST", url, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        key = r.headers["X-Basertd-Resume-Key"]
        got = read_events(r, n)
    return key, next(e["id"] for e in reversed(got) if "id" in e)


def test_another_uid_can_neither_resume_nor_cancel_a_native_stream_but_an_operator_can_read_it(daemon):
    with Client(daemon.socket, timeout=60) as c:
        s = c.stream(prompt_tokens=[1, 2, 3, 4], max_tokens=1200, temperature=0, ignore_eos=True)
        it = iter(s)
        got = list(next(it).ids)

        def as_nobody() -> str:
            with Client(daemon.socket, timeout=30) as other:
                other.cancel(s.request_id)  # another connection's request id: nothing to cancel
                try:
                    other.resume(s.resume_id, after=0, resume=False)
                    return "resumed"
                except ClientError as exc:
                    return str(exc.code)

        def as_operator() -> int:
            with Client(daemon.socket, timeout=30) as op:
                return sum(len(t.ids) for t in op.resume(s.resume_id, after=0, resume=False))

        assert run_as(NOBODY, NOBODY, [], as_nobody) == ErrorCode.PERMISSION_DENIED
        assert run_as(NOBODY, NOBODY, [daemon.group.gr_gid], as_operator) == 1200  # an operator
        for t in it:
            got.extend(t.ids)
        assert len(got) == 1200 and s.done.finish_reason == "length"  # never cancelled
    assert run_as(NOBODY, NOBODY, [], as_nobody) == ErrorCode.PERMISSION_DENIED  # the result too


def test_http_resume_needs_the_same_api_key_or_peer_uid_and_no_key_is_logged(daemon):
    url = daemon.http_url + "/v1/completions"
    body = {"prompt": "tenant a's secret", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client() as client:
        key, last = read_some(client, url, body, {"Authorization": f"Bearer {KEY_A}"}, 3)
        assert last.startswith(key + ":")
        other = client.post(
            url, json=body, headers={"Authorization": f"Bearer {KEY_B}", "Last-Event-ID": last}, timeout=30
        )
        assert other.status_code == 403, other.text
        assert "another requester" in other.json()["error"]["message"]
        same = client.post(
            url, json=body, headers={"Authorization": f"Bearer {KEY_A}", "Last-Event-ID": last}, timeout=60
        )
        assert same.status_code == 200, same.text
        ids = [e["id"] for e in sse_fields(same.text) if "id" in e]
        assert ids[-1] == f"{key}:400"

    # a Unix HTTP listener binds the stream to the peer's uid
    chat = {"messages": [{"role": "user", "content": "root's"}], "max_tokens": 400, "stream": True}
    with httpx.Client(transport=httpx.HTTPTransport(uds=daemon.http_sock)) as unix:
        _, last = read_some(unix, "http://basertd/v1/chat/completions", chat, {}, 2)

    def nobody_follows() -> int:
        with httpx.Client(transport=httpx.HTTPTransport(uds=daemon.http_sock)) as c:
            r = c.post("http://basertd/v1/chat/completions", json=chat, headers={"Last-Event-ID": last})
            return r.status_code

    assert run_as(NOBODY, NOBODY, [], nobody_follows) == 403
    log = daemon.log_text()
    assert KEY_A not in log and KEY_B not in log and key not in log
    access = [e for e in daemon.log_events() if e.get("event") == "access" and e.get("api") == "openai"]
    assert access and all(key not in json.dumps(e) for e in access)


def test_a_resume_flood_is_rate_limited_and_leaves_other_requests_fast(daemon):
    with Client(daemon.socket, timeout=120) as c:
        s = c.stream(prompt_tokens=[9, 8, 7], max_tokens=LONG, temperature=0, ignore_eos=True)
        whole = "".join(t.text for t in s)
    stop = threading.Event()
    answered, refused, wrong = [0], [0], [0]

    def flood() -> None:
        with Client(daemon.socket, timeout=60) as f:
            while not stop.is_set():
                try:
                    text = "".join(t.text for t in f.resume(s.resume_id, after=0, resume=False))
                    answered[0] += 1
                    wrong[0] += text != whole
                except ClientError as exc:
                    assert exc.code == ErrorCode.QUEUE_FULL, exc
                    refused[0] += 1

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    worst = 0.0
    try:
        with Client(daemon.socket, timeout=60) as probe:
            for _ in range(12):
                t0 = time.monotonic()
                probe.generate(prompt_tokens=[5, 6], max_tokens=4, temperature=0, ignore_eos=True)
                worst = max(worst, time.monotonic() - t0)
                time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    print(f"resume flood: answered {answered[0]}, refused {refused[0]}, worst probe {worst:.3f} s")
    assert answered[0] >= 1 and wrong[0] == 0
    assert refused[0] > answered[0]  # the bucket (burst 10, 5/s) held the flood back
    assert worst < 1.0
