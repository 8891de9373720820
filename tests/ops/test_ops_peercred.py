"""Control verbs are guarded by the kernel's peer credentials: a process that dropped
to another uid is refused every control verb with a typed PERMISSION_DENIED (logged, counted, and
nothing changes) but can still generate; the operator group is read from SO_PEERGROUPS and can be
changed by a SIGHUP reload."""

from __future__ import annotations

import grp
import os
import signal
import socket
import time

import pytest
from click.testing import CliRunner
from daemon_harness import Daemon
from ops_harness import ref_worker, run_as

from basertd import ctl
from basertd.client import Client, ClientError, ErrorCode
from basertd.schema import control
from basertd.server.transport.peercred import OperatorPolicy, PeerCredentials, peer_credentials

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")

VERBS = [
    control.Status(),
    control.Workers(),
    control.Lanes(),
    control.Queue(),
    control.CacheStats(),
    control.CacheList(),
    control.CachePin(tokens=[1, 2, 3]),
    control.CacheUnpin(pin_id=1),
    control.CacheEvict(),
    control.Drain(timeout_s=0),
    control.Resume(),
    control.RestartWorker(worker_id=0),
    control.Metrics(),
    control.Shutdown(drain=False),
    control.ConfigCheck(text=""),
]


def _operator_group() -> grp.struct_group:
    """A group nobody is not a member of (for the operator-group test)."""
    for g in grp.getgrall():
        if g.gr_gid not in (0, NOBODY) and "nobody" not in g.gr_mem:
            return g
    pytest.skip("no spare group on this system")


def test_another_uid_is_refused_every_control_verb_but_can_generate():
    with Daemon(ref_worker(lanes=2), open_to_all=True) as d:
        pid_before = [w.pid for w in d.workers()]

        def as_nobody() -> dict:
            out: dict = {}
            with Client(d.socket, timeout=30) as c:
                done = c.generate("open to every socket user", max_tokens=4, temperature=0)
                out["generated"] = done.usage.completion_tokens
                for msg in VERBS:
                    try:
                        c.request(msg)
                        out[type(msg).__name__] = "allowed"
                    except ClientError as exc:
                        out[type(msg).__name__] = (str(exc.code), exc.message)
            return out

        out = run_as(NOBODY, NOBODY, [], as_nobody)
        assert out.pop("generated") == 4
        for verb, result in out.items():
            assert result != "allowed", verb
            assert result[0] == ErrorCode.PERMISSION_DENIED, (verb, result)
            assert "uid 65534" in result[1], result
        # nothing changed: not draining, same worker process, still running
        with d.client() as c:
            st = c.request(control.Status())
            assert st.state == "ready"
            assert c.generate("still served", max_tokens=2, temperature=0).usage.completion_tokens == 2
            metrics = c.request(control.Metrics()).text
        assert [w.pid for w in d.workers()] == pid_before
        assert d.proc.poll() is None
        denied = [e for e in d.log_events() if e.get("event") == "control_denied"]
        assert len(denied) == len(VERBS) and all(e["uid"] == NOBODY for e in denied)
        assert {e["verb"] for e in denied} == {
            "status",
            "workers",
            "lanes",
            "queue",
            "cache stats",
            "cache ls",
            "cache pin",
            "cache unpin",
            "cache evict",
            "drain",
            "resume",
            "restart-worker",
            "metrics",
            "shutdown",
            "config check",
        }
        assert 'basertd_control_denied_total{verb="drain"} 1.0' in metrics

        # basertctl as that user: one line, exit status 4 (documented in --help)
        def ctl_as_nobody() -> tuple[int, str, str]:
            r = CliRunner().invoke(ctl.cli, ["--socket", str(d.socket), "drain", "--timeout", "0"])
            return r.exit_code, r.stdout, r.stderr

        code, stdout, stderr = run_as(NOBODY, NOBODY, [], ctl_as_nobody)
        assert code == ctl.EXIT_DENIED == 4, (code, stdout, stderr)
        assert stderr.count("\n") == 1 and "permission_denied" in stderr and "Traceback" not in stderr


def test_operator_group_comes_from_the_kernel_and_changes_on_sighup():
    group = _operator_group()
    with Daemon(ref_worker(lanes=2), open_to_all=True) as d:

        def status_as(groups: list[int]):
            def call():
                with Client(d.socket, timeout=30) as c:
                    try:
                        return c.request(control.Status()).state
                    except ClientError as exc:
                        return str(exc.code)

            return run_as(NOBODY, NOBODY, groups, call)

        assert status_as([group.gr_gid]) == ErrorCode.PERMISSION_DENIED  # no operator group yet
        text = d.config_path.read_text()
        d.config_path.write_text(text + f'[operators]\noperator_group = "{group.gr_name}"\n')
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while not (reloaded := [e for e in d.log_events() if e.get("event") == "reloaded"]):
            assert time.monotonic() < deadline, d.log_text()
            time.sleep(0.05)
        assert reloaded[0]["applied"] == ["operators.operator_group"] and reloaded[0]["not_reloaded"] == []
        assert status_as([group.gr_gid]) == "ready"  # a member, through SO_PEERGROUPS
        assert status_as([]) == ErrorCode.PERMISSION_DENIED  # the same uid outside the group


def test_peer_credentials_are_the_kernels_and_the_policy_fails_closed():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        cred = peer_credentials(a)
        assert (cred.pid, cred.uid, cred.gid) == (os.getpid(), os.geteuid(), os.getegid())
        assert set(cred.groups) == set(os.getgroups())
    finally:
        a.close()
        b.close()
    assert peer_credentials(None) == PeerCredentials()

    def dropped() -> PeerCredentials:
        x, y = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with x, y:
            return peer_credentials(x)

    g = _operator_group()
    cred = run_as(NOBODY, NOBODY, [g.gr_gid], dropped)
    assert (cred.uid, cred.gid, cred.groups) == (NOBODY, NOBODY, (g.gr_gid,))
    policy = OperatorPolicy("", daemon_uid=4242)
    assert policy.allows(PeerCredentials(uid=0))
    assert policy.allows(PeerCredentials(uid=4242, gid=1))
    assert not policy.allows(PeerCredentials(uid=NOBODY, gid=NOBODY))
    assert not policy.allows(PeerCredentials())  # unknown peer
    policy = OperatorPolicy(g.gr_name, daemon_uid=4242)
    assert policy.allows(PeerCredentials(uid=NOBODY, gid=g.gr_gid))
    assert policy.allows(PeerCredentials(uid=NOBODY, gid=NOBODY, groups=(g.gr_gid,)))
    assert not policy.allows(PeerCredentials(uid=NOBODY, gid=NOBODY, groups=(NOBODY,)))
    assert not OperatorPolicy("no-such-group-here", daemon_uid=4242).allows(PeerCredentials(uid=NOBODY))
