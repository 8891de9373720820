"""The plan's admits in one llama.cpp tick: a ``Lane`` each, or a REJECTED admit result when no
certificate serves it (ABI rules 14, 119, 122).

A lane holds ``context_length`` token slots (int32) with the prompt first; its sequence is a fresh
one (``Cells.take_seq``) or the seed lease's, seated with ``Seeds.seat`` (ABI rules 75-83; a seed
whose sliding window was lost is a cold fallback that prefills from 0). Its sampler takes the
admit's sampling, parameters, logprobs request and logit-bias table; its grammar starts from the
matcher of the admit's grammar handle advanced over the replayed tokens (rule 74); a certified
strategy slot gives it prompt-lookup speculation (``speculation.LaneSpec``). The plan was
validated first (``validate``), so nothing here refuses it.
"""

from __future__ import annotations

import numpy as np

from basertd.schema.abi import AdmitStatus, Sampling, Status
from basertd.schema.tick import AdmitResult
from basertd.worker.engines.llamacpp import sampling
from basertd.worker.engines.llamacpp.lane import Lane
from basertd.worker.engines.llamacpp.speculation import LaneSpec
from basertd.worker.engines.llamacpp.tick import Tick
from basertd.worker.engines.llamacpp.work import AdmitWork, TickWork

_U32 = (1 << 32) - 1


def u32_status(status: Status) -> int:
    """``status`` as the u32 bits a record carries (ABI rule 15: two's complement)."""
    return int(status) & _U32


def admit(tick: Tick, work: TickWork) -> None:
    """The plan's admits: a lane each (seated on its seed), or REJECTED when no certificate
    serves it (rules 14, 119, 122)."""
    for w in work.admits:
        tag = w.rec.lane_tag
        if w.cert_reject:
            tick.ev.admit_results.append(
                AdmitResult(
                    lane_tag=tag,
                    status=AdmitStatus.REJECTED,
                    reject_code=u32_status(Status.REJECT_CERT_UNMATCHED),
                )
            )
            continue
        tick.lanes[tag] = _new_lane(tick, w)
        tick.ev.admit_results.append(
            AdmitResult(lane_tag=tag, status=AdmitStatus.ADMITTED, cert_id=w.cert_id, granted_class=w.granted)
        )


def _new_lane(tick: Tick, w: AdmitWork) -> Lane:
    """The lane of admit ``w``: its tokens, sampler, sequence (a fresh one, or seated on its seed
    lease: ``Seeds.seat``, cold when the window was lost), grammar and speculation."""
    p = tick.parts
    a = w.rec
    n = w.prompt.shape[0]
    tokens = np.zeros(tick.context_length, np.int32)
    tokens[:n] = w.prompt
    bias = p.logit_biases.get(a.logit_bias_handle) if a.logit_bias_handle else None
    cfg = sampling.SamplerConfig.from_admit(a.sampling, a.params, a.want_logprobs, bias)
    kv_len, produced = w.kv_len, w.produced
    if w.lease is None:
        seq, taint, cold = p.cells.take_lane_seq(), 0, w.cold_fallback
    else:
        seq, taint, cold = p.seeds.seat(w.lease, w.share_len, w.cold_fallback)
        if cold:
            kv_len, produced = 0, w.prefill_end
    return Lane(
        tag=a.lane_tag,
        seq=seq,
        handle=p.new_handle(),
        tokens=tokens,
        n_tokens=n,
        prompt_len=n,
        prefill_end=w.prefill_end,
        prefilled=w.prefilled,
        kv_len=kv_len,
        produced=produced,
        sampling=Sampling(a.sampling),
        cfg=cfg,
        rng_base=a.rng_counter_base,
        determinism_class=a.determinism_class,
        taint=taint,
        seeded_tokens=0 if cold else w.share_len,
        grammar=tick.grammars.lane_grammar(a.grammar_handle, w.prompt[n - a.grammar_replay :]),
        spec=None if w.lookup is None else LaneSpec(w.lookup, w.cert_id),
        mark=p.seeds.prompt_mark(w.prefill_end, kv_len),
    )
