"""What one engine endpoint's ``/metrics`` said: the one value the adapters hand the core per scrape.

The engine adapter (``adapters/protocol/dialects.py``) reads each engine's own
metric names into it; the release side (``core/release``), the cost model's
decode rate and the telemetry read it. It lives alone so that none of them
has to import another to name it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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


@dataclass(frozen=True)
class EngineLimits:
    """What an engine says of its own limits (None: it does not say; see docs/engines.md per engine).

    Read once per endpoint (at start, and whenever it comes back), not per
    scrape: they are its start-up arguments.
    """

    # Requests it runs at once (its batch size: SGLang max_running_requests, llama.cpp total_slots).
    max_running: int | None = None
    # Requests it holds, running and waiting, before it refuses more (its own queue cap: TGI
    # max_concurrent_requests; SGLang max_running_requests + max_queued_requests).
    max_held: int | None = None
    # Tokens of one request, prompt and output (vLLM and SGLang max_model_len, TGI max_total_tokens).
    max_model_len: int | None = None
    # It orders its waiting queue by each request's `priority`: "lower" values first (vLLM --scheduling-policy
    # priority; SGLang with --schedule-low-priority-values-first) or "higher" first (SGLang's default).
    priority_first: Literal["lower", "higher"] | None = None

    def too_tight(self, target_waiting: int, runs: float | None) -> str:
        """Why the engine's own cap would refuse what the gate sends it ("" if it would not).

        ``runs``: what the engine runs at once, where the engine does not say
        (the operator's ``max_running``, else the most it was seen running).
        """
        running = self.max_running if self.max_running is not None else runs
        if self.max_held is None or running is None or self.max_held >= running + target_waiting:
            return ""
        return (f"its queue cap holds {self.max_held} requests, below the {running:g} it runs plus the gate's "
                f"target_waiting {target_waiting}: it will refuse requests the gateway releases; raise its cap "
                f"to at least {running + target_waiting:g}, plus room for clients that bypass the gateway")
