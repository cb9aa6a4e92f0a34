"""An input file read as OpenAI validates it: each bad line one error, the good ones kept, in file order;
read line by line, a line over the limit never read whole."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from extproc.adapters.batches.lines import Line, LineError, LineLimits, Reading, Unusable, raw_lines

pytestmark = pytest.mark.unit

LIMITS = LineLimits(max_lines=10, max_line_bytes=400)
CHAT = "/v1/chat/completions"


def line(custom_id: str | None, **changes: Any) -> bytes:
    item: dict[str, Any] = {"custom_id": custom_id, "method": "POST", "url": CHAT,
                            "body": {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}}
    body = changes.pop("body", {})
    item.update(changes)
    item["body"] = {**item["body"], **body} if isinstance(body, dict) else body
    return json.dumps(item).encode()


def read(content: bytes) -> tuple[list[Line], list[LineError], str | None]:
    """``content``'s lines as the runner reads them: (good, bad, the batch's model); raises Unusable."""
    reading = Reading(CHAT, LIMITS)
    items = list(reading.items(raw_lines(io.BytesIO(content), LIMITS.max_line_bytes)))
    return ([i for i in items if isinstance(i, Line)], [i for i in items if isinstance(i, LineError)], reading.model)


def parsed(*lines: bytes) -> tuple[list[Line], list[LineError], str | None]:
    return read(b"\n".join(lines) + b"\n")


def test_good_lines_keep_their_place_id_and_body() -> None:
    good, bad, model = parsed(line("a"), b"", b"   ", line("b", body={"max_tokens": 3}))
    assert [(x.index, x.custom_id) for x in good] == [(0, "a"), (1, "b")]
    assert json.loads(good[1].body)["max_tokens"] == 3
    assert model == "m1" and bad == []


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
    good, errors, _ = parsed(line("a"), bad, line("b"))
    assert [x.custom_id for x in good] == ["a", "b"]
    assert [(e.index, e.code) for e in errors] == [(1, code)]
    assert errors[0].message.startswith("line 2: ")


def test_the_first_valid_line_names_the_batch_model() -> None:
    _, errors, model = parsed(line("a", body={"model": ""}), line("b", body={"model": "m2"}), line("c"))
    assert model == "m2"
    assert [e.code for e in errors] == ["missing_model", "mismatched_model"]


def test_a_line_over_the_limit_is_cut_short_and_the_next_one_read() -> None:
    huge = b"x" * (5 * LIMITS.max_line_bytes)
    source = io.BytesIO(line("a") + b"\n" + huge + b"\n" + line("b") + b"\r\n" + huge)
    assert [len(raw) for raw in raw_lines(source, LIMITS.max_line_bytes)] == [
        len(line("a")), LIMITS.max_line_bytes + 1, len(line("b")), LIMITS.max_line_bytes + 1]


def test_a_file_without_a_valid_line_or_with_too_many_fails_as_a_whole() -> None:
    for content, code, words in ((b"", "empty_file", "no valid request"),
                                 (b"nope\n", "invalid_file", "line 1: not a JSON object"),
                                 (b"\n".join(line(str(i)) for i in range(11)), "too_many_requests", "more than 10")):
        with pytest.raises(Unusable) as unusable:
            read(content)
        assert unusable.value.code == code and words in unusable.value.message
