"""Restart admission (``basertd.server.frontend.restart``): requests recovered from the
write-ahead log pass the same checks as new ones before they run. A real daemon on the reference
engine is SIGKILLed with four streams running; the next start on the same ``state_dir`` has a
smaller vocabulary and context: the stream whose prompt ids left the vocabulary, the one whose
prompt no longer fits and the one whose generated ids left the vocabulary are failed typed ("after
a restart") and never reach a worker; the one that still fits runs on to its end."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from pathlib import Path

from daemon_harness import Daemon
from proc_testutil import pid_alive, wait_until
from serving_harness import ref_toml

from basertd.client import AsyncClient, Client, ClientError, ErrorCode

SLOW = {"vocab_size": 512, "tick_delay_us": 20000}


def config(vocab: int, context: int) -> str:
    ref = {**SLOW, "vocab_size": vocab}
    return ref_toml(lanes=4, context=context, grant=1, ref=ref) + '[durability]\nmode = "tick"\n'


def test_recovered_requests_that_no_longer_fit_fail_typed_and_the_rest_run_on():
    state = Path(tempfile.mkdtemp(prefix="brt-ra-", dir="/tmp")) / "state"
    prompts = {
        "vocab": [1, 480, 490, 500],  # ids past a 259-token vocabulary
        "context": [1] + [7] * 300,  # past a 256-token context
        # the engine's greedy tokens are a hash of the context modulo the vocabulary: with 512 ids
        # this prompt's first is 434, past the new 259, and the resume would replay it
        "replayed": [1, 40, 50, 60],
        # ... while this one's first four (175, 67, 74, 206) stay inside: it is started last, so
        # it has at most a tick or two of tokens when the coordinator dies
        "fits": [1, 12, 22, 32],
    }
    d = Daemon(config(512, 512), state_dir=state)
    try:

        async def start() -> dict[str, str]:
            c = await AsyncClient.connect(d.socket)
            ids = {}
            for name, toks in prompts.items():
                s = await c.stream(
                    prompt_tokens=toks, max_tokens=60, temperature=0.0, ignore_eos=True, resume=False
                )
                await s.__aiter__().__anext__()  # running: its first tokens are durable
                ids[name] = s.resume_id
            d.track_children()
            d.proc.kill()  # the coordinator dies with the connection open: nothing is cancelled
            d.proc.wait()
            with contextlib.suppress(Exception):
                await c.close()
            return ids

        resume_ids = asyncio.run(asyncio.wait_for(start(), 60))
        kids = d.track_children()
        wait_until(lambda: not any(pid_alive(p) for p in kids), 10, what="workers follow the coordinator")
    finally:
        d.kill()
    e = Daemon(config(259, 256), state_dir=state)
    try:
        with Client(e.socket, timeout=60) as c:
            for name, code in (
                ("vocab", ErrorCode.INVALID_REQUEST),
                ("context", ErrorCode.CONTEXT_LENGTH_EXCEEDED),
                ("replayed", ErrorCode.INVALID_REQUEST),
            ):
                try:
                    got = c.resume(resume_ids[name], after=0)
                    list(got)
                    raise AssertionError(f"{name}: resumed without an error")
                except ClientError as exc:
                    assert exc.code == code, (name, exc)
                    assert "after a restart" in exc.message, exc.message
                    assert name != "replayed" or "generated before the restart" in exc.message, exc.message
            fits = c.resume(resume_ids["fits"], after=0)
            assert len([i for t in fits for i in t.ids]) == 60 and fits.done.finish_reason == "length"
        resumed = [x["resume_id"] for x in e.log_events() if x.get("event") == "request_resumed"]
        assert resumed == [resume_ids["fits"]], resumed  # the three others never reached a worker
    except BaseException:
        e.kill()
        shutil.rmtree(state.parent, ignore_errors=True)
        raise
    e.stop()
    shutil.rmtree(state.parent, ignore_errors=True)
