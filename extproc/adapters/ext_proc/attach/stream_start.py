"""A stream's first event, read before its response headers go to the client: an engine's refusal inside a 200.

vLLM with its queue caps (a stream that passed the first admission check and
failed the second), SGLang and TGI answer a stream they refuse as full with
status 200 and the error as the stream's first event (docs/engines.md). Envoy's
router has no status to retry, and the OpenAI SDKs cannot retry a 200. Envoy
can be made to hold the response headers until the processor has seen that
event: with the response body in ``FULL_DUPLEX_STREAMED`` (the release's mode
override, or the gateway's own mode) the headers wait for their answer while
the body's chunks are sent at once (``Filter::onData`` and
``ProcessorState::getCallbackStateAfterHeaderResp`` in envoyproxy/envoy's
source/extensions/filters/http/ext_proc, measured with Envoy 1.40:
tests/adapters/ext_proc/test_stream_start.py). The processor reads the chunks up to the first
event that carries data; a refusal becomes the processor's own answer, 503
``engine_full`` with Retry-After, which the SDKs retry; anything else lets the
headers go and gives the chunks back as they came.

:class:`FirstEvent` is that reading, for one response: it keeps the chunks
until a verdict and parses only the first event (``data:`` lines, as the SSE
format has them; comments and keep-alives before it are skipped).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

# An event that has not ended within this many bytes is no refusal (an error event is a few hundred).
MOST_HELD_BYTES = 64 * 1024
_EVENT_END = b"\n\n"

# Whether a stream's first event (a JSON object) is the engine's refusal as full: the dialect's (dialects.py).
Refusal = Callable[[Mapping[str, Any]], bool]


class Verdict(Enum):
    REFUSED = "refused"  # the first event is the engine's refusal: answer 503 in its place
    GOES_ON = "goes_on"  # anything else: the headers and the chunks go on


class FirstEvent:
    """One response body's chunks until its first data event is whole, and then the verdict on it."""

    __slots__ = ("_chunks", "_size", "_refused", "event", "headers_held")

    def __init__(self, refused: Refusal) -> None:
        # The response's headers came and their answer waits for the verdict.
        self.headers_held = False
        self._chunks: list[bytes] = []
        self._size = 0
        self._refused = refused
        # The first event's JSON object, once read (what a refusal says, for the answer's message).
        self.event: Mapping[str, Any] | None = None

    def feed(self, chunk: bytes, end: bool) -> Verdict | None:
        """The next chunk (``end``: the body's last); None until a verdict, which comes at the body's end at last."""
        self._chunks.append(chunk)
        self._size += len(chunk)
        data = b"".join(self._chunks) if len(self._chunks) > 1 else chunk
        verdict = self._verdict(data.replace(b"\r\n", b"\n").replace(b"\r", b"\n"))
        if verdict is None and (end or self._size > MOST_HELD_BYTES):
            return Verdict.GOES_ON
        return verdict

    def held(self) -> bytes:
        """The chunks read so far, to give back when the stream goes on."""
        held = b"".join(self._chunks)
        self._chunks = []
        return held

    def _verdict(self, data: bytes) -> Verdict | None:
        start = 0
        while (end := data.find(_EVENT_END, start)) >= 0:
            lines = data[start:end].split(b"\n")
            start = end + len(_EVENT_END)
            fields = [line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:")]
            if not fields:  # a comment (a keep-alive) or an event without data: the next one decides
                continue
            try:
                event = json.loads(b"\n".join(fields))
            except ValueError:
                return Verdict.GOES_ON  # not JSON ("[DONE]", or an engine's own text): no refusal of ours to read
            if isinstance(event, dict) and "error" in event and self._refused(event):
                self.event = event
                return Verdict.REFUSED
            return Verdict.GOES_ON
        return None


def error_message(event: Mapping[str, Any]) -> str:
    """What the engine said in its refusal event, for the answer that replaces it (at most 200 characters)."""
    error = event.get("error")
    message = error.get("message") if isinstance(error, dict) else error
    return str(message)[:200]
