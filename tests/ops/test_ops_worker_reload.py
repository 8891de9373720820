"""Workers changed by a reload (SIGHUP) and by ``basertctl worker restart``, on real daemons with
the C reference engine (deterministic: a stream's tokens are a function of its prompt and seed):
a replaced, added or removed worker hands its running streams over (to a peer serving the same
model, or to its own next process) and every stream finishes with exactly the tokens of an
undisturbed run; the other workers' processes are untouched; the ``reloaded`` line names the
change; a file that does not validate, or a worker table whose model does not load, changes
nothing."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from daemon_harness import Daemon
from ops_harness import ref_worker
from proc_testutil import wait_until

from basertd.client import ClientError, ErrorCode

PROMPTS = [f"handed over stream {i} " * (1 + i % 3) for i in range(4)]
MAX_TOKENS = 100
# greedy and sampled streams (a sampled one resumes on the same RNG stream, ABI rule 73)
PARAMS = [
    dict(max_tokens=MAX_TOKENS, temperature=0.9, top_k=40, seed=100 + i)
    if i % 2
    else dict(max_tokens=MAX_TOKENS, temperature=0)
    for i in range(len(PROMPTS))
]
GRANT = "[scheduler]\ndecode_grant = 1\ndecode_tick_s = 0\n"


def _events(d: Daemon, name: str) -> list[dict]:
    return [e for e in d.log_events() if e.get("event") == name]


def _sighup(d: Daemon, config: str, event: str = "reloaded") -> dict:
    """Rewrite the daemon's file to ``config`` (its runtime and state lines kept), send SIGHUP and
    return the next ``event`` line (``reloaded`` or ``reload_failed``)."""
    head = [
        ln
        for ln in d.config_path.read_text().splitlines(keepends=True)
        if ln.startswith(("runtime_dir", "state_dir"))
    ]
    seen = len(_events(d, event))
    d.config_path.write_text("".join(head) + config + "\n[http]\nlisten = []\n")
    d.proc.send_signal(signal.SIGHUP)
    return wait_until(lambda: _events(d, event)[seen:], 120, what=event)[0]


def _undisturbed(d: Daemon) -> list[list[int]]:
    """Every prompt's tokens from an undisturbed run, all at once (each on its own connection:
    the reference engine's tokens do not depend on what else runs beside them)."""

    def one(p: str, kw: dict) -> list[int]:
        with d.client() as c:
            return list(c.generate(p, **kw).ids)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS, PARAMS))


class Streams:
    """One running stream per prompt (``PARAMS``), each on its own connection, every one past its first
    token; ``finish()`` reads them to the end and returns their token ids."""

    def __init__(self, d: Daemon) -> None:
        self.clients = [d.client() for _ in PROMPTS]
        self.its = [iter(c.stream(p, **kw)) for c, p, kw in zip(self.clients, PROMPTS, PARAMS, strict=True)]
        self.got = [list(next(it).ids) for it in self.its]

    def finish(self) -> list[list[int]]:
        try:
            for got, it in zip(self.got, self.its, strict=True):
                for t in it:
                    got += t.ids
            return self.got
        finally:
            for c in self.clients:
                c.close()


def test_reload_replaces_one_worker_while_streams_run_on_both():
    two = ref_worker(lanes=2, delay_us=20000) * 2 + GRANT
    changed = ref_worker(lanes=2, delay_us=20000) + ref_worker(lanes=4, delay_us=5000) + GRANT
    with Daemon(two) as d:
        before = d.workers()
        streams = Streams(d)
        busy = d.workers()
        assert min(w.lanes_busy for w in busy) >= 1, busy  # streams run on both workers
        report = _sighup(d, changed)
        got = streams.finish()
        assert report["applied"] == ["workers.1"]
        assert report["workers"] == [
            "worker 1 replaced (lanes 2 -> 4, ref_config.tick_delay_us 20000 -> 5000)"
        ]
        assert report["not_reloaded"] == []
        after = d.workers()
        assert after[0].pid == before[0].pid  # the other worker was not touched
        assert after[1].pid not in (0, before[1].pid) and after[1].lanes_max == 4
        (handed,) = [e for e in _events(d, "worker_lanes_resumed") if e["planned"]]
        assert handed["worker_id"] == 1 and handed["resumed"] == 2 and not handed["failed_keys"]
        assert "crash_resumes_total{" not in d.ctl("metrics").stdout  # a hand-over is no crash
        # a file that does not validate, and a table whose model does not load: nothing changes
        failed = _sighup(d, changed.replace("lanes = 4", "lanes = 0"), "reload_failed")
        assert "lanes" in failed["error"]
        missing = changed + '[[workers]]\nengine = "llamacpp"\nmodel = "/nonexistent/model.gguf"\n'
        failed = _sighup(d, missing, "reload_failed")
        assert "/nonexistent/model.gguf" in failed["error"]
        assert [(w.pid, w.lanes_max) for w in d.workers()] == [(w.pid, w.lanes_max) for w in after]
        assert got == _undisturbed(d)  # token-exact: nothing lost, repeated or different


def test_reload_adds_a_worker_then_removes_it_while_its_streams_run():
    one = ref_worker(lanes=2, delay_us=20000) + GRANT
    two = ref_worker(lanes=2, delay_us=20000) * 2 + GRANT
    with Daemon(one) as d:
        (first,) = d.workers()
        added = _sighup(d, two)
        assert added["workers"] == ["worker 1 added"] and added["applied"] == ["workers.1"]
        w0, w1 = d.workers()
        assert w0.pid == first.pid and w1.pid not in (0, first.pid) and w1.state == "ready"
        streams = Streams(d)
        assert min(w.lanes_busy for w in d.workers()) >= 1  # the new worker serves too
        removed = _sighup(d, one)
        assert removed["workers"] == ["worker 1 removed"]
        got = streams.finish()
        assert got == _undisturbed(d)  # worker 1's streams finished on worker 0, token-exact
        (handed,) = [e for e in _events(d, "worker_lanes_resumed") if e["planned"]]
        assert handed["worker_id"] == 1 and handed["resumed"] >= 1 and handed["moved_to_peers"]
        (only,) = d.workers()
        assert only.pid == first.pid
        wait_until(lambda: w1.pid not in d.track_children(), 30, what="the removed worker's process exits")


def test_worker_restart_verb_resumes_streams_on_the_new_process():
    with Daemon(ref_worker(lanes=4, delay_us=40000) + GRANT) as d:
        (before,) = d.workers()
        streams = Streams(d)
        r = d.ctl("--json", "worker", "restart", "0")
        assert r.returncode == 0, r.stderr
        got = streams.finish()
        assert got == _undisturbed(d)  # they waited for the new process and resumed there
        (handed,) = [e for e in _events(d, "worker_lanes_resumed") if e["planned"]]
        assert handed["resumed"] == len(PROMPTS) and not handed["moved_to_peers"]
        (after,) = d.workers()
        assert after.pid not in (0, before.pid) and after.respawns == before.respawns + 1
        assert "crash_resumes_total{" not in d.ctl("metrics").stdout


def test_reload_replacing_a_workers_model_moves_its_streams_to_the_old_models_peer():
    from basertd.native import ref_engine_path

    two = ref_worker(lanes=2, delay_us=20000) * 2 + GRANT
    lib = ref_engine_path()  # the reference engine named by path: served as another model
    other = ref_worker(lanes=2, delay_us=20000).replace(
        'engine = "basert"\n', f'engine = "basert"\nmodel = "{lib}"\n'
    )
    with Daemon(two) as d:
        before = d.workers()
        streams = Streams(d)
        assert min(w.lanes_busy for w in d.workers()) >= 1
        report = _sighup(d, ref_worker(lanes=2, delay_us=20000) + other + GRANT)
        assert report["workers"] == [f"worker 1 replaced (model '' -> {lib!r})"]
        assert streams.finish() == _undisturbed(d)  # worker 1's streams finished on worker 0
        (handed,) = [e for e in _events(d, "worker_lanes_resumed") if e["planned"]]
        assert handed["worker_id"] == 1 and handed["resumed"] >= 1 and handed["moved_to_peers"]
        w0, w1 = d.workers()
        assert w0.pid == before[0].pid and w1.pid != before[1].pid
        with d.client() as c:
            assert sorted(m.id for m in c.models().models) == ["basert-ref", "libbasert_ref"]
            assert len(c.generate("on the new model", model="libbasert_ref", max_tokens=3).ids) == 3
        # no worker serves worker 0's model any more: its running stream fails typed, not with
        # another model's tokens
        with d.client() as c:
            it = iter(c.stream("nowhere to go", model="basert-ref", max_tokens=MAX_TOKENS, temperature=0))
            next(it)
            _sighup(d, other * 2 + GRANT)
            with pytest.raises(ClientError) as failed:
                list(it)
        assert failed.value.code == ErrorCode.WORKER_FAILED and "basert-ref" in str(failed.value)
        assert d.workers()[1].pid == w1.pid


def test_worker_changes_compare_tables_by_position():
    from basertd.server.config_sections import WorkerConfig
    from basertd.server.ops.worker_changes import worker_changes

    a, b = (
        WorkerConfig(engine="basert"),
        WorkerConfig(engine="basert", lanes=4, ref_config={"vocab_size": 300}),
    )
    assert worker_changes([a, a], [a, a]) == []
    (c,) = worker_changes([a, a], [a, b])
    assert c.describe() == "worker 1 replaced (lanes 8 -> 4, ref_config.vocab_size None -> 300)"
    assert [c.describe() for c in worker_changes([a], [b, a, a])] == [
        "worker 1 added",
        "worker 2 added",
        "worker 0 replaced (lanes 8 -> 4, ref_config.vocab_size None -> 300)",
    ]
    assert [c.describe() for c in worker_changes([a, b, a], [a])] == ["worker 2 removed", "worker 1 removed"]
