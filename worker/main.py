"""``basertd-worker``: one engine process per device (DESIGN.md "Processes").

Started by the coordinator (``basertd.server.workers.process``), never by hand in production::

    basertd-worker --worker-id 0 --link ipc:///run/basertd/basertd-w0-x/link.sock --parent-pid 1234 \\
        --ring 1:prompt:5:4096:272 --ring 2:emit:6:4096:80 --ring 3:logits:7:8:4112 \\
        --engine basert --ref-config '{"vocab_size": 512, "max_lanes": 16}'

Engines (``basertd.worker.engines.ENGINES``):

- ``basert`` (default): a tick-ABI library through ``basertd.native.abi``. ``--model BUNDLE``
  loads a bundle file with baseRT.h's ``baseRT_load_model_ex`` from ``--lib PATH`` (a libbaseRT
  build; default the C reference engine, whose bundle files are small descriptors) with
  ``--kernel-library PATH`` and ``--lanes`` / ``--context-length``. A library lacking a needed
  function, a baseRT version other than 0.3.x, or a bundle that does not load: one line on stderr
  and exit 3. Without ``--model`` it is the reference engine's private factory, configured with
  ``--ref-config`` (a JSON object, or ``key=value`` pairs separated by commas, of
  ``basertd.native.ref`` config fields). The process sees only its own GPU: the coordinator sets
  CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES from the worker's ``device``.
- ``llamacpp``: a GGUF ``--model`` through llama-cpp-python, ``--lanes``, ``--context-length``
  (tokens per lane), ``--threads``.

Control: ``--control FD``, an inherited control segment (``basertd.shm.control``: the yield word
the coordinator sets to end a tick early); handed to engines that serve ``Capability.TICK_YIELD``.

Rings: ``--ring ID:KIND:FD:SLOTS:SLOT_BYTES`` (repeatable): ring ``ID`` of KIND ``prompt`` (tokens,
engine reads), ``emit`` (tokens, engine writes) or ``logits`` (f32 rows, engine writes), in the
inherited memfd ``FD``, at offset 0, ``SLOTS`` slots of ``SLOT_BYTES`` bytes (16-byte slot header
included). The segment must hold 64 + SLOTS * SLOT_BYTES bytes (checked with fstat).

Exit codes (``lifecycle.ExitCode``): 0 orderly (SHUTDOWN, SIGTERM/SIGINT after the tick in flight,
parent gone), 2 bad command line (the message names the flag), 3 engine/model load failure (the
message says why; with ``--error-file PATH`` that one line is also written there, for the
coordinator to report), 70 engine FATAL, 76 Link W failure (malformed frame, protocol violation).
Logs: JSON lines on stderr (``basertd.worker.logging``), content-free.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

# isort: off
import basertd.lean_structlog  # noqa: F401  (first: structlog without rich)
from basertd.worker import preload  # noqa: F401  (then, before numpy: llama.cpp for a CUDA build)

# isort: on
from basertd.schema.abi import RingKind, RingRole
from basertd.shm import ControlBlock, RingError, Segment, SegmentError, ring_bytes
from basertd.worker import logging as wlog
from basertd.worker.engines import (
    ENGINES,
    Capability,
    EngineLoadError,
    EngineOptionError,
    EngineOptions,
    UnknownEngine,
    open_engine,
)
from basertd.worker.engines.draft import DraftConfig
from basertd.worker.engines.lookup import LookupConfig
from basertd.worker.lifecycle import ExitCode, LifecycleError, StopSignals, die_with_parent
from basertd.worker.link import EMIT_WINDOW_S, InheritedRing, LinkServer
from basertd.worker.strategies import SpeculationArgError, parse_speculation
from basertd.worker.strategies import register as register_strategies

RING_KINDS: dict[str, tuple[RingKind, RingRole]] = {
    "prompt": (RingKind.TOKENS, RingRole.ENGINE_READS),
    "emit": (RingKind.TOKENS, RingRole.ENGINE_WRITES),
    "logits": (RingKind.LOGITS, RingRole.ENGINE_WRITES),
}
"""``--ring`` KIND names -> (ring kind, role from the engine's side); DESIGN.md "Rings"."""
ERROR_LINE_MAX = 2000
"""Characters of the one-line reason ``--error-file`` receives."""


class _Parser(argparse.ArgumentParser):
    """argparse with exit status 2 and the flag named, as argparse does, for our own checks too.
    ``error_file``: where ``error`` also writes its one line (set before parsing, see
    ``error_file_of``)."""

    error_file: str | None = None

    def fail(self, flag: str, message: str) -> None:
        self.error(f"argument {flag}: {message}")

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        write_error_line(self.error_file, f"{self.prog}: {message}")
        super().error(message)


def error_file_of(argv: Sequence[str]) -> str | None:
    """The ``--error-file`` of ``argv`` (``--error-file PATH`` or ``--error-file=PATH``), read
    before parsing so that a usage error can be reported there too."""
    for i, arg in enumerate(argv):
        if arg == "--error-file" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--error-file="):
            return arg.partition("=")[2]
    return None


def write_error_line(path: str | None, line: str) -> None:
    """Write ``line`` (one line, newlines folded, at most ``ERROR_LINE_MAX`` characters) to
    ``path`` (created mode 0600, replaced if present), for the coordinator to report as the
    worker's last error. Never raises: the exit status still says what kind of failure it was."""
    if not path:
        return
    text = " ".join(line.split())[:ERROR_LINE_MAX]
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    except OSError:
        pass


def _int_at_least(text: str, low: int, what: str) -> int:
    """``text`` as a base-10 integer of at least ``low``; ``argparse.ArgumentTypeError`` naming
    ``what`` was expected otherwise."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def _positive(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def _non_negative(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def _u32(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 1 << 32:
        raise argparse.ArgumentTypeError(f"expected an integer in 0..2**32-1, got {value}")
    return value


def build_parser() -> _Parser:
    """The command line (``basertd-worker --help``)."""
    p = _Parser(prog="basertd-worker", description="basertd engine worker: one engine, one Link W.")
    p.add_argument("--worker-id", type=_u32, default=0, help="this worker's id in the coordinator's config")
    p.add_argument(
        "--link", required=True, metavar="ENDPOINT", help="the coordinator's zmq endpoint (ipc://...)"
    )
    p.add_argument(
        "--parent-pid",
        type=_positive,
        default=None,
        help="the coordinator's pid (default: our parent at start)",
    )
    p.add_argument(
        "--ring",
        action="append",
        default=[],
        metavar="ID:KIND:FD:SLOTS:SLOT_BYTES",
        help="an inherited ring segment; KIND is prompt, emit or logits (repeatable)",
    )
    p.add_argument(
        "--control",
        type=int,
        default=None,
        metavar="FD",
        help="an inherited control segment (the yield word, basertd.shm.control)",
    )
    p.add_argument(
        "--engine", default="basert", help=f"engine: {', '.join(sorted(ENGINES))} (default basert)"
    )
    p.add_argument(
        "--lib", default=None, metavar="PATH", help="basert: tick-ABI library (default: reference engine)"
    )
    p.add_argument(
        "--ref-config",
        default=None,
        metavar="JSON|K=V,...",
        help="basert reference engine: config fields as a JSON object or key=value pairs",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="llamacpp: GGUF file; basert: bundle file loaded with baseRT_load_model_ex (.base, or a "
        "reference bundle file)",
    )
    p.add_argument(
        "--kernel-library",
        default=None,
        metavar="PATH",
        help="basert: GPU kernel library for baseRT_load_model_ex (default: the library's auto-detection)",
    )
    p.add_argument("--device", default="cpu", help="device, e.g. cpu or cuda:0 (default cpu)")
    p.add_argument("--lanes", type=_positive, default=None, help="concurrent lanes")
    p.add_argument("--context-length", type=_positive, default=None, help="tokens per lane")
    p.add_argument("--threads", type=_positive, default=None, help="engine CPU threads")
    p.add_argument(
        "--host-bytes",
        type=_non_negative,
        default=None,
        metavar="BYTES",
        help="llamacpp: host memory for prefixes evicted from the KV pool (default 0: off)",
    )
    p.add_argument(
        "--kv-layout",
        default=None,
        choices=("unified", "per-lane"),
        help="llamacpp: one KV cache all lanes share (unified, the default) or a KV stream per lane",
    )
    p.add_argument(
        "--emit-window-ms",
        type=_non_negative_float,
        default=EMIT_WINDOW_S * 1000,
        help="coalesce partial emits over this many ms (0: one TICK_EMIT per engine callback)",
    )
    p.add_argument(
        "--speculation",
        action="append",
        default=[],
        type=_speculation,
        metavar="STRATEGY[:KEY=N,...]",
        help="register a speculation strategy at load, e.g. prompt-lookup:draft_max=8 (repeatable)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        metavar="PATH",
        help="the draft GGUF of --speculation draft-model (same vocabulary as the model)",
    )
    p.add_argument("--log-level", default="info", choices=wlog.level_names())
    p.add_argument(
        "--error-file",
        default=None,
        metavar="PATH",
        help="on exit 2 (usage) or 3 (load failure) write the one-line reason here as well",
    )
    return p


def _speculation(value: str) -> LookupConfig | DraftConfig:
    try:
        return parse_speculation(value)
    except SpeculationArgError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_ref_config(text: str | None) -> dict[str, Any]:
    """``--ref-config``: a JSON object, or ``key=value[,key=value...]`` with integer values (else
    the value is kept as a string). Raises ValueError with the reason."""
    if text is None or not text.strip():
        return {}
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("expected a JSON object")
        return value
    out: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"expected key=value, got {part!r}")
        raw = raw.strip()
        try:
            out[key] = int(raw, 0)
        except ValueError:
            out[key] = raw
    return out


def attach_rings(parser: _Parser, specs: Sequence[str]) -> list[InheritedRing]:
    """Parse every ``--ring`` and attach its segment (``Segment.attach`` checks the size with
    fstat). Exits 2 through ``parser`` naming ``--ring`` on any problem; attached segments are
    closed first."""
    rings: list[InheritedRing] = []
    try:
        for text in specs:
            parts = text.split(":")
            if len(parts) != 5:
                parser.fail("--ring", f"expected ID:KIND:FD:SLOTS:SLOT_BYTES, got {text!r}")
            rid_s, kind_s, fd_s, slots_s, slot_bytes_s = parts
            if kind_s not in RING_KINDS:
                parser.fail("--ring", f"KIND must be one of {', '.join(RING_KINDS)}, got {kind_s!r}")
            try:
                rid, fd, slots, slot_bytes = (int(x, 10) for x in (rid_s, fd_s, slots_s, slot_bytes_s))
            except ValueError:
                parser.fail("--ring", f"ID, FD, SLOTS and SLOT_BYTES must be integers, got {text!r}")
            if not 1 <= rid < 1 << 32 or any(r.ring_id == rid for r in rings):
                parser.fail("--ring", f"ring id {rid} is out of range or given twice")
            if fd < 3 or any(r.fd == fd for r in rings):
                parser.fail("--ring", f"fd {fd} is not an inheritable descriptor or given twice")
            if not 1 <= slots < 1 << 32 or slot_bytes < 24 or slot_bytes % 8 or slot_bytes >= 1 << 32:
                parser.fail("--ring", f"bad geometry {slots} slots x {slot_bytes} bytes")
            try:
                seg = Segment.attach(fd, ring_bytes(slots, slot_bytes))
            except RingError as exc:
                parser.fail("--ring", f"ring {rid} on fd {fd}: {exc}")
            kind, role = RING_KINDS[kind_s]
            rings.append(InheritedRing(rid, kind, role, fd, slots, slot_bytes, seg))
    except BaseException:
        for r in rings:
            r.segment.close()
        raise
    return rings


def attach_control(parser: _Parser, fd: int | None) -> ControlBlock | None:
    """Attach ``--control FD`` (None when absent). Exits 2 through ``parser`` naming ``--control``
    when the descriptor is not a control segment."""
    if fd is None:
        return None
    if fd < 3:
        parser.fail("--control", f"fd {fd} is not an inheritable descriptor")
    try:
        return ControlBlock.attach(fd)
    except SegmentError as exc:
        parser.fail("--control", str(exc))
    return None  # unreachable: fail exits


def run(argv: Sequence[str] | None = None) -> int:
    """Parse, load, serve; returns the exit code (``lifecycle.ExitCode``). Usage errors exit 2
    through argparse (SystemExit)."""
    parser = build_parser()
    parser.error_file = error_file_of(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        ref_config = parse_ref_config(args.ref_config)
    except ValueError as exc:
        parser.fail("--ref-config", str(exc))
    log = wlog.configure(args.worker_id, args.log_level)
    parent_pid = args.parent_pid if args.parent_pid is not None else os.getppid()
    try:
        if not die_with_parent(parent_pid):
            log.info("parent_gone", parent_pid=parent_pid, at="startup")
            return ExitCode.OK
    except LifecycleError as exc:
        log.error("pdeathsig_failed", reason=str(exc))
        write_error_line(args.error_file, f"basertd-worker: cannot watch the parent process: {exc}")
        return ExitCode.USAGE
    stop = StopSignals()
    stop.install()
    rings: list[InheritedRing] = []
    control: ControlBlock | None = None
    try:
        rings = attach_rings(parser, args.ring)
        control = attach_control(parser, args.control)
        options = EngineOptions(
            lib=args.lib,
            kernel_library=args.kernel_library,
            ref_config=ref_config,
            model=args.model,
            device=args.device,
            lanes=args.lanes,
            context_length=args.context_length,
            threads=args.threads,
            host_bytes=args.host_bytes,
            kv_layout=args.kv_layout,
        )
        log.info("engine_loading", engine=args.engine, device=args.device, rings=len(rings))
        try:
            engine = open_engine(args.engine, options)
        except UnknownEngine as exc:
            parser.fail("--engine", str(exc))
        except EngineOptionError as exc:
            parser.error(str(exc))
        except EngineLoadError as exc:
            log.error("model_load_failed", engine=args.engine, reason=str(exc))
            line = f"basertd-worker: cannot load the {args.engine} engine: {exc}"
            print(line, file=sys.stderr)
            write_error_line(args.error_file, line)
            return ExitCode.MODEL_LOAD
        # Yield inside a tick: engines that can end a tick at a step boundary take the control
        # segment (and then say extra["yield"] = "step"); the others finish every tick.
        yields = bool(
            control is not None and engine.supports(Capability.TICK_YIELD) and engine.attach_control(control)
        )
        strategies = register_strategies(engine, args.speculation, log, args.draft_model)
        info = engine.info()
        log.info(
            "engine_loaded",
            yields=yields,
            engine=info.engine,
            engine_version=info.engine_version,
            model_id=info.model_id,
            vocab_size=info.vocab_size,
            max_lanes=info.max_lanes,
        )
        server = LinkServer(
            engine,
            endpoint=args.link,
            worker_id=args.worker_id,
            parent_pid=parent_pid,
            rings=rings,
            stop=stop,
            log=log,
            emit_window_s=args.emit_window_ms / 1000,
            strategies=strategies,
        )
        rings = []  # the server owns and closes them now
        return server.run()
    finally:
        for r in rings:
            r.segment.close()
        if control is not None:
            control.close()  # after the server closed the engine, which may hold its address
        stop.close()


def main() -> int:
    """Console entry point (``basertd-worker``)."""
    return run()


if __name__ == "__main__":
    sys.exit(main())
