"""Durable acceptance end to end (DESIGN.md "Crash = preemption; acceptance is durable"): a real
``basertd serve`` on the reference engine with ``[durability] mode = "tick"`` and with ``"write"``
(the default: no fsync before delivery, what a client saw is in the page cache), a real state
directory, real SIGTERMs and SIGKILLs of the coordinator, and the real clients resuming.

The socket is the test's own listening socket handed over as ``LISTEN_FDS`` (as systemd's socket
activation does), so it outlives every daemon: a client that reconnects while no daemon runs waits
in the backlog until the next one adopts it."""

from __future__ import annotations

import asyncio
import random
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

import pytest
from daemon_harness import Daemon
from proc_testutil import devshm_listing, pid_alive
from serving_harness import direct_ref, ref_toml

from basertd.client import AsyncClient, Client, ClientError, ErrorCode
from basertd.schema import client as api

LANES = 16
CONTEXT = 256
REF = {"eos_period": 0, "tick_delay_us": 8000}
MAX_TOKENS = 40
STREAMS = 16
ROUNDS = {"write": 10, "tick": 2}
"""Rounds of the random-SIGKILL test per mode: the default mode ("write", whose page cache alone
holds what a client saw) gets the 50 kills; "tick", whose records are on disk before delivery and
which shares every recovery path, 10, so the two together stay within the suite's time."""
KILLS_PER_ROUND = 5


def config(mode: str = "tick") -> str:
    return ref_toml(lanes=LANES, context=CONTEXT, grant=1, ref=REF) + f'[durability]\nmode = "{mode}"\n'


def request(k: int) -> dict:
    """Stream ``k``: greedy for even k, sampled (seeded) for odd k."""
    return dict(
        prompt_tokens=[1, 10 + k, 20 + 3 * k, 30],
        max_tokens=MAX_TOKENS,
        temperature=0.0 if k % 2 == 0 else 0.9,
        top_k=0 if k % 2 == 0 else 40,
        seed=1000 + k,
        ignore_eos=True,
    )


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    """Every stream's tokens from an uninterrupted run (the engine alone, no coordinator)."""
    with direct_ref(lanes=LANES, context=CONTEXT, ref=REF) as d:
        out = []
        for k in range(STREAMS):
            r = request(k)
            gen = api.Generate(request_id="x", **{n: v for n, v in r.items() if n != "prompt_tokens"})
            out.append(d.run(r["prompt_tokens"], gen))
        return out


def listener(base: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(base / "basertd.sock"))
    sock.listen(128)
    return sock


def sigkill(d: Daemon) -> None:
    """SIGKILL the coordinator only; its workers must follow it (no orphan), then drop its files."""
    kids = d.track_children()
    d.proc.kill()
    d.proc.wait()
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in kids):
        assert time.monotonic() < deadline, f"orphan workers: {[p for p in kids if pid_alive(p)]}"
        time.sleep(0.02)
    d.cleanup()


def test_accepted_resume_id_and_resume_of_finished_and_live_requests(expected):
    with Daemon(config()) as d, d.client() as c:
        s = c.stream(**request(0))
        assert s.resume_id.startswith("r-")
        first = next(iter(s))
        with Client(d.socket, timeout=30) as other:  # a second client follows the live stream
            live = other.resume(s.resume_id, after=len(first.ids))
            rest = [t.ids for t in live]
        ids = first.ids + [i for t in s for i in t.ids]
        assert len(ids) == MAX_TOKENS and [i for r in rest for i in r] == ids[len(first.ids) :]
        assert s.done is not None and live.done is not None and live.done.finish_reason == "length"
        # a finished request is answered from the log: the tokens after ``after``, then Done
        again = c.resume(s.resume_id, after=7)
        assert [i for t in again for i in t.ids] == ids[7:] and again.done.finish_reason == "length"
        with pytest.raises(ClientError) as exc:
            c.resume(s.resume_id, after=MAX_TOKENS + 1)
        assert exc.value.code == ErrorCode.INVALID_REQUEST
        with pytest.raises(ClientError) as exc:
            c.resume("r-nosuchrequest", after=0)
        assert exc.value.code == ErrorCode.NOT_FOUND
        assert ids == expected[0]
        assert '"journal_opened"' in d.log_text()


def test_mode_off_gives_no_resume_id_and_resume_is_not_found():
    with Daemon(config("off")) as d, d.client() as c:
        s = c.stream(**request(1))
        assert s.resume_id == ""
        assert len([i for t in s for i in t.ids]) == MAX_TOKENS
        with pytest.raises(ClientError) as exc:
            c.resume("r-x")
        assert exc.value.code == ErrorCode.NOT_FOUND
        assert not d.state_dir.exists()  # mode off touches no state directory


@pytest.mark.parametrize("mode", ["write", "tick"])
def test_sigterm_hands_over_and_the_next_start_finishes_the_streams(expected, mode):
    """SIGTERM with a short drain timeout: running streams are not cancelled, they stay in the log;
    the next start on the same state directory runs them on and the clients resume exactly."""
    base = Path(tempfile.mkdtemp(prefix="brt-dur-", dir="/tmp"))
    state = base / "state"
    sock = listener(base)
    cfg = config(mode) + "[operators]\ndrain_timeout_s = 0.1\n"
    d = Daemon(cfg, listen=sock, state_dir=state)
    try:

        async def scenario() -> list[list[int]]:
            async with await AsyncClient.connect(sock.getsockname()) as c:
                streams = [await c.stream(**request(k)) for k in range(4)]
                got: list[list[int]] = [[] for _ in streams]

                async def read(k: int) -> None:
                    async for t in streams[k]:
                        got[k].extend(t.ids)

                readers = [asyncio.create_task(read(k)) for k in range(4)]
                while min(len(g) for g in got) < 3:
                    await asyncio.sleep(0.01)
                nonlocal d
                d.track_children()
                d.proc.send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(d.proc.wait, 30) == 0
                d.assert_released()
                d.cleanup()
                d = await asyncio.to_thread(Daemon, cfg, listen=sock, state_dir=state)
                await asyncio.gather(*readers)
                assert all(s.resumes >= 1 for s in streams)
                return got

        got = asyncio.run(scenario())
        assert got == expected[:4]
        assert '"request_resumed"' in d.log_text()
        d.stop()
    except BaseException:
        d.kill()
        raise
    finally:
        sock.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["write", "tick"])
def test_coordinator_sigkill_at_random_moments_loses_and_repeats_nothing(expected, mode):
    """ROUNDS[mode] x KILLS_PER_ROUND coordinator SIGKILLs at random moments while STREAMS streams (greedy
    and sampled) run; each restart on the same state_dir: every stream ends token-exact against
    the uninterrupted run, no orphan worker, nothing left in /dev/shm. Mode "write" (the default)
    has no fsync before delivery: the page cache alone must hold every token a client saw."""
    rng = random.Random(15)
    base = Path(tempfile.mkdtemp(prefix="brt-dur-", dir="/tmp"))
    state = base / "state"
    sock = listener(base)
    shm_before = devshm_listing()
    d = Daemon(config(mode), listen=sock, state_dir=state)
    kills = 0
    try:
        for _ in range(ROUNDS[mode]):

            async def one_round() -> list[list[int]]:
                nonlocal d, kills
                clients = [await AsyncClient.connect(sock.getsockname()) for _ in range(4)]
                streams = [await clients[k % 4].stream(**request(k)) for k in range(STREAMS)]
                got: list[list[int]] = [[] for _ in streams]

                async def read(k: int) -> None:
                    async for t in streams[k]:
                        got[k].extend(t.ids)

                readers = asyncio.gather(*(read(k) for k in range(STREAMS)))
                for _ in range(KILLS_PER_ROUND):
                    await asyncio.sleep(rng.uniform(0.0, 0.35))
                    await asyncio.to_thread(sigkill, d)
                    kills += 1
                    d = await asyncio.to_thread(Daemon, config(mode), listen=sock, state_dir=state)
                await asyncio.wait_for(readers, 120)
                for c in clients:
                    await c.close()
                assert sum(s.resumes for s in streams) >= 1  # the kills did hit running streams
                return got

            got = asyncio.run(one_round())
            for k in range(STREAMS):
                assert got[k] == expected[k], f"stream {k}: {got[k]} != {expected[k]}"
        assert kills == ROUNDS[mode] * KILLS_PER_ROUND
        d.stop()
        assert devshm_listing() == shm_before
    except BaseException:
        d.kill()
        raise
    finally:
        sock.close()
        shutil.rmtree(base, ignore_errors=True)
