"""A request's prefix signature: which leading blocks of its prompt an engine may already hold in its KV cache.

vLLM's automatic prefix caching (and SGLang's radix cache) keep the KV of a
prompt's leading blocks after a request ends, keyed by a hash chained over
the blocks: block *i*'s key covers every token up to the end of block *i*, so
two prompts share a cached block only when everything before it matches too.
A request whose leading blocks are cached skips their prefill.

The processor sees text, not tokens, so a block here is ``block_bytes`` bytes
of the request's leading prompt text (the adapter builds it from the body:
``adapters/request/prompt_prefix.py``), about ``block_tokens`` tokens at the
cost model's bytes per token. The hashes are the same chain as the engine's,
over bytes instead of token ids: two requests share their first *n* hashes
exactly when their first *n* blocks of text match, which is when the engine's
chains (over the tokens of that text) match for about as many tokens.

* Only full blocks are hashed, as engines cache only full blocks.
* At most ``max_blocks`` are hashed, so the cost per request is bounded
  whatever the prompt's length (measured in docs/locality.md).
* The hashes are Python's own (SipHash, salted per process): they never leave
  the processor, so a client cannot aim for a collision it cannot compute.
* ``key`` is the body's ``prompt_cache_key`` (OpenAI's routing hint): it
  scopes routing (``release/picking.py``), not the cache.

Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Prefix:
    """A request's prefix signature (see the module docstring)."""

    # Chained hashes: blocks[i] covers the first (i + 1) blocks of the leading text.
    blocks: tuple[int, ...]
    # Estimated prompt tokens one block covers.
    block_tokens: float
    # The body's prompt_cache_key, if any.
    key: str | None = None

    @property
    def tokens(self) -> float:
        """The prompt tokens the hashed blocks cover (estimated)."""
        return len(self.blocks) * self.block_tokens


NO_PREFIX = Prefix((), 0.0)


def signature(text: bytes, *, block_bytes: int, max_blocks: int, bytes_per_token: float,
              key: str | None = None) -> Prefix:
    """Chained hashes of the first ``max_blocks`` full blocks of ``text`` (a partial last block is not hashed)."""
    if block_bytes < 1 or bytes_per_token <= 0:
        raise ValueError("a block needs at least one byte and a positive bytes per token")
    blocks: list[int] = []
    chained = 0
    for start in range(0, min(len(text) // block_bytes, max_blocks) * block_bytes, block_bytes):
        chained = hash((chained, text[start:start + block_bytes]))
        blocks.append(chained)
    return Prefix(tuple(blocks), block_bytes / bytes_per_token, key)
