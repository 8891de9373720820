"""The coordinator's end of Link W: one ``WorkerLink`` per engine worker (DESIGN.md "Link W").

A ``WorkerLink`` speaks to one ``basertd-worker`` over a zmq PAIR socket from the coordinator's
asyncio event loop. It owns that socket; the process itself (spawn, pidfd, teardown) belongs to
``basertd.server.workers.process``, which hands the link the child's pidfd.

What it does:

- **Handshake** (``handshake``): wait for HELLO, answer WELCOME with ``negotiate()``'s version
  (or ERROR and fail), read CAPABILITIES, send RINGS_ATTACH, expect RINGS_ATTACHED(OK).
- **Requests** (``request`` and the thin wrappers): each request gets the next envelope ``seq``;
  the worker's reply carries it back in ``corr`` and resolves that request's future. An ERROR
  reply raises ``WorkerError`` (``status`` an ABI ``Status``); a reply of a type the catalog does
  not allow for the request (``REPLIES``) is a protocol error.
- **Ticks** (``tick``): exactly one plan in flight per worker (a second ``tick`` while one is
  pending raises ``TickInFlight``). TICK_EMIT frames of the plan are delivered to ``on_emit`` as
  they arrive, before the result; TICK_REJECTED raises ``PlanRejected`` (the engine changed
  nothing); the result's ``plan_seq`` must echo the plan's (ABI rule 55).
- **State ops**: STATE_OP answers STATE_OP_ACCEPTED at once; the op's STATE_OP_DONE arrives later
  and is collected with ``op_done(op)``.
- **Peer death**: the worker's pidfd and the socket are watched by the same event loop. When the
  pidfd turns readable (the process exited, for any reason, SIGKILL included) the link first
  dispatches every frame already queued on the socket (so a result the worker sent before dying
  is not lost), then fails every pending call with ``WorkerDied``. No timeout or heartbeat is
  involved: the notice takes one loop iteration.
- **Protocol errors**: any frame the codec refuses (``FrameError``), an unexpected reply type or a
  result that does not echo its plan ends the link: pending calls and every later call raise
  ``LinkProtocolError``; the supervisor then treats the worker as dead.

Why plain ``zmq.Socket`` + ``loop.add_reader`` rather than ``zmq.asyncio.Socket``: the zmq socket's
FD is edge-style (it signals "look at ZMQ_EVENTS"), which is exactly what zmq.asyncio wraps with
``add_reader``. Doing it here in one synchronous callback lets the pidfd callback drain the socket
before failing pending calls, with no second ``recv`` racing a cancelled one, and costs one
callback per burst of frames instead of a future per frame.

The errors live in ``basertd.server.workers.link_errors`` (import them from there); what the link waits
for (request replies, the tick in flight and its emits, state ops' ends) and the frames that
answer it in ``basertd.server.workers.link_replies``. Everything runs on one event loop thread;
a link is not thread-safe. ``basertd.server.workers.sync_worker.SyncWorker`` is a small blocking
wrapper for tests and benches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog
import zmq

from basertd.schema import link
from basertd.schema.abi import Status
from basertd.schema.codec import MAX_FRAME_BYTES, MAX_SIDE_BYTES, FrameError, LinkCodec
from basertd.schema.link import MsgType
from basertd.schema.tick import MatchResult, ShedPolicy, TickEvents, TickPlan, TokenRef
from basertd.server.workers.link_errors import (
    EmitCallbackError,
    LinkClosed,
    LinkError,
    LinkProtocolError,
    LinkTimeout,
    MessageNotEncodable,
    PlanRejected,
    TickInFlight,
    WorkerDied,
    WorkerError,
)
from basertd.server.workers.link_replies import EmitCallback, Replies, TickWait

__all__ = ["MAX_LINK_MESSAGE_BYTES", "WorkerLink", "configure_link_socket"]

log = structlog.get_logger("basertd.link")

MAX_LINK_MESSAGE_BYTES = max(MAX_FRAME_BYTES, MAX_SIDE_BYTES)
"""zmq ``MAXMSGSIZE`` of both ends (bytes): the largest frame the codec accepts (a 1 GiB side frame
of a sealed state export). zmq drops a peer that sends a bigger frame before it is buffered."""

_BURST = 256  # frames dispatched per loop callback before yielding to other tasks


def configure_link_socket(sock: zmq.Socket) -> None:
    """Socket options both ends of Link W use: ``MAXMSGSIZE`` = ``MAX_LINK_MESSAGE_BYTES``;
    ``LINGER`` 0 (a closed link drops unsent frames: the peer is gone or being torn down);
    high-water marks 0, because the protocol bounds what is queued (one plan in flight, its
    emits, and replies to requests) and a full PAIR queue would block the single-threaded worker
    mid-tick."""
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_LINK_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


# --- the link -----------------------------------------------------------------------------------


class WorkerLink:
    """One Link W connection to one worker, driven by the running asyncio loop.

    ``sock``: a connected-or-bound zmq PAIR socket (the link owns it from now on and closes it in
    ``close``). ``pid`` / ``pidfd``: the worker process and its pidfd (``os.pidfd_open``), watched
    for exit; the link does not close the pidfd. ``exit_status()``: returns the worker's return
    code once it has exited (``Popen.poll``), used in ``WorkerDied``. ``worker_id``: the id the
    worker must announce in HELLO.

    Call ``handshake`` first (it arms the loop callbacks). Every coroutine raises ``LinkClosed``,
    ``WorkerDied`` or ``LinkProtocolError`` once the link is dead, ``LinkTimeout`` when a
    ``timeout`` (seconds) expires, and ``WorkerError`` for an ERROR reply.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        *,
        pid: int | None = None,
        pidfd: int | None = None,
        exit_status: Callable[[], int | None] | None = None,
        worker_id: int = 0,
    ) -> None:
        self._sock = sock
        self._fd = sock.getsockopt(zmq.FD)
        self.pid = pid
        self._pidfd = pidfd
        self._exit_status = exit_status
        self.worker_id = worker_id
        self.codec = LinkCodec()
        self.version: int | None = None
        self.capabilities: link.Capabilities | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._seq = 0
        self._log = log.bind(worker_id=worker_id, pid=pid)
        self._replies = Replies(self._log)
        self.died_in_tick = False
        """Set when the link failed: True when a plan sent by ``tick`` had no result yet (the
        death is charged to that tick's requests, ``basertd.server.workers.slot``)."""
        self._hello: asyncio.Future | None = None
        self._error: LinkError | None = None
        self._dead: asyncio.Future | None = None
        self._armed = False
        self._check_scheduled = False
        self._last_worker_error: link.Error | None = None
        self._shutdown_sent = False
        self._handlers: dict[MsgType, Callable[[link.Envelope, Any], None]] = {
            MsgType.TICK_EMIT: self._replies.on_tick_emit,
            MsgType.STATE_OP_DONE: self._replies.on_op_done,
            MsgType.HELLO: self._on_hello,
            MsgType.ERROR: self._on_error,
        }
        """The handler of each message type the worker may send unasked; any other is a reply."""

    # -- state ---------------------------------------------------------------------------------

    @property
    def error(self) -> LinkError | None:
        """Why the link is dead (``WorkerDied``, ``LinkProtocolError``, ``LinkClosed``), or None."""
        return self._error

    @property
    def alive(self) -> bool:
        """True until the link fails or is closed."""
        return self._error is None

    @property
    def tick_in_flight(self) -> bool:
        """True while a plan sent by ``tick`` has no result yet (even after its caller timed out)."""
        return self._replies.tick is not None

    async def wait_dead(self) -> LinkError:
        """Wait until the link fails or is closed and return why (never raises it)."""
        self._arm()
        assert self._dead is not None
        return await asyncio.shield(self._dead)

    # -- loop integration ------------------------------------------------------------------------

    def _arm(self) -> None:
        if self._armed:
            return
        if self._error is not None:
            raise self._error
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._dead = loop.create_future()
        self._hello = loop.create_future()
        loop.add_reader(self._fd, self._on_readable)
        if self._pidfd is not None:
            loop.add_reader(self._pidfd, self._on_peer_exit)
        self._armed = True
        self._schedule_check()

    def _disarm(self) -> None:
        if not self._armed or self._loop is None:
            return
        self._armed = False
        self._loop.remove_reader(self._fd)
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)

    def _schedule_check(self) -> None:
        # After any send the zmq FD may have been reset without its pending input being read;
        # look at ZMQ_EVENTS once more from the loop.
        if not self._check_scheduled and self._loop is not None:
            self._check_scheduled = True
            self._loop.call_soon(self._on_readable)

    def _on_readable(self) -> None:
        self._check_scheduled = False
        sock = self._sock
        for _ in range(_BURST):
            if self._error is not None:
                return
            try:
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                self._fail(LinkProtocolError(f"receive failed: {exc}"))
                return
            self._dispatch(frames)
        self._schedule_check()  # more may be queued: continue after other callbacks had a turn

    def _on_peer_exit(self) -> None:
        # Dispatch what the worker sent before it died, then fail whatever is still pending.
        while self._error is None:
            try:
                if not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    break
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:
                break
            self._dispatch(frames)
        if self._error is not None:
            return
        code = self._exit_status() if self._exit_status is not None else None
        detail = ""
        if self._last_worker_error is not None:
            detail = f"last error {self._last_worker_error.message or self._last_worker_error.status}"
        self._fail(WorkerDied(self.pid, code, detail))

    def _fail(self, error: LinkError) -> None:
        if self._error is not None:
            return
        self._error = error
        if self._shutdown_sent and isinstance(error, WorkerDied) and error.returncode == 0:
            # The worker did what SHUTDOWN asked: a clean exit, not a death.
            self._log.info("link_closed", reason="the worker exited after shutdown (exit code 0)")
        elif isinstance(error, LinkClosed):
            self._log.info("link_closed", reason=str(error))
        else:
            self._log.warning("link_down", error=type(error).__name__, reason=str(error))
        self._disarm()
        self.died_in_tick = self._replies.fail(error)
        if self._hello is not None and not self._hello.done():
            self._hello.set_exception(error)
        if self._dead is not None and not self._dead.done():
            self._dead.set_result(error)
        if self._hello is not None and not self._hello.cancelled():
            self._hello.exception()  # nobody may await it any more: mark it retrieved

    # -- receive ---------------------------------------------------------------------------------

    def _dispatch(self, frames: list) -> None:
        """Decode one frame and hand it to the handler of its message type (``_handlers``): the
        frames the worker sends unasked (TICK_EMIT, STATE_OP_DONE, HELLO, an ERROR with corr 0)
        have one each; every other frame is a reply (``_on_reply``)."""
        try:
            env, body = self.codec.decode(frames)
        except FrameError as exc:
            self._log.error("link_frame_error", code=int(exc.code), code_name=exc.code.name, reason=str(exc))
            self._fail(LinkProtocolError(f"undecodable frame from the worker: {exc}", int(exc.code)))
            return
        self._handlers.get(env.msg_type, self._on_reply)(env, body)

    def _on_hello(self, env: link.Envelope, body: link.Hello) -> None:
        if self._hello is not None and not self._hello.done():
            self._hello.set_result(body)
        else:
            self._fail(LinkProtocolError("HELLO after the handshake"))

    def _on_error(self, env: link.Envelope, body: link.Error) -> None:
        if env.corr != 0:  # the answer to a request
            self._on_reply(env, body)
            return
        self._last_worker_error = body
        self._log.warning("worker_error", status=body.status, reason=body.message)

    def _on_reply(self, env: link.Envelope, body: Any) -> None:
        """Resolve the pending request (or the tick in flight) that ``env.corr`` answers
        (``Replies.on_reply``); a result that does not echo its plan ends the link."""
        error = self._replies.on_reply(env, body)
        if error is not None:
            self._fail(error)

    # -- send ------------------------------------------------------------------------------------

    def _send(self, msg: Any, corr: int = 0) -> int:
        if self._error is not None:
            raise self._error
        seq = self._seq + 1
        try:
            frames = self.codec.encode(msg, seq, corr)
        except FrameError as exc:
            raise MessageNotEncodable(f"cannot encode {type(msg).__name__}: {exc}") from None
        self._seq = seq
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            err = LinkProtocolError(f"send failed: {exc}")
            self._fail(err)
            raise err from None
        self._schedule_check()
        return seq

    async def _await(self, fut: asyncio.Future, timeout: float | None) -> tuple:
        if timeout is None:
            return await fut
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise LinkTimeout(f"no reply within {timeout} s") from None

    async def _roundtrip(self, msg: Any, timeout: float | None) -> tuple:
        self._arm()
        if self.version is None:
            raise LinkError("handshake() has not completed")
        assert self._loop is not None
        fut = self._loop.create_future()
        seq = self._send(msg)
        self._replies.pending[seq] = fut
        try:
            return await self._await(fut, timeout)
        finally:
            self._replies.forget(seq, fut)

    # -- handshake -------------------------------------------------------------------------------

    async def handshake(
        self, rings: list[link.RingAttachSpec], *, timeout: float | None = 60.0
    ) -> link.Capabilities:
        """Run the handshake (DESIGN.md "Link W"): HELLO in, WELCOME out, CAPABILITIES in,
        RINGS_ATTACH out, RINGS_ATTACHED(OK) in. ``rings`` are the rings as the worker sees them
        (its inherited fd numbers). ``timeout`` (seconds) bounds the whole handshake, model loading
        included. Returns the capability record (also kept in ``capabilities``).

        Raises ``LinkProtocolError`` (no common version, wrong worker id, rings that do not match
        what the worker reports, a bad frame), ``WorkerError`` (RINGS_ATTACHED with a failure
        status, e.g. ERR_RING_LAYOUT), ``WorkerDied`` (e.g. the model could not load: exit 3),
        ``LinkTimeout``."""
        self._arm()
        if self.version is not None:
            raise LinkError("handshake() already completed")
        assert self._hello is not None and self._loop is not None
        deadline = None if timeout is None else self._loop.time() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - self._loop.time())

        try:
            hello: link.Hello = await asyncio.wait_for(asyncio.shield(self._hello), left())
        except TimeoutError:
            raise LinkTimeout(f"no HELLO within {timeout} s") from None
        if hello.worker_id != self.worker_id or (self.pid is not None and hello.pid != self.pid):
            err = LinkProtocolError(
                f"HELLO from worker {hello.worker_id} pid {hello.pid}, "
                f"expected worker {self.worker_id} pid {self.pid}"
            )
            self._fail(err)
            raise err
        try:
            version = link.negotiate(hello.min_version, hello.max_version)
        except FrameError as exc:
            self._send(link.Error(status=Status.ERR_FATAL, message=str(exc)))
            err = LinkProtocolError(f"version negotiation failed: {exc}", int(exc.code))
            self._fail(err)
            raise err from None
        fut = self._loop.create_future()
        seq = self._send(link.Welcome(version=version))
        self._replies.pending[seq] = fut
        self.codec.version = version
        self.version = version
        self._log = self._replies.log = self._log.bind(link_version=version)
        env, caps, _ = await self._await(fut, left())
        if env.msg_type != MsgType.CAPABILITIES:
            self._protocol_violation(MsgType.WELCOME, env)
        reported = {(r.ring_id, r.kind, r.role, r.slots, r.slot_bytes, r.length) for r in caps.rings}
        wanted = {(r.ring_id, r.kind, r.role, r.slots, r.slot_bytes, r.length) for r in rings}
        if reported != wanted:
            err = LinkProtocolError(f"worker reports rings {sorted(reported)}, expected {sorted(wanted)}")
            self._fail(err)
            raise err
        env, attached, _ = await self._roundtrip(link.RingsAttach(rings=list(rings)), left())
        if env.msg_type == MsgType.ERROR:
            raise WorkerError(attached.status, attached.message)
        if env.msg_type != MsgType.RINGS_ATTACHED:
            self._protocol_violation(MsgType.RINGS_ATTACH, env)
        if attached.status != Status.OK:
            raise WorkerError(attached.status, attached.message)
        self.capabilities = caps
        self._log.info(
            "link_up",
            engine=caps.engine,
            model_id=caps.model_id,
            max_lanes=caps.max_lanes,
            vocab_size=caps.vocab_size,
        )
        return caps

    def _protocol_violation(self, request: MsgType, env: link.Envelope) -> None:
        got = env.msg_type.name if isinstance(env.msg_type, MsgType) else str(env.msg_type)
        err = LinkProtocolError(f"{request.name} answered with {got}")
        self._fail(err)
        raise err

    # -- requests --------------------------------------------------------------------------------

    async def request(self, msg: Any, *, timeout: float | None = None) -> Any:
        """Send one request (a Link W body whose type has an entry in ``link.REPLIES``) and
        return the reply body. Raises ``WorkerError`` for ERROR, ``LinkProtocolError`` for a
        reply type the catalog does not allow (the link is then dead), the link's errors and
        ``LinkTimeout``. Use ``tick`` for plans and ``shutdown`` for SHUTDOWN."""
        mt = link.msg_type_of(msg)
        if mt == MsgType.TICK_SUBMIT:
            raise TypeError("use tick() to submit plans")
        allowed = link.REPLIES.get(mt)
        if allowed is None:
            raise TypeError(f"{mt.name} is not a request with a reply")
        env, body, _ = await self._roundtrip(msg, timeout)
        if env.msg_type == MsgType.ERROR:
            raise WorkerError(body.status, body.message)
        if env.msg_type not in allowed:
            self._protocol_violation(mt, env)
        return body

    async def tick(
        self, plan: TickPlan, *, on_emit: EmitCallback | None = None, timeout: float | None = None
    ) -> TickEvents:
        """Submit one plan and return its events (``events.plan_seq == plan.plan_seq``, rule 55).

        With ``plan.flags & TickFlag.PARTIAL_EMITS`` the worker forwards the engine's partial
        emits as TICK_EMIT frames; each is passed to ``on_emit`` before this returns (the events'
        emits stay authoritative). Raises ``TickInFlight`` (another plan pending; nothing sent),
        ``PlanRejected`` (engine state unchanged), ``WorkerError`` (ERR_FATAL: the engine died
        and the worker exits 70), ``EmitCallbackError`` (``on_emit`` raised; the tick completed),
        ``WorkerDied``, ``LinkProtocolError``, ``LinkTimeout``."""
        self._arm()
        replies = self._replies
        if replies.tick is not None:
            raise TickInFlight(f"plan {replies.tick.plan_seq} has no result yet")
        if self.version is None:
            raise LinkError("handshake() has not completed")
        assert self._loop is not None
        fut = self._loop.create_future()
        seq = self._send(plan)
        replies.pending[seq] = fut
        replies.tick = TickWait(seq, plan.plan_seq, on_emit)
        try:
            env, body, tick = await self._await(fut, timeout)
        finally:
            replies.forget(seq, fut)
        mt = env.msg_type
        if mt == MsgType.TICK_RESULT:
            if tick is not None and tick.callback_error is not None:
                raise EmitCallbackError(body) from tick.callback_error
            return body
        if mt == MsgType.TICK_REJECTED:
            raise PlanRejected(body.status, body.message, plan_seq=body.plan_seq)
        if mt == MsgType.ERROR:
            raise WorkerError(body.status, body.message)
        self._protocol_violation(MsgType.TICK_SUBMIT, env)
        raise AssertionError("unreachable")

    # -- thin wrappers ---------------------------------------------------------------------------

    async def ping(self, *, timeout: float | None = None) -> link.Pong:
        """PING -> PONG: queue depth, ticks run, lanes, pool counters and the engine's ``stats``."""
        return await self.request(link.Ping(), timeout=timeout)

    async def match(self, span: TokenRef, space_id: int = link.ALL_SPACES) -> MatchResult:
        """MATCH: cached prefixes of ``span`` (prompt-ring tokens); pins nothing (ABI rule 87)."""
        return await self.request(link.Match(span=span, space_id=space_id))

    async def seed_acquire(
        self, span: TokenRef, prefix_len: int, determinism_class: int = 0
    ) -> link.SeedGrant:
        """SEED_ACQUIRE: pin ``span[:prefix_len]`` for one admit (ABI rules 75-83)."""
        return await self.request(
            link.SeedAcquire(span=span, prefix_len=prefix_len, determinism_class=determinism_class)
        )

    async def seed_release(self, seed_handle: int) -> None:
        """SEED_RELEASE an unconsumed seed; ``WorkerError(ERR_UNKNOWN_HANDLE)`` if unknown (rule 81)."""
        await self.request(link.SeedRelease(seed_handle=seed_handle))

    async def grammar_create(self, msg: link.GrammarCreate, *, timeout: float | None = None) -> int:
        """GRAMMAR_CREATE -> the grammar handle for ``LaneAdmit.grammar_handle``; 0 when the engine
        cannot compile the spec (or does not serve its kind). Raises the link's errors."""
        created: link.GrammarCreated = await self.request(msg, timeout=timeout)
        return created.handle

    async def grammar_free(self, handle: int) -> None:
        """GRAMMAR_FREE a handle; ``WorkerError(ERR_UNKNOWN_HANDLE)`` if unknown (ABI rule 113)."""
        await self.request(link.GrammarFree(handle=handle))

    async def state_op(self, op: Any) -> link.StateOpAccepted:
        """STATE_OP (one of ``link.STATE_OPS``) -> STATE_OP_ACCEPTED. For an async op
        (``accepted.op != 0``) collect the end with ``op_done``."""
        return await self.request(op)

    async def op_done(self, op: int, *, timeout: float | None = None) -> link.StateOpDone:
        """The STATE_OP_DONE of async op ``op`` (waits for it; each op's end is returned once)."""
        self._arm()
        done = self._replies.take_op_done(op)
        if done is not None:
            return done
        if self._error is not None:
            raise self._error
        assert self._loop is not None
        fut = self._replies.op_waiter(op, self._loop)
        try:
            return await self._await(fut, timeout)
        finally:
            self._replies.drop_op_waiter(op, fut)

    async def cache_evict(self, policy: ShedPolicy, bytes_target: int) -> int:
        """CACHE_EVICT: bytes actually freed (ABI rule 89)."""
        reply = await self.request(link.CacheEvict(policy=policy, bytes_target=bytes_target))
        return reply.bytes_freed

    async def drain(self, *, timeout: float | None = None) -> link.Drained:
        """DRAIN: the worker refuses plans with admits from now on and answers DRAINED once it
        holds no lane (the coordinator retires them with ordinary plans meanwhile)."""
        return await self.request(link.Drain(), timeout=timeout)

    def shutdown(self, reason: str = "") -> None:
        """Send SHUTDOWN (no reply: the worker frees the engine and exits 0; watch the process).
        Does nothing on a dead link."""
        if self._error is None and self.version is not None:
            self._send(link.Shutdown(reason=reason))
            self._shutdown_sent = True

    def close(self) -> None:
        """Fail pending calls with ``LinkClosed``, stop watching the fds and close the socket.
        Idempotent. The pidfd stays open (its owner closes it)."""
        self._fail(LinkClosed("link closed"))
        if not self._sock.closed:
            self._sock.close(linger=0)

    def __repr__(self) -> str:
        state = "up" if self._error is None else type(self._error).__name__
        return f"WorkerLink(worker_id={self.worker_id}, pid={self.pid}, {state})"
