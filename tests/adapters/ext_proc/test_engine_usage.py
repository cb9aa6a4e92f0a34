"""The engine's usage read from a response body as Envoy sends it: whole, streamed, cut anywhere."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.adapters.request.engine_usage import Reported, UsageReader

pytestmark = pytest.mark.unit

# vLLM's answer: the text first, the usage after it (its field order), here with a text that quotes the key.
WHOLE = json.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": 'say "usage": {"prompt_tokens": 1}'},
                 "finish_reason": "length"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42,
              "prompt_tokens_details": {"cached_tokens": 8}},
    "prompt_logprobs": None, "kv_transfer_params": None,
}).encode()


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


# A stream with include_usage (and continuous usage stats off): usage null in each event, the count in the last.
STREAM = sse(*[{"object": "chat.completion.chunk", "choices": [{"delta": {"content": "usage"}}], "usage": None}] * 3,
             {"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3,
                                                                          "total_tokens": 8}})


def read(body: bytes, size: int) -> Reported | None:
    reader = UsageReader()
    for start in range(0, len(body), size):
        reader.feed(body[start:start + size])
    return reader.reported


@given(size=st.integers(min_value=1, max_value=len(WHOLE) + 1))
def test_a_whole_answer_gives_its_usage_wherever_envoy_cut_it(size: int) -> None:
    assert read(WHOLE, size) == Reported(12, 30, 8)


@given(size=st.integers(min_value=1, max_value=len(STREAM) + 1))
def test_a_stream_gives_the_usage_of_its_last_event_wherever_envoy_cut_it(size: int) -> None:
    assert read(STREAM, size) == Reported(5, 3)  # no cached count given: None, not 0


def test_continuous_usage_stats_the_last_count_wins() -> None:
    body = sse(*({"choices": [{"delta": {"content": "x"}}], "usage": {"prompt_tokens": 5, "completion_tokens": n}}
                 for n in range(1, 6)))
    assert read(body, 7) == Reported(5, 5)


@pytest.mark.parametrize("body", [
    sse({"choices": [{"delta": {"content": "a"}}]}),  # a stream whose client did not ask
    sse({"choices": [], "usage": None}),
    json.dumps({"error": {"message": "bad", "code": 400}}).encode(),  # an error answer
    json.dumps({"choices": [], "usage": {"prompt_tokens": "12", "completion_tokens": 3}}).encode(),
    json.dumps({"choices": [], "usage": {"prompt_tokens": -1, "completion_tokens": 3}}).encode(),
    json.dumps({"choices": [], "usage": {"prompt_tokens": True, "completion_tokens": 3}}).encode(),
    json.dumps({"choices": [], "usage": [1, 2]}).encode(),
    b'{"choices": [], "usage": {"prompt_tokens": 12, "completion_t',  # cut off: Envoy sent only part of it
    b"",
])
def test_an_answer_without_a_usable_count_reports_none(body: bytes) -> None:
    assert read(body, 5) is None and read(body, 1 << 20) is None


def test_vllms_null_details_leave_the_cached_count_unsaid() -> None:
    body = json.dumps({"usage": {"prompt_tokens": 15, "completion_tokens": 8, "prompt_tokens_details": None}}).encode()
    assert read(body, 1 << 20) == Reported(15, 8, None)


def test_a_long_text_after_a_broken_usage_key_is_not_kept() -> None:
    reader = UsageReader()
    reader.feed(b'{"usage": {"prompt_tokens": 1, ')
    for _ in range(100):
        reader.feed(b"x" * 1000)
    assert reader.kept < 10_000 and reader.reported is None
