"""An input file read as OpenAI validates it: each bad line one error, the good ones kept, in file order."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.adapters.batches.lines import BatchFailure, Limits, Parsed, parse

pytestmark = pytest.mark.unit

LIMITS = Limits(max_lines=10, max_line_bytes=400)
CHAT = "/v1/chat/completions"


def line(custom_id: str | None, **changes: Any) -> bytes:
    item: dict[str, Any] = {"custom_id": custom_id, "method": "POST", "url": CHAT,
                            "body": {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}}
    body = changes.pop("body", {})
    item.update(changes)
    item["body"] = {**item["body"], **body} if isinstance(body, dict) else body
    return json.dumps(item).encode()


def parsed(*lines: bytes) -> Parsed:
    result = parse(b"\n".join(lines) + b"\n", CHAT, LIMITS)
    assert isinstance(result, Parsed)
    return result


def test_good_lines_keep_their_place_id_and_body() -> None:
    result = parsed(line("a"), b"", b"   ", line("b", body={"max_tokens": 3}))
    assert [(x.index, x.custom_id) for x in result.lines] == [(0, "a"), (1, "b")]
    assert json.loads(result.lines[1].body)["max_tokens"] == 3
    assert result.model == "m1" and result.errors == []


@pytest.mark.parametrize(("bad", "code"), [
    (b"not json", "invalid_json_line"),
    (b"[1, 2]", "invalid_json_line"),
    (b"\xff\xfe", "invalid_json_line"),
    (line(None), "missing_custom_id"),
    (line("x", method="GET"), "invalid_method"),
    (line("x", url="/v1/embeddings"), "mismatched_url"),
    (line("x", body=[1]), "invalid_body"),
    (line("x", body={"model": ""}), "missing_model"),
    (line("x", body={"model": "m2"}), "mismatched_model"),
    (line("x", body={"stream": True}), "unsupported_stream"),
    (line("x", body={"messages": "y" * 400}), "line_too_large"),
    (line("a"), "duplicate_custom_id"),
])
def test_each_bad_line_is_one_error_and_the_others_run(bad: bytes, code: str) -> None:
    result = parsed(line("a"), bad, line("b"))
    assert [x.custom_id for x in result.lines] == ["a", "b"]
    assert [(e.index, e.code) for e in result.errors] == [(1, code)]
    assert result.errors[0].message.startswith("line 2: ")


def test_the_first_valid_line_names_the_batch_model() -> None:
    result = parsed(line("a", body={"model": ""}), line("b", body={"model": "m2"}), line("c"))
    assert result.model == "m2"
    assert [e.code for e in result.errors] == ["missing_model", "mismatched_model"]


def test_a_file_without_a_valid_line_or_with_too_many_fails_as_a_whole() -> None:
    assert parse(b"", CHAT, LIMITS) == BatchFailure("empty_file", "the file has no valid request")
    failure = parse(b"nope\n", CHAT, LIMITS)
    assert isinstance(failure, BatchFailure) and failure.code == "invalid_file" and "line 1" in failure.message
    many = parse(b"\n".join(line(str(i)) for i in range(11)), CHAT, LIMITS)
    assert isinstance(many, BatchFailure) and many.code == "too_many_requests"
