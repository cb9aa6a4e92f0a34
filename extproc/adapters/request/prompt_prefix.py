"""A request's prefix signature, from its prompt as the body (or an operator's metadata field) carries it.

The leading prompt text is what the engine's prefix cache keys on, flattened
the way the shared interface fixes (core/prefix.py hashes it):

* chat (``messages``): per message in order, its ``role``, ``\\n``, its content
  text, ``\\n``; a content is a string or a list of parts whose ``text``
  parts count (joined by ``\\n``, as vLLM joins them), images and audio not;
* completions (``prompt``): the string, or the first of a list of strings;
* an operator's ``extproc.prompt_prefix`` metadata string: as it is.

Only the first ``block_bytes x max_blocks`` bytes can be hashed, so building
stops there: a long conversation costs its first few messages. The prompt
comes undecoded (request_fields.py keeps ``messages`` as a slice of the body:
a model without signatures never pays for it); here the messages are decoded
once, typed, so msgspec skips every other key (tool calls, names) and builds
only roles and texts.

An odd prompt (a message that is not an object, a content of another type, a
list of token ids) gives no text rather than an error: the signature is a
scheduling hint, and judging the body is the engine's business.
"""

from __future__ import annotations

from typing import Any

import msgspec

from extproc.adapters.config import ModelConfig
from extproc.adapters.request.request_fields import Prompt
from extproc.core.prefix import NO_PREFIX, Prefix, signature


class _Part(msgspec.Struct):
    type: Any = None
    text: Any = None


class _Message(msgspec.Struct):
    role: Any = None
    content: str | list[_Part] | None = None


_messages = msgspec.json.Decoder(list[_Message])
_completion = msgspec.json.Decoder(str | list[Any] | None)


def leading_text(prompt: Prompt, limit: int) -> bytes:
    """The prompt's leading text (see the module docstring), cut at ``limit`` bytes."""
    if prompt.text is not None:
        return prompt.text[:limit]
    if prompt.messages:
        return _chat(prompt.messages, limit)
    if prompt.prompt:
        return _completions(prompt.prompt)[:limit]
    return b""


def _chat(messages: msgspec.Raw, limit: int) -> bytes:
    try:
        decoded = _messages.decode(messages)
    except msgspec.DecodeError:
        return b""
    pieces: list[bytes] = []
    size = 0
    for message in decoded:
        role = message.role if isinstance(message.role, str) else ""
        piece = f"{role}\n{_content(message.content)}\n".encode()
        pieces.append(piece)
        size += len(piece)
        if size >= limit:
            break
    return b"".join(pieces)[:limit]


def _content(content: str | list[_Part] | None) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    return "\n".join(p.text for p in content if p.type == "text" and isinstance(p.text, str))


def _completions(raw: msgspec.Raw) -> bytes:
    try:
        prompt = _completion.decode(raw)
    except msgspec.DecodeError:
        return b""
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else None
    return prompt.encode() if isinstance(prompt, str) else b""


class Signer:
    """A model's signatures: its block size in bytes (block_tokens x cost.bytes_per_token) and how many blocks."""

    def __init__(self, model: ModelConfig) -> None:
        if model.prefix is None:
            raise ValueError(f"model {model.name!r} has no prefix section")
        # The bytes of leading text one block covers (at least 1).
        self.block_bytes = max(1, round(model.prefix.block_tokens * model.cost.bytes_per_token))
        self.max_blocks = model.prefix.max_blocks
        self.bytes_per_token = model.cost.bytes_per_token

    def sign(self, prompt: Prompt, key: str | None) -> Prefix:
        """The signature of ``prompt``, keyed by the body's ``prompt_cache_key`` (NO_PREFIX: nothing to hash, no key)."""
        text = leading_text(prompt, self.block_bytes * self.max_blocks)
        if len(text) < self.block_bytes and key is None:
            return NO_PREFIX
        return signature(text, block_bytes=self.block_bytes, max_blocks=self.max_blocks,
                         bytes_per_token=self.bytes_per_token, key=key)
