"""A long batch line as chunks (adapters/batches/continuation.py): each chunk's request, and the chunks as one answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.adapters.batches.continuation import Chunks, Plan, continuation, merged_usage, plan
from extproc.adapters.batches.shapes import CHAT, COMPLETIONS

pytestmark = pytest.mark.unit

QUESTION = [{"role": "system", "content": "Be thorough."}, {"role": "user", "content": "Tell the story."}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m1", "messages": QUESTION, "max_tokens": 100, **fields}


def planned(endpoint: str, body: dict[str, Any], chunk: int = 40) -> Plan:
    found = plan(endpoint, json.dumps(body).encode(), chunk)
    assert found is not None
    return found


def answer(text: str, tokens: int, finish: str = "length", *, prompt: int = 10, chat_api: bool = True,
           request_id: str = "chatcmpl-1") -> dict[str, Any]:
    content = {"message": {"role": "assistant", "content": text}} if chat_api else {"text": text}
    return {"id": request_id, "object": "chat.completion", "created": 1, "model": "m1",
            "choices": [{"index": 0, **content, "logprobs": None, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}}


@pytest.mark.parametrize(("endpoint", "body", "chunk"), [
    (CHAT, chat(), 0),  # off
    (CHAT, chat(max_tokens=40), 40),  # one chunk's worth
    (CHAT, chat(max_tokens=None), 40),  # no limit of its own: the engine's default
    (CHAT, chat(max_completion_tokens=30), 40),  # vLLM reads max_completion_tokens first
    (CHAT, chat(n=2), 40),
    (CHAT, chat(logprobs=True, top_logprobs=2), 40),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 40),
    (CHAT, chat(response_format={"type": "json_object"}), 40),  # its grammar would start again at each chunk
    (CHAT, chat(stream=True), 40),
    (CHAT, chat(continue_final_message=True), 40),  # the message to continue is the user's
    (COMPLETIONS, {"model": "m1", "prompt": [1, 2, 3], "max_tokens": 100}, 40),  # token ids
    (COMPLETIONS, {"model": "m1", "prompt": ["a", "b"], "max_tokens": 100}, 40),  # two prompts
    (COMPLETIONS, {"model": "m1", "prompt": "a", "max_tokens": 100, "echo": True}, 40),
    ("/v1/embeddings", {"model": "m1", "input": "a", "max_tokens": 100}, 40),
])
def test_a_line_is_sent_whole_when_chunks_could_not_rebuild_its_answer(endpoint: str, body: dict[str, Any],
                                                                      chunk: int) -> None:
    assert plan(endpoint, json.dumps(body).encode(), chunk) is None


def test_a_chat_chunk_continues_the_answer_as_an_open_final_assistant_message() -> None:
    line = planned(CHAT, chat(response_format={"type": "text"}, temperature=0.7))
    assert line.limit == 100
    first = continuation(line, "", 0)
    assert first == {**chat(response_format={"type": "text"}, temperature=0.7), "max_tokens": 40}  # the line's own
    later = continuation(line, "Once upon a time", 80)
    assert later["messages"] == [*QUESTION, {"role": "assistant", "content": "Once upon a time"}]
    assert (later["continue_final_message"], later["add_generation_prompt"]) == (True, False)
    assert later["max_tokens"] == 20 and later["temperature"] == 0.7  # what is left of the line's 100


def test_both_limits_are_set_to_the_chunk_and_min_tokens_to_what_is_left_of_it() -> None:
    line = planned(CHAT, chat(max_completion_tokens=90, min_tokens=50))
    assert line.limit == 90
    first, second, third = (continuation(line, "x" * done, done) for done in (0, 40, 80))
    assert [(c["max_tokens"], c["max_completion_tokens"], c["min_tokens"]) for c in (first, second, third)] == [
        (40, 40, 40), (40, 40, 10), (10, 10, 0)]


def test_a_line_continuing_its_own_assistant_message_has_that_message_extended() -> None:
    prefilled = [*QUESTION, {"role": "assistant", "content": "Chapter one:"}]
    line = planned(CHAT, chat(messages=prefilled, continue_final_message=True, add_generation_prompt=False))
    later = continuation(line, " It rained.", 40)
    assert later["messages"] == [*QUESTION, {"role": "assistant", "content": "Chapter one: It rained."}]


@pytest.mark.parametrize("prompt", ["Write a long essay.", ["Write a long essay."]])
def test_a_completion_chunk_is_the_prompt_followed_by_the_text_so_far(prompt: str | list[str]) -> None:
    line = planned(COMPLETIONS, {"model": "m1", "prompt": prompt, "max_tokens": 100, "stop": ["\n\n"]})
    later = continuation(line, " First,", 40)
    assert later["prompt"] == ("Write a long essay. First," if isinstance(prompt, str) else ["Write a long essay. First,"])
    assert later["max_tokens"] == 40 and "continue_final_message" not in later


def test_chunks_until_the_lines_limit_make_one_answer_with_one_requests_usage() -> None:
    chunks = Chunks(planned(CHAT, chat()))
    sent = []
    for piece, tokens, prompt, request_id in (("Once", 40, 10, "a"), (" upon", 40, 50, "b"), (" a time", 20, 90, "c")):
        sent.append(json.loads(chunks.request()))
        more = chunks.add(answer(piece, tokens, prompt=prompt, request_id=request_id))
    assert not more and [body["max_tokens"] for body in sent] == [40, 40, 20]
    assert sent[2]["messages"][-1] == {"role": "assistant", "content": "Once upon"}
    whole = chunks.answer()
    assert whole["id"] == "a" and whole["choices"][0]["message"] == {"role": "assistant", "content": "Once upon a time"}
    assert whole["choices"][0]["finish_reason"] == "length"
    # The original prompt once, the completion summed: what one request of 100 tokens reports.
    assert whole["usage"] == {"prompt_tokens": 10, "completion_tokens": 100, "total_tokens": 110}


def test_a_chunk_ending_for_another_reason_than_length_is_the_last() -> None:
    chunks = Chunks(planned(COMPLETIONS, {"model": "m1", "prompt": "p", "max_tokens": 100}))
    assert chunks.add(answer("One.", 40, chat_api=False))
    assert not chunks.add(answer(" Two.", 7, "stop", prompt=50, chat_api=False))
    whole = chunks.answer()
    assert (whole["choices"][0]["text"], whole["choices"][0]["finish_reason"]) == ("One. Two.", "stop")
    assert whole["usage"]["completion_tokens"] == 47 and whole["usage"]["prompt_tokens"] == 10


def test_a_first_chunk_that_ends_the_line_is_its_answer_unchanged() -> None:
    chunks = Chunks(planned(CHAT, chat()))
    only = answer("Short.", 3, "stop")
    assert not chunks.add(only) and chunks.answer() is only


def test_an_answer_with_nothing_to_continue_from_ends_the_chunks() -> None:
    chunks = Chunks(planned(CHAT, chat()))
    called = answer("", 40)
    called["choices"][0]["message"] = {"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]}
    assert not chunks.add(called)
    without_usage = answer("text", 40)
    del without_usage["usage"]
    assert not Chunks(planned(CHAT, chat())).add(without_usage)


@pytest.mark.parametrize(("keep", "text"), [(False, "The end."), (True, "The end.\n\n")])
def test_a_stop_string_split_across_two_chunks_ends_the_answer_there(keep: bool, text: str) -> None:
    chunks = Chunks(planned(CHAT, chat(stop=["\n\n", "THE END"], include_stop_str_in_output=keep)))
    assert chunks.add(answer("The end.\n", 40))
    assert not chunks.add(answer("\nMore text", 40, prompt=50))
    choice = chunks.answer()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"], choice["stop_reason"]) == (text, "stop", "\n\n")


def test_usage_details_are_summed_and_the_first_prompts_kept() -> None:
    usages = [{"prompt_tokens": 10, "completion_tokens": 40, "total_tokens": 50,
               "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 30}},
              {"prompt_tokens": 50, "completion_tokens": 5, "total_tokens": 55,
               "prompt_tokens_details": {"cached_tokens": 48}, "completion_tokens_details": {"reasoning_tokens": 0}}]
    assert merged_usage(usages) == {"prompt_tokens": 10, "completion_tokens": 45, "total_tokens": 55,
                                    "prompt_tokens_details": {"cached_tokens": 0},
                                    "completion_tokens_details": {"reasoning_tokens": 30}}
    assert merged_usage([None, "x"]) is None
