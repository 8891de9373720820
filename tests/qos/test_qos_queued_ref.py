"""The ``Queued`` wait notice (``basertd.schema.client.Queued``): a request kept waiting for a lane
hears from the daemon after Accepted and before its first token, with its position and class; the
sync and asyncio clients keep it in ``stream.queued`` and yield only tokens."""

from __future__ import annotations

import asyncio

from daemon_harness import Daemon
from serving_harness import ref_toml

from basertd.client import AsyncClient
from basertd.schema import client as api


def test_a_waiting_request_gets_queued_notices_before_its_first_token():
    with Daemon(ref_toml(lanes=1)) as d:

        async def scenario():
            async with await AsyncClient.connect(d.socket) as c:
                hog = await c.stream("hog the only lane", request_id="hog", max_tokens=150, temperature=0.0)
                first = await c.stream("first in line", request_id="w0", max_tokens=4, qos="batch")
                second = await c.stream("second in line", request_id="w1", max_tokens=4, qos="batch")
                outs = []
                for s in (hog, first, second):
                    ids = []
                    async for t in s:
                        if not ids and s is not hog:
                            assert s.queued is not None, "no Queued notice before the first token"
                        ids.extend(t.ids)
                    outs.append(ids)
                return first.queued, second.queued, [len(o) for o in outs], hog.queued

        q0, q1, lens, hog_q = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert lens == [150, 4, 4]
        assert hog_q is None  # admitted at once: no notice
        assert isinstance(q0, api.Queued) and q0.request_id == "w0" and q0.qos == "batch"
        assert q0.position == 0 and q1.position == 1, (q0, q1)

        with d.client() as a, d.client() as b:  # the sync client skips notices the same way
            hog = a.stream("hog again", request_id="hog2", max_tokens=200, temperature=0.0)
            waiting = b.stream("waiting again", request_id="w2", max_tokens=3)
            assert sum(len(t.ids) for t in waiting) == 3 and waiting.queued is not None
            assert waiting.queued.position == 0 and waiting.queued.qos == "interactive"
            assert sum(len(t.ids) for t in hog) == 200
