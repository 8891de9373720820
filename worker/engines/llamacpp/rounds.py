"""``Rounds``: a tick's decode rounds over llama.cpp: batch assembly, ``llama_decode``, the yield
inside a tick and abort arming.

A grant of k tokens runs at most k rounds. Each round puts a token for every decoding lane that
needs a forward first (with its prompt-lookup drafts, ``speculation``: a speculative round may
commit several tokens), then the tick's prefill (rows a yield may not cut first: KV the coordinator already
counts as prefilled), in one ``TokenBatch`` that ``decode`` splits into steps of at most
``yield_step_tokens`` rows. A long prefill is spread evenly over the rounds the grants leave
(``_feed_room``), so a lane decoding beside it gets a token every round.

Yield (``basertd.shm.control``): the yield word is read before every step but the tick's first,
and before every round after the first unless a decoding lane is in its replay tail (its units
emit nothing, so they must all run); once set, the tick ends with what it has done and the
planned prefill that did not run is reported exactly as a budget-shed chunk (one PREFILL_CHUNK
entry per lane, tokens = planned - done; ABI rules 56, 57). An urgent yield does not wait for the
step boundary: llama.cpp's abort callback (``abort.AbortWatch``) ends the step in flight, whose KV
llama.cpp drops (``arm_abort`` says which steps may be cut so every two ticks make progress).

Each round's decode-only ``llama_decode`` (its decode rows alone: no prefill in the round, or the
decode part of a split round) is timed into the speculator's verify cost (``verify_cost``), with
how many of its rows were drafts.
"""

from __future__ import annotations

import time

import llama_cpp as L
import numpy as np

from basertd.schema.abi import FaultCode, ShedKind, Status
from basertd.schema.tick import ShedEntry
from basertd.worker.engines.base import EngineFatal
from basertd.worker.engines.llamacpp.abort import AbortWatch
from basertd.worker.engines.llamacpp.batch import BatchDecodeError, TokenBatch
from basertd.worker.engines.llamacpp.cells import Cells
from basertd.worker.engines.llamacpp.grammar import GrammarSet
from basertd.worker.engines.llamacpp.lane import Lane
from basertd.worker.engines.llamacpp.rates import RateCurve
from basertd.worker.engines.llamacpp.speculation import Speculator
from basertd.worker.engines.llamacpp.tick import Tick
from basertd.worker.engines.llamacpp.work import SHED_REASON_BUDGET, TickWork

MIN_ROUND_FEED = 64
"""A tick's prefill of at most this many rows is not spread over its decode rounds: it goes whole
in the first (a short prompt's first token is not delayed by rounds of a few rows each). A longer
one is spread evenly, so the rounds the grants allow are all used and none is decode-only."""

SPLIT_MIN_PREFILL_ROWS = 8
"""A round whose prefill rows reach this many decodes its decode rows in a ``llama_decode`` of
their own first (``TokenBatch.decode``'s ``split``: a prefill chunk that shares flash-attention
query tiles with other lanes' decode rows attends over all their keys). Below it, the extra
``llama_decode`` (one more pass over the weights) would cost more than the shared tile."""

_U32 = (1 << 32) - 1


def decode_share_ns(n_decode_rows: int, parts: list[tuple[int, int]]) -> int:
    """Nanoseconds of a round that carried prefill rows which belong to its ``n_decode_rows``
    decode rows (they come first): the first ``llama_decode`` when it held them alone (a split
    round), else their share by rows of the first one they rode in. ``parts``: ``(rows, ns)`` per
    ``llama_decode`` (``TokenBatch.parts``).

    The tick's ``decode_ns`` / ``prefill_ns`` are what the scheduler's rates are measured from
    (DESIGN.md "Scheduling": seconds per decode step and per prefill token). Counting a mixed
    round's decode rows as prefill time made the prefill look slower the fewer prefill rows a round
    carried, so the inter-token bound gave the next round fewer still: under a burst of long
    prompts beside decoding lanes the per-round prefill shrank towards one token."""
    if not n_decode_rows or not parts:
        return 0
    rows, ns = parts[0]
    if rows <= n_decode_rows:
        return ns
    return ns * n_decode_rows // rows


class Rounds:
    """The decode rounds over ``cells``' llama.cpp context: ``lanes`` the live lanes by tag,
    ``n_vocab`` the logits row width, ``step_rows`` rows per ``llama_decode`` (a round's decode
    rows fit one step), ``batch_rows`` the initial batch capacity, ``rates`` the measured
    llama_decode rates, ``stats`` the engine's counters. ``control`` / ``abort`` are set by
    ``attach_control``."""

    def __init__(
        self,
        cells: Cells,
        lanes: dict[int, Lane],
        grammars: GrammarSet,
        rates: RateCurve,
        stats: dict[str, int],
        n_vocab: int,
        step_rows: int,
        batch_rows: int,
        speculator: Speculator,
    ) -> None:
        self.ctx = cells.ctx
        self.cells = cells
        self.lanes = lanes
        self.grammars = grammars
        self.rates = rates
        self.stats = stats
        self.n_vocab = n_vocab
        self.n_ubatch = int(L.llama_n_ubatch(self.ctx))
        self.step_rows = step_rows
        self.speculator = speculator
        self.batch = TokenBatch(batch_rows, step_rows)
        self.control = None
        self.abort: AbortWatch | None = None
        self.first_step_aborted = False  # the last tick's first step was aborted

    def attach_control(self, control: object) -> bool:
        """Read ``control``'s yield word (a ``basertd.shm.ControlBlock``) between steps, so the
        tick in flight ends after its current step once it is set, and arm llama.cpp's abort
        callback over it (an urgent reason ends the step itself). Returns True: this engine can
        yield (its capability record then says ``yield = step``)."""
        self.control = control
        self.abort = AbortWatch.attach(self.ctx, control)
        return True

    def yield_requested(self) -> bool:
        """The control segment's yield word is set (``basertd.shm.control``)."""
        c = self.control
        return c is not None and c.yield_reason() != 0

    def start(self, tick: Tick) -> None:
        """At the start of a tick: note whether the yield word was clear (only the abort
        callback's first-step rule reads it)."""
        if self.abort is not None:
            tick.clear_at_start = not self.yield_requested()

    def run(self, work: TickWork, tick: Tick) -> None:
        """The tick's prefills and decodes, round after round, until every grant is spent and every
        prefill fed, or a yield; then the abort callback is disarmed."""
        lanes = self.lanes
        self.speculator.forget_gone(lanes)  # draft sequences of lanes retired before the rounds
        for tag, eff in work.prefills:
            lane = lanes.get(tag)
            if lane is not None:
                tick.floor.setdefault(tag, lane.prefilled)
                lane.prefilled += eff
        tick.overshoot.update(work.overshoot)
        for tag, max_new in work.decodes:
            if tag in lanes:
                tick.grant[tag] = max_new
                tick.note(tag)
                tick.start_tokens[tag] = lanes[tag].n_tokens
        # Lanes with KV to catch up on before decoding: the plan's prefills in plan order, then
        # lanes whose admit needs internal feeding (cold fallback, re-decode of a cached prompt end).
        feed: list[Lane] = []
        seen: set[int] = set()
        for tag, _ in work.prefills:
            lane = lanes.get(tag)
            if lane is not None and tag not in seen and lane.kv_len < lane.prefilled:
                feed.append(lane)
                seen.add(tag)
        for w in work.admits:
            lane = lanes.get(w.rec.lane_tag)
            if lane is not None and lane.tag not in seen and lane.kv_len < lane.prefilled:
                feed.append(lane)
                seen.add(lane.tag)
        decode_order = [tag for tag, _ in work.decodes if tag in lanes]
        while True:
            active = [t for t in decode_order if tick.grant.get(t, 0) > 0 and t in lanes]
            if not active and not feed:
                break
            tick.replaying = self._replaying(active)
            if tick.steps and not tick.replaying and self.yield_requested():
                tick.yielded = True  # decode lanes keep the tokens they have (finish NONE)
                break
            self._grammar_fill(active)
            self._round(active, feed, tick)
            feed = [ln for ln in feed if ln.tag in lanes and ln.kv_len < ln.prefilled]
            if tick.on_partial is not None:
                for tag, toks in tick.fresh.items():
                    if toks:
                        if tick.on_partial_spec is not None:
                            tick.on_partial_spec(tag, *tick.spec.get(tag, (0, 0)))
                        tick.on_partial(tag, np.array(toks, dtype=np.uint32))
            tick.fresh.clear()
            if tick.yielded:
                break
        if tick.yielded:
            self._shed_cut_prefills(work, tick)
        if self.abort is not None:
            self.abort.disarm()

    def _replaying(self, tags: list[int]) -> bool:
        """Whether any of these lanes is still in its replay tail: replay units emit nothing (ABI
        rule 72), so the coordinator counts them from the grant, and the rounds must not be cut."""
        return any((ln := self.lanes.get(t)) is not None and ln.produced < ln.n_tokens for t in tags)

    def _grammar_fill(self, active: list[int]) -> None:
        """Fill the bitmasks of the round's constrained lanes that sample (not replaying) in one
        llguidance call, before their rows exist."""
        gs = []
        for tag in active:
            lane = self.lanes[tag]
            if lane.grammar is not None and lane.produced >= lane.n_tokens:
                gs.append(lane.grammar)
        self.grammars.fill(gs)

    def arm_abort(self, start: int, tick: Tick) -> None:
        """Before the batch part starting at row ``start``: let an urgent yield (an arrival that
        outranks the tick, a cancel, a drain; not the inter-token bound, which waits for the step
        boundary) abort that part mid-way, or not. A part is abortable when it is one ubatch, holds
        no rows a yield may not cut, no decoding lane of the round is in its replay tail, and the
        tick has made progress: a step already done, or, for the tick's first step, the yield word
        was clear when the tick began (the arrival is newer than the plan) and the previous tick
        did not lose its own first step the same way (so two ticks in a row always progress)."""
        w = self.abort
        if w is None:
            return
        end = self.batch.part_end(start)
        if start == self.batch.split:  # the rest of a step whose decode rows went first
            start = 0
        ok = (
            end - start <= self.n_ubatch
            and start >= tick.min_rows
            and not tick.replaying
            and (tick.steps > 0 or (tick.clear_at_start and not self.first_step_aborted))
        )
        if ok:
            w.arm()
        else:
            w.disarm()

    def _shed_cut_prefills(self, work: TickWork, tick: Tick) -> None:
        """After a yield: each lane whose planned prefill did not all run is reported exactly as a
        budget-shed chunk (one PREFILL_CHUNK entry per lane, tokens = planned - done; ABI rules 56,
        57), its cursor set back to what its KV holds."""
        self.stats["yields_total"] += 1
        if self.control is not None:
            self.control.note_yield_taken()
        by_tag = {e.lane_tag: e for e in work.shed if e.kind == ShedKind.PREFILL_CHUNK}
        for tag, _ in work.prefills:
            lane = self.lanes.get(tag)
            if lane is None or lane.kv_len >= lane.prefilled:
                continue
            cut = lane.prefilled - max(lane.kv_len, tick.floor.get(tag, 0))
            lane.prefilled -= cut
            entry = by_tag.get(tag)
            if entry is not None:
                entry.tokens += cut
            else:
                entry = ShedEntry(
                    lane_tag=tag, kind=ShedKind.PREFILL_CHUNK, reason=SHED_REASON_BUDGET, tokens=cut
                )
                by_tag[tag] = entry
                work.shed.append(entry)
                work.chunks_dropped += 1
            tick.grant[tag] = 0  # its decode waits for the prefill to resume (ABI rule 47)

    def _round(self, active: list[int], feed: list[Lane], tick: Tick) -> None:
        """One ``llama_decode`` (more if it exceeds n_batch): a token for every decoding lane that
        needs one, then the prefill runs; then every active lane takes one decode unit."""
        lanes = self.lanes
        feeding = {ln.tag for ln in feed}
        forward: list[Lane] = []
        ready: list[Lane] = []
        for tag in active:
            lane = lanes[tag]
            if tag in feeding:
                continue  # its unit takes the logits of its last prefill row
            if lane.kv_len == lane.produced - 1:
                forward.append(lane)
            elif lane.kv_len == lane.produced and (
                lane.held_row is not None or lane.produced < lane.n_tokens
            ):
                ready.append(lane)  # a held row, or a replayed token that needs no logits
            else:
                tick.fault(lane, FaultCode.INTERNAL, 1)
        if self.cells.streams:
            # llama.cpp puts the rows of consecutive stream ids, in batch order, in one ubatch
            # (the prefill keeps the plan's order: it decides which lane a short round feeds)
            forward.sort(key=lambda ln: ln.seq)
        # Never hand llama.cpp more tokens than the ledger has cells for (the plan was checked;
        # this only trips if a seeded admit fell back to a cold prefill after validation).
        while feed and len(forward) + sum(ln.prefilled - ln.kv_len for ln in feed) > self.cells.free:
            tick.fault(feed.pop(), FaultCode.OOM_TENTATIVE, 0)
        need_rows = len(forward) + sum(ln.prefilled - ln.kv_len for ln in feed)
        rows_free = min(self.step_rows - len(forward), self.cells.free - need_rows)
        drafts = self.speculator.plan(forward, len(active), tick, rows_free) if forward else {}
        need_rows += sum(int(d.shape[0]) for d in drafts.values())
        room = self._feed_room(forward, ready, feed, tick)
        b = self.batch
        if need_rows > b.capacity:
            self.batch = b = TokenBatch(need_rows, self.step_rows)
        b.clear()
        runs: list[tuple[Lane, int, int, bool]] = []  # lane, first row, rows, wants logits
        spec: list[tuple[Lane, int, np.ndarray]] = []  # lane, first row, drafts (``speculation``)
        for lane in forward:
            k = lane.kv_len
            d = drafts.get(lane.tag)
            if d is None:
                row = b.add(lane.tokens[k : k + 1], k, lane.seq, True)
                runs.append((lane, row, 1, True))
            else:  # the pending token and its drafts, a logits row each, all in the first step
                n = 1 + int(d.shape[0])
                toks = np.concatenate((lane.tokens[k : k + 1], d))
                first = b.add(toks, k, lane.seq, True, every=True) - n + 1
                runs.append((lane, first, n, False))
                spec.append((lane, first, d))
        n_decode_rows = b.n
        # Rows a yield may not cut come first: KV the coordinator already counts as prefilled (a
        # cold fallback, a cached prompt's last token); then this tick's planned chunks.
        for mandatory in (True, False):
            for lane in feed:
                floor = min(max(tick.floor.get(lane.tag, lane.prefilled), lane.kv_len), lane.prefilled)
                k, end = (lane.kv_len, floor) if mandatory else (max(floor, lane.kv_len), lane.prefilled)
                if not mandatory:
                    end = min(end, k + room)
                if end <= k:
                    continue
                if not mandatory:
                    room -= end - k
                want = end == lane.prefilled and end == lane.prefill_end and lane.produced == end
                row = b.add(lane.tokens[k:end], k, lane.seq, want)
                runs.append((lane, row - (end - k) + 1, end - k, want))
            if mandatory:
                tick.min_rows = b.n
        if b.n:
            self._decode_batch(runs, spec, n_decode_rows, tick)
        ready = [ln for ln in ready if ln.tag in lanes and tick.grant.get(ln.tag, 0) > 0]
        for lane in [ln for ln in ready if ln.held_row is None]:
            tick.units([lane], None)  # a replayed token: no logits
        held = [ln for ln in ready if ln.held_row is not None]
        if held:
            rows = np.stack([ln.held_row for ln in held])
            for lane in held:
                lane.held_row = None
            tick.units(held, rows)

    def _feed_room(self, forward: list[Lane], ready: list[Lane], feed: list[Lane], tick: Tick) -> int:
        """Planned prefill rows this round may carry (rows a yield may not cut are always fed).
        With lanes decoding beside the prefill, the tick's prefill is spread evenly over the rounds
        their grants leave, so each decoding lane gets a token every round rather than once the
        whole prefill has run (a round is then about prefill / grant rows, and the tick as long as
        before); with none decoding, all of it (split into steps by ``TokenBatch``)."""
        left = sum(ln.prefilled - max(tick.floor.get(ln.tag, ln.prefilled), ln.kv_len) for ln in feed)
        rounds = max((tick.grant.get(ln.tag, 0) for ln in (*forward, *ready)), default=0)
        if left <= 0 or rounds <= 1:
            return max(left, 0)
        if left <= MIN_ROUND_FEED:  # a short prefill (an interactive prompt) goes whole
            return left
        return -(-left // rounds)

    def _decode_batch(
        self,
        runs: list[tuple[Lane, int, int, bool]],
        spec: list[tuple[Lane, int, np.ndarray]],
        n_decode_rows: int,
        tick: Tick,
    ) -> None:
        n_vocab = self.n_vocab
        ctx = self.ctx
        lanes = self.lanes
        stats = self.stats
        grow = self.cells.grow

        def on_part(start: int, end: int) -> list[Lane]:
            """The part's KV and logits taken; returns the lanes whose prompt mark it crossed."""
            units: list[tuple[Lane, int]] = []  # lane, output row of this part
            out_of_row: np.ndarray | None = None
            marked: list[Lane] = []
            for lane, first, n, want in runs:
                lo, hi = max(first, start), min(first + n, end)
                if lo >= hi or lane.tag not in lanes:
                    continue
                k = hi - lo
                grow(lane.seq, k)
                lane.kv_len += k
                lane.content_gen += 1
                if lane.mark and lane.kv_len >= lane.mark:
                    marked.append(lane)
                if first >= n_decode_rows:
                    stats["prefill_tokens_total"] += k
                if want and lane.kv_len == lane.produced:
                    if out_of_row is None:  # llama_get_logits keeps the batch's output order
                        out_of_row = np.cumsum(self.batch.logits[start:end], dtype=np.int64) - 1
                    units.append((lane, int(out_of_row[first + n - 1 - start])))
            verify = [
                (ln, f, d) for ln, f, d in spec if start <= f and f + d.shape[0] < end and ln.tag in lanes
            ]
            if verify and out_of_row is None:
                out_of_row = np.cumsum(self.batch.logits[start:end], dtype=np.int64) - 1
            if not units and not verify:
                return marked
            n_out = int(out_of_row[-1]) + 1
            logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), (n_out, n_vocab))
            go = [(ln, o) for ln, o in units if tick.grant.get(ln.tag, 0) > 0]
            for lane, o in units:
                if tick.grant.get(lane.tag, 0) <= 0:
                    lane.held_row = logits[o].copy()
            if go:
                idx = [o for _, o in go]
                contiguous = idx == list(range(idx[0], idx[0] + len(idx)))
                rows = logits[idx[0] : idx[0] + len(idx)] if contiguous else logits[idx]
                tick.units([ln for ln, _ in go], rows)
            for lane, first, d in verify:
                o = int(out_of_row[first - start])
                self.speculator.verify(tick, lane, logits[o : o + d.shape[0] + 1], d)
            return marked

        def stop(rows_done: int) -> bool:
            if rows_done < tick.min_rows or not self.yield_requested():
                return False
            tick.yielded = True
            return True

        def on_step(start: int, end: int) -> None:
            if end != self.batch.split:  # decode rows split off are not a step of their own
                tick.steps += 1
            for lane in on_part(start, end):
                # the window of the mark is intact right after the llama_decode that crossed it;
                # taken once the part's logits are read (a snapshot may run a llama_decode: cells)
                if lane.tag in lanes:
                    tick.parts.seeds.snapshot_prompt(lane.seq, lane.tokens, lane.mark, lane.taint)
                    lane.mark = 0

        def arm(start: int) -> None:
            self.arm_abort(start, tick)

        t = time.perf_counter_ns()
        try:
            split = n_decode_rows if self.batch.n - n_decode_rows >= SPLIT_MIN_PREFILL_ROWS else 0
            done = self.batch.decode(ctx, on_step, stop, arm if self.abort is not None else None, split)
        except BatchDecodeError as exc:
            if exc.rc < -1:
                raise EngineFatal(Status.ERR_FATAL, str(exc)) from exc
            for lane, first, n, _ in runs:
                if first + n > exc.start and lane.tag in lanes:
                    tick.fault(lane, FaultCode.INTERNAL, exc.rc & _U32)
        dt = time.perf_counter_ns() - t
        if self.batch.aborted:
            tick.yielded = True
            self.first_step_aborted = tick.steps == 0
            stats["yield_aborts_total"] += 1
            stats["yield_abort_rows_total"] += self.batch.part_end(done) - done
        elif tick.steps:
            self.first_step_aborted = False
        for rows, ns in self.batch.parts:
            self.rates.note(rows, ns)
        parts = self.batch.parts
        if n_decode_rows and parts and parts[0][0] == n_decode_rows:  # decode rows alone (``verify_cost``)
            m = sum(int(d.shape[0]) for _, _, d in spec)
            self.speculator.cost.note(n_decode_rows - m, m, parts[0][1])
        if self.batch.n > n_decode_rows:
            decode_ns = decode_share_ns(n_decode_rows, parts)
            tick.decode_ns += decode_ns
            tick.prefill_ns += max(0, dt - decode_ns)
        else:
            tick.decode_ns += dt
