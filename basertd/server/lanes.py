"""The scheduler's state records: live lanes and the per-class request queues (issue 7).

Both are plain, inspectable data so the scheduler's state can be examined and extended (the
preemption issue requeues running requests at the head of their class and resumes them with
their generated tokens; the prefix-cache policy attaches seeds to admits).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from basertd.server.plan import Candidate, LaneView
from basertd.server.requests import QOS_CLASSES, GenerationRequest


@dataclass(eq=False)
class Lane:
    """One live lane of one worker incarnation.

    ``tag``: the lane tag (unique per scheduler, never reused). ``request``: the generation it
    serves. ``prompt_len``: tokens admitted as its prompt; ``prefilled``: prompt tokens the engine
    has prefilled (confirmed by events); ``reserved``: KV tokens reserved for it (prompt +
    max_tokens, rounded up to whole pages). ``retire``/``publish``: retire it in the next plan, and
    whether to publish its KV to the prefix cache. ``tick_tokens``: tokens delivered by partial
    emits (TICK_EMIT) during the tick in flight; the terminal emit delivers only what follows them.
    ``admitted_at``: monotonic seconds."""

    tag: int
    request: GenerationRequest
    prompt_len: int
    reserved: int
    admitted_at: float
    prefilled: int = 0
    retire: bool = False
    publish: bool = False
    tick_tokens: list[int] = field(default_factory=list)

    @property
    def phase(self) -> str:
        """ "prefill", "decode" or "retiring" (the operator's view, ``control.LaneRow.state``)."""
        if self.retire or self.request.finished:
            return "retiring"
        return "decode" if self.prefilled >= self.prompt_len else "prefill"

    def view(self) -> LaneView:
        """The plan builder's view of this lane."""
        done = self.retire or self.request.finished
        return LaneView(
            tag=self.tag,
            prompt_len=self.prompt_len,
            prefilled=self.prefilled,
            remaining=0 if done else self.request.remaining,
            reserved=self.reserved,
            qos_rank=qos_rank(self.request.qos),
            retire=done,
            publish=self.publish,
        )


def qos_rank(qos: str) -> int:
    """0 for interactive, 1 batch, 2 background."""
    return QOS_CLASSES.index(qos)


class RequestQueues:
    """One FIFO per QoS class (DESIGN.md "Scheduling"), served in strict class order for now.

    ``push`` appends, ``push_front`` puts a request back at the head of its class (a transient
    admit refusal; later, preemption). Requests that finished while queued (cancel, disconnect)
    are skipped and dropped lazily; ``remove`` drops one at once."""

    def __init__(self) -> None:
        self.classes: dict[str, deque[GenerationRequest]] = {q: deque() for q in QOS_CLASSES}
        self.tokens = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self.classes.values())

    def depth(self, qos: str) -> int:
        """Requests queued in class ``qos``."""
        return len(self.classes[qos])

    def push(self, req: GenerationRequest) -> None:
        """Queue ``req`` at the tail of its class."""
        self.classes[req.qos].append(req)
        self.tokens += len(req.prompt)

    def push_front(self, req: GenerationRequest) -> None:
        """Queue ``req`` at the head of its class."""
        self.classes[req.qos].appendleft(req)
        self.tokens += len(req.prompt)

    def remove(self, req: GenerationRequest) -> bool:
        """Drop ``req`` if queued; True when it was."""
        try:
            self.classes[req.qos].remove(req)
        except ValueError:
            return False
        self.tokens -= len(req.prompt)
        return True

    def pop(self, req: GenerationRequest) -> None:
        """Take ``req`` (known to be queued, usually at a class head) out for admission."""
        q = self.classes[req.qos]
        if q and q[0] is req:
            q.popleft()
        else:
            q.remove(req)
        self.tokens -= len(req.prompt)

    def __iter__(self) -> Iterator[GenerationRequest]:
        """Queued requests in admission order, dropping finished ones on the way."""
        for q in self.classes.values():
            while q and q[0].finished:
                self.tokens -= len(q.popleft().prompt)
            yield from (r for r in list(q) if not r.finished)

    def drain(self) -> list[GenerationRequest]:
        """Take every queued request out (admission order)."""
        out = [r for q in self.classes.values() for r in q]
        for q in self.classes.values():
            q.clear()
        self.tokens = 0
        return out

    def oldest_wait(self, qos: str, now: float) -> float:
        """Seconds the head of class ``qos`` has waited (0 when empty)."""
        q = self.classes[qos]
        return now - q[0].t_received if q else 0.0


def candidate(req: GenerationRequest, page_tokens: int) -> Candidate:
    """The plan builder's view of a queued request: its KV reservation is prompt + max_tokens
    rounded up to whole pages of ``page_tokens`` tokens."""
    return Candidate(
        key=req.key,
        prompt_len=len(req.prompt),
        reserve=reservation(len(req.prompt) + req.max_tokens, page_tokens),
        remaining=req.remaining,
        qos_rank=qos_rank(req.qos),
    )


def reservation(tokens: int, page_tokens: int) -> int:
    """``tokens`` rounded up to a whole number of pages (``page_tokens`` <= 1: unchanged)."""
    if page_tokens <= 1:
        return tokens
    return -(-tokens // page_tokens) * page_tokens
