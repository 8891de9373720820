"""Applying one accepted tick's events to the scheduling state (DESIGN.md "Scheduling", ABI
rules 53-73). Synchronous: the loop has already read the emitted tokens from the emit ring.

Order (as the engine applied the plan, rule 53): retires first (a retire with publish enters the
prefix index; a preempted or checkpointed lane's request goes back to the head of its class, the
oldest at the head), then admit results (a refused admit releases its seed and grammar handle and
fails its request, or requeues it when the code is transient), prefill progress (a PREFILL_CHUNK
shed entry cut the chunk: the rest resumes next tick, rule 57, and that lane did not decode),
replay countdown (rule 72), lane faults, then emitted tokens (the terminal emit delivers only what
the tick's partial emits did not), and last the measured rates.
"""

from __future__ import annotations

import time

import structlog

from basertd.schema.abi import AdmitStatus, FaultCode, Finish, ShedKind, Status
from basertd.schema.client import ErrorCode
from basertd.schema.tick import TickEvents
from basertd.server.request.record import GenerationRequest, RequestState, token_logprobs
from basertd.server.sched.draft import Plan, checkpoint
from basertd.server.sched.lanes import Lane
from basertd.server.sched.state import SchedulerState

log = structlog.get_logger("basertd.scheduler")

TRANSIENT_ADMIT_CODES = frozenset({Status.REJECT_STALE_SEED, Status.NEEDS_REPLAN, Status.REJECT_BUDGET})
"""Admit reject codes after which the request is requeued rather than failed."""
MAX_ADMIT_RETRIES = 3
"""Transient admit refusals (and stale-seed plan rejections in a row) before a request fails."""
FINISH_REASON = {Finish.EOS: "eos", Finish.LENGTH: "length", Finish.GRAMMAR: "stop"}


class EventApplier(SchedulerState):
    """``apply`` and ``on_emit`` over a ``SchedulerState`` (module docstring)."""

    def deliver(self, lane: Lane, tokens: list[int], logprobs: list | None = None) -> str | None:
        """Send ``tokens`` to ``lane``'s request; returns its finish reason when they end it."""
        req = lane.request
        first = req.t_first_token is None
        if tokens:
            self.t_token[lane.tag] = time.monotonic()
        reason = req.deliver(tokens, logprobs=logprobs)
        if first and req.t_first_token is not None:
            in_flight = 1 if req.tick_in_flight_at_arrival else 0
            req.ttft_ticks = self.plan_seq - req.plan_seq_received + in_flight
        return reason

    def on_emit(self, lane_tag: int, tokens: list[int]) -> None:
        """A partial emit (TICK_EMIT) of the tick in flight: ``tokens`` of lane ``lane_tag`` go to
        its client now (a logprobs lane's go out with their rows, from the tick's events)."""
        lane = self.lanes.get(lane_tag)
        if lane is None or lane.request.finished or lane.request.sampler.logprobs:
            return
        lane.tick_tokens.extend(tokens)
        reason = self.deliver(lane, tokens)
        if reason is not None:
            self.finish(lane, reason)

    def finish(self, lane: Lane, reason: str) -> None:
        """``lane``'s request ended with ``reason``: the lane retires (with publish when
        ``[cache] publish_on_retire``) in the next plan."""
        lane.request.finish(reason)
        self.requests_done += 1
        lane.retire = True
        lane.publish = self.cache.publish_on_retire

    def _retired(self, lane: Lane, publish: bool, preempted: bool) -> None:
        """``lane`` was retired by an accepted plan: index what it published, requeue its request
        when it was preempted or checkpointed."""
        if publish and lane.kv_tokens >= self.cache_policy.page:
            self.cache_policy.published(lane.published_tokens(), lane.kv_tokens, lane.hashes)
        req = lane.request
        self.grammars.drop(req)
        if not (preempted or lane.requeue) or req.finished:
            return
        req.state = RequestState.QUEUED
        req.lane_tag = None
        self.queues.push_front(req)
        if preempted:
            req.preemptions += 1
            self.preemptions += 1
            self.metrics.preempted(self.worker_id, req.qos)
            log.info(
                "lane_preempted",
                worker_id=self.worker_id,
                lane_tag=lane.tag,
                request_key=req.key,
                qos=req.qos,
                generated=len(req.generated),
            )
        else:
            self.checkpoints += 1
            log.debug("lane_checkpointed", worker_id=self.worker_id, lane_tag=lane.tag, tokens=lane.kv_tokens)

    def _admit_refused(self, req: GenerationRequest, result) -> None:
        if req.finished:
            return
        code = None
        if result is not None:
            try:
                code = result.reject_status
            except ValueError:
                code = None
        name = code.name if code is not None else "no admit result"
        tries = self.admit_retries.get(req.key, 0)
        if code in TRANSIENT_ADMIT_CODES and tries < MAX_ADMIT_RETRIES:
            self.admit_retries[req.key] = tries + 1
            req.state = RequestState.QUEUED
            req.lane_tag = None
            self.queues.push_front(req)
            log.info("admit_requeued", worker_id=self.worker_id, request_key=req.key, status=name)
            return
        self.admit_retries.pop(req.key, None)
        log.warning("admit_refused", worker_id=self.worker_id, request_key=req.key, status=name)
        self.fail(req, ErrorCode.INVALID_REQUEST, f"the engine refused this request ({name})")

    def _end_lane(self, lane: Lane, message: str) -> None:
        if not lane.request.finished:
            self.fail(lane.request, ErrorCode.INTERNAL, message)
        lane.retire = True
        lane.publish = False

    def apply(self, plan: Plan, events: TickEvents, tokens: dict[int, list[int] | None]) -> None:
        """Apply the accepted tick of ``plan``: its ``events`` and the tokens of each emit with
        ``n_tokens`` (lane tag -> tokens read from the emit ring, None when unreadable: that
        request fails INTERNAL). Counts the tick, the tokens and the cache evictions it reports."""
        self.rejections = 0
        self.max_admits = None
        self.prefill_cap = None
        self.ticks_run += 1
        self.cache_policy.on_tick(events.shed.entries)
        draft = plan.draft
        preempted = set(draft.preempted)
        # Victims go back to the head of their class oldest last, so the oldest is at the head.
        retired = [(tag, publish, self.lanes.pop(tag, None)) for tag, publish in draft.retires]
        retired.sort(key=lambda r: -(r[2].request.t_received if r[2] is not None else 0.0))
        for tag, publish, lane in retired:
            if lane is not None:
                self._retired(lane, publish, tag in preempted)

        results = {r.lane_tag: r for r in events.admit_results}
        for tag, cand in draft.admits:
            lane = self.lanes.get(tag)
            r = results.get(tag)
            if lane is not None and (r is None or r.status != AdmitStatus.ADMITTED):
                del self.lanes[tag]
                seed = plan.seeds.get(cand.key)
                if seed is not None:
                    self.to_release.append(seed.handle)
                self.grammars.drop(lane.request)
                self._admit_refused(lane.request, r)
            elif lane is not None and lane.request.admissions == 0:
                lane.request.cached_tokens = min(lane.seeded_tokens, len(lane.request.prompt))
            if lane is not None and tag in self.lanes:
                lane.request.admissions += 1

        shed = {e.lane_tag: e.tokens for e in events.shed.entries if e.kind == ShedKind.PREFILL_CHUNK}
        for tag, offset, count in draft.prefills:
            lane = self.lanes.get(tag)
            if lane is not None:
                done = max(0, count - shed.get(tag, 0))
                lane.prefilled = offset + done
                self.prefill_tokens_total += done
                if lane.checkpoint and lane.prefilled >= lane.checkpoint:
                    checkpoint(lane)
        replayed: dict[int, int] = {}
        for tag, grant in draft.decodes:
            lane = self.lanes.get(tag)
            if tag in shed:
                continue  # its prefill was cut (a yield or a budget shed): it did not decode
            if lane is not None and lane.replay_left:
                used = min(grant, lane.replay_left)
                lane.replay_left -= used
                lane.replayed += used
                replayed[tag] = used

        for fault in events.faults:
            lane = self.lanes.get(fault.lane_tag)
            if lane is None:
                continue
            try:
                name = FaultCode(fault.code).name
            except ValueError:
                name = str(fault.code)
            log.warning(
                "lane_fault",
                worker_id=self.worker_id,
                lane_tag=fault.lane_tag,
                code=name,
                detail=fault.detail,
            )
            self._end_lane(lane, f"the engine stopped this generation (lane fault {name})")
            lane.requeue = False

        self._apply_emits(events, tokens)

        for lane in self.lanes.values():
            if lane.request.finished:
                lane.retire = True
            lane.tick_tokens.clear()

        t = events.timings
        emitted = {e.lane_tag: e.n_tokens for e in events.emits}
        steps = max((emitted.get(tag, 0) + replayed.get(tag, 0) for tag, _ in draft.decodes), default=0)
        prefilled = sum(max(0, n - shed.get(tag, 0)) for tag, _, n in draft.prefills)
        self.rates.observe(prefilled, t.prefill_ns / 1e9, steps, t.decode_ns / 1e9)
        self.last_mem = events.mem
        for tag in [t for t in self.t_token if t not in self.lanes]:
            del self.t_token[tag]

    def _apply_emits(self, events: TickEvents, read: dict[int, list[int] | None]) -> None:
        rows: dict[int, list] = {}
        for row in events.logprobs:
            rows.setdefault(row.lane_tag, []).append(row)
        for emit in events.emits:
            lane = self.lanes.get(emit.lane_tag)
            if lane is None:
                continue
            partial, lane.tick_tokens = lane.tick_tokens, []
            tokens: list[int] = []
            if emit.n_tokens:
                got = read.get(emit.lane_tag)
                if got is None:
                    log.error("emit_unreadable", worker_id=self.worker_id, lane_tag=lane.tag)
                    self._end_lane(lane, "emitted tokens were lost")
                    continue
                tokens = list(got)
            lane.emitted.extend(tokens)
            self.decode_tokens_total += len(tokens)
            if tokens[: len(partial)] != partial:
                log.error("partial_emits_disagree", worker_id=self.worker_id, lane_tag=lane.tag)
            req = lane.request
            lps = None
            if req.sampler.logprobs and not req.finished:
                try:
                    lps = token_logprobs(tokens, rows.get(lane.tag, []))[len(partial) :]
                except ValueError as exc:
                    self.fail(
                        req, ErrorCode.INTERNAL, f"the engine's logprobs do not match its tokens: {exc}"
                    )
            fresh = tokens[len(partial) :]
            reason = self.deliver(lane, fresh, lps) if fresh and not req.finished else None
            if reason is None and emit.finish != Finish.NONE and not req.finished:
                if emit.finish in FINISH_REASON:
                    reason = FINISH_REASON[emit.finish]
                else:
                    self.fail(
                        req, ErrorCode.INTERNAL, f"the engine ended this generation (finish {emit.finish})"
                    )
                    lane.retire = True
            if reason is not None:
                self.finish(lane, reason)
            elif emit.finish != Finish.NONE:
                lane.retire = True
