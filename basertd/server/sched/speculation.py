"""Which speculation strategy a lane runs (tick ABI §2 ``LaneAdmit.strategy_slot``), decided by
the coordinator at each admission from the request's ``speculation`` field and what the worker
registered (``WorkerLimits.strategies``, one ``link.StrategyOffer`` per certificate). Pure
functions.

A lane gets a strategy's slot only when that strategy's certificate covers it, so the engine never
refuses the admit (REJECT_CERT_UNMATCHED) and the granted exactness is the certificate's, never
APPROXIMATE: its sampling mode (greedy lanes are GREEDY; sampled lanes GUMBEL) and parameter domain
(GREEDY_ONLY: temperature 0; PENALTY_FREE: no penalties; ANY), a grammar only when the certificate
allows grammars, a logit bias only when it allows biases. "auto" takes the first covering offer
the worker made; a strategy name takes that strategy's first covering offer; "off" none. A
llama.cpp worker's prompt-lookup and draft-model each have a greedy certificate (GREEDY_ONLY) and a
sampled one (GUMBEL, ANY: the rejection rule), so greedy and sampled lanes both speculate under
"auto"; grammar lanes never do. What "auto" does after that is the engine's, with the
coordinator's ``[speculation]`` knobs (registered at load): no drafts in rounds of more than
``max_batch_lanes`` decoding lanes, a lane whose acceptance does not pay pauses its drafts
(``basertd.worker.engines.llamacpp.speculation``).
"""

from __future__ import annotations

from collections.abc import Sequence

from basertd.schema import link
from basertd.schema.abi import CertDomain, CertMode, Sampling
from basertd.server.request.record import Sampler

AUTO = "auto"
OFF = "off"
OVERSHOOT_MAX = 64
"""The most tokens a speculating lane's last round of a tick may commit past its grant: the
largest ``[speculation] draft_max`` the config accepts (a round commits its accepted drafts and one
more token, and starts only while the grant lasts)."""


def _greedy(sampler: Sampler) -> bool:
    return sampler.mode == Sampling.GPU_GREEDY or sampler.params.temperature <= 0.0


def covers(offer: link.StrategyOffer, sampler: Sampler, grammar: bool) -> bool:
    """``offer``'s certificate covers a lane sampled by ``sampler`` (with a grammar when
    ``grammar``); False without a certificate."""
    if not offer.cert_id:
        return False
    p = sampler.params
    greedy = _greedy(sampler)
    mode = CertMode.GREEDY if sampler.mode == Sampling.GPU_GREEDY else CertMode.GUMBEL
    if not offer.sampling_modes & mode:
        return False
    penalty_free = p.freq_penalty == 0.0 and p.presence_penalty == 0.0 and p.repeat_penalty in (0.0, 1.0)
    domain = {CertDomain.GREEDY_ONLY: greedy, CertDomain.PENALTY_FREE: penalty_free, CertDomain.ANY: True}
    if not domain.get(offer.param_domain, False):
        return False
    if grammar and not offer.grammar_allowed:
        return False
    return not (sampler.logit_bias and not offer.logit_bias_allowed)


def strategy_for(
    mode: str, sampler: Sampler, grammar: bool, offers: Sequence[link.StrategyOffer]
) -> link.StrategyOffer | None:
    """The strategy a lane of a request with ``speculation`` = ``mode`` runs (module docstring),
    or None (``strategy_slot`` 0)."""
    if mode == OFF:
        return None
    for offer in offers:
        if (mode == AUTO or offer.strategy_id == mode) and covers(offer, sampler, grammar):
            return offer
    return None


def overshoot(strategy: str, grant: int, headroom: int, replaying: bool) -> int:
    """``LaneDecode.overshoot`` of a lane decoding ``grant`` tokens this tick (tick ABI §2: tokens a
    speculative round may commit past ``max_new_tokens``): the request's ``headroom`` past the
    grant (``max_tokens`` less the tokens generated, less ``grant``), at most ``OVERSHOOT_MAX``, for
    a lane on a strategy (``strategy`` not ""); 0 for a plain lane, a lane still replaying
    delivered tokens (replay units keep their one-token shape, ABI rule 72) and when the grant is
    the request's end. Without it a round drafts at most ``grant - 1`` tokens, so the decode grant
    (``[scheduler] decode_grant``), not ``draft_max``, would bound every draft."""
    if not strategy or replaying:
        return 0
    return max(0, min(OVERSHOOT_MAX, headroom - grant))


def explicit_refusal(mode: str, enabled: Sequence[str], grammar: bool) -> str | None:
    """Why a request's ``speculation`` value cannot be honoured, or None: an unknown value or a
    strategy the ``[speculation]`` config does not enable, or a named strategy for a request with
    a grammar (no certificate covers grammar lanes). Greedy and sampled requests may name a strategy
    (its certificates cover both). "auto" and "off" always pass (auto simply decodes plainly where
    nothing covers the lane)."""
    if mode in (AUTO, OFF):
        return None
    if mode not in enabled:
        names = ", ".join([AUTO, OFF, *enabled])
        return f"speculation must be one of {names}, got {mode!r}"
    if grammar:
        return f"speculation {mode!r} does not run with structured output: use auto or off"
    return None


def named_refusal(
    mode: str, sampler: Sampler, grammar: bool, offers: Sequence[link.StrategyOffer], worker: str
) -> str | None:
    """Why a request naming strategy ``mode`` cannot run it on ``worker`` (a name for messages)
    whose handshake registered ``offers``, or None: the worker registered no strategy of that
    name (its registration was refused at load: a draft model that did not load, say), or none of
    that strategy's certificates covers the request (``covers``: an engine whose certificates
    cover greedy lanes only, say). "auto" and "off" always pass. Call once the worker has
    handshaken (before, it offers nothing yet)."""
    if mode in (AUTO, OFF):
        return None
    named = [o for o in offers if o.strategy_id == mode]
    if not named:
        return f"speculation {mode!r} is not registered by {worker} (its log says why): use auto or off"
    if not any(covers(o, sampler, grammar) for o in named):
        kind = (
            "greedy" if sampler.mode == Sampling.GPU_GREEDY or sampler.params.temperature <= 0 else "sampled"
        )
        return (
            f"speculation {mode!r} does not cover this {kind} request on {worker} "
            '(its certificates: README "Speculative decoding"): use auto or off'
        )
    return None
