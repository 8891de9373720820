"""``BetweenTicks``: a worker that loses a chunked input between two chunks (a restart: the slot
holds another process, which gets the input again from its first chunk; the same process answering
ERR_UNKNOWN_HANDLE ends the request), a worker dying during an exchange (sent again to the next
incarnation, up to the bound), an input left open by a cancelled request, and packed embeddings
between a long input's chunks. The worker side is a recording stand-in for ``WorkerLink.request``:
a restart cannot be timed between two chunks of a real worker (the chunk protocol and a worker
killed during a long input run on real workers in tests/http/test_http_embeddings_chunks.py and
tests/llamacpp/test_llamacpp_embed_chunks.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from basertd.schema import link
from basertd.schema.abi import Status
from basertd.schema.client import ErrorCode
from basertd.server.request.record import AdmissionError
from basertd.server.workers.between_ticks import BetweenTicks
from basertd.server.workers.link_errors import LinkError, WorkerError

MAX_CRASH_RESUMES = 3


class FakeLink:
    """Answers EMBED chunks as a worker with one open input; ``forget_after`` chunks, it loses it.
    A packed EMBED (no ``input_id``) is answered at once, or EBUSY while an input is open when
    ``room_beside`` is False; ``gate``, when set, holds chunk 0's answer until it is set."""

    def __init__(self, forget_after: int = 10**9, hang_at: int = -1, room_beside: bool = True) -> None:
        self.alive = True
        self.sent: list[object] = []
        self.forget_after = forget_after
        self.hang_at = hang_at
        self.room_beside = room_beside
        self.gate: asyncio.Event | None = None
        self.open = 0
        self.die_at = 0  # the link fails on this message (1-based), the process gone

    async def request(self, msg, timeout):
        self.sent.append(msg)
        if self.die_at == len(self.sent):
            self.alive = False
            raise LinkError("the worker died")
        if isinstance(msg, link.Embed) and msg.input_id == 0:
            if self.open and not self.room_beside:
                raise WorkerError(Status.EBUSY, f"no room beside input {self.open}")
            return link.EmbedResult(dim=2, values=np.tile([0.6, 0.8], len(msg.lengths)).astype(np.float32))
        if isinstance(msg, link.Embed) and msg.chunk == 0 and self.gate is not None:
            self.open = msg.input_id
            await self.gate.wait()
        if isinstance(msg, link.EmbedCancel):
            if msg.input_id != self.open:
                raise WorkerError(Status.ERR_UNKNOWN_HANDLE, "not open")
            self.open = 0
            return link.Ok()
        if msg.chunk == self.hang_at:
            await asyncio.Event().wait()
        if len(self.sent) > self.forget_after:
            self.open = 0
        if msg.chunk == 0:
            self.open = msg.input_id
        elif msg.input_id != self.open:
            raise WorkerError(Status.ERR_UNKNOWN_HANDLE, f"input {msg.input_id} is not open")
        if not msg.last:
            return link.EmbedResult()
        self.open = 0  # the last chunk closes the input
        return link.EmbedResult(dim=2, values=np.array([0.6, 0.8], np.float32))


def between_of(fake: FakeLink) -> BetweenTicks:
    """Worker 0's exchanges, its process in ``procs[0]`` (a test replaces it: a respawn; a
    respawn waited for takes ``respawns``' next link)."""
    procs = [SimpleNamespace(link=fake)]
    respawns: list[FakeLink] = []

    async def respawned(worker_id):
        if procs[worker_id] is None or not procs[worker_id].link.alive:
            if not respawns:
                return None
            procs[worker_id] = SimpleNamespace(link=respawns.pop(0))
        return procs[worker_id]

    between = BetweenTicks(lambda worker_id: procs[worker_id], respawned, lambda: MAX_CRASH_RESUMES)
    between.procs, between.respawns = procs, respawns
    return between


def test_chunks_go_in_order_and_the_last_returns_the_vector():
    fake = FakeLink()
    vec = asyncio.run(between_of(fake).embed_chunked(0, list(range(3, 303)), 128))
    assert vec.tolist() == pytest.approx([0.6, 0.8])
    assert [(m.chunk, m.last, len(m.tokens)) for m in fake.sent] == [
        (0, False, 128),
        (1, False, 128),
        (2, True, 44),
    ]
    assert len({m.input_id for m in fake.sent}) == 1 and fake.sent[0].input_id != 0


def test_a_worker_that_lost_the_input_ends_the_request_with_worker_failed():
    fake = FakeLink(forget_after=1)  # restarted after chunk 0
    with pytest.raises(AdmissionError) as err:
        asyncio.run(between_of(fake).embed_chunked(0, list(range(3, 303)), 128))
    assert err.value.code == ErrorCode.WORKER_FAILED and "lost the state" in str(err.value)


def test_a_new_process_between_chunks_gets_the_input_again_from_its_first_chunk():
    """A crash is a preemption: the respawned worker is sent the whole input again and the
    request is answered."""
    fake, fresh = FakeLink(), FakeLink()
    between = between_of(fake)

    async def restart_after_chunk_0(msg, timeout, request=fake.request):
        reply = await request(msg, timeout)
        between.procs[0] = SimpleNamespace(link=fresh)  # the slot respawned it
        return reply

    fake.request = restart_after_chunk_0
    vec = asyncio.run(between.embed_chunked(0, list(range(3, 303)), 128))
    assert vec.tolist() == pytest.approx([0.6, 0.8])
    assert len(fake.sent) == 1 and [(m.chunk, m.last) for m in fresh.sent] == [
        (0, False),
        (1, False),
        (2, True),
    ]
    assert fresh.sent[0].input_id != fake.sent[0].input_id and fresh.open == 0


def test_a_worker_restarting_on_every_pass_ends_the_request_with_worker_failed():
    between = between_of(FakeLink())
    incarnations: list[FakeLink] = []

    def respawning(link: FakeLink) -> FakeLink:
        async def restart_after_chunk_0(msg, timeout, request=link.request):
            reply = await request(msg, timeout)
            incarnations.append(new := respawning(FakeLink()))
            between.procs[0] = SimpleNamespace(link=new)
            return reply

        link.request = restart_after_chunk_0
        return link

    between.procs[0].link = respawning(between.procs[0].link)
    with pytest.raises(AdmissionError) as err:
        asyncio.run(between.embed_chunked(0, list(range(3, 303)), 128))
    assert err.value.code == ErrorCode.WORKER_FAILED and "lost the state" in str(err.value)
    assert len(incarnations) == MAX_CRASH_RESUMES  # each pass got one chunk in before its restart


def test_an_input_left_open_by_a_cancelled_request_is_cancelled_before_the_next_embed():
    fake = FakeLink(hang_at=1)
    between = between_of(fake)

    async def run():
        task = asyncio.create_task(between.embed_chunked(0, list(range(3, 303)), 128))
        while len(fake.sent) < 2:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        fake.hang_at = -1
        return await between.embed(0, [[5, 6]])

    asyncio.run(run())
    left = fake.sent[0].input_id
    assert isinstance(fake.sent[2], link.EmbedCancel) and fake.sent[2].input_id == left
    assert fake.open == 0 and fake.sent[3].input_id == 0  # then the packed EMBED


@pytest.mark.parametrize("room", [True, False])
def test_a_packed_embed_goes_between_the_chunks_or_waits_for_the_input(room):
    """A short EMBED sent while a long input's chunk 0 is in flight goes right after it, before
    chunk 1 (the worker serves it in the cells the open input leaves); when the worker has no room
    beside the input (EBUSY) it is sent again once the input is done."""
    fake = FakeLink(room_beside=room)
    fake.gate = asyncio.Event()
    between = between_of(fake)

    async def run():
        long = asyncio.create_task(between.embed_chunked(0, list(range(3, 303)), 128))
        while not fake.sent:
            await asyncio.sleep(0.001)
        short = asyncio.create_task(between.embed(0, [[5, 6], [7]]))
        await asyncio.sleep(0.01)  # the packed EMBED now waits for chunk 0's exchange
        fake.gate.set()
        return await long, await short

    vec, rows = asyncio.run(run())
    assert vec.tolist() == pytest.approx([0.6, 0.8]) and rows.shape == (2, 2)
    order = [("packed" if m.input_id == 0 else m.chunk) for m in fake.sent]
    assert order == ([0, "packed", 1, 2] if room else [0, "packed", 1, 2, "packed"])
    assert not any(isinstance(m, link.EmbedCancel) for m in fake.sent)  # the open input was kept


def test_a_worker_dying_during_a_chunk_gets_the_input_again_once_it_respawned():
    fake, fresh = FakeLink(), FakeLink()
    fake.die_at = 2  # chunk 1
    between = between_of(fake)
    between.respawns.append(fresh)
    vec = asyncio.run(between.embed_chunked(0, list(range(3, 303)), 128))
    assert vec.tolist() == pytest.approx([0.6, 0.8])
    assert [m.chunk for m in fake.sent] == [0, 1] and [m.chunk for m in fresh.sent] == [0, 1, 2]


@pytest.mark.parametrize("deaths", [MAX_CRASH_RESUMES - 1, MAX_CRASH_RESUMES])
def test_a_packed_embed_survives_its_worker_dying_up_to_the_bound(deaths):
    """``deaths`` incarnations die on their first message; the request is answered by the
    first that lives, or fails WORKER_FAILED at its ``max_crash_resumes``-th death."""
    dying = [FakeLink() for _ in range(deaths)]
    for link_ in dying:
        link_.die_at = 1
    between = between_of(dying[0])
    between.respawns.extend([*dying[1:], FakeLink()])

    async def run():
        return await between.embed(0, [[5, 6]])

    if deaths < MAX_CRASH_RESUMES:
        assert asyncio.run(run()).shape == (1, 2)
        assert between.procs[0].link.sent and not between.respawns
    else:
        with pytest.raises(AdmissionError) as err:
            asyncio.run(run())
        assert err.value.code == ErrorCode.WORKER_FAILED and "failed during EMBED" in str(err.value)
        assert len(between.respawns) == 1  # the living one was never reached


def test_no_incarnation_coming_fails_the_request_at_once():
    fake = FakeLink()
    fake.die_at = 1
    between = between_of(fake)  # no respawn: the slot gave up
    with pytest.raises(AdmissionError) as err:
        asyncio.run(between.embed(0, [[5, 6]]))
    assert err.value.code == ErrorCode.WORKER_FAILED and len(fake.sent) == 1
