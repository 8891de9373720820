"""Speculation strategies a worker registers at load, before admission (tick ABI §2): the
``--speculation`` flag's value, the registrations it makes and the ``StrategyOffer`` records the
capability record carries to the coordinator.

``--speculation prompt-lookup:draft_min=1,draft_max=8,ngram_min=2,ngram_max=4,max_batch_lanes=4,``
``min_accept_permille=150`` (every key optional; the ``LookupConfig`` defaults fill the rest);
``--speculation draft-model:draft_min=1,draft_max=8,max_batch_lanes=4,min_accept_permille=150``
(``DraftConfig``) with the draft GGUF in ``--draft-model PATH``. A registration the engine refuses
(a draft model that does not load or whose vocabulary differs: ERR_REGISTRATION_REFUSED), a
draft-model strategy without a ``--draft-model`` path, or an engine without the SPECULATION
capability, leaves the worker serving without that strategy (logged): speculation is an
optimisation, never a reason not to start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from basertd.schema import link
from basertd.worker.engines.base import Capability, Engine, EngineError
from basertd.worker.engines.draft import DRAFT_MODEL, DraftConfig, draft_registration
from basertd.worker.engines.lookup import PROMPT_LOOKUP, LookupConfig, lookup_registration

_CONFIGS: dict[str, type[LookupConfig] | type[DraftConfig]] = {
    PROMPT_LOOKUP: LookupConfig,
    DRAFT_MODEL: DraftConfig,
}
STRATEGY_IDS = tuple(_CONFIGS)
"""The strategies ``--speculation`` accepts."""


class SpeculationArgError(ValueError):
    """A ``--speculation`` value that does not parse (the message names the part)."""


def parse_speculation(value: str) -> LookupConfig | DraftConfig:
    """``"prompt-lookup[:key=int,...]"`` -> its ``LookupConfig``, ``"draft-model[:key=int,...]"``
    -> its ``DraftConfig``. Raises SpeculationArgError for another strategy, an unknown key, a
    non-integer or an out-of-bounds value."""
    name, _, rest = value.partition(":")
    if name not in STRATEGY_IDS:
        raise SpeculationArgError(f"unknown strategy {name!r} (known: {', '.join(STRATEGY_IDS)})")
    cls = _CONFIGS[name]
    fields: dict[str, int] = {}
    for part in filter(None, rest.split(",")):
        key, eq, num = part.partition("=")
        if not eq or key not in cls.__dataclass_fields__:
            raise SpeculationArgError(f"{name}: unknown setting {part!r}")
        try:
            fields[key] = int(num)
        except ValueError:
            raise SpeculationArgError(f"{name}: {key} must be an integer, got {num!r}") from None
    try:
        return cls(**fields)
    except ValueError as exc:
        raise SpeculationArgError(f"{name}: {exc}") from None


def speculation_arg(cfg: LookupConfig | DraftConfig) -> str:
    """The ``--speculation`` value of ``cfg`` (``parse_speculation``'s inverse)."""
    name = DRAFT_MODEL if isinstance(cfg, DraftConfig) else PROMPT_LOOKUP
    keys = type(cfg).__dataclass_fields__
    return f"{name}:" + ",".join(f"{k}={getattr(cfg, k)}" for k in keys)


def register(
    engine: Engine, configs: Sequence[LookupConfig | DraftConfig], log: Any, draft_model: str | None = None
) -> list[link.StrategyOffer]:
    """Register each config on ``engine`` (a ``DraftConfig`` with the GGUF at ``draft_model``);
    returns what the capability record offers: one ``StrategyOffer`` per certificate of each
    granted strategy, in ``configs`` order and then the engine's (the llama.cpp engine: greedy,
    then sampled), all naming the strategy's one slot; one offer without a certificate for a
    strategy granted none."""
    if not configs:
        return []
    if not engine.supports(Capability.SPECULATION):
        log.warning("speculation_unsupported", strategies=len(configs))
        return []
    offers = []
    for cfg in configs:
        if isinstance(cfg, DraftConfig):
            if not draft_model:
                log.warning("strategy_refused", strategy=DRAFT_MODEL, reason="no --draft-model path")
                continue
            reg = draft_registration(cfg, draft_model)
        else:
            reg = lookup_registration(cfg)
        name = reg.strategy_id
        try:
            grant = engine.strategy_register(reg)
        except EngineError as exc:
            log.warning("strategy_refused", strategy=name, status=exc.status.name, reason=str(exc))
            continue
        slot = grant.strategy_slot
        mine = [
            link.StrategyOffer(
                strategy_id=name,
                strategy_slot=slot,
                cert_id=c.cert_id,
                exactness=int(c.exactness),
                sampling_modes=int(c.sampling_modes),
                param_domain=int(c.param_domain),
                grammar_allowed=bool(c.grammar_allowed),
                logit_bias_allowed=bool(c.logit_bias_allowed),
            )
            for c in grant.certificates
        ] or [link.StrategyOffer(strategy_id=name, strategy_slot=slot)]
        log.info(
            "strategy_registered",
            strategy=name,
            slot=slot,
            cert_ids=[o.cert_id for o in mine if o.cert_id],
        )
        offers += mine
    return offers
