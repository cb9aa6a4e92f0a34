"""The ``usage`` the engine reports at the end of its response: what a budget is charged when it comes.

An OpenAI-compatible engine (vLLM, SGLang, the simulator) ends a completion
with its own count: ``usage.prompt_tokens``, ``usage.completion_tokens`` and,
where it has a prefix cache, ``usage.prompt_tokens_details.cached_tokens``.
A whole JSON answer carries it after ``choices``; a stream carries it in its
last event only when the request asked for it
(``stream_options.include_usage``). That count is the engine's own word, so
it is what a tenant's budget is charged (``budgets/gate.py``); the cost
model's estimate stays for a response that never says it.

:class:`UsageReader` takes the response body chunk by chunk, as Envoy sends
it, and keeps only what it must: the text from the last ``"usage"`` key on
(a key split between two chunks is found through a few bytes kept from the
previous one). A chunk without the key costs one substring search. The key
is looked for unescaped, as a JSON key is written: a completion's text that
contains the word quotes it as ``\\"usage\\"``, which does not match, and the
last match wins, as the engine writes its count after the text.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

_KEY = b'"usage"'
# Kept of a chunk without the key: enough for the key's start, split at the chunk's end.
_SPLIT = len(_KEY) - 1
# A usage object is a few hundred bytes; text from the key on beyond this is no usage object.
_MOST_PENDING = 8192
_decoder = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class Reported:
    """The engine's count of one request's tokens."""

    prompt_tokens: float
    completion_tokens: float
    # Of the prompt tokens, those it found in its prefix cache; None where it does not say (vLLM without
    # --enable-prompt-tokens-details writes null): then the prefix-cache account's share stands.
    cached_tokens: float | None = None


class UsageReader:
    """One response body's reported usage, read as its chunks pass: :attr:`reported` once one came."""

    __slots__ = ("_pending", "reported")

    def __init__(self) -> None:
        # From the last unparsed "usage" key on (or the last bytes, where a key may begin).
        self._pending = b""
        self.reported: Reported | None = None

    @property
    def kept(self) -> int:
        """Bytes of the body kept for the next chunk: a held response's memory here, bounded whatever the body."""
        return len(self._pending)

    def feed(self, chunk: bytes) -> None:
        """The next chunk of the body."""
        data = self._pending + chunk if self._pending else chunk
        found = data.rfind(_KEY)
        if found < 0:
            self._pending = data[-_SPLIT:]
            return
        rest = data[found + len(_KEY):]
        parsed = _usage(rest)
        if parsed is None:  # the object is not complete yet: wait for the next chunk, if it is short enough
            self._pending = data[found:] if len(rest) < _MOST_PENDING else b""
            return
        self._pending = rest[-_SPLIT:]
        if isinstance(parsed, Reported):
            self.reported = parsed


class _Null:
    """``"usage": null`` (a stream's events before the last), or a value that is no usage object."""


_NULL = _Null()


def _usage(rest: bytes) -> Reported | _Null | None:
    """The usage object after a ``"usage"`` key; None: cut off (more may come)."""
    text = rest.lstrip()
    if not text:
        return None
    if text[:1] != b":":
        return _NULL
    text = text[1:].lstrip()
    if not text:
        return None
    if text[:1] != b"{":
        return _NULL
    try:
        value, _ = _decoder.raw_decode(text.decode("utf-8", "replace"))
    except json.JSONDecodeError:  # cut off by the chunk's end (a broken one is dropped past _MOST_PENDING)
        return None
    if not isinstance(value, dict):
        return _NULL
    prompt, completion = _count(value.get("prompt_tokens")), _count(value.get("completion_tokens"))
    if prompt is None or completion is None:
        return _NULL
    details = value.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Reported(prompt, completion, cached)


def _count(value: object) -> float | None:
    """A token count as the engine wrote it: a whole number >= 0; None otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else None
