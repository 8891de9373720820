"""Start one engine worker and own everything it needs (DESIGN.md "Processes", "Rings", "Link W").

``WorkerProcess.start(spec)`` does, in this order, undoing every step on any failure:

1. a private runtime directory (``mkdtemp``, mode 0700) inside ``spec.runtime_dir`` (default
   ``$XDG_RUNTIME_DIR`` or the temp dir) holding the ``ipc://`` endpoint ``link.sock``;
2. three anonymous memfd segments (``basertd.shm.Segment``; nothing named in ``/dev/shm``) with
   their BRTRING1 headers formatted here (ABI rule 123), one ring per segment at offset 0:
   ring 1 prompt (TOKENS, engine reads; the coordinator keeps the ``RingWriter``), ring 2 emit
   (TOKENS, engine writes; the coordinator keeps a ``RingReader``), ring 3 logits (LOGITS,
   engine writes; ``RingReader``). Fresh segments per incarnation, so generations start at 1;
3. a zmq PAIR socket bound on the endpoint (``configure_link_socket``: MAXMSGSIZE, no HWM);
4. ``sys.executable -m basertd.worker.main`` (or ``spec.command``) with the segments' fds in
   ``pass_fds`` and on the command line (``--ring ID:KIND:FD:SLOTS:SLOT_BYTES``),
   ``--parent-pid`` this process, ``--link`` the endpoint, ``--error-file`` in the private
   directory (a worker exiting 2 or 3 writes its one-line reason there; it becomes the
   ``WorkerStartError``'s ``reason``), the engine flags of the spec, and ``--control FD``, a
   fresh 64-byte control segment (``basertd.shm.ControlBlock``: the yield word of
   ``request_yield`` / ``clear_yield``);
5. ``os.pidfd_open`` of the child, handed to the ``WorkerLink`` so its death is noticed at once;
6. the Link W handshake and ring attach (``WorkerLink.handshake``).

``WorkerProcess.spawn(spec)`` is steps 1-5 alone, with no event loop needed; its ``SpawnedWorker``
does step 6 later (``handshake()``) or is undone (``kill()``). The daemon spawns its workers so,
before it imports most of itself (``basertd.server.launch``), and their start overlaps its own.

``close()`` sends SHUTDOWN, waits up to ``grace`` seconds for the exit (SIGKILL after that),
reaps the child, closes the link and socket, unlinks the endpoint, removes the runtime directory
and closes the rings and segments. It is idempotent and also runs when the worker died on its
own. ``kill()`` is the synchronous, immediate variant for exit paths without a loop.

The child's ``PR_SET_PDEATHSIG`` fires when the *thread* that spawned it exits, so start workers
from the event loop's thread (or another thread that lives as long as the worker), never from a
short-lived executor thread.

``basertd.server.workers.sync_worker.SyncWorker`` wraps a ``WorkerProcess`` and a private event
loop into blocking calls for tests and benches; the coordinator itself uses ``WorkerProcess`` and
``WorkerLink`` on its own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq

from basertd.schema import link
from basertd.schema.abi import RingKind, RingRole
from basertd.server.workers.environment import compute_env, device_env, worker_environ
from basertd.server.workers.link import WorkerLink, configure_link_socket
from basertd.server.workers.link_errors import LinkError, WorkerDied
from basertd.shm import ControlBlock, RingReader, RingWriter, Segment, YieldReason, ring_bytes, slot_bytes_for

__all__ = [
    "EMIT_RING_ID",
    "LOGITS_RING_ID",
    "PROMPT_RING_ID",
    "RingGeometry",
    "SpawnedWorker",
    "WorkerProcess",
    "WorkerSpec",
    "WorkerSpecError",
    "WorkerStartError",
    "read_error_line",
]

log = structlog.get_logger("basertd.worker_proc")

PROMPT_RING_ID = 1
"""Ring id of the prompt-token ring (coordinator writes, engine reads; DESIGN.md "Rings")."""
EMIT_RING_ID = 2
"""Ring id of the emitted-token ring (engine writes)."""
LOGITS_RING_ID = 3
"""Ring id of the logits-row ring (engine writes rows of HOST-sampled lanes)."""

_RING_NAMES = {PROMPT_RING_ID: "prompt", EMIT_RING_ID: "emit", LOGITS_RING_ID: "logits"}
_RING_KINDS = {
    PROMPT_RING_ID: (RingKind.TOKENS, RingRole.ENGINE_READS),
    EMIT_RING_ID: (RingKind.TOKENS, RingRole.ENGINE_WRITES),
    LOGITS_RING_ID: (RingKind.LOGITS, RingRole.ENGINE_WRITES),
}
_MAX_IPC_PATH = 100  # sun_path is 108 bytes; keep a margin


class WorkerSpecError(ValueError):
    """A ``WorkerSpec`` that cannot start a worker (a bad value, named in the message); raised
    before anything is created."""


class WorkerStartError(LinkError):
    """The worker did not come up: it exited during startup (``returncode``: 2 bad command line,
    3 model could not load, ...), the handshake failed or timed out. Everything was torn down.
    ``reason``: the worker's own one-line explanation (its ``--error-file``), "" when it wrote
    none."""

    def __init__(self, message: str, returncode: int | None = None, reason: str = "") -> None:
        self.returncode = returncode
        self.reason = reason
        super().__init__(message)

    @property
    def permanent(self) -> bool:
        """The worker refused its command line (exit 2) or could not load its engine or model
        (exit 3): starting it again with the same spec fails the same way."""
        return self.returncode in PERMANENT_EXIT_CODES


PERMANENT_EXIT_CODES = (2, 3)
"""Worker exit statuses that respawning cannot fix (``basertd.worker.lifecycle.ExitCode`` USAGE
and MODEL_LOAD): the supervisor gives up at once."""
ERROR_FILE = "error"
"""Name, in the private runtime directory, of the file the worker writes its one-line reason to
when it exits 2 or 3 (``basertd-worker --error-file``)."""


def read_error_line(rundir: str | None) -> str:
    """The worker's one-line reason from ``rundir``/``ERROR_FILE``, "" when there is none."""
    if not rundir:
        return ""
    try:
        with open(os.path.join(rundir, ERROR_FILE), encoding="utf-8", errors="replace") as f:
            return " ".join(f.read(4096).split())
    except OSError:
        return ""


@dataclass(frozen=True)
class RingGeometry:
    """One ring's shape: ``slots`` (>= 1) of ``slot_bytes`` bytes each, the 16-byte slot header
    included (a multiple of 8, >= 24). ``RingGeometry.for_elems(slots, n)`` sizes slots for ``n``
    4-byte elements (tokens or f32 logits) each."""

    slots: int
    slot_bytes: int

    @classmethod
    def for_elems(cls, slots: int, elems: int) -> RingGeometry:
        """``slots`` slots whose payload holds ``elems`` 4-byte elements."""
        return cls(slots, slot_bytes_for(elems))

    @property
    def length(self) -> int:
        """Bytes of the segment: 64-byte header + slots * slot_bytes (ABI rule 125)."""
        return ring_bytes(self.slots, self.slot_bytes)


@dataclass(frozen=True)
class WorkerSpec:
    """What to start. Engine fields become ``basertd-worker`` flags:

    ``engine`` "basert" (a tick-ABI library: ``lib``, default the C reference engine, configured
    by ``ref_config``, a dict of ``basertd.native.ref`` config fields) or "llamacpp" (``model`` a
    GGUF path). ``device``, ``lanes``, ``context_length`` (tokens), ``threads``, ``host_bytes``
    (the llama.cpp engine's host tier, bytes) and ``kv_layout`` (its KV layout) go through as is
    when set. ``extra_args``: more
    worker flags, verbatim.

    Rings: ``prompt_ring`` (tokens of every admitted prompt until its admit is accepted),
    ``emit_ring`` (must hold every emit of one tick: >= lanes slots), ``logits_ring`` (one slot
    per pending HOST row; a slot must hold vocab_size f32 for HOST lanes to work).

    ``runtime_dir``: parent of the private per-worker directory (None: ``$XDG_RUNTIME_DIR`` or the
    temp dir). ``stderr``: where the worker's JSON log lines go (None inherits ours; a file object
    or fd). ``start_timeout``: seconds for spawn + model load + handshake. ``env``: extra
    environment variables (they win over ``compute_env`` and ``device_env``). ``command``: the
    program and leading arguments that run the worker (default ``[sys.executable, "-m",
    "basertd.worker.main"]``; e.g. behind ``taskset``); the worker flags are appended.
    ``emit_window_ms``: coalescing window of partial emits (None: the worker's default, 2 ms; 0:
    every engine callback is sent at once; see ``basertd.worker.link``: a lane's TICK_EMITs of one
    tick concatenate to a prefix of that tick's tokens for it)."""

    worker_id: int = 0
    engine: str = "basert"
    lib: str | None = None
    ref_config: Mapping[str, Any] | None = None
    model: str | None = None
    device: str | None = None
    lanes: int | None = None
    context_length: int | None = None
    threads: int | None = None
    host_bytes: int | None = None
    kv_layout: str | None = None
    extra_args: Sequence[str] = ()
    prompt_ring: RingGeometry = field(default_factory=lambda: RingGeometry.for_elems(4096, 64))
    emit_ring: RingGeometry = field(default_factory=lambda: RingGeometry.for_elems(4096, 16))
    logits_ring: RingGeometry = field(default_factory=lambda: RingGeometry.for_elems(8, 1024))
    runtime_dir: str | None = None
    stderr: Any = None
    start_timeout: float = 60.0
    env: Mapping[str, str] | None = None
    log_level: str = "info"
    command: Sequence[str] | None = None
    emit_window_ms: float | None = None

    def geometry(self, ring_id: int) -> RingGeometry:
        """The geometry of ring ``ring_id`` (1 prompt, 2 emit, 3 logits)."""
        return {
            PROMPT_RING_ID: self.prompt_ring,
            EMIT_RING_ID: self.emit_ring,
            LOGITS_RING_ID: self.logits_ring,
        }[ring_id]

    def validate(self) -> None:
        """Raises ``WorkerSpecError`` naming the first bad field."""
        if not isinstance(self.worker_id, int) or not 0 <= self.worker_id < 1 << 32:
            raise WorkerSpecError(f"worker_id must be a u32, got {self.worker_id!r}")
        if not self.engine or not isinstance(self.engine, str):
            raise WorkerSpecError(f"engine must be a name, got {self.engine!r}")
        for name in ("lanes", "context_length", "threads"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise WorkerSpecError(f"{name} must be a positive int, got {v!r}")
        for rid in _RING_NAMES:
            g = self.geometry(rid)
            if g.slots < 1 or g.slot_bytes < 24 or g.slot_bytes % 8:
                raise WorkerSpecError(f"{_RING_NAMES[rid]}_ring: bad geometry {g}")
        if self.start_timeout <= 0:
            raise WorkerSpecError(f"start_timeout must be > 0 seconds, got {self.start_timeout!r}")
        if self.ref_config is not None:
            try:
                json.dumps(dict(self.ref_config))
            except (TypeError, ValueError) as exc:
                raise WorkerSpecError(f"ref_config must be JSON-serialisable: {exc}") from None

    def engine_args(self) -> list[str]:
        """The engine part of the worker's command line."""
        args = ["--engine", self.engine]
        if self.lib is not None:
            args += ["--lib", str(self.lib)]
        if self.ref_config is not None:
            args += ["--ref-config", json.dumps(dict(self.ref_config), sort_keys=True)]
        if self.model is not None:
            args += ["--model", str(self.model)]
        if self.device is not None:
            args += ["--device", str(self.device)]
        for flag, value in (
            ("--lanes", self.lanes),
            ("--context-length", self.context_length),
            ("--threads", self.threads),
            ("--host-bytes", self.host_bytes),
            ("--kv-layout", self.kv_layout),
        ):
            if value is not None:
                args += [flag, str(value)]
        if self.emit_window_ms is not None:
            args += ["--emit-window-ms", repr(float(self.emit_window_ms))]
        return args + [str(a) for a in self.extra_args]


def _default_runtime_root() -> str:
    root = os.environ.get("XDG_RUNTIME_DIR")
    if root and os.path.isdir(root) and os.access(root, os.W_OK):
        return root
    return tempfile.gettempdir()


class _Resources:
    """Everything ``start`` created so far, released in reverse by ``release`` (idempotent)."""

    def __init__(self) -> None:
        self.rundir: str | None = None
        self.ipc_path: str | None = None
        self.segments: list[Segment] = []
        self.rings: list[Any] = []
        self.control: ControlBlock | None = None
        self.sock: zmq.Socket | None = None
        self.proc: subprocess.Popen | None = None
        self.pidfd: int | None = None
        self.link: WorkerLink | None = None

    def kill_child(self) -> int | None:
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
        return proc.wait()

    def release(self) -> None:
        self.kill_child()
        if self.link is not None:
            self.link.close()
        elif self.sock is not None and not self.sock.closed:
            self.sock.close(linger=0)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.ipc_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.ipc_path)
            self.ipc_path = None
        if self.rundir is not None:
            shutil.rmtree(self.rundir, ignore_errors=True)
            self.rundir = None
        for ring in self.rings:
            ring.close()
        self.rings.clear()
        for seg in self.segments:
            seg.close()
        self.segments.clear()
        if self.control is not None:
            self.control.close()
            self.control = None


class SpawnedWorker:
    """A worker spawned by ``WorkerProcess.spawn`` whose handshake is still to come: ``pid``,
    ``spec``; ``handshake()`` (once) makes it a ``WorkerProcess``; ``kill()`` undoes it when it
    will never be handshaken (idempotent)."""

    def __init__(self, spec: WorkerSpec, res: _Resources, attach: list[link.RingAttachSpec]) -> None:
        assert res.proc is not None and res.link is not None
        self.spec = spec
        self.pid: int = res.proc.pid
        self._res: _Resources | None = res
        self._attach = attach

    async def handshake(self) -> WorkerProcess:
        """Step 6 of the module docstring, on the running loop. Raises ``WorkerStartError`` (the
        worker exited, the handshake failed or timed out; everything released and the child
        reaped) or RuntimeError when called twice or after ``kill``."""
        res, self._res = self._res, None
        if res is None:
            raise RuntimeError(f"worker {self.spec.worker_id}: handshake after handshake or kill")
        spec = self.spec
        assert res.link is not None and res.proc is not None
        try:
            try:
                caps = await res.link.handshake(self._attach, timeout=spec.start_timeout)
            except WorkerDied as exc:
                code = exc.returncode
                if code is None:  # the pidfd fired before subprocess reaped it: the exit is there
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        code = res.proc.wait(timeout=1.0)
                reason = read_error_line(res.rundir)
                said = f": {reason}" if reason else ""
                raise WorkerStartError(
                    f"worker {spec.worker_id} exited during startup: {exc}{said}", code, reason
                ) from exc
            except LinkError as exc:
                raise WorkerStartError(f"worker {spec.worker_id} handshake failed: {exc}") from exc
            return WorkerProcess(spec, res, caps)
        except BaseException:
            res.release()
            raise

    def kill(self) -> None:
        """SIGKILL, reap and release everything, unless ``handshake`` took it over; idempotent."""
        res, self._res = self._res, None
        if res is not None:
            res.release()


class WorkerProcess:
    """One running ``basertd-worker`` with its link, rings and resources.

    Attributes: ``spec``; ``pid``; ``link`` (the ``WorkerLink``); ``capabilities`` (the handshake's
    record); ``prompt_ring`` (``RingWriter``: write each admit's prompt here and put the returned
    ``TokenRef`` in ``LaneAdmit.prompt``); ``emit_ring`` / ``logits_ring`` (``RingReader``: read
    ``LaneEmit.token_ref`` / ``logits_row`` here, right after the tick, before the ring wraps);
    ``control`` (the ``ControlBlock`` behind ``request_yield`` / ``clear_yield``); ``ipc_path`` and
    ``runtime_dir`` (gone after ``close``)."""

    def __init__(self, spec: WorkerSpec, res: _Resources, caps: link.Capabilities) -> None:
        self.spec = spec
        self._res = res
        assert res.proc is not None and res.link is not None and res.rundir is not None
        self.pid: int = res.proc.pid
        self.link: WorkerLink = res.link
        self.capabilities = caps
        self.prompt_ring: RingWriter = res.rings[0]
        self.emit_ring: RingReader = res.rings[1]
        self.logits_ring: RingReader = res.rings[2]
        assert res.control is not None
        self.control: ControlBlock = res.control
        self.ipc_path: str = res.ipc_path or ""
        self.runtime_dir: str = res.rundir
        self._closed = False

    @classmethod
    async def start(cls, spec: WorkerSpec, *, context: zmq.Context | None = None) -> WorkerProcess:
        """Create the resources, spawn the worker and complete the handshake (module docstring):
        ``spawn`` then ``SpawnedWorker.handshake``.

        Raises ``WorkerSpecError`` (nothing created), ``WorkerStartError`` (the worker exited, the
        handshake failed or timed out; everything released and the child reaped), and the
        ``basertd.shm`` errors for segments the kernel refuses."""
        return await cls.spawn(spec, context=context).handshake()

    @classmethod
    def spawn(cls, spec: WorkerSpec, *, context: zmq.Context | None = None) -> SpawnedWorker:
        """Steps 1-5 of the module docstring, without a running event loop: the worker runs (its
        imports and model load begin) and ``SpawnedWorker.handshake`` completes the start later,
        on the loop's thread (the thread that spawned it must outlive it: ``PR_SET_PDEATHSIG``).
        Raises ``WorkerSpecError`` and the ``basertd.shm`` errors; nothing is left on a failure."""
        spec.validate()
        res = _Resources()
        try:
            parent = spec.runtime_dir or _default_runtime_root()
            res.rundir = tempfile.mkdtemp(prefix=f"basertd-w{spec.worker_id}-", dir=parent)
            os.chmod(res.rundir, 0o700)
            res.ipc_path = os.path.join(res.rundir, "link.sock")
            if len(res.ipc_path.encode()) > _MAX_IPC_PATH:
                raise WorkerSpecError(f"runtime_dir {parent!r} is too long for an ipc socket path")
            attach: list[link.RingAttachSpec] = []
            for rid, name in _RING_NAMES.items():
                geo = spec.geometry(rid)
                kind, role = _RING_KINDS[rid]
                seg = Segment.create(geo.length, name=f"basertd-w{spec.worker_id}-{name}")
                res.segments.append(seg)
                writer = RingWriter.create(seg, rid, kind, geo.slots, geo.slot_bytes)
                if role == RingRole.ENGINE_READS:
                    res.rings.append(writer)  # the coordinator writes prompts
                else:
                    writer.close()  # formatted here; the engine is the writer
                    res.rings.append(RingReader.attach(seg, rid, kind, geo.slots, geo.slot_bytes))
                attach.append(
                    link.RingAttachSpec(
                        ring_id=rid,
                        kind=int(kind),
                        role=int(role),
                        slots=geo.slots,
                        slot_bytes=geo.slot_bytes,
                        length=geo.length,
                        fd=seg.fd,
                        offset=0,
                    )
                )
            res.control = ControlBlock.create(name=f"basertd-w{spec.worker_id}-control")
            ctx = context or zmq.Context.instance()
            res.sock = ctx.socket(zmq.PAIR)
            configure_link_socket(res.sock)
            endpoint = "ipc://" + res.ipc_path
            res.sock.bind(endpoint)
            command = list(spec.command) if spec.command else [sys.executable, "-m", "basertd.worker.main"]
            argv = [
                *command,
                "--worker-id",
                str(spec.worker_id),
                "--link",
                endpoint,
                "--parent-pid",
                str(os.getpid()),
                "--log-level",
                spec.log_level,
                "--error-file",
                os.path.join(res.rundir, ERROR_FILE),
                *spec.engine_args(),
            ]
            for a in attach:
                argv += ["--ring", f"{a.ring_id}:{_RING_NAMES[a.ring_id]}:{a.fd}:{a.slots}:{a.slot_bytes}"]
            argv += ["--control", str(res.control.fd)]
            env = {**worker_environ(), **compute_env(), **device_env(spec.device), **(spec.env or {})}
            res.proc = subprocess.Popen(
                argv,
                pass_fds=[*(a.fd for a in attach), res.control.fd],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=spec.stderr,
                env=env,
                close_fds=True,
            )
            res.pidfd = os.pidfd_open(res.proc.pid)
            res.link = WorkerLink(
                res.sock,
                pid=res.proc.pid,
                pidfd=res.pidfd,
                exit_status=res.proc.poll,
                worker_id=spec.worker_id,
            )
            log.info("worker_spawned", worker_id=spec.worker_id, pid=res.proc.pid, engine=spec.engine)
        except BaseException:
            res.release()
            raise
        return SpawnedWorker(spec, res, attach)

    # -- state -----------------------------------------------------------------------------------

    @property
    def returncode(self) -> int | None:
        """The worker's exit status once it has exited (negative: killed by that signal)."""
        proc = self._res.proc
        return None if proc is None else proc.poll()

    @property
    def alive(self) -> bool:
        """True while the process runs and the link is up."""
        return self.returncode is None and self.link.alive

    async def wait(self) -> int:
        """Wait for the process to exit (noticed through its pidfd) and return its status."""
        if self.returncode is None and self.link.alive:
            await self.link.wait_dead()
        proc = self._res.proc
        assert proc is not None
        if proc.poll() is None:
            # The link died for another reason (protocol error, closed): the process may still run.
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            pidfd = self._res.pidfd
            if pidfd is None:
                return proc.wait()
            loop.add_reader(pidfd, lambda: fut.done() or fut.set_result(None))
            try:
                await fut
            finally:
                loop.remove_reader(pidfd)
        return proc.wait()

    # -- yield inside a tick -----------------------------------------------------------------------

    @property
    def can_yield(self) -> bool:
        """True when the worker's engine ends a tick early on ``request_yield`` (capability record
        ``extra["yield"] == "step"``); otherwise the word is ignored and every tick runs to its end."""
        return self.capabilities.extra.get("yield") == "step"

    def request_yield(self, reason: int = YieldReason.URGENT_ADMIT) -> None:
        """Ask the tick in flight to end at its next step boundary (``basertd.shm.control``): set
        when work arrives that outranks it (an interactive request, a cancel, a drain). Sticky: every
        tick ends after its first step until ``clear_yield``. The yielded tick's events report the
        prefill not done as PREFILL_CHUNK shed entries (ABI rules 56, 57) and decode lanes with fewer
        tokens than granted (finish NONE). ValueError for reason 0. No-op once closed."""
        if not self._closed:
            self.control.request_yield(reason)

    def clear_yield(self) -> None:
        """Let ticks run to their end again; call it when sending the plan that serves the urgent
        work (before the reply, so that plan is not itself cut short). No-op once closed."""
        if not self._closed:
            self.control.clear_yield()

    @property
    def yield_requested(self) -> bool:
        """Whether the yield word is set now."""
        return not self._closed and self.control.yield_reason() != 0

    @property
    def yields_taken(self) -> int:
        """Ticks the engine has ended early in this incarnation."""
        return 0 if self._closed else self.control.yields_taken

    # -- teardown --------------------------------------------------------------------------------

    async def close(self, grace: float = 5.0, reason: str = "close") -> int | None:
        """Orderly stop: SHUTDOWN (SIGTERM when the link is already down), wait up to ``grace``
        seconds, then SIGKILL; reap; release the socket, endpoint, runtime directory, rings and
        segments. Returns the exit status. Idempotent."""
        if self._closed:
            return self.returncode
        try:
            if self.returncode is None:
                if self.link.alive:
                    try:
                        self.link.shutdown(reason)
                    except LinkError:
                        pass
                else:
                    # No link to say SHUTDOWN on (closed, or a protocol error): SIGTERM makes the
                    # worker finish its tick in flight and exit 0.
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(self.wait(), grace)
                except TimeoutError:
                    log.warning("worker_kill", worker_id=self.spec.worker_id, pid=self.pid, after_s=grace)
        finally:
            self._closed = True
            self._res.release()
        return self.returncode

    def kill(self) -> int | None:
        """Immediate synchronous teardown: SIGKILL, reap, release everything. Idempotent."""
        self._closed = True
        self._res.release()
        return self.returncode

    def __repr__(self) -> str:
        return f"WorkerProcess(worker_id={self.spec.worker_id}, pid={self.pid}, returncode={self.returncode})"
