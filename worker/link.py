"""The worker's end of Link W: one loop, one thread, one engine (DESIGN.md "Link W").

``LinkServer.run()`` connects a zmq PAIR socket to the coordinator's endpoint and serves until it
is told to stop; it returns the process exit code (``lifecycle.ExitCode``).

Protocol, as this side plays it:

1. HELLO (the versions we speak, worker id, pid) -> WELCOME (the chosen version; ERROR ends the
   link) -> CAPABILITIES, built from ``engine.info()``, ``engine.state_spaces()`` and the rings
   inherited on the command line.
2. RINGS_ATTACH: each spec must name one of the inherited ring segments by its fd, with the very
   geometry the command line gave (one ring per segment, offset 0); the engine attaches all or
   nothing (ABI rule 125) and we answer RINGS_ATTACHED(status). Allowed again later (re-attach
   resets the engine's writer cursors, rule 130).
3. Requests, in arrival order. TICK_SUBMIT runs the plan on this thread; with
   ``TickFlag.PARTIAL_EMITS`` the engine's partial emits are sent as TICK_EMIT frames from inside
   the tick (same thread, same socket; each token array is copied first, so no frame aliases ring
   or engine memory). They are coalesced: tokens are buffered per lane and flushed, one TICK_EMIT
   per lane, by the first callback at least ``emit_window_s`` (default 2 ms, ``--emit-window-ms``;
   0 sends every callback's tokens at once) after the tick started or the last flush; what is
   still buffered when the tick returns is dropped, because the result follows at once and
   carries it. So a lane's TICK_EMITs of one tick concatenate to a *prefix* of that tick's tokens
   for it (all of them with a 0 window); a fast tick streams nothing, a slow one streams about
   every window. The result is TICK_RESULT (events, ``plan_seq`` echoed), TICK_REJECTED
   (``PlanRejected``: the engine changed nothing) or ERROR. Requests that arrive mid-tick are
   served after it, except PING: at each flush the worker answers every PING received or queued
   so far (PONG ``tick_in_flight`` = True, stats of the previous PONG: the engine is never
   re-entered from its own callback).
4. Async state ops (snapshot, restore, demote, promote) answer STATE_OP_ACCEPTED with the op
   handle; their end is reported as STATE_OP_DONE (``corr`` = the STATE_OP's seq; a DONE snapshot
   or demote carries the sealed bytes as a side frame) once ``op_poll`` sees it terminal. Pending
   ops are polled after every message and every 5 ms while idle.
5. DRAIN: plans with admits are refused from then on (TICK_REJECTED ILLEGAL_COMBINATION, as the
   ABI refuses DRAIN plus admit, rule 33); DRAINED is sent once the engine holds no lane.
   SHUTDOWN: free the engine, exit 0.

Errors: an engine refusal (``EngineError``, a ring error) becomes ERROR{status}; a bad argument
(ValueError/TypeError) ERROR{REJECT_BOUNDS}; anything unexpected ERROR{ERR_FATAL} with the
exception's type, and the worker goes on. ``EngineFatal`` sends ERROR{ERR_FATAL} and exits 70. A
frame the codec refuses ends the link at once: one JSON log line with the ``FrameErrorCode``, exit
76, no traceback.

Liveness: the loop polls the socket and the stop-signal pipe with a 500 ms timeout and checks
that the parent is still the expected coordinator at least that often (``lifecycle``).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from basertd.schema import link
from basertd.schema.abi import OpState, RingKind, RingRole, Status, TickFlag
from basertd.schema.codec import MAX_FRAME_BYTES, MAX_SIDE_BYTES, FrameError, LinkCodec
from basertd.schema.link import MsgType
from basertd.schema.tick import TickPlan
from basertd.shm import RingError, Segment
from basertd.worker.engines.base import Engine, EngineError, EngineFatal, PlanRejected, RingMapping
from basertd.worker.lifecycle import ExitCode, StopSignals, parent_alive

__all__ = ["InheritedRing", "LinkServer"]

PARENT_CHECK_S = 0.5
"""Seconds between checks that the parent is still the coordinator (and the idle poll timeout)."""
OP_POLL_S = 0.005
"""Idle poll timeout while async state ops are pending, seconds."""
EMIT_WINDOW_S = 0.002
"""Default coalescing window of partial emits, seconds (``--emit-window-ms``; module docstring)."""
FLUSH_LINGER_MS = 2000
"""How long the socket may take to deliver the last frames (e.g. the result of the tick that was
in flight when SIGTERM came) when the worker exits."""

_TERMINAL = (OpState.DONE, OpState.FAILED, OpState.CANCELLED)


class _PartialEmits:
    """``engine.tick``'s partial-emit callback (``base.PartialEmit``): ``emit(lane_tag, tokens)``
    on each call, and the ``spec`` method an engine that speculates calls first, which keeps the
    lane's drafts so far this tick in ``counts`` for the TICK_EMIT that carries those tokens."""

    __slots__ = ("counts", "emit")

    def __init__(self, emit: Callable[[int, np.ndarray], None], counts: dict[int, tuple[int, int]]) -> None:
        self.emit = emit
        self.counts = counts

    def __call__(self, lane_tag: int, tokens: np.ndarray) -> None:
        self.emit(lane_tag, tokens)

    def spec(self, lane_tag: int, proposed: int, accepted: int) -> None:
        self.counts[lane_tag] = (proposed, accepted)


@dataclass
class InheritedRing:
    """One ring segment inherited from the coordinator (``--ring ID:KIND:FD:SLOTS:SLOT_BYTES``):
    ``segment`` is the attached memfd (``Segment.attach`` checked its size), the ring at offset 0."""

    ring_id: int
    kind: RingKind
    role: RingRole
    fd: int
    slots: int
    slot_bytes: int
    segment: Segment

    @property
    def length(self) -> int:
        """Bytes mapped (64 + slots * slot_bytes)."""
        return self.segment.length

    def spec(self) -> link.RingSpec:
        """The ring as the capability record reports it."""
        return link.RingSpec(
            ring_id=self.ring_id,
            kind=int(self.kind),
            role=int(self.role),
            slots=self.slots,
            slot_bytes=self.slot_bytes,
            length=self.length,
        )

    def mapping(self) -> RingMapping:
        """The ring as the engine sees it."""
        return RingMapping(
            ring_id=self.ring_id,
            kind=self.kind,
            role=self.role,
            slots=self.slots,
            slot_bytes=self.slot_bytes,
            buffer=self.segment.buffer,
            address=self.segment.address,
            length=self.length,
        )


class _LinkEnd(Exception):
    """Internal: stop the loop with ``code`` (after logging ``event``)."""

    def __init__(self, exit_code: ExitCode, event: str, **fields: Any) -> None:
        self.code = exit_code
        self.event = event
        self.fields = fields
        super().__init__(event)


@dataclass
class _PendingOp:
    seq: int
    has_output: bool


class LinkServer:
    """Serves Link W for one engine until SHUTDOWN, a stop signal, an orphaning, an engine FATAL
    or a link failure (see the module docstring).

    ``engine``: a loaded ``Engine`` (closed by ``run`` on exit). ``endpoint``: the coordinator's
    zmq endpoint (``ipc://...``). ``rings``: the inherited ring segments (closed on exit).
    ``stop``: installed ``StopSignals``. ``parent_pid``: the coordinator's pid. ``log``: a bound
    structlog logger. ``context``: a zmq context (a private one by default)."""

    def __init__(
        self,
        engine: Engine,
        *,
        endpoint: str,
        worker_id: int,
        parent_pid: int,
        rings: Sequence[InheritedRing],
        stop: StopSignals,
        log: Any,
        context: zmq.Context | None = None,
        emit_window_s: float = EMIT_WINDOW_S,
        strategies: Sequence[link.StrategyOffer] = (),
    ) -> None:
        self.engine = engine
        self.emit_window_s = emit_window_s
        self.strategies = list(strategies)  # registered at load (``basertd.worker.strategies``)
        self._emit_buf: dict[int, list[np.ndarray]] = {}
        self._emit_spec: dict[int, tuple[int, int]] = {}  # lane -> drafts (proposed, accepted) this tick
        self._partial_emits = _PartialEmits(self._on_partial_emit, self._emit_spec)
        self._last_flush = 0.0
        self.endpoint = endpoint
        self.worker_id = worker_id
        self.parent_pid = parent_pid
        self.rings = list(rings)
        self.stop = stop
        self.log = log
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sock: zmq.Socket | None = None
        self.codec = LinkCodec()
        self._seq = 0
        self._queue: deque[tuple[link.Envelope, Any]] = deque()
        self._ops: dict[int, _PendingOp] = {}
        self._in_tick = False
        self._tick_seq = 0
        self._tick_plan_seq = 0
        self._mid_tick_error: _LinkEnd | None = None
        self.ticks_run = 0
        self.last_plan_seq = 0
        self._last_mem = link.MemCounters()
        self._last_stats: dict[str, int] = {}
        self._draining = False
        self._drain_corr: int | None = None
        self._last_parent_check = 0.0
        self._handlers: dict[MsgType, Callable[[link.Envelope, Any], Any]] = {
            MsgType.RINGS_ATTACH: self._on_rings_attach,
            MsgType.TICK_SUBMIT: self._on_tick,
            MsgType.MATCH: self._on_match,
            MsgType.SEED_ACQUIRE: self._on_seed_acquire,
            MsgType.SEED_RELEASE: self._on_seed_release,
            MsgType.SEED_ADOPT: self._on_seed_adopt,
            MsgType.STATE_OP: self._on_state_op,
            MsgType.STATE_OP_CANCEL: self._on_state_op_cancel,
            MsgType.CACHE_EVICT: self._on_cache_evict,
            MsgType.CACHE_EVICT_ENTRIES: self._on_cache_evict_entries,
            MsgType.GRAMMAR_CREATE: self._on_grammar_create,
            MsgType.GRAMMAR_FREE: self._on_grammar_free,
            MsgType.LOGIT_BIAS_CREATE: self._on_logit_bias_create,
            MsgType.LOGIT_BIAS_FREE: self._on_logit_bias_free,
            MsgType.TOKENIZE: self._on_tokenize,
            MsgType.DETOKENIZE: self._on_detokenize,
            MsgType.EMBED: self._on_embed,
            MsgType.EMBED_CANCEL: self._on_embed_cancel,
            MsgType.SCORE: self._on_score,
            MsgType.PING: self._on_ping,
            MsgType.DRAIN: self._on_drain,
            MsgType.SHUTDOWN: self._on_shutdown,
        }

    # -- socket ----------------------------------------------------------------------------------

    def _send(self, msg: Any, corr: int = 0) -> None:
        self._seq += 1
        try:
            frames = self.codec.encode(msg, self._seq, corr)
        except FrameError as exc:
            # Our own message does not fit the wire (e.g. an engine value out of range): refuse
            # the request instead of dying.
            self.log.error("encode_failed", msg_type=type(msg).__name__, code=int(exc.code), reason=str(exc))
            frames = self.codec.encode(
                link.Error(status=Status.ERR_FATAL, message=f"reply not encodable: {exc}"), self._seq, corr
            )
        assert self._sock is not None
        try:
            self._sock.send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:
            raise _LinkEnd(ExitCode.LINK, "link_send_failed", reason=str(exc)) from None

    def _receive_ready(self, answer_pings: bool = False) -> None:
        """Move every frame already on the socket into the queue (decoded). With
        ``answer_pings`` (mid-tick), PINGs are answered at once instead of queued."""
        assert self._sock is not None
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                raise _LinkEnd(ExitCode.LINK, "link_recv_failed", reason=str(exc)) from None
            try:
                env, body = self.codec.decode(frames)
            except FrameError as exc:
                raise _LinkEnd(
                    ExitCode.LINK,
                    "link_frame_error",
                    code=int(exc.code),
                    code_name=exc.code.name,
                    reason=str(exc),
                ) from None
            if answer_pings and env.msg_type == MsgType.PING:
                self._send(self._pong(), env.seq)
            else:
                self._queue.append((env, body))

    # -- the loop --------------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until told to stop; returns the exit code. Releases the engine, the rings, the
        socket and the zmq context on every path."""
        code = ExitCode.OK
        linger = FLUSH_LINGER_MS
        try:
            self._sock = self._ctx.socket(zmq.PAIR)
            self._sock.setsockopt(zmq.MAXMSGSIZE, max(MAX_FRAME_BYTES, MAX_SIDE_BYTES))
            self._sock.setsockopt(zmq.SNDHWM, 0)
            self._sock.setsockopt(zmq.RCVHWM, 0)
            self._sock.connect(self.endpoint)
            self._send(
                link.Hello(
                    min_version=link.MIN_PROTOCOL_VERSION,
                    max_version=link.PROTOCOL_VERSION,
                    worker_id=self.worker_id,
                    pid=os.getpid(),
                )
            )
            self.log.info("link_hello", endpoint=self.endpoint)
            self._loop()
            self.log.info("worker_exit", reason=self.stop.signal_name or "shutdown", ticks=self.ticks_run)
        except _LinkEnd as end:
            code = end.code
            level = "info" if end.code == ExitCode.OK else "error"
            getattr(self.log, level)(end.event, exit_code=int(end.code), **end.fields)
            if end.code == ExitCode.LINK:
                linger = 0
        except Exception as exc:  # a worker bug: one log line, never a traceback
            code = ExitCode.ENGINE_FATAL
            self.log.error(
                "worker_internal_error", exit_code=int(code), error=type(exc).__name__, reason=str(exc)
            )
        finally:
            self._close(linger)
        return int(code)

    def _loop(self) -> None:
        assert self._sock is not None
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self.stop.wakeup_fd, zmq.POLLIN)
        while True:
            if self.stop.requested:
                self.log.info("stop_signal", signal=self.stop.signal_name)
                return
            self._check_parent()
            if not self._queue:
                timeout = OP_POLL_S if self._ops else PARENT_CHECK_S
                events = dict(poller.poll(int(timeout * 1000)))
                if self.stop.wakeup_fd in events:
                    self.stop.drain()
                if self._sock in events:
                    self._receive_ready()
                if self._ops:
                    self._poll_ops()
                continue
            env, body = self._queue.popleft()
            if self.codec.version is None:
                self._handshake_step(env, body)
                continue
            if env.msg_type == MsgType.SHUTDOWN:
                self.log.info("shutdown_requested", reason=body.reason)
                return
            self._serve(env, body)
            if self._ops:
                self._poll_ops()

    def _check_parent(self) -> None:
        now = time.monotonic()
        if now - self._last_parent_check < PARENT_CHECK_S:
            return
        self._last_parent_check = now
        if not parent_alive(self.parent_pid):
            raise _LinkEnd(ExitCode.OK, "parent_gone", parent_pid=self.parent_pid)

    def _handshake_step(self, env: link.Envelope, body: Any) -> None:
        if env.msg_type == MsgType.ERROR:
            raise _LinkEnd(ExitCode.LINK, "handshake_refused", status=body.status, reason=body.message)
        if env.msg_type != MsgType.WELCOME:
            raise _LinkEnd(ExitCode.LINK, "handshake_violation", msg_type=int(env.msg_type))
        if not link.MIN_PROTOCOL_VERSION <= body.version <= link.PROTOCOL_VERSION:
            raise _LinkEnd(ExitCode.LINK, "handshake_bad_version", version=body.version)
        self.codec.version = body.version
        self._send(self._capabilities(), env.seq)
        self.log.info("link_welcome", link_version=body.version)

    def _capabilities(self) -> link.Capabilities:
        info = self.engine.info()
        return link.Capabilities(
            engine=info.engine,
            engine_version=info.engine_version,
            model=info.model,
            model_id=info.model_id,
            vocab_size=info.vocab_size,
            context_length=info.context_length,
            max_lanes=info.max_lanes,
            max_batch_size=info.max_batch_size,
            page_size_tokens=info.page_size_tokens,
            pool_bytes=info.pool_bytes,
            seed_lease_ticks=info.seed_lease_ticks,
            eos_token_ids=list(info.eos_token_ids),
            bos_token_id=info.bos_token_id,
            add_bos=info.add_bos,
            tokenizer=link.TokenizerDesc(kind=info.tokenizer.kind, path=info.tokenizer.path),
            state_spaces=self.engine.state_spaces(),
            rings=[r.spec() for r in self.rings],
            extra=dict(info.extra),
            strategies=self.strategies,
        )

    def _serve(self, env: link.Envelope, body: Any) -> None:
        handler = self._handlers.get(env.msg_type)
        if handler is None:
            name = env.msg_type.name if isinstance(env.msg_type, MsgType) else str(env.msg_type)
            raise _LinkEnd(ExitCode.LINK, "link_unexpected_message", msg_type=int(env.msg_type), name=name)
        try:
            reply = handler(env, body)
        except _LinkEnd:
            raise
        except EngineFatal as exc:
            self._send(link.Error(status=Status.ERR_FATAL, message=str(exc)), env.seq)
            raise _LinkEnd(ExitCode.ENGINE_FATAL, "engine_fatal", reason=str(exc)) from None
        except (EngineError, RingError) as exc:
            status = int(exc.status)
            reply = link.Error(status=status, message=str(exc))
        except (ValueError, TypeError, OverflowError) as exc:
            reply = link.Error(status=Status.REJECT_BOUNDS, message=f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            self.log.error(
                "handler_failed", msg_type=int(env.msg_type), error=type(exc).__name__, reason=str(exc)
            )
            reply = link.Error(status=Status.ERR_FATAL, message=f"worker error {type(exc).__name__}: {exc}")
        if reply is not None:
            self._send(reply, env.seq)

    # -- tick ------------------------------------------------------------------------------------

    def _on_partial_emit(self, lane_tag: int, tokens: np.ndarray) -> None:
        # Runs inside engine.tick on this thread; it must not raise into the engine.
        if self._mid_tick_error is not None:
            return
        try:
            # A copy: the engine's array may alias memory it rewrites.
            self._emit_buf.setdefault(lane_tag, []).append(
                np.array(tokens, dtype=np.uint32, copy=True).reshape(-1)
            )
            now = time.monotonic()
            if now - self._last_flush < self.emit_window_s:
                return
            self._last_flush = now
            for tag, parts in self._emit_buf.items():
                toks = parts[0] if len(parts) == 1 else np.concatenate(parts)
                drafted, taken = self._emit_spec.get(tag, (0, 0))
                emit = link.TickEmit(
                    plan_seq=self._tick_plan_seq, lane_tag=tag, tokens=toks, proposed=drafted, accepted=taken
                )
                self._send(emit, self._tick_seq)
            self._emit_buf.clear()
            self._receive_ready(answer_pings=True)
            if self._queue and any(env.msg_type == MsgType.PING for env, _ in self._queue):
                pings = [env.seq for env, _ in self._queue if env.msg_type == MsgType.PING]
                self._queue = deque(item for item in self._queue if item[0].msg_type != MsgType.PING)
                for seq in pings:
                    self._send(self._pong(), seq)
        except _LinkEnd as end:
            self._mid_tick_error = end
        except Exception as exc:
            self._mid_tick_error = _LinkEnd(ExitCode.LINK, "partial_emit_failed", error=type(exc).__name__)

    def _on_tick(self, env: link.Envelope, plan: TickPlan) -> Any:
        if self._draining and plan.admits:
            return link.TickRejected(
                plan_seq=plan.plan_seq,
                status=Status.REJECT_ILLEGAL_COMBINATION,
                message="the worker is draining: no admits",
            )
        streaming = bool(plan.flags & TickFlag.PARTIAL_EMITS)
        self._in_tick = True
        self._tick_seq = env.seq
        self._tick_plan_seq = plan.plan_seq
        self._mid_tick_error = None
        self._last_flush = time.monotonic()
        try:
            events = self.engine.tick(plan, self._partial_emits if streaming else None)
        except PlanRejected as exc:
            return link.TickRejected(plan_seq=plan.plan_seq, status=int(exc.status), message=exc.message)
        finally:
            self._in_tick = False
            self._emit_buf.clear()  # not yet streamed: the result carries them
            self._emit_spec.clear()
        if self._mid_tick_error is not None:
            raise self._mid_tick_error
        self.ticks_run += 1
        self.last_plan_seq = plan.plan_seq
        self._last_mem = events.mem
        self._send(events, env.seq)
        if self._draining and self._drain_corr is not None:
            self._maybe_drained()
        return None

    # -- state ops -------------------------------------------------------------------------------

    def _on_state_op(self, env: link.Envelope, op: Any) -> Any:
        e = self.engine
        if isinstance(op, link.OpExportSize):
            required, gen = e.export_size(op.seq, op.space_id, op.range, op.encoding)
            return link.StateOpAccepted(value=required, sizing_gen=gen)
        if isinstance(op, link.OpSnapshot):
            handle = e.snapshot(op.seq, op.space_id, op.boundary_pos, op.sizing_gen, op.dst_bytes)
            return self._track(handle, env.seq, True)
        if isinstance(op, link.OpRestore):
            return self._track(e.restore(op.seq, op.space_id, op.data.tobytes()), env.seq, False)
        if isinstance(op, link.OpDemote):
            handle = e.demote(op.seq, op.space_id, op.range, op.encoding, op.sizing_gen, op.dst_bytes)
            return self._track(handle, env.seq, True)
        if isinstance(op, link.OpPromote):
            return self._track(e.promote(op.seq, op.space_id, op.range, op.data.tobytes()), env.seq, False)
        if isinstance(op, link.OpTrim):
            e.trim(op.seq, op.space_id, op.new_len)
            return link.StateOpAccepted()
        if isinstance(op, link.OpSnapshotBoundary):
            return link.StateOpAccepted(value=e.snapshot_boundary(op.seq, op.space_id, op.cap))
        if isinstance(op, link.OpFork):
            return link.StateOpAccepted(value=e.seq_fork(op.parent, op.flags))
        if isinstance(op, link.OpLaneSequence):
            seq = e.lane_sequence(op.lane_tag)
            return link.StateOpAccepted(value=0 if seq is None else seq)
        if isinstance(op, link.OpSequenceCreate):
            return link.StateOpAccepted(value=e.sequence_create())
        if isinstance(op, link.OpSequenceFree):
            e.sequence_free(op.seq)
            return link.StateOpAccepted()
        if isinstance(op, link.OpSequencePublish):
            e.sequence_publish(op.seq, op.tokens)
            return link.StateOpAccepted()
        raise TypeError(f"unknown state op {type(op).__name__}")

    def _track(self, handle: int, seq: int, has_output: bool) -> link.StateOpAccepted:
        self._ops[handle] = _PendingOp(seq, has_output)
        return link.StateOpAccepted(op=handle)

    def _poll_ops(self) -> None:
        for handle, pending in list(self._ops.items()):
            try:
                st = self.engine.op_poll(handle)
            except EngineFatal:
                raise
            except EngineError as exc:
                del self._ops[handle]
                self._send(
                    link.StateOpDone(op=handle, state=OpState.FAILED, error=int(exc.status)), pending.seq
                )
                continue
            if st.state not in _TERMINAL:
                continue
            del self._ops[handle]
            data = None
            if pending.has_output and st.state == OpState.DONE:
                data = np.frombuffer(self.engine.op_output(handle), dtype=np.uint8)
            self._send(
                link.StateOpDone(
                    op=handle, state=st.state, error=st.error, bytes_moved=st.bytes_moved, data=data
                ),
                pending.seq,
            )

    def _on_state_op_cancel(self, env: link.Envelope, msg: link.StateOpCancel) -> Any:
        self.engine.op_cancel(msg.op)
        return link.Ok()

    # -- cache, seeds ----------------------------------------------------------------------------

    def _on_match(self, env: link.Envelope, msg: link.Match) -> Any:
        return self.engine.space_match(msg.space_id, msg.span)

    def _grant(self, handle: int) -> link.SeedGrant:
        return link.SeedGrant(
            seed_handle=handle, lease_ticks=self.engine.seed_lease_ticks(), tick=self.ticks_run
        )

    def _on_seed_acquire(self, env: link.Envelope, msg: link.SeedAcquire) -> Any:
        return self._grant(self.engine.seed_acquire(msg.span, msg.prefix_len, msg.determinism_class))

    def _on_seed_release(self, env: link.Envelope, msg: link.SeedRelease) -> Any:
        self.engine.seed_release(msg.seed_handle)
        return link.Ok()

    def _on_seed_adopt(self, env: link.Envelope, msg: link.SeedAdopt) -> Any:
        return self._grant(self.engine.seed_adopt(msg.seq, msg.span))

    def _on_cache_evict(self, env: link.Envelope, msg: link.CacheEvict) -> Any:
        return link.CacheEvicted(bytes_freed=self.engine.cache_evict(msg.policy, msg.bytes_target))

    def _on_cache_evict_entries(self, env: link.Envelope, msg: link.CacheEvictEntries) -> Any:
        self.engine.cache_evict_entries(msg.keys)
        return link.Ok()

    # -- grammar, bias, vocabulary ---------------------------------------------------------------

    def _on_grammar_create(self, env: link.Envelope, msg: link.GrammarCreate) -> Any:
        return link.GrammarCreated(handle=self.engine.grammar_create(msg.json_schema, msg.kind))

    def _on_grammar_free(self, env: link.Envelope, msg: link.GrammarFree) -> Any:
        self.engine.grammar_free(msg.handle)
        return link.Ok()

    def _on_logit_bias_create(self, env: link.Envelope, msg: link.LogitBiasCreate) -> Any:
        if len(msg.tokens) != len(msg.values):
            raise ValueError(f"{len(msg.tokens)} tokens but {len(msg.values)} values")
        handle = self.engine.logit_bias_create(msg.tokens.tolist(), msg.values.tolist())
        return link.LogitBiasCreated(handle=handle)

    def _on_logit_bias_free(self, env: link.Envelope, msg: link.LogitBiasFree) -> Any:
        self.engine.logit_bias_free(msg.handle)
        return link.Ok()

    def _on_tokenize(self, env: link.Envelope, msg: link.Tokenize) -> Any:
        return link.TokenizeResult(tokens=self.engine.tokenize(msg.text, msg.add_special))

    def _on_detokenize(self, env: link.Envelope, msg: link.Detokenize) -> Any:
        return link.DetokenizeResult(text=bytes(self.engine.detokenize(msg.tokens.tolist())))

    def _on_embed(self, env: link.Envelope, msg: link.Embed) -> Any:
        if int(msg.lengths.sum(dtype=np.uint64)) != len(msg.tokens):
            raise ValueError(f"lengths sum to {int(msg.lengths.sum())} but {len(msg.tokens)} tokens came")
        if msg.input_id:
            if len(msg.lengths) != 1:
                raise ValueError(f"a chunk of input {msg.input_id} holds {len(msg.lengths)} inputs, not 1")
            vector = self.engine.embed_chunk(msg.input_id, msg.chunk, msg.tokens, msg.last)
            if vector is None:
                return link.EmbedResult()
            return link.EmbedResult(dim=int(vector.shape[0]), values=vector)
        inputs = np.split(msg.tokens, np.cumsum(msg.lengths)[:-1]) if len(msg.lengths) else []
        vectors = self.engine.embed(inputs)
        return link.EmbedResult(dim=int(vectors.shape[1]), values=vectors.reshape(-1))

    def _on_embed_cancel(self, env: link.Envelope, msg: link.EmbedCancel) -> Any:
        self.engine.embed_cancel(msg.input_id)
        return link.Ok()

    def _on_score(self, env: link.Envelope, msg: link.Score) -> Any:
        s = self.engine.score(msg.tokens, msg.top_k)
        return link.ScoreResult(
            top_k=msg.top_k,
            logprobs=s.logprobs,
            top_ids=s.top_ids.reshape(-1),
            top_logprobs=s.top_logprobs.reshape(-1),
        )

    # -- rings -----------------------------------------------------------------------------------

    def _on_rings_attach(self, env: link.Envelope, msg: link.RingsAttach) -> Any:
        by_fd = {r.fd: r for r in self.rings}
        chosen: list[InheritedRing] = []
        for spec in msg.rings:
            ring = by_fd.get(spec.fd)
            if ring is None:
                return link.RingsAttached(
                    status=Status.ERR_RING_LAYOUT, message=f"fd {spec.fd} is not an inherited ring segment"
                )
            want = (ring.ring_id, int(ring.kind), int(ring.role), ring.slots, ring.slot_bytes, ring.length, 0)
            got = (spec.ring_id, spec.kind, spec.role, spec.slots, spec.slot_bytes, spec.length, spec.offset)
            if want != got:
                return link.RingsAttached(
                    status=Status.ERR_RING_LAYOUT,
                    message=f"ring on fd {spec.fd}: attach spec {got} does not match the command line {want}",
                )
            chosen.append(ring)
        try:
            self.engine.attach_rings([r.mapping() for r in chosen])
        except EngineFatal:
            raise
        except EngineError as exc:
            return link.RingsAttached(status=int(exc.status), message=str(exc))
        self.log.info("rings_attached", rings=[r.ring_id for r in chosen])
        return link.RingsAttached(status=Status.OK)

    # -- liveness, lifecycle ---------------------------------------------------------------------

    def _pong(self) -> link.Pong:
        if not self._in_tick:
            self._last_stats = {k: int(v) for k, v in self.engine.stats().items()}
        stats = self._last_stats
        return link.Pong(
            queue_depth=len(self._queue),
            ticks_run=self.ticks_run,
            last_plan_seq=self.last_plan_seq,
            lanes_active=int(stats.get("live_lanes", 0)),
            tick_in_flight=self._in_tick,
            mem=self._last_mem,
            stats=dict(stats),
        )

    def _on_ping(self, env: link.Envelope, msg: link.Ping) -> Any:
        return self._pong()

    def _on_drain(self, env: link.Envelope, msg: link.Drain) -> Any:
        self._draining = True
        self._drain_corr = env.seq
        self.log.info("drain_requested")
        self._maybe_drained()
        return None

    def _maybe_drained(self) -> None:
        lanes = int(self.engine.stats().get("live_lanes", 0))
        if lanes == 0 and self._drain_corr is not None:
            corr, self._drain_corr = self._drain_corr, None
            self._send(link.Drained(lanes_active=0), corr)
            self.log.info("drained")

    def _on_shutdown(self, env: link.Envelope, msg: link.Shutdown) -> Any:  # handled by the loop
        return None

    def _close(self, linger_ms: int) -> None:
        try:
            self.engine.close()
        except Exception as exc:
            self.log.error("engine_close_failed", error=type(exc).__name__, reason=str(exc))
        for ring in self.rings:
            ring.segment.close()
        if self._sock is not None:
            self._sock.close(linger=linger_ms)
        if self._own_ctx:
            self._ctx.term()
