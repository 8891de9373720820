"""``basertd.server.request.sandbox.SandboxPool`` with real child processes (the grammar checker
``spec_check``, no daemon): a job past the time limit kills its child, a child that dies of a
signal is ``SandboxCrashed`` naming it, a handler's error is ``SandboxJobError`` and its child
serves on, too many waiting jobs are ``SandboxBusy``, a caller cancelled mid-job kills that child
(so its late reply never reaches the next job), and ``close`` leaves no child process behind."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from proc_testutil import children_of, wait_until_async

from basertd.server.request.sandbox import (
    SandboxBusy,
    SandboxCrashed,
    SandboxJobError,
    SandboxPool,
    SandboxTimeout,
)


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


PATTERNS = {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+$"} for i in range(2000)}


def slow_job() -> list[list[str]]:
    """A schema that takes about a second to compile."""
    return [["json_schema", json.dumps({"type": "object", "properties": PATTERNS})]]


def pool(**kw) -> SandboxPool:
    kw.setdefault("size", 1)
    kw.setdefault("timeout_s", 30.0)
    kw.setdefault("max_pending", 8)
    return SandboxPool("grammar", "basertd.server.request.spec_check", memory_bytes=2 << 30, **kw)


def test_crash_timeout_error_and_busy_are_typed_and_the_pool_serves_on():
    async def main() -> None:
        p = pool(timeout_s=30.0)
        p.start()
        try:
            assert await p.run([["regex", "a+"]]) == 0
            with pytest.raises(SandboxCrashed) as crash:
                await p.run([["lark", lark_chain(3000)]])
            assert crash.value.signal_name == "SIGSEGV"
            with pytest.raises(SandboxJobError, match="unclosed"):
                await p.run([["regex", "(unclosed"]])
            assert await p.run([["lark", "start: nope"], ["regex", "a"]]) == 1  # the first that compiles
            p.timeout_s = 0.05
            with pytest.raises(SandboxTimeout):
                await p.run(slow_job())
            p.timeout_s = 30.0
            assert await p.run([["regex", "b+"]]) == 0
            p.max_pending = 1
            first = asyncio.ensure_future(p.run(slow_job()))
            await asyncio.sleep(0)
            with pytest.raises(SandboxBusy):
                await p.run([["regex", "a"]])
            await first
        finally:
            await p.close()
        assert not children_of(os.getpid())

    asyncio.run(main())


def test_a_caller_cancelled_mid_job_kills_that_child_and_the_next_job_gets_its_own_reply():
    async def main() -> None:
        p = pool()
        try:
            assert await p.run([["regex", "a"]]) == 0
            (busy,) = children_of(os.getpid())
            job = asyncio.ensure_future(p.run(slow_job()))
            await wait_until_async(lambda: p.pending == 1)
            for _ in range(3):  # the job is written to the child within a few loop turns
                await asyncio.sleep(0)
            job.cancel()
            with pytest.raises(asyncio.CancelledError):
                await job
            await wait_until_async(lambda: busy not in children_of(os.getpid()), timeout=10)
            assert await p.run([["lark", "start: nope"], ["regex", "a"]]) == 1
        finally:
            await p.close()
        assert not children_of(os.getpid())

    asyncio.run(main())


def test_start_warms_the_children_asked_for_and_jobs_start_the_rest_one_ahead():
    """The daemon warms one child per pool while it starts (``SandboxPool.start(1)``); no slot is
    warmed twice, and an idle pool stays at one process. A job that takes the last ready child
    starts the next in the background, so a second job finds it ready; never more than ``size``."""

    async def main() -> None:
        p = pool(size=3)
        try:
            p.start(1)
            (first,) = await wait_until_async(lambda: children_of(os.getpid()))
            await asyncio.sleep(0.3)
            assert children_of(os.getpid()) == {first}  # idle: one process
            assert await p.run([["regex", "a+"]]) == 0  # took the only ready one: one more starts
            (second,) = await wait_until_async(lambda: children_of(os.getpid()) - {first}, timeout=30)
            await asyncio.sleep(0.3)
            assert children_of(os.getpid()) == {first, second}  # one ahead, not all at once
            # two jobs at once take both ready children: the third slot starts, no more
            assert await asyncio.gather(p.run([["regex", "a+"]]), p.run([["regex", "b+"]])) == [0, 0]
            await wait_until_async(lambda: len(children_of(os.getpid())) == 3, timeout=30)
            for _ in range(3):
                assert await asyncio.gather(*(p.run([["regex", "c+"]]) for _ in range(3))) == [0, 0, 0]
            await asyncio.sleep(0.3)
            assert len(children_of(os.getpid())) == 3
            p.start()  # every slot holds a child: nothing more starts
            await asyncio.sleep(0.3)
            assert len(children_of(os.getpid())) == 3
        finally:
            await p.close()
        assert not children_of(os.getpid())

    asyncio.run(main())
