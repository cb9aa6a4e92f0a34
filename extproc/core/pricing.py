"""What a release costs, with the engines' prefix caches counted: one model's cost model and its account of the caches.

A request is estimated when it is queued (``cost.py``: from its size and its
tenant's averages), priced again when it is released to an endpoint whose
cache likely holds part of its prompt (those tokens cost
``cached_input_weight``), and measured when its stream ends (its occupancy
times the decode rate the scrapes show). The account of what each
endpoint's cache holds (``prefix_cache.py``) answers two more questions: how
many prompt tokens a queued request would find cached if released now (what
the ``locality`` policy orders by), and at each endpoint (what picking weighs
against load). Only requests with a prefix signature take part; the others
are priced by size alone.

Pure: the model's state (``model_state.py``) calls it; it reads the pool only
to know where picking would look.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from extproc.core.cost import Charge, CostModel, CostWeights, DecodeRate, Estimate
from extproc.core.held import Held
from extproc.core.prefix_cache import PrefixCaches
from extproc.core.release.pool import Pool
from extproc.core.values.engine_load import EngineLoad


class Pricing:
    """One model's cost model, decode rate and account of its endpoints' prefix caches."""

    def __init__(self, pool: Pool, weights: CostWeights) -> None:
        self._pool = pool
        self._cost = CostModel(weights)
        self._decode_rate = DecodeRate()
        # What each endpoint's prefix cache likely holds (requests with a prefix signature only).
        self._caches = PrefixCaches()

    def reweigh(self, weights: CostWeights) -> None:
        """New weights, from the next estimate on (a reload); the tenants' averages are kept."""
        self._cost.weights = weights

    def engine_context(self, max_model_len: int | None) -> None:
        """An endpoint's engine says its context length: the clamp where none is configured (the largest said wins)."""
        if max_model_len is not None:
            self._cost.engine_context = max(max_model_len, self._cost.engine_context or 0)

    def estimate(self, tenant: str, content_length: int | None, max_tokens: float | None) -> Estimate:
        """What a request is charged when released, before its endpoint is known (``CostModel.estimate``)."""
        return self._cost.estimate(tenant, content_length, max_tokens)

    def expect(self, tenant: str, content_length: int | None, max_tokens: float | None) -> tuple[float, float]:
        """The prompt and output tokens a request would be charged, learning nothing (``CostModel.expect``)."""
        return self._cost.expect(tenant, content_length, max_tokens)

    def expected_hit(self, held: Held) -> float:
        """The prompt tokens ``held`` would find cached if released now: where picking would look, at best."""
        prefix = held.request.prefix
        if not prefix.blocks:
            return 0.0
        if not self._pool.pick_endpoints:
            return self._caches.expected(prefix, self._cache_of(held))
        return self._caches.best(prefix, self._pool.serving(held.request.eligible))

    def hit_at(self, held: Held) -> Callable[[str], float] | None:
        """Per endpoint, the prompt tokens ``held`` would find cached there (picking weighs them); None: no signature."""
        prefix = held.request.prefix
        if not prefix.blocks:
            return None
        return lambda endpoint: self._caches.expected(prefix, endpoint)

    def at_release(self, held: Held) -> Estimate:
        """``held``, released to its endpoint: its prefix joins that cache's account, and its estimate prices the cached part."""
        prefix, estimate = held.request.prefix, held.estimate
        if not prefix.blocks:
            return estimate
        cache = self._cache_of(held)
        rest = max(0.0, estimate.prompt_tokens - prefix.tokens) + estimate.output_tokens
        predicted = self._caches.released(cache, prefix, rest)
        return self._cost.cached_at(estimate, predicted, self._caches.factor(cache))

    def measure(self, held: Held, occupancy_s: float) -> Charge:
        """What ``held`` cost in the end, from how long it was released (its stream ended, or it was preempted)."""
        return self._cost.measure(held.request.tenant, held.estimate, occupancy_s, self._decode_rate.rate,
                                  self._caches.factor(self._cache_of(held)))

    def scraped(self, endpoint: str, load: EngineLoad, started_at: float) -> None:
        """A usable scrape: the decode rate learns from its counters, the cache account from its hits."""
        self._decode_rate.record(endpoint, load.generation_tokens, load.running, started_at)
        self._caches.scraped(endpoint, load)

    def forget(self, endpoints: Iterable[str]) -> None:
        """Endpoints that left the pool: their cache accounts go."""
        self._caches.forget(endpoints)

    def _cache_of(self, held: Held) -> str:
        """Whose cache account a release's prefix goes into: its endpoint; without picking, the pool's one or all as one."""
        if held.endpoint is not None:
            return held.endpoint
        endpoints = self._pool.endpoints
        return endpoints[0] if len(endpoints) == 1 else ""
