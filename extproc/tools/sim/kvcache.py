"""The simulator's KV block pool, with vLLM's automatic prefix caching.

A transcription of what the v1 engine does with blocks (vLLM 0.32), reduced
to one full-attention KV cache group:

* ``vllm/v1/core/block_pool.py`` ``BlockPool``: a block has a reference count;
  a block nobody references sits in the *free queue*, and counts as free even
  when it still holds a cached prefix. ``get_new_blocks`` takes blocks from
  the queue's front and evicts the hash of each (``_maybe_evict_cached_block``);
  ``touch`` takes a cache hit out of the queue (``ref_cnt == 0``) and counts
  one more reference; ``free_blocks`` drops a reference and, at zero, appends
  a hashed block to the queue's tail ("FIFO reuse of cached blocks for LRU
  eviction behavior") and prepends an unhashed one ("LIFO reuse of non-cached
  blocks"). So the least recently freed cached block is evicted first.
* ``vllm/v1/core/single_type_kv_cache_manager.py`` ``free``: a request's
  blocks are freed in reverse ("so that the tail blocks are freed first"),
  so its last blocks are evicted before its first.
* ``vllm/v1/core/kv_cache_manager.py`` ``get_computed_blocks``: the hit is the
  longest run of leading full blocks whose chained hashes are cached, capped
  at ``request.num_tokens - 1`` tokens ("When all tokens hit the cache, we
  must recompute the last token to obtain logits"), so a prompt of exactly
  ``k`` blocks hits at most ``k - 1``. ``allocate_slots`` counts a hit block
  that sits in the free queue as one more block to take from it
  (``get_num_blocks_to_allocate``), and caches the request's full blocks as
  soon as it is scheduled, so a request scheduled later in the same step
  already hits them.
* ``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens``: a block's hash
  covers its parent's hash and its own tokens, so equal hashes mean equal
  prefixes.

Simplified: no null block (vLLM reserves one, so its ``num_gpu_blocks``
counts one more than it can use); one block per hash (vLLM may keep
duplicates); only prompt blocks are hashed (vLLM hashes generated tokens too,
but the simulator's words are not the next prompt's units), so generated
tokens' blocks are reused first when freed, as vLLM's partial blocks are.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

# The parent of a prompt's first block (vLLM's NONE_HASH, here a constant: the hashes never leave the process).
_ROOT_HASH = 0


def block_hashes(units: Sequence[Hashable], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the full blocks of ``units`` (a partial last block is not hashed, as in vLLM).

    Python's ``hash`` suffices: the hashes only compare blocks within one
    simulator process (vLLM uses sha256 because its hashes cross processes).
    """
    hashes: list[int] = []
    parent = _ROOT_HASH
    for start in range(0, len(units) - block_size + 1, block_size):
        parent = hash((parent, tuple(units[start:start + block_size])))
        hashes.append(parent)
    return tuple(hashes)


class BlockPool:
    """A fixed number of KV blocks, each free, or referenced by the requests that use it.

    With ``caching`` off no block is ever hashed, so the pool only counts
    blocks and every lookup misses (vLLM without ``--enable-prefix-caching``).
    A request's blocks are the ``table`` list its caller owns.
    """

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._refs = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        # Front is evicted (reused) first; an OrderedDict gives vLLM's O(1) removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks no request holds, cached or not: vLLM's ``get_num_free_blocks``."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests; cached but free blocks count as free (``BlockPool.get_usage``)."""
        return 1.0 - self.num_free / self.num_blocks

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached prefix, held or free."""
        return len(self._by_hash)

    def lookup(self, hashes: Sequence[int], num_tokens: int) -> list[int]:
        """The cached blocks of the longest hit for a request of ``num_tokens`` tokens whose full blocks hash to ``hashes``."""
        hit: list[int] = []
        for block_hash in hashes[: (num_tokens - 1) // self.block_size]:
            block = self._by_hash.get(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def can_allocate(self, hit: Sequence[int], total_blocks: int) -> bool:
        """Whether a request reusing ``hit`` fits in ``total_blocks`` blocks now."""
        taken_from_free = sum(1 for block in hit if self._refs[block] == 0)
        return total_blocks - len(hit) + taken_from_free <= self.num_free

    def allocate(self, table: list[int], hit: Sequence[int], total_blocks: int, hashes: Sequence[int]) -> None:
        """Give a request with no blocks ``hit`` and new ones up to ``total_blocks``; cache its full blocks."""
        assert not table and self.can_allocate(hit, total_blocks)
        for block in hit:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        table.extend(hit)
        self.grow(table, total_blocks - len(hit))
        if self.caching:
            for block, block_hash in zip(table[len(hit):], hashes[len(hit):], strict=False):
                if block_hash not in self._by_hash:
                    self._by_hash[block_hash] = block
                    self._hash_of[block] = block_hash

    def grow(self, table: list[int], count: int) -> None:
        """Append ``count`` blocks from the free queue's front, evicting whatever prefix they cached."""
        assert count <= self.num_free
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            evicted = self._hash_of[block]
            if evicted is not None:
                del self._by_hash[evicted]
                self._hash_of[block] = None
            self._refs[block] = 1
            table.append(block)

    def free(self, table: list[int]) -> None:
        """Release a request's blocks, last first; a block nobody else holds becomes free (and stays cached)."""
        reuse_first: list[int] = []
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                if self._hash_of[block] is None:
                    reuse_first.append(block)
        for block in reversed(reuse_first):  # vLLM's prepend_n: the list's first block ends up at the front
            self._free.move_to_end(block, last=False)
        table.clear()
