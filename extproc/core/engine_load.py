"""What one engine endpoint's ``/metrics`` said: the one value the adapters hand the core per scrape.

The engine adapter (``adapters/engines/dialects.py``) reads each engine's own
metric names into it; the release side (``core/release``), the cost model's
decode rate and the telemetry read it. It lives alone so that none of them
has to import another to name it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLoad:
    """One endpoint's state as its ``/metrics`` reported it.

    ``itl_sum``/``itl_count`` are cumulative counters (seconds spent between
    tokens, and tokens); only their deltas mean anything.
    """

    waiting: float
    running: float
    kv_usage: float | None = None
    itl_sum: float | None = None
    itl_count: float | None = None
    # Cumulative generated tokens, where the dialect has the counter (the cost model's decode rate).
    generation_tokens: float | None = None
    # Cumulative prompt tokens looked up in the prefix cache, and found there (vLLM's prefix_cache_* counters).
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    # The KV cache's size in tokens (vLLM: cache_config_info's num_gpu_blocks x block_size).
    kv_capacity_tokens: float | None = None
    # Cumulative requests the engine refused because its own queue cap was reached (vLLM's
    # admission_rejections_total), from every client, the gateway's and any that bypass it.
    rejected: float | None = None
