"""What each endpoint's prefix cache likely holds: a model of the engines' KV caches, from what we sent them.

The engine does not say which prefixes it holds, only how many prompt tokens
it looked up and found (vLLM's ``vllm:prefix_cache_queries_total`` and
``vllm:prefix_cache_hits_total``). So the processor keeps its own account of
what it released where, and corrects it by those counters.

The account, per endpoint
  An LRU of the blocks (``core/prefix.py``) of the prompts released to it,
  sized from its KV capacity as scraped (``EngineLoad.kv_capacity_tokens``;
  :data:`DEFAULT_CAPACITY_TOKENS` until a page says). A release touches its
  hashed blocks, and also pushes the rest of what it will hold (the prompt
  beyond the hashed blocks, its output) through the LRU as one anonymous
  entry: a flood of unrelated long requests evicts a cached document as it
  would in the engine. A request's blocks are put in last block first, so
  its first block is the most recent and the last to be evicted, as vLLM's
  free-block queue frees a request's blocks tail first: what survives is a
  leading run, and the expected hit is found by bisection.

The correction, per endpoint
  Each scrape with the counters compares what the engine found (the hits'
  growth) with what the account predicted for the releases to it since the
  last scrape; both are averaged over the last few scrapes (releases reach the
  engine's counters 50-400 ms late, so one interval's pair does not match)
  and their ratio, clamped to ``[0, 1]``, scales every prediction. An engine
  with prefix caching off drives it to 0 (locality then changes nothing);
  one that evicts sooner than the account lowers it. It never exceeds 1: hits
  the account did not predict (a shared system prompt shorter than a block)
  are not ours to order by. An engine without the counters (TGI, llama.cpp)
  keeps the account uncorrected.

Pure: no clock and no I/O; the dispatcher calls it on releases and scrapes.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Iterable

from extproc.core.prefix import Prefix
from extproc.core.values.engine_load import EngineLoad

# An engine's KV cache until its page says its size: a small GPU's.
DEFAULT_CAPACITY_TOKENS = 65_536.0
# The weight of the newest scrape in the averages of found and predicted hits.
CORRECTION_WEIGHT = 0.2


class EndpointCache:
    """One endpoint's account (see the module docstring)."""

    def __init__(self) -> None:
        # Block hash (or an anonymous entry's number) -> the tokens it holds; oldest first.
        self._lru: OrderedDict[int | tuple[str, int], float] = OrderedDict()
        self._held = 0.0
        self.capacity = DEFAULT_CAPACITY_TOKENS
        self.factor = 1.0
        self._predicted = 0.0  # predicted hit tokens of releases since the last counted scrape
        self._found_avg: float | None = None
        self._predicted_avg: float | None = None
        self._last: tuple[float, float] | None = None  # (queries, hits) counters at the last scrape

    def leading(self, prefix: Prefix) -> int:
        """How many of ``prefix``'s leading blocks the account holds."""
        blocks, lru = prefix.blocks, self._lru
        if not blocks or blocks[0] not in lru:
            return 0  # the common case of a request with nothing cached: one lookup
        low, high = 1, len(blocks)  # blocks[:low] held; blocks[high:] not
        while low < high:
            middle = (low + high + 1) // 2
            if blocks[middle - 1] in lru:
                low = middle
            else:
                high = middle - 1
        return low

    def expected(self, prefix: Prefix) -> float:
        """The prompt tokens of ``prefix`` expected cached here, corrected by the engine's counters."""
        return self.leading(prefix) * prefix.block_tokens * self.factor

    def released(self, prefix: Prefix, other_tokens: float, anonymous: tuple[str, int]) -> float:
        """A request with ``prefix`` and ``other_tokens`` more to hold was released here; its predicted hit (uncorrected)."""
        predicted = self.leading(prefix) * prefix.block_tokens
        self._predicted += predicted
        lru = self._lru
        for block in reversed(prefix.blocks):
            if block in lru:
                lru.move_to_end(block)
            else:
                lru[block] = prefix.block_tokens
                self._held += prefix.block_tokens
        if other_tokens > 0:
            lru[anonymous] = other_tokens
            self._held += other_tokens
        self._evict()
        return predicted

    def _evict(self) -> None:
        while self._held > self.capacity and self._lru:
            _, tokens = self._lru.popitem(last=False)
            self._held -= tokens

    def scraped(self, load: EngineLoad) -> None:
        """Take the page's capacity and counters (module docstring)."""
        capacity = load.kv_capacity_tokens
        if capacity is not None and math.isfinite(capacity) and capacity >= 1:
            self.capacity = capacity
            self._evict()
        queries, hits = load.prefix_queries, load.prefix_hits
        if queries is None or hits is None or not (math.isfinite(queries) and math.isfinite(hits)):
            return
        last, self._last = self._last, (queries, hits)
        predicted, self._predicted = self._predicted, 0.0
        if last is not None and (queries < last[0] or hits < last[1]):
            self.restarted()  # its counters went down: a new engine, with an empty cache
            return
        if last is None:
            return
        self._found_avg = _blend(self._found_avg, hits - last[1])
        self._predicted_avg = _blend(self._predicted_avg, predicted)
        if self._predicted_avg > 0:
            self.factor = min(1.0, max(0.0, self._found_avg / self._predicted_avg))

    def restarted(self) -> None:
        """The engine restarted (or left): its cache is empty."""
        self._lru.clear()
        self._held = 0.0


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - CORRECTION_WEIGHT) * old + CORRECTION_WEIGHT * new


class PrefixCaches:
    """One model's endpoints' accounts: what a release with a prefix may expect where."""

    def __init__(self) -> None:
        self._caches: dict[str, EndpointCache] = {}
        self._numbers = itertools.count()

    def of(self, endpoint: str) -> EndpointCache:
        cache = self._caches.get(endpoint)
        if cache is None:
            cache = self._caches[endpoint] = EndpointCache()
        return cache

    def expected(self, prefix: Prefix, endpoint: str) -> float:
        """The tokens of ``prefix`` expected cached at ``endpoint`` (0 for an endpoint never released to)."""
        cache = self._caches.get(endpoint)
        return cache.expected(prefix) if cache is not None and prefix.blocks else 0.0

    def best(self, prefix: Prefix, endpoints: Iterable[str]) -> float:
        """The most tokens of ``prefix`` expected cached at any of ``endpoints``."""
        if not prefix.blocks:
            return 0.0
        return max((self.expected(prefix, e) for e in endpoints), default=0.0)

    def released(self, endpoint: str, prefix: Prefix, other_tokens: float) -> float:
        """A release went to ``endpoint``; its predicted hit before correction (the cost's correction rescales it)."""
        return self.of(endpoint).released(prefix, other_tokens, (endpoint, next(self._numbers)))

    def factor(self, endpoint: str) -> float:
        """How far the engine's counters confirm the account at ``endpoint`` (1: fully, or no counters)."""
        cache = self._caches.get(endpoint)
        return cache.factor if cache is not None else 1.0

    def scraped(self, endpoint: str, load: EngineLoad) -> None:
        self.of(endpoint).scraped(load)

    def forget(self, endpoints: Iterable[str]) -> None:
        """Endpoints left the pool (or restarted): their caches are gone."""
        for endpoint in endpoints:
            self._caches.pop(endpoint, None)
