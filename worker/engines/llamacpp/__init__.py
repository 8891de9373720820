"""The llama.cpp engine adapter: real GGUF models through llama-cpp-python 0.3.36's low-level API
(DESIGN.md "Engines"; ``../shared/reference/llamacpp-notes.md``).

``LlamaCppEngine`` implements ``basertd.worker.engines.base.Engine``. Modules, one concept each:
``model`` (loading, vocabulary, model id), ``batch`` (the reused llama_batch), ``pool`` (the KV cell
ledger), ``lane`` (per-lane cursors), ``sampling`` (vectorised samplers, counter-based RNG),
``validate`` (plan -> reject codes), ``prefix_cache`` (published prefixes, leases, sliding-window
rules), ``cells`` (llama.cpp memory, the ledger and sequence ids, changed together), ``seeds``
(matches, leases, publish, evict), ``state`` (sealed envelopes), ``ops`` (bare sequences,
snapshot / restore), ``rings`` (the engine's side of the BRTRING1 rings), ``tick`` (one tick's
state and lane work), ``rounds`` (decode rounds, batches, yield and abort), ``engine`` (the Engine
surface), ``factory`` (``open_engine``, the worker registry's entry point).
"""

from basertd.worker.engines.llamacpp.engine import LlamaCppEngine
from basertd.worker.engines.llamacpp.factory import open_engine
from basertd.worker.engines.llamacpp.seeds import KV_SPACE_ID

__all__ = ["KV_SPACE_ID", "LlamaCppEngine", "open_engine"]
