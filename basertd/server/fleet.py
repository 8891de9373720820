"""The fleet: every configured worker with its supervisor, scheduler and tokenizer, and routing.

``Fleet(config, workers_dir, metrics)`` builds, per ``[[workers]]`` table, one ``WorkerSlot`` (the
supervisor: spawn, respawn, give up), one ``Scheduler`` (its plans and ticks) and the
coordinator-side tokenizer of its vocabulary (workers sharing a vocabulary share one). It answers
the questions the front end and the operator verbs ask about the workers: which worker serves a
model and holds the longest cached prefix of a prompt (``route``), whether prompts start with BOS,
which models are served, how loaded the workers are, and each worker's engine counters
(``worker_stats``, a PONG); embeddings and prompt scores go through ``between_ticks``
(``basertd.server.workers.between_ticks``). It owns no client and no request: DESIGN.md "Scheduling"
and "Prefix cache policy" for what the schedulers do with what it routes to them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import structlog
import zmq

from basertd.schema import client as api
from basertd.schema import link
from basertd.schema.client import ErrorCode
from basertd.server.cache.policy import WorkerCache
from basertd.server.cache.policy import route as route_by_prefix
from basertd.server.config import Config
from basertd.server.config_sections import WorkerConfig
from basertd.server.observe.kv_events import KvEventsHub, medium_of
from basertd.server.observe.metrics import LiveState, Metrics
from basertd.server.observe.snapshot import FleetTotals, WorkerSnapshot
from basertd.server.request.record import AdmissionError
from basertd.server.request.tokenizer import Tokenizer, TokenizerError, make_tokenizer
from basertd.server.sched.loop import Scheduler, WorkerLimits
from basertd.server.states import SlotState
from basertd.server.tasks import cancel_and_wait
from basertd.server.workers.between_ticks import BetweenTicks
from basertd.server.workers.link_errors import LinkError
from basertd.server.workers.process import SpawnedWorker, WorkerSpec
from basertd.server.workers.slot import WorkerSlot
from basertd.server.workers.specs import daemon_worker_spec, prefix_cache_usable

log = structlog.get_logger("basertd.fleet")

# a scheduler loop ends at once when cancelled (nothing it runs on the way out awaits)
SCHEDULER_RECANCEL_S = 0.5

WORKER_CLOSE_GRACE_S = 5.0
"""Seconds a stopping worker gets between SHUTDOWN and SIGKILL."""
PONG_TIMEOUT_S = 1.0
"""Seconds ``worker_stats`` waits for a worker's PONG before answering without engine counters."""
STALE_KEY = "stats_age_ms"
"""The key ``worker_stats`` adds to counters it answers from an earlier PONG: their age (ms)."""
RESPAWN_WAIT_S = 120.0
"""Seconds an embedding or scoring request waits for its dead worker's next incarnation."""


def _count(text: str) -> int:
    """A capability record's decimal count (``extra`` values are strings); 0 when it is not one."""
    return int(text) if text.isdigit() else 0


class CapabilityGatedCache(WorkerCache):
    """A worker's prefix-cache policy that is off (no seeds, no coalescing, no pins, no cached
    hints) for an incarnation whose capability record says its engine has no usable prefix cache
    (``worker_specs.prefix_cache_usable``: a basert bundle without paged KV or prefix cache);
    DESIGN.md "Prefix cache policy". ``usable`` / ``unusable_reason`` describe the current or last
    incarnation; a change is logged once (``prefix_cache_off`` with the engine's reason)."""

    usable = True
    unusable_reason = ""

    def attach(self, caps) -> None:
        super().attach(caps)
        usable, why = prefix_cache_usable(caps)
        if not usable and (self.usable or why != self.unusable_reason):
            log.warning("prefix_cache_off", worker_id=self.worker_id, reason=why)
        elif usable and not self.usable:
            log.info("prefix_cache_on", worker_id=self.worker_id)
        self.usable, self.unusable_reason = usable, why

    @property
    def enabled(self) -> bool:
        return self.usable and super().enabled


class UnavailableTokenizer:
    """Stands for a basert bundle's tokenizer that did not load in the coordinator (the library
    lacks ``baseRT_load_tokenizer_only``, the bundle does not load): the daemon still starts, the
    worker of that bundle fails to start with its own line (exit 3) and is reported, and every
    encode raises ``TokenizerError`` with ``reason``. Vocabulary size 0: no token id is valid."""

    kind = "unavailable"
    vocab_size = 0
    add_bos = False

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def encode(self, text: str, *, add_bos: bool) -> list[int]:
        raise TokenizerError(f"the model's tokenizer is unavailable: {self.reason}")

    def piece(self, token: int) -> bytes:
        return b""


@dataclass
class Member:
    """One configured worker: its id, configuration, served model name, supervisor, scheduler,
    the tokenizer of its vocabulary and its prefix-cache policy (``cache``, the one its scheduler
    runs; the cache verbs and the KV-event publisher reach it here)."""

    worker_id: int
    config: WorkerConfig
    model_name: str
    slot: WorkerSlot
    scheduler: Scheduler
    tokenizer: Tokenizer
    cache: WorkerCache
    tok_key: tuple[str, str] = ("", "")
    leaving: bool = False
    """Being handed over (replaced or removed): new requests go to a peer when one serves the
    model, and no peer hands its lanes here."""


@dataclass(frozen=True)
class Prepared:
    """What a worker table needs before anything changes (``Fleet.prepare``): its table, the
    worker spec, the tokenizer key, served name and tokenizer."""

    config: WorkerConfig
    spec: WorkerSpec
    tok_key: tuple[str, str]
    name: str
    tokenizer: Tokenizer


class Fleet:
    """The workers of one daemon (module docstring). ``build()`` (async: tokenizers load in a
    thread) then ``start()``; ``stop()`` stops every scheduler and worker and frees the
    tokenizers. Raises ``basertd.models.ModelUnavailable`` or ``TokenizerError`` from ``build`` (a
    basert bundle whose tokenizer does not load is an ``UnavailableTokenizer`` instead: its worker
    reports why it cannot load)."""

    def __init__(self, config: Config, workers_dir: str, metrics: Metrics) -> None:
        self.config = config
        self.workers_dir = workers_dir
        self.metrics = metrics
        self.members: list[Member] = []
        self._tasks: dict[int, asyncio.Task] = {}
        self.changing = asyncio.Lock()  # one worker change (reload, restart) at a time
        self._bos: dict[int, bool] = {}
        self._stats: dict[int, tuple[object, float, dict[str, int]]] = {}
        """Per worker, the incarnation that last answered a PONG, when (monotonic seconds) and its
        counters (``worker_stats``)."""
        self.between_ticks = BetweenTicks(
            lambda worker_id: self.members[worker_id].slot.proc,
            lambda worker_id: self.members[worker_id].slot.live(RESPAWN_WAIT_S),
            lambda: self.config.scheduler.max_crash_resumes,  # a reload replaces the config
        )
        self.kv_events: KvEventsHub | None = None

    # --- construction and lifecycle --------------------------------------------------------------

    async def build(self, spawned: dict[int, SpawnedWorker] | None = None) -> None:
        """Create every worker's spec, supervisor, tokenizer and scheduler. Each worker is spawned
        (its supervisor started) before the coordinator loads the tokenizers, so the worker's
        imports and model load overlap the tokenizer's load (a GGUF vocabulary takes about as long
        to load as the worker's whole start; DESIGN.md "Processes"); ``start()`` then starts the
        schedulers. ``spawned``: workers spawned already (``basertd.server.launch``), by worker
        id; each is taken out of it and adopted by its slot. Raises what ``prepare`` raises, after
        stopping the workers already spawned."""
        early: list[tuple[int, WorkerConfig, WorkerSpec, tuple[str, str], str, WorkerSlot, list]] = []
        spawned = spawned if spawned is not None else {}
        try:
            for worker_id, wcfg in enumerate(self.config.workers):
                spec, tok_key, name = self._spec(worker_id, wcfg)
                first = spawned.pop(worker_id, None)
                if first is not None:
                    spec = first.spec
                holder: list[Scheduler] = []
                slot = self._slot(spec, holder)
                slot.start(first)
                early.append((worker_id, wcfg, spec, tok_key, name, slot, holder))
            for worker_id, wcfg, spec, tok_key, name, slot, holder in early:
                tok = await self._tokenizer(worker_id, tok_key)
                prep = Prepared(wcfg, spec, tok_key, name, tok)
                self.members.append(self._member(worker_id, wcfg, prep, slot, holder))
        except BaseException:
            started = [e[5] for e in early[len(self.members) :]]
            await asyncio.gather(*(s.stop() for s in started), return_exceptions=True)
            raise

    def _spec(self, worker_id: int, wcfg: WorkerConfig) -> tuple[WorkerSpec, tuple[str, str], str]:
        """Worker ``worker_id``'s spec, tokenizer key and served name for the table ``wcfg``.
        Raises ``basertd.models.ModelUnavailable``."""
        return daemon_worker_spec(self.config, worker_id, wcfg, self.workers_dir)

    async def prepare(self, worker_id: int, wcfg: WorkerConfig) -> Prepared:
        """Worker ``worker_id``'s spec, served name and tokenizer for the table ``wcfg`` (a
        tokenizer already loaded for the same vocabulary is shared, otherwise it loads in a
        thread). Changes nothing. Raises ``basertd.models.ModelUnavailable`` or
        ``TokenizerError`` (a basert bundle whose tokenizer does not load gets an
        ``UnavailableTokenizer``)."""
        spec, tok_key, name = self._spec(worker_id, wcfg)
        return Prepared(wcfg, spec, tok_key, name, await self._tokenizer(worker_id, tok_key))

    async def _tokenizer(self, worker_id: int, tok_key: tuple[str, str]) -> Tokenizer:
        """The tokenizer of ``tok_key``: a member's when one shares the vocabulary, else loaded in
        a thread. Raises ``TokenizerError`` (a basert bundle's gets an ``UnavailableTokenizer``)."""
        tok = next((m.tokenizer for m in self.members if m.tok_key == tok_key), None)
        if tok is None:
            try:
                tok = await asyncio.to_thread(make_tokenizer, *tok_key)
            except TokenizerError as exc:
                if tok_key[0] != "basert":
                    raise
                # The worker of this bundle fails the same way and is reported (status, health).
                log.error("tokenizer_unavailable", worker_id=worker_id, reason=str(exc))
                tok = UnavailableTokenizer(str(exc))
        return tok

    @staticmethod
    def _slot(spec: WorkerSpec, holder: list[Scheduler]) -> WorkerSlot:
        """The supervisor of ``spec``; giving up is reported to the scheduler ``holder`` holds
        once there is one (nothing is queued before)."""
        return WorkerSlot(
            spec,
            close_grace_s=WORKER_CLOSE_GRACE_S,
            on_give_up=lambda err, h=holder: h and h[0].on_give_up(err),
        )

    def _member(
        self,
        worker_id: int,
        wcfg: WorkerConfig,
        prep: Prepared,
        slot: WorkerSlot | None = None,
        holder: list[Scheduler] | None = None,
    ) -> Member:
        """A new member (supervisor, scheduler, cache policy) from ``prep``; nothing started but
        ``slot`` when it is given (``build``: spawned early, with its ``holder``)."""
        cfg = self.config
        if slot is None or holder is None:
            holder = []
            slot = self._slot(prep.spec, holder)
        spec = prep.spec
        limits = WorkerLimits(
            context_length=wcfg.context_length,
            max_lanes=wcfg.lanes,
            max_batch_size=wcfg.lanes,
            page_tokens=1,
            kv_tokens=wcfg.lanes * wcfg.context_length,
            max_admit_tokens=spec.prompt_ring.slots * ((spec.prompt_ring.slot_bytes - 16) // 4) // 2,
        )
        policy = CapabilityGatedCache(worker_id, cfg.cache)
        sched = Scheduler(
            slot,
            limits,
            cfg.scheduler,
            cfg.cache,
            metrics=self.metrics,
            tokenizer=prep.tokenizer,
            cache_policy=policy,
        )
        holder.append(sched)
        m = Member(worker_id, wcfg, prep.name, slot, sched, prep.tokenizer, policy, prep.tok_key)
        # a crashed or handed-over worker's lanes resume on a live peer of the same model
        sched.handover.peers = lambda me=m: [
            o.scheduler
            for o in self.members
            if o is not me and not o.leaving and o.model_name == me.model_name and o.tokenizer is me.tokenizer
        ]
        return m

    def publish_kv_events(self, hub: KvEventsHub) -> None:
        """Tell ``hub``'s publisher of each worker (one per member, by worker id) of its prefix
        index from now on; a worker added later gets its own publisher (``add``), a removed one's
        is closed (``remove_last``). Call before ``start``."""
        self.kv_events = hub
        for m in self.members:
            m.cache.observe(hub.publisher(m.worker_id))

    def _publish_added(self, m: Member) -> None:
        """Open a KV-event publisher for ``m`` (added by a reload) when events are on. An endpoint
        that cannot be opened (a port taken, say) is logged and the worker runs without events;
        the reload itself goes ahead."""
        if self.kv_events is None:
            return
        try:
            pub = self.kv_events.add(m.worker_id, medium_of(m.config.device))
        except (zmq.ZMQError, OSError, ValueError) as exc:
            log.error("kv_events_worker_failed", worker_id=m.worker_id, error=str(exc))
            return
        log.info(
            "kv_events_worker_added", worker_id=m.worker_id, endpoint=pub.endpoint, replay=pub.replay_endpoint
        )
        m.cache.observe(pub)

    def start(self) -> None:
        """Start every supervisor and scheduler task."""
        for m in self.members:
            self._start(m)

    def _start(self, m: Member) -> None:
        m.slot.start()
        task = asyncio.get_running_loop().create_task(m.scheduler.run(), name=f"scheduler-{m.worker_id}")
        self._tasks[m.worker_id] = task

    async def stop(self) -> None:
        """Stop every scheduler (what is queued or running fails SHUTTING_DOWN), then every
        worker (SHUTDOWN, SIGKILL after a grace period, reaped); free the tokenizers. Never
        raises; idempotent."""
        for m in self.members:
            await m.scheduler.stop()
        await cancel_and_wait(self._tasks.values(), recancel_s=SCHEDULER_RECANCEL_S)
        self._tasks.clear()
        await asyncio.gather(*(m.slot.stop() for m in self.members), return_exceptions=True)
        for tok in {id(m.tokenizer): m.tokenizer for m in self.members}.values():
            close = getattr(tok, "close", None)
            if close is not None:
                close()

    # --- workers changed at run time (``basertd.server.ops.worker_changes``) ---------------------

    def add(self, prep: Prepared) -> Member:
        """Append and start worker ``len(self)`` from ``prep`` (its id is the next position)."""
        m = self._member(len(self.members), prep.config, prep)
        self.members.append(m)
        self._publish_added(m)
        self._start(m)
        return m

    def retarget(self, m: Member, prep: Prepared) -> None:
        """Make member ``m`` serve ``prep``'s table from its next incarnation on: configuration,
        served name, tokenizer (the old one freed when no member shares it). Call while its
        slot is being replaced (``WorkerSlot.replace``)."""
        old = m.tokenizer
        m.config, m.model_name, m.tok_key, m.tokenizer = prep.config, prep.name, prep.tok_key, prep.tokenizer
        m.scheduler.tokenizer = prep.tokenizer
        self._bos.pop(m.worker_id, None)
        pub = self.kv_events.publisher(m.worker_id) if self.kv_events is not None else None
        if pub is not None:
            pub.medium = medium_of(prep.config.device)
        self._close_unused(old)

    async def remove_last(self) -> Member:
        """Stop and forget the last worker (its queues and lanes already handed over): its
        scheduler (anything left fails SHUTTING_DOWN), its task, its process, its KV-event
        publisher; its tokenizer is freed when no other worker shares it."""
        m = self.members[-1]
        await m.scheduler.stop(f"worker {m.worker_id} was removed by a reload")
        task = self._tasks.pop(m.worker_id, None)
        if task is not None:
            await cancel_and_wait([task], recancel_s=SCHEDULER_RECANCEL_S)
        await m.slot.stop()
        self.members.pop()
        m.cache.observe(None)
        if self.kv_events is not None:
            self.kv_events.remove(m.worker_id)
        self._bos.pop(m.worker_id, None)
        self._stats.pop(m.worker_id, None)
        self._close_unused(m.tokenizer)
        return m

    def _close_unused(self, tok: Tokenizer) -> None:
        if all(o.tokenizer is not tok for o in self.members):
            close = getattr(tok, "close", None)
            if close is not None:
                close()

    # --- views -----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self) -> Iterator[Member]:
        return iter(self.members)

    def __getitem__(self, worker_id: int) -> Member:
        return self.members[worker_id]

    @property
    def slots(self) -> list[WorkerSlot]:
        return [m.slot for m in self.members]

    @property
    def schedulers(self) -> list[Scheduler]:
        return [m.scheduler for m in self.members]

    def worker_ids(self, worker_id: int | None) -> list[int]:
        """``[worker_id]`` (every id for None). Raises ``LookupError`` naming the valid range for
        an unknown id."""
        n = len(self.members)
        if worker_id is None:
            return list(range(n))
        if not 0 <= worker_id < n:
            raise LookupError(f"no worker {worker_id} (workers are 0..{n - 1})")
        return [worker_id]

    @property
    def ready_count(self) -> int:
        """Workers whose current incarnation is serving."""
        return sum(1 for m in self.members if m.slot.state is SlotState.READY)

    def snapshots(self) -> list[WorkerSnapshot]:
        """Every worker now, by id (``Scheduler.snapshot``; call on the event loop)."""
        return [m.scheduler.snapshot() for m in self.members]

    def context_length(self, worker_id: int) -> int:
        """The context window (tokens) of worker ``worker_id``'s current (or last) incarnation."""
        return self.members[worker_id].scheduler.snapshot().limits.context_length

    def totals(self) -> FleetTotals:
        """Workers ready, lanes busy and queued requests summed over every worker now."""
        return FleetTotals.of(self.snapshots())

    def problems(self) -> list[str]:
        """One line per worker that is not serving for a reason an operator must see: given up
        (with its last error), or a scheduler that stopped making progress. Empty when all is well
        (a worker still starting or respawning is not a problem yet)."""
        out = []
        for snap in self.snapshots():
            if snap.state is SlotState.GIVEN_UP:
                out.append(f"worker {snap.worker_id}: {snap.last_error or 'gave up starting'}")
            elif snap.stall_reason:
                out.append(f"worker {snap.worker_id}: {snap.stall_reason}")
        return out

    def models(self) -> list[api.ModelInfo]:
        """One entry per served model name, with the number of workers serving it."""
        out: dict[str, api.ModelInfo] = {}
        for m, snap in zip(self.members, self.snapshots(), strict=True):
            info = out.get(m.model_name)
            if info is None:
                info = out[m.model_name] = api.ModelInfo(
                    id=m.model_name,
                    engine=m.config.engine,
                    context_length=snap.limits.context_length,
                    vocab_size=m.tokenizer.vocab_size,
                )
            info.workers += 1
            proc = m.slot.proc
            if proc is not None and not info.digest:  # the weights, as a running engine reports them
                extra = proc.capabilities.extra
                info.family = extra.get("arch", "")
                info.parameters = _count(extra.get("n_params", ""))
                info.quantization = extra.get("quantization", "")
                info.file_bytes = _count(extra.get("file_bytes", ""))
                info.digest = proc.capabilities.model_id
        return list(out.values())

    # --- routing ---------------------------------------------------------------------------------

    def route(self, model: str) -> int:
        """The worker a new request for ``model`` ("" = any) goes to: the least loaded one that has
        not given up (any, if all have). Raises ``AdmissionError(NOT_FOUND)`` for a model no
        worker serves."""
        ids = [m.worker_id for m in self.members if model in ("", m.model_name)]
        if not ids:
            served = ", ".join(sorted({m.model_name for m in self.members}))
            raise AdmissionError(
                ErrorCode.NOT_FOUND, f"model {model!r} is not served here (served: {served})", "model"
            )
        staying = [i for i in ids if not self.members[i].leaving] or ids
        alive = [i for i in staying if not self.members[i].slot.given_up] or staying
        return min(alive, key=lambda i: self.members[i].scheduler.core.load())

    def route_prefix(self, worker_id: int, prompt: list[int], salt: int = 0) -> int:
        """Among the live workers serving the same model with the same vocabulary as
        ``worker_id``, the one holding the longest cached prefix of ``prompt`` (under cache salt
        ``salt``) unless it is much busier (``cache_policy.route``, ``[cache] route_slack``). Raises
        ``AdmissionError(WORKER_FAILED)`` when worker ``worker_id`` was removed meanwhile (a
        reload, while the prompt was tokenized)."""
        if worker_id >= len(self.members):
            raise AdmissionError(
                ErrorCode.WORKER_FAILED, f"worker {worker_id} was removed; retry the request"
            )
        me = self.members[worker_id]
        peers = [
            m.worker_id
            for m in self.members
            if m.model_name == me.model_name
            and m.tokenizer is me.tokenizer
            and not m.slot.given_up
            and not m.leaving
        ]
        if len(peers) < 2:
            return worker_id
        cores = {i: self.members[i].scheduler.core for i in peers}
        options = [(i, core.cached_prefix(prompt, salt), core.load()) for i, core in cores.items()]
        return route_by_prefix(options, self.config.cache.route_slack)

    def add_bos(self, worker_id: int) -> bool:
        """Whether prompts for this worker start with BOS: the capability record of its current
        (or last) incarnation, else what the vocabulary itself says."""
        m = self.members[worker_id]
        if m.slot.proc is not None:
            self._bos[worker_id] = bool(m.slot.proc.capabilities.add_bos)
        known = self._bos.get(worker_id)
        return m.tokenizer.add_bos if known is None else known

    async def worker_stats(self, worker_id: int) -> dict[str, int] | None:
        """The engine's counters of worker ``worker_id`` from a PONG; when it does not answer within
        ``PONG_TIMEOUT_S`` (a worker answers between ticks, and a tick can be longer), the counters
        of the last PONG this incarnation answered, with ``STALE_KEY`` their age in milliseconds,
        rather than none. None when it is not running or its incarnation never answered. A fresh
        PONG's host-tier counts also refresh the member's cache policy
        (``WorkerCache.engine_reported``), which the metrics read."""
        m = self.members[worker_id]
        proc = m.slot.proc
        if proc is None or not proc.link.alive:
            return None
        try:
            pong = await proc.link.ping(timeout=PONG_TIMEOUT_S)
        except LinkError:
            last = self._stats.get(worker_id)
            if last is None or last[0] is not proc or not proc.link.alive:
                return None
            return {**last[2], STALE_KEY: int((time.monotonic() - last[1]) * 1000)}
        stats = dict(pong.stats or {})
        self._stats[worker_id] = (proc, time.monotonic(), stats)
        m.cache.engine_reported(stats)
        return dict(stats)

    def embedding_dim(self, worker_id: int) -> int | None:
        """The dimensions of worker ``worker_id``'s embeddings, as its engine reports them
        (capability ``extra["embedding_dim"]``); None when it is not running or does not say."""
        proc = self.members[worker_id].slot.proc
        dim = proc.capabilities.extra.get("embedding_dim", "") if proc is not None else ""
        return int(dim) if dim.isdigit() else None

    async def embed(self, worker_id: int, inputs: list[list[int]]) -> np.ndarray:
        """``BetweenTicks.embed`` on worker ``worker_id``."""
        return await self.between_ticks.embed(worker_id, inputs)

    async def embed_chunked(self, worker_id: int, tokens: list[int], chunk_tokens: int) -> np.ndarray:
        """``BetweenTicks.embed_chunked`` on worker ``worker_id``."""
        return await self.between_ticks.embed_chunked(worker_id, tokens, chunk_tokens)

    async def score(self, worker_id: int, tokens: list[int], top_k: int) -> link.ScoreResult:
        """``BetweenTicks.score`` on worker ``worker_id``."""
        return await self.between_ticks.score(worker_id, tokens, top_k)

    def live_state(self, in_flight: int, draining: bool) -> LiveState:
        """Every worker's snapshot now with the model it serves (call on the event loop), and the
        daemon's ``in_flight`` request count and ``draining`` flag (``Drainer``): what the metrics
        collectors read at scrape time."""
        return LiveState(
            workers=self.snapshots(),
            model_names={m.worker_id: m.model_name for m in self.members},
            in_flight=in_flight,
            draining=draining,
        )
