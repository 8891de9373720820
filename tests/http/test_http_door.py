"""The HTTP door under hostile clients, against a real daemon (reference engine, one lane) driven
through raw sockets (the hostile side) and the ``openai`` package / ``httpx`` (the probes).

Bounds under test (``[http]``, ``basertd.server.transport.http.door``): connection caps in all and
per peer, the request-head deadline, the idle deadline, the reply write timeout that cancels a
stream whose reader stopped reading (its lane freed), the ``Host`` / ``Origin`` checks of a
loopback listener (``origin``) and the JSON nesting and number bounds of every dialect
(``body``). Each is small here (a 1 s head deadline, caps of 110 / 130) to keep the module fast."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from daemon_harness import Daemon
from proc_testutil import wait_until
from serving_harness import ref_toml

HEADER_TIMEOUT_S = 1.0
IDLE_TIMEOUT_S = 4.0
WRITE_TIMEOUT_S = 1.0
PER_PEER = 110
TOTAL = 130
CONTEXT = 16384


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    unix = tmp_path_factory.mktemp("door") / "http.sock"
    cfg = ref_toml(lanes=1, context=CONTEXT, grant=8) + (
        f'[http]\nlisten = ["127.0.0.1:0", "unix:{unix}"]\n'
        f"max_connections = {TOTAL}\nmax_connections_per_peer = {PER_PEER}\n"
        f"header_timeout_s = {HEADER_TIMEOUT_S}\nbody_timeout_s = 2.0\nidle_timeout_s = {IDLE_TIMEOUT_S}\n"
        f"write_timeout_s = {WRITE_TIMEOUT_S}\nwrite_buffer_bytes = 4096\n"
        'allowed_hosts = ["basertd.example"]\n'
    )
    with Daemon(cfg) as d:
        addr = next(a for a in d.http_addresses() if not a.startswith("unix:"))
        d.http_host, port = addr.rsplit(":", 1)
        d.http_port = int(port)
        d.http_url = f"http://{addr}"
        d.http_unix = str(unix)
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    with openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def dropped(daemon, reason: str) -> float:
    """``basertd_connections_dropped_total{reason}`` read from /metrics."""
    text = httpx.get(daemon.http_url + "/metrics", timeout=30).text
    m = re.search(r'basertd_connections_dropped_total\{reason="' + reason + r'"\} ([0-9.e+]+)', text)
    return float(m.group(1)) if m else 0.0


def probe(client) -> float:
    """Seconds one small completion takes over a fresh connection."""
    t0 = time.monotonic()
    out = client.completions.create(model="", prompt="probe", max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason == "length"
    return time.monotonic() - t0


def connect(daemon, source: str = "127.0.0.1", rcvbuf: int = 0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((source, 0))
    s.settimeout(30)
    s.connect((daemon.http_host, daemon.http_port))
    return s


def read_until_closed(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def status_of(s: socket.socket, request: bytes | None = None) -> int:
    """The status a connection is answered with (sending ``request`` first, if any)."""
    if request:
        s.sendall(request)
    head = read_until_closed(s, 10.0) if request is None else s.recv(4096)
    return int(head.split(b" ", 2)[1])


def settle(daemon, client) -> None:
    """Wait until the door counts no leftover connection of an earlier test (a probe succeeds)."""
    wait_until(lambda: _ok(client), 30, interval=0.2, what="a probe answered")


def _ok(client) -> bool:
    try:
        probe(client)
        return True
    except openai.APIError:
        return False


def test_slow_header_connections_are_closed_at_the_deadline_while_a_probe_answers(daemon, client):
    settle(daemon, client)
    before = dropped(daemon, "http_header_timeout")
    socks = [connect(daemon) for _ in range(100)]
    started = time.monotonic()
    for s in socks:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    stop = threading.Event()

    def dribble() -> None:  # one more header line every 0.2 s: a slowloris, never idle
        i = 0
        while not stop.wait(0.2):
            for s in socks:
                try:
                    s.sendall(b"X-Slow-%d: 1\r\n" % i)
                except OSError:
                    pass
            i += 1

    t = threading.Thread(target=dribble, daemon=True)
    t.start()
    try:
        latency = probe(client)
        print(f"probe beside 100 slow-header connections: {latency:.3f} s")
        assert latency < 1.0  # another connection is served meanwhile
        answers = [read_until_closed(s, 15.0) for s in socks]
        closed_after = time.monotonic() - started
    finally:
        stop.set()
        t.join()
        for s in socks:
            s.close()
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), {a[:40] for a in answers}
    assert closed_after < HEADER_TIMEOUT_S + 3.0
    assert dropped(daemon, "http_header_timeout") >= before + 100


def test_connection_caps_refuse_with_429_and_503_and_count_the_drops(daemon, client):
    settle(daemon, client)
    peer0, total0 = dropped(daemon, "http_peer_cap"), dropped(daemon, "http_total_cap")
    held = [connect(daemon, "127.0.0.1") for _ in range(PER_PEER)]
    try:
        extra = connect(daemon, "127.0.0.1")
        assert status_of(extra) == 429  # answered before it sent anything
        extra.close()
        other = connect(daemon, "127.0.0.4")  # another peer is still served
        other.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        text = read_until_closed(other, 30).decode()
        other.close()
        assert re.search(r"^basertd_http_connections (\S+)$", text, re.M).group(1) == f"{PER_PEER + 1}.0"
        held += [connect(daemon, "127.0.0.2") for _ in range(TOTAL - PER_PEER)]
        extra = connect(daemon, "127.0.0.3")
        assert status_of(extra, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n") == 503
        extra.close()
    finally:
        for s in held:
            s.close()
    settle(daemon, client)
    # on a Unix listener the peer is the uid (SO_PEERCRED)
    held = []
    try:
        for _ in range(PER_PEER):
            s = socket.socket(socket.AF_UNIX)
            s.connect(daemon.http_unix)
            held.append(s)
        extra = socket.socket(socket.AF_UNIX)
        extra.connect(daemon.http_unix)
        assert status_of(extra) == 429
        extra.close()
    finally:
        for s in held:
            s.close()
    settle(daemon, client)  # the cap frees as the connections close
    assert dropped(daemon, "http_peer_cap") >= peer0 + 2
    assert dropped(daemon, "http_total_cap") >= total0 + 1


def test_silent_connection_is_closed_at_the_idle_deadline(daemon, client):
    settle(daemon, client)
    before = dropped(daemon, "http_idle_timeout")
    s = connect(daemon)
    t0 = time.monotonic()
    assert read_until_closed(s, IDLE_TIMEOUT_S + 10) == b""
    assert IDLE_TIMEOUT_S - 0.5 < time.monotonic() - t0 < IDLE_TIMEOUT_S + 5
    s.close()
    assert dropped(daemon, "http_idle_timeout") >= before + 1


def test_never_reading_sse_client_is_cancelled_and_its_lane_freed(daemon, client):
    settle(daemon, client)
    before = dropped(daemon, "http_write_timeout")
    s = connect(daemon, rcvbuf=4096)
    body = b'{"prompt": "never read", "max_tokens": %d, "stream": true}' % (CONTEXT - 64)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    try:
        # the one lane is taken by the stream nobody reads ...
        wait_until(lambda: daemon.status().lanes_busy == 1, 30, interval=0.05, what="the lane busy")
        # ... until the write timeout cancels it: then a probe on another connection is served
        t0 = time.monotonic()
        assert probe(client) < WRITE_TIMEOUT_S + 10.0
        waited = time.monotonic() - t0
        print(f"probe behind a never-reading stream on the only lane: {waited:.3f} s")
        assert dropped(daemon, "http_write_timeout") == before + 1
        wait_until(lambda: daemon.status().lanes_busy == 0, 10, interval=0.05, what="the lane freed")
    finally:
        s.close()
    assert waited < WRITE_TIMEOUT_S + 10.0
    ended = [e for e in daemon.log_events() if e.get("event") == "access" and e.get("max_tokens") is None]
    assert any(
        e.get("finish_reason") == "cancelled" and e.get("completion_tokens", 0) < CONTEXT // 2 for e in ended
    )


def test_slow_body_is_408_at_the_body_deadline(daemon, client):
    settle(daemon, client)
    before = dropped(daemon, "http_body_timeout")
    s = connect(daemon)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt": '
    )
    t0 = time.monotonic()
    answer = read_until_closed(s, 30)
    s.close()
    assert answer.startswith(b"HTTP/1.1 408 ") and b"body_timeout" in answer, answer[:200]
    assert time.monotonic() - t0 < 2.0 + 5.0
    assert dropped(daemon, "http_body_timeout") == before + 1


def test_foreign_host_and_cross_site_posts_are_refused(daemon):
    url = daemon.http_url + "/v1/completions"
    body = '{"prompt": "hi", "max_tokens": 2}'
    with httpx.Client(timeout=30) as h:
        r = h.post(url, content=body, headers={"Host": "evil.example:8000"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
        r = h.get(daemon.http_url + "/metrics", headers={"Host": "rebound.example"})
        assert r.status_code == 403
        for ctype in ("text/plain", "application/x-www-form-urlencoded"):
            r = h.post(url, content=body, headers={"Content-Type": ctype, "Origin": "http://evil.example"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        r = h.post(url, content=body, headers={"Content-Type": "text/plain", "Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 403
        # loopback names, the configured host and clients that are no browser (no Origin) are served
        for headers in (
            {"Host": f"localhost:{daemon.http_port}"},
            {"Host": "basertd.example", "Origin": "http://basertd.example"},
            {"Origin": "http://localhost:3000", "Content-Type": "text/plain"},
            {"Content-Type": "application/x-www-form-urlencoded"},  # what curl -d sends
        ):
            r = h.post(url, content=body, headers=headers)
            assert r.status_code == 200, (headers, r.text)


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", '{"max_tokens": 2, "prompt": %s}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "response_format": %s}'),
        ("/v1/messages", '{"max_tokens": 2, "messages": [], "metadata": %s}'),
        ("/api/generate", '{"model": "", "prompt": "hi", "format": %s}'),
        ("/api/chat", '{"model": "", "messages": [], "format": %s}'),
    ],
)
def test_deep_json_and_long_numbers_are_400_on_every_dialect(daemon, path, body):
    with httpx.Client(base_url=daemon.http_url, timeout=30) as h:
        for depth in (1000, 100_000):
            nested = "[" * depth + "]" * depth
            r = h.post(path, content=body % nested, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text
            assert "nests" in r.text and "128" in r.text
        r = h.post(path, content=body % ("1" * 5000), headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "digits" in r.text, r.text
        # the same characters inside a string are no number and no nesting
        r = h.post(path, content=body % ('"' + "[" * 1000 + "1" * 5000 + '"'))
        assert r.status_code != 500
    assert daemon.proc.poll() is None


@pytest.mark.parametrize(
    "path,body,shape",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, lambda j: j["error"]["code"]),
        (
            "/v1/messages",
            {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            lambda j: j["type"] == "error" and j["error"]["type"],
        ),
        (
            "/api/generate",
            {"model": "", "prompt": "hi", "raw": True, "stream": False, "options": {"num_predict": 2}},
            lambda j: j["error"],
        ),
    ],
)
def test_a_body_not_in_its_content_encoding_is_a_typed_400(daemon, path, body, shape):
    """Plain JSON labelled gzip: the dialect's own 400 (not a 500) and the connection closed after
    it, no error line in the log; the same body gzipped is served."""
    before = len(daemon.log_events())
    raw = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    with httpx.Client(base_url=daemon.http_url, timeout=30) as h:
        r = h.post(path, content=raw, headers=headers)
        assert r.status_code == 400 and shape(r.json()), r.text
        assert "Content-Encoding gzip" in r.text and r.headers["Connection"] == "close", (r.headers, r.text)
        r = h.post(path, content=gzip.compress(raw), headers=headers)
        if path == "/v1/messages":  # read and parsed: the reference model has no chat template
            assert r.status_code == 400 and "chat template" in r.text, r.text
        else:
            assert r.status_code == 200, r.text
    errors = [e for e in daemon.log_events()[before:] if e.get("level") in ("error", "critical")]
    assert not errors, [(e["event"], e.get("exception", "")[-3000:]) for e in errors]


def test_a_body_declared_over_max_body_bytes_is_413_before_it_is_sent(daemon, client):
    """A head whose Content-Length passes ``max_body_bytes`` is refused at once, not after the body
    deadline."""
    settle(daemon, client)
    s = connect(daemon)
    t0 = time.monotonic()
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 99999999999\r\n\r\n"
    )
    head = s.recv(4096)
    s.close()
    assert head.startswith(b"HTTP/1.1 413 ") and b"max_body_bytes" in head, head[:300]
    assert time.monotonic() - t0 < 1.5  # the body deadline is 2 s: refused before it


def test_expect_100_continue_is_answered_only_for_a_body_the_door_would_read(daemon, client):
    """``Expect: 100-continue``: a head the door refuses (too large, foreign Host) gets its final
    status and no interim 100, so the client never sends the body; an acceptable one gets the 100,
    then its answer once the body is sent."""
    settle(daemon, client)
    refused = [
        (b"127.0.0.1", b"99999999999", b"413"),
        (b"evil.example", b"2", b"403"),
    ]
    for host, length, status in refused:
        s = connect(daemon)
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: " + host + b"\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: " + length + b"\r\n\r\n"
        )
        head = s.recv(4096)
        s.close()
        assert head.startswith(b"HTTP/1.1 " + status + b" "), head[:300]
        assert b"100 Continue" not in head
    body = json.dumps({"model": "", "prompt": "x", "max_tokens": 1}).encode()
    s = connect(daemon)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    assert s.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
    s.sendall(body)
    out = read_until_closed(s, 30.0)
    s.close()
    assert out.startswith(b"HTTP/1.1 200 ") and b'"finish_reason"' in out, out[:300]


def test_a_malformed_request_head_is_400_and_an_info_line_without_a_traceback(daemon, client):
    settle(daemon, client)
    before = len(daemon.log_events())
    s = connect(daemon)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n")
    assert status_of(s) == 400
    s.close()
    wait_until(
        lambda: any(e.get("event") == "bad_http_request" for e in daemon.log_events()[before:]),
        10,
        what="the bad_http_request line",
    )
    lines = daemon.log_events()[before:]
    (bad,) = [e for e in lines if e.get("event") == "bad_http_request"]
    assert bad["level"] == "info" and bad["peer"] and "8190" in bad["error"] and "exception" not in bad
    assert not [e for e in lines if e.get("level") in ("error", "critical")]


def _raw_status(s: socket.socket) -> int | None:
    """The status of the refusal a connection got, or None when it was accepted (nothing to read)."""
    s.settimeout(0.5)
    try:
        head = s.recv(4096)
    except TimeoutError:
        return None
    except ConnectionResetError:
        return -1
    return int(head.split(b" ", 2)[1]) if head else -1


@pytest.mark.slow
def test_idle_flood_under_a_1024_descriptor_limit_is_refused_at_the_cap_while_native_probes_answer():
    """~1,300 idle TCP connections against a daemon whose RLIMIT_NOFILE is 1,024 (soft and hard):
    the HTTP cap (fitted to the limit) refuses the excess, no accept ever fails, the native socket
    keeps answering and a killed worker respawns."""
    cfg = (
        ref_toml(lanes=1, context=512, grant=8) + '[http]\nlisten = ["127.0.0.1:0"]\nmax_connections = 512\n'
    )
    with Daemon(cfg, wrapper=("prlimit", "--nofile=1024:1024", "--")) as d:
        host, port = next(a for a in d.http_addresses() if not a.startswith("unix:")).rsplit(":", 1)
        socks = []
        try:
            for i in range(1300):  # from 6 source addresses, so the total cap, not the peer cap, binds
                s = socket.socket()
                s.bind((f"127.0.0.{2 + i % 6}", 0))
                s.settimeout(10)
                s.connect((host, int(port)))
                socks.append(s)
            with d.client(timeout=30) as c:
                t0 = time.monotonic()
                out = c.generate("probe", max_tokens=2, temperature=0)
                native_s = time.monotonic() - t0
            print(f"native probe beside 1,300 idle HTTP connections: {native_s:.3f} s")
            assert out.finish_reason == "length" and native_s < 5.0
            statuses = [_raw_status(s) for s in socks[-100:]]
            assert statuses.count(503) + statuses.count(-1) == 100, statuses
            # descriptors are left for a worker to respawn meanwhile
            (before,) = d.workers()
            os.kill(before.pid, signal.SIGKILL)
            wait_until(
                lambda: (w := d.workers()[0]).state == "ready" and w.pid not in (0, before.pid),
                60,
                interval=0.2,
                what="the worker respawned",
            )
            with d.client(timeout=30) as c:
                assert c.generate("probe", max_tokens=2, temperature=0).finish_reason == "length"
        finally:
            for s in socks:
                s.close()
        lines = d.log_text()
        assert "fd_limit_low" in lines and "out of system resource" not in lines
        assert "accept_failed" not in lines


@pytest.mark.slow
def test_failed_accepts_are_logged_once_per_burst():
    """A native-socket flood past a 200-descriptor limit: accept fails with EMFILE again and again;
    the log has one ``accept_failed`` line (no traceback per attempt), and once the flood leaves
    the daemon serves again."""
    with Daemon(ref_toml(lanes=1, context=512), wrapper=("prlimit", "--nofile=200:200", "--")) as d:
        socks = []
        try:
            for _ in range(260):
                s = socket.socket(socket.AF_UNIX)
                s.connect(str(d.socket))
                socks.append(s)
            wait_until(lambda: "accept_failed" in d.log_text(), 30, interval=0.2, what="accept_failed")
        finally:
            for s in socks:
                s.close()
        with d.client(timeout=30) as c:
            assert c.generate("probe", max_tokens=2, temperature=0).finish_reason == "length"
        wait_until(lambda: "accept_recovered" in d.log_text(), 30, interval=0.2, what="the burst's end")
        (end,) = [e for e in d.log_events() if e.get("event") == "accept_recovered"]
        assert end["failed_accepts"] > 1  # many failed accepts, ...
        lines = d.log_text()
        assert lines.count("accept_failed") == 1  # ... one line
        assert "out of system resource" not in lines and "Traceback" not in lines


def test_json_depth_skips_strings_and_escapes():
    from basertd.server.transport.http.body import json_depth

    assert json_depth(b'{"a": [1, {"b": []}]}') == 4
    assert json_depth(b'["[[[[", "\\\\", "\\"]]]]", [[]]]') == 3  # brackets inside strings do not count
    assert json_depth(b'"[[["') == 0 and json_depth(b"") == 0


def test_host_names_a_loopback_listener_serves():
    from basertd.server.transport.http.origin import HostPolicy, host_of

    policy = HostPolicy(["Basertd.Example"])
    served = ["localhost:8000", "127.0.0.7", "[::1]:80", "app.localhost", "LOCALHOST.", "basertd.example:1"]
    refused = ["evil.example", "127.0.0.1.nip.io", "[::2]:80", "localhost.evil.example", ""]
    assert all(policy.allows(host_of(h)) for h in served)
    assert not any(policy.allows(host_of(h)) for h in refused)
