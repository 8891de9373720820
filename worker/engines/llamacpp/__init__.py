"""The llama.cpp engine adapter: real GGUF models through llama-cpp-python 0.3.36's low-level API
(DESIGN.md "Engines"; ``../shared/reference/llamacpp-notes.md``).

``LlamaCppEngine`` implements ``basertd.worker.engines.base.Engine``. Modules, one concept each:
``engine`` (the Engine surface, composing the rest), ``context`` (the llama_context and its
sizes), ``cells`` (llama.cpp memory, the KV cell ledger of ``pool`` and sequence ids, changed
together), ``seeds`` (matches, leases, publish, evict, over ``prefix_cache``: published prefixes,
leases, sliding-window rules), ``sequences`` (bare sequences, forks, adoption), ``ops`` (exports,
snapshots, restores), ``state`` (sealed envelopes), ``validate`` (plan -> reject codes),
``feasibility`` (the KV a plan may need) and ``work`` (the validated plan), ``tick`` (one
tick's state and lane work), ``rounds`` (decode rounds, batches, yield and abort), ``batch`` (the
reused llama_batch), ``model`` (loading, vocabulary, model id), ``lane`` (per-lane cursors),
``sampling`` (vectorised samplers, counter-based RNG, logit biases), ``rings`` (the engine's side
of the BRTRING1 rings), ``factory`` (``open_engine``, the worker registry's entry point).
"""

from basertd.worker.engines.llamacpp.engine import LlamaCppEngine
from basertd.worker.engines.llamacpp.factory import open_engine
from basertd.worker.engines.llamacpp.seeds import KV_SPACE_ID

__all__ = ["KV_SPACE_ID", "LlamaCppEngine", "open_engine"]
