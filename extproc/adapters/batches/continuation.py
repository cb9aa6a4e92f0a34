"""A long generation sent as chunks, each continuing the last, and recorded as the one answer the engine would give.

A batch line asking for many tokens holds an engine slot for its whole
generation; a chat arriving meanwhile waits for a slot (a line can be
preempted, but only at the cost of its work so far). Sent as successive
requests of at most ``batches.chunk_tokens`` tokens, each going back through
the fair queue, the line frees its slot at every chunk's end, and a chat
queued meanwhile is released first. Each chunk continues the text so far, as
vLLM documents for exactly this:

* ``/v1/chat/completions``: the text so far appended as a final assistant
  message, with ``continue_final_message: true`` and
  ``add_generation_prompt: false`` (the template leaves that message open, so
  the model goes on writing it; vLLM refuses the two both true);
* ``/v1/completions``: the prompt followed by the text so far.

It stops once a chunk ends for another reason than ``length`` or the line's
own ``max_tokens`` (``max_completion_tokens``) is reached. The recorded answer
is one response: the first chunk's id and metadata, the concatenated text,
the last chunk's finish reason, and the usage of one request (the original
prompt's tokens, the chunks' completion tokens summed). A stop string split
across two chunks (each chunk's engine sees only its own output) is found
here and cut as the engine would, finish reason ``stop``.

Pure: :func:`plan` says whether and how a line is chunked, :class:`Chunks`
builds each chunk's request and takes its answer; the HTTP is ``sender.py``'s.
A line whose answer could not be rebuilt from chunks is sent whole (None
from :func:`plan`): a stream, ``n`` > 1 or ``best_of``, log probabilities,
``echo`` or ``suffix``, tools, a structured output (its grammar would start
again at each chunk), a prompt of token ids or of several prompts, a final
message to continue that is not assistant text, or no ``max_tokens`` at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from extproc.adapters.batches.shapes import CHAT, COMPLETIONS

# The limit's fields, in the order vLLM reads them (max_completion_tokens wins where both are set).
_LIMITS = ("max_completion_tokens", "max_tokens")
# Fields whose answer is not the concatenation of the chunks' answers: set (not null, false or the default),
# the line is sent whole.
_WHOLE = ("stream", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "suffix", "tools", "functions",
          "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


@dataclass(frozen=True, slots=True)
class Plan:
    """How a line is chunked: its body, the line's own token limit, and the most tokens a chunk asks for."""

    endpoint: str
    body: dict[str, Any]
    limit: int
    chunk: int


def plan(endpoint: str, body: bytes, chunk_tokens: int) -> Plan | None:
    """The line's chunking, or None when it is sent whole (chunking off, short enough, or not rebuildable)."""
    if not chunk_tokens or endpoint not in (CHAT, COMPLETIONS):
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict) or not _rebuildable(endpoint, request):
        return None
    limit = next((request[key] for key in _LIMITS if request.get(key) is not None), None)
    if type(limit) is not int or limit <= chunk_tokens:
        return None
    return Plan(endpoint, request, limit, chunk_tokens)


def _rebuildable(endpoint: str, request: dict[str, Any]) -> bool:
    if any(request.get(key) not in (None, False) for key in _WHOLE):
        return False
    if request.get("n") not in (None, 1) or request.get("best_of") not in (None, 1):
        return False
    response_format = request.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        return False
    if endpoint == COMPLETIONS:
        prompt = request.get("prompt")
        return isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str))
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        return False
    if request.get("continue_final_message"):  # the line continues its own assistant message: chunks extend it
        last = messages[-1]
        return isinstance(last, dict) and last.get("role") == "assistant" and isinstance(last.get("content"), str)
    return True


def continuation(plan: Plan, text: str, generated: int) -> dict[str, Any]:
    """The request for the next chunk, ``text`` (``generated`` tokens) written so far: the line's body, continued."""
    body = dict(plan.body)
    size = min(plan.chunk, plan.limit - generated)
    for key in _LIMITS:
        if body.get(key) is not None:
            body[key] = size
    min_tokens = body.get("min_tokens")
    if type(min_tokens) is int and min_tokens > 0:
        body["min_tokens"] = max(0, min(size, min_tokens - generated))
    if not generated and not text:
        return body
    if plan.endpoint == COMPLETIONS:
        prompt = body["prompt"]
        body["prompt"] = prompt + text if isinstance(prompt, str) else [prompt[0] + text]
        return body
    messages = list(body["messages"])
    if body.get("continue_final_message"):
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + text}
    else:
        messages.append({"role": "assistant", "content": text})
    body.update(messages=messages, continue_final_message=True, add_generation_prompt=False)
    return body


class Chunks:
    """One line's chunks: :meth:`request` the next one's body, :meth:`add` its answer, :meth:`answer` the whole."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.answers: list[dict[str, Any]] = []
        self.text = ""
        self.generated = 0
        self._stopped_at: str | None = None  # a stop string found across two chunks

    def request(self) -> bytes:
        return json.dumps(continuation(self.plan, self.text, self.generated), separators=(",", ":")).encode()

    def add(self, answer: dict[str, Any]) -> bool:
        """Take a chunk's (2xx) answer; True when another chunk is due."""
        self.answers.append(answer)
        choice, tokens = _choice(answer), _completion_tokens(answer)
        piece = None if choice is None else _text(self.plan.endpoint, choice)
        if choice is None or piece is None or tokens is None:  # nothing to continue from (a tool call, no usage)
            return False
        before = len(self.text)
        self.text += piece
        self.generated += tokens
        if self._stop_across(before):
            return False
        return choice.get("finish_reason") == "length" and 0 < tokens and self.generated < self.plan.limit

    def _stop_across(self, boundary: int) -> bool:
        """A stop string that begins before ``boundary`` (the last chunk's start) and ends after it: cut there."""
        stops = self.plan.body.get("stop")
        for stop in [stops] if isinstance(stops, str) else stops if isinstance(stops, list) else ():
            if not isinstance(stop, str) or not stop or not boundary:
                continue
            at = self.text.find(stop, max(0, boundary - len(stop) + 1))
            if 0 <= at < boundary:
                keep = self.plan.body.get("include_stop_str_in_output") is True
                self.text = self.text[:at + len(stop) if keep else at]
                self._stopped_at = stop
                return True
        return False

    def answer(self) -> dict[str, Any]:
        """The chunks as one response: the first's id and metadata, the whole text, the last's finish, one usage."""
        if len(self.answers) == 1 and self._stopped_at is None:
            return self.answers[0]
        choice = dict(_choice(self.answers[-1]) or {})
        if self.plan.endpoint == COMPLETIONS:
            choice["text"] = self.text
        else:
            choice["message"] = {**(choice.get("message") or {"role": "assistant"}), "content": self.text}
        if self._stopped_at is not None:
            choice.update(finish_reason="stop", stop_reason=self._stopped_at)
        whole = {**self.answers[0], "choices": [choice]}
        usage = merged_usage(answer.get("usage") for answer in self.answers)
        if usage is not None:
            whole["usage"] = usage
        return whole


def merged_usage(usages: Iterable[object]) -> dict[str, Any] | None:
    """One request's usage from its chunks': the first's prompt (the original prompt), every completion summed.

    Each continuation re-read the prompt and the text so far as its own
    prompt; that is the engine's work (mostly prefix-cache hits), not the
    line's prompt, so it is not added. ``completion_tokens_details`` are summed too.
    """
    found: list[dict[str, Any]] = [usage for usage in usages if isinstance(usage, dict)]
    if not found:
        return None
    whole = dict(found[0])
    completion: int = sum(usage.get("completion_tokens") or 0 for usage in found)
    whole["completion_tokens"] = completion
    whole["total_tokens"] = (whole.get("prompt_tokens") or 0) + completion
    details: list[dict[str, Any]] = [usage["completion_tokens_details"] for usage in found
                                     if isinstance(usage.get("completion_tokens_details"), dict)]
    if details:
        keys = {key for detail in details for key, value in detail.items() if type(value) is int}
        whole["completion_tokens_details"] = {key: sum(detail.get(key) or 0 for detail in details) for key in keys}
    return whole


def _choice(answer: dict[str, Any]) -> dict[str, Any] | None:
    choices = answer.get("choices")
    if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict):
        choice: dict[str, Any] = choices[0]
        return choice
    return None


def _text(endpoint: str, choice: dict[str, Any]) -> str | None:
    if endpoint == COMPLETIONS:
        text = choice.get("text")
    else:
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) and not message.get("tool_calls") else None
    return text if isinstance(text, str) else None


def _completion_tokens(answer: dict[str, Any]) -> int | None:
    usage = answer.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if type(tokens) is int else None
