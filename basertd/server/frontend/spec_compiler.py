"""Compiling grammar specs for admission: once per distinct spec, in a child process, bounded.

``SpecCompiler.compile(spec)`` answers whether a ``grammar.GrammarSpec`` (or one of its
fallbacks) compiles with the worker's compiler (``basertd.grammar_compile``), running it in a
``sandbox.SandboxPool`` of ``spec_check`` children: a time limit per compile, a memory limit per
child, a cap on compiles waiting. Results are cached by the SHA-256 of the spec's candidates (an
LRU of ``CACHE_ENTRIES``; refusals, crashes and timeouts included, so a hostile spec sent again
costs nothing), and a spec being compiled is compiled once for every request that waits on it:
one HTTP request of 64 prompts x n=16 sharing a schema compiles it once.

Errors are ``GrammarRequestError``: INVALID_REQUEST (HTTP 400) naming the library's message, the
time limit, or the crash (logged with the spec's hash and counted in
``basertd_sandbox_jobs_failed_total{pool="grammar"}``); QUEUE_FULL when too many compiles wait.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict

import structlog

from basertd.grammar_compile import KIND_NAMES
from basertd.schema.client import ErrorCode
from basertd.server.observe.metrics import Metrics
from basertd.server.request.grammar import GrammarRequestError, GrammarSpec
from basertd.server.request.sandbox import (
    SandboxBusy,
    SandboxCrashed,
    SandboxError,
    SandboxJobError,
    SandboxPool,
    SandboxTimeout,
)

log = structlog.get_logger("basertd.grammar")

CACHE_ENTRIES = 1024
"""Distinct specs whose result is remembered."""
POOL = "grammar"
"""The sandbox pool's name in metrics and logs."""


class GrammarBusy(GrammarRequestError):
    """Too many specs wait to be compiled (QUEUE_FULL, an HTTP 429); retry later."""

    code = ErrorCode.QUEUE_FULL


def spec_hash(spec: GrammarSpec) -> str:
    """Hex SHA-256 of the spec's candidates (kind and text of the spec and its fallbacks)."""
    h = hashlib.sha256()
    for kind, text in spec.candidates():
        h.update(kind.encode())
        h.update(b"\0")
        h.update(text.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


class SpecCompiler:
    """Compiles specs off the event loop (module docstring). ``processes``: child processes;
    ``timeout_s``: seconds one compile may take; ``max_pending``: compiles waiting or running at
    once; ``memory_bytes``: each child's address-space limit."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        processes: int,
        timeout_s: float,
        max_pending: int,
        memory_bytes: int,
    ) -> None:
        self.metrics = metrics
        self.pool = SandboxPool(
            POOL,
            "basertd.server.request.spec_check",
            size=processes,
            timeout_s=timeout_s,
            max_pending=max_pending,
            memory_bytes=memory_bytes,
        )
        self._done: OrderedDict[str, GrammarSpec | GrammarRequestError] = OrderedDict()
        self._running: dict[str, asyncio.Future[GrammarSpec | GrammarRequestError]] = {}
        self.compiles = 0
        """Compiles run in a child (cache misses; ``basertd_grammar_compiles_total``)."""

    async def compile(self, spec: GrammarSpec) -> GrammarSpec:
        """The candidate of ``spec`` that compiles, as a plain spec (no fallback), from the cache
        or a child. Raises ``GrammarRequestError`` (module docstring)."""
        key = spec_hash(spec)
        done = self._done.get(key)
        if done is None:
            running = self._running.get(key)
            if running is None:
                running = asyncio.get_running_loop().create_future()
                self._running[key] = running
                try:
                    done = await self._compile(key, spec)
                    running.set_result(done)
                except BaseException as exc:  # busy or cancelled: not remembered, waiters told
                    running.set_exception(exc)
                    running.exception()  # retrieved: no "never retrieved" warning without waiters
                    raise
                finally:
                    del self._running[key]
            else:
                done = await asyncio.shield(running)
        else:
            self._done.move_to_end(key)
        if isinstance(done, GrammarRequestError):
            raise type(done)(str(done))
        return done

    async def _compile(self, key: str, spec: GrammarSpec) -> GrammarSpec | GrammarRequestError:
        what = spec.label or KIND_NAMES.get(spec.kind, spec.kind)
        self.compiles += 1
        self.metrics.grammar_compiled()
        try:
            index = await self.pool.run(spec.candidates())
        except SandboxBusy as exc:
            self.metrics.sandbox_failed(POOL, exc.reason)
            raise GrammarBusy(f"too many grammars are being compiled; retry shortly ({exc})") from None
        except SandboxJobError as exc:
            self.metrics.sandbox_failed(POOL, "refused")
            return self._remember(key, GrammarRequestError(f"invalid {what}: {exc}"))
        except (SandboxTimeout, SandboxCrashed, SandboxError) as exc:
            self.metrics.sandbox_failed(POOL, exc.reason)
            log.warning("grammar_compile_failed", reason=exc.reason, spec_sha256=key, error=str(exc))
            if isinstance(exc, SandboxCrashed):
                message = f"invalid {what}: compiling it crashed the grammar compiler ({exc.signal_name})"
            else:
                message = f"invalid {what}: {exc}"
            return self._remember(key, GrammarRequestError(f"{message}; spec sha256 {key[:16]}"))
        kind, text = spec.candidates()[index]
        return self._remember(key, GrammarSpec(kind, text, label=spec.label))

    def _remember(
        self, key: str, result: GrammarSpec | GrammarRequestError
    ) -> GrammarSpec | GrammarRequestError:
        self._done[key] = result
        while len(self._done) > CACHE_ENTRIES:
            self._done.popitem(last=False)
        return result

    async def close(self) -> None:
        """Stop the child processes."""
        await self.pool.close()
