"""The scheduler's state records: live lanes and the per-class request queues (DESIGN.md "Scheduling").

Both are plain, inspectable data. A preempted or checkpointed lane's request goes back to the head
of its class and is admitted again with its generated tokens appended to its prompt as
``decode_replay`` (ABI rules 71-73); the prefix-cache policy seeds admits from cached prefixes
(rule 45), so a lane may start with part of its prompt already prefilled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from basertd.server.request.record import QOS_CLASSES, GenerationRequest
from basertd.server.sched.plan_builder import Candidate, LaneView
from basertd.server.sched.qos import admission_order
from basertd.server.sched.qos import qos_rank as _rank


@dataclass(eq=False)
class Lane:
    """One live lane of one worker incarnation.

    ``tag``: the lane tag (unique per scheduler, never reused). ``request``: the generation it
    serves. ``prompt_len``: its prefill end in tokens (the admitted prompt less the replayed
    tokens); ``prefilled``: prompt tokens the engine has prefilled or seeded (confirmed by events;
    a seed may reach into the replayed tokens); ``reserved``: KV tokens reserved for it (prompt +
    max_tokens, rounded up to whole pages). ``retire``/``publish``: retire it in the next plan, and
    whether to publish its KV to the prefix cache. ``tick_tokens``: tokens delivered by partial
    emits (TICK_EMIT) during the tick in flight; the terminal emit delivers only what follows them.
    ``admitted_at``: monotonic seconds.

    For preemption and the prefix cache: ``admitted``: the admitted prompt (the request's prompt
    plus the tokens it generated before a preemption) and ``hashes`` its page hash path; ``seeded_tokens``:
    tokens its seed covered;
    ``replay_left``: replayed tokens its decode units must still feed (ABI rule 72); ``emitted``:
    tokens the engine emitted on this lane (all of them, delivered or not); ``checkpoint``: 0, or
    where its prefill stops for it to publish its prefix and be requeued (prefix coalescing);
    ``preemptible``: an interactive request may preempt it (any lane of a lower class); ``aged``:
    it was admitted at an effective rank above its class (aging, ``basertd.server.sched.qos``), and is
    preemptible only once it emitted a token, so every admission of it makes progress;
    ``requeue``: once retired, its request goes back to the head of its class (preemption,
    checkpoint)."""

    tag: int
    request: GenerationRequest
    prompt_len: int
    reserved: int
    admitted_at: float
    prefilled: int = 0
    retire: bool = False
    publish: bool = False
    tick_tokens: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    seeded_tokens: int = 0
    replay_left: int = 0
    replayed: int = 0
    emitted: list[int] = field(default_factory=list)
    checkpoint: int = 0
    preemptible: bool = False
    strategy: str = ""  # the speculation strategy its admit named ("" none; ``sched.speculation``)
    tokens_per_round: float = 1.0  # tokens a decode round commits, decaying mean (``sched.apply``)
    aged: bool = False
    requeue: bool = False

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
            replay=self.replay_left,
            checkpoint=self.checkpoint,
            tokens_per_round=self.tokens_per_round,
            preemptible=self.preemptible
            and not done
            and not self.checkpoint
            and (not self.aged or bool(self.emitted)),
        )

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV the engine surely holds: seeded, prefilled and replayed ones, and every
        emitted token but the last (whose KV the next decode unit would compute)."""
        fed = max(self.prefilled, self.seeded_tokens) + self.replayed
        return fed + max(0, len(self.emitted) - 1)

    def published_tokens(self) -> list[int]:
        """The tokens a publishing retire leaves in the cache (then cut to whole pages)."""
        return (self.admitted + self.emitted)[: self.kv_tokens]


def qos_rank(qos: str) -> int:
    """0 for interactive, 1 batch, 2 background."""
    return _rank(qos)


class RequestQueues:
    """One FIFO per QoS class (DESIGN.md "Scheduling"), served in class order with aging
    (``ordered``, ``basertd.server.sched.qos.admission_order``).

    ``push`` appends, ``push_front`` puts a request back at the head of its class (a transient
    admit refusal, a preemption, a checkpoint). Requests that finished while queued (cancel,
    disconnect) are skipped and dropped lazily; ``remove`` drops one at once."""

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

    def ordered(
        self, now: float, aging_s: float, skip: Callable[[GenerationRequest], bool] | None = None
    ) -> Iterator[GenerationRequest]:
        """Queued requests in admission order with aging (``aging_s`` seconds per class, 0: strict
        class order), dropping finished ones first; ``skip(req)`` leaves a request out of this
        order without dequeuing it (a request waiting for a shared prefix)."""
        for q in self.classes.values():
            while q and q[0].finished:
                self.tokens -= len(q.popleft().prompt)
        snapshot = {name: [r for r in q if not r.finished] for name, q in self.classes.items()}
        return admission_order(snapshot, now, aging_s, skip=skip)

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


def on_probation(req: GenerationRequest, max_crash_resumes: int) -> bool:
    """True when one more crash of its worker while ``req`` runs would fail it (``[scheduler]
    max_crash_resumes``, DESIGN.md "Scheduling"): such requests run one at a time until one
    delivers a token, so a crash names the poison request and never fails the lanes that merely
    shared its ticks."""
    streak = req.crash_streak
    return not req.finished and streak > 0 and streak + 1 >= max_crash_resumes


class Probe:
    """The one admission per plan open to a request on probation (``on_probation``): ``take()``
    is True once, and never while such a lane already runs (``busy``)."""

    __slots__ = ("busy",)

    def __init__(self, busy: bool) -> None:
        self.busy = busy

    def take(self) -> bool:
        """Claim the place; False when it is taken."""
        if self.busy:
            return False
        self.busy = True
        return True


def candidate(
    req: GenerationRequest,
    page_tokens: int,
    *,
    seed: int = 0,
    urgent: bool = False,
    checkpoint: int = 0,
) -> Candidate:
    """The plan builder's view of a queued request: its KV reservation is prompt + max_tokens
    rounded up to whole pages of ``page_tokens`` tokens. A request resumed after a preemption is
    admitted with its generated tokens appended (``replay`` of them, ABI rules 71-73); ``seed``:
    tokens a cached prefix covers (rule 45); ``urgent``: it may preempt; ``checkpoint``: as
    ``Candidate.checkpoint``."""
    k = len(req.generated)
    return Candidate(
        key=req.key,
        prompt_len=len(req.prompt),
        reserve=reservation(len(req.prompt) + req.max_tokens, page_tokens),
        remaining=req.remaining,
        qos_rank=qos_rank(req.qos),
        prefilled=seed,
        replay=k,
        urgent=urgent,
        checkpoint=checkpoint,
    )


def reservation(tokens: int, page_tokens: int) -> int:
    """``tokens`` rounded up to a whole number of pages (``page_tokens`` <= 1: unchanged)."""
    if page_tokens <= 1:
        return tokens
    return -(-tokens // page_tokens) * page_tokens
