"""basertd: a serving daemon for LLM inference.

The coordinator (this package's own modules) owns clients, queues, the scheduler and the
prefix-cache policy; ``basertd.worker`` runs one engine per GPU; they meet only in
``basertd.schema`` (DESIGN.md "Layout").
"""

__version__ = "0.1.0"
