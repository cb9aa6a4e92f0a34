"""An input file read into the lines a batch runs and the lines it reports bad, as OpenAI validates them.

Pure: bytes in, :class:`Parsed` out. Each input line is
``{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body": {... "model" ...}}``.
OpenAI fails a whole batch on its first bad line; here a bad line is one
entry in the error file (:class:`LineError`, its line number in the message)
and the good lines run. Only what makes the batch as a whole unusable (no
valid line, too many lines) fails it (:class:`BatchFailure`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


@dataclass(frozen=True, slots=True)
class Line:
    """A valid request: its place in the file (0-based), its ``custom_id`` and its body as JSON text."""

    index: int
    custom_id: str
    body: bytes


@dataclass(frozen=True, slots=True)
class LineError:
    """A bad line: where (0-based), its ``custom_id`` if it had one, and OpenAI's error code and message."""

    index: int
    custom_id: str | None
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class BatchFailure:
    """Why the batch cannot run at all (its ``errors.data`` entry)."""

    code: str
    message: str


@dataclass
class Parsed:
    """The batch's lines, good and bad, in file order, and the one model its good lines name."""

    lines: list[Line] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)
    model: str | None = None


@dataclass(frozen=True)
class Limits:
    max_lines: int
    max_line_bytes: int


_decoder = msgspec.json.Decoder()


def parse(content: bytes, endpoint: str, limits: Limits) -> Parsed | BatchFailure:
    """The lines of ``content`` (JSONL) for a batch on ``endpoint``; blank lines are skipped."""
    parsed = Parsed()
    seen: set[str] = set()
    index = 0
    for raw in content.split(b"\n"):
        if not raw.strip():
            continue
        if index >= limits.max_lines:
            return BatchFailure("too_many_requests", f"the file has more than {limits.max_lines} requests, "
                                "the most one batch may hold")
        found = _line(raw, index, endpoint, limits, seen, parsed.model)
        if isinstance(found, LineError):
            parsed.errors.append(found)
        else:
            parsed.model = parsed.model or _model(found.body)
            seen.add(found.custom_id)
            parsed.lines.append(found)
        index += 1
    if not parsed.lines:
        detail = f" (line {parsed.errors[0].index + 1}: {parsed.errors[0].message})" if parsed.errors else ""
        return BatchFailure("empty_file" if not parsed.errors else "invalid_file",
                            f"the file has no valid request{detail}")
    return parsed


def _model(body: bytes) -> str:
    model = _decoder.decode(body)["model"]
    assert isinstance(model, str)
    return model


def _line(raw: bytes, index: int, endpoint: str, limits: Limits, seen: set[str], model: str | None) -> Line | LineError:
    where = f"line {index + 1}"
    if len(raw) > limits.max_line_bytes:
        return LineError(index, None, "line_too_large", f"{where}: {len(raw)} bytes, more than {limits.max_line_bytes}")
    try:
        item = _decoder.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return LineError(index, None, "invalid_json_line", f"{where}: not a JSON object")
    if not isinstance(item, dict):
        return LineError(index, None, "invalid_json_line", f"{where}: not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(index, None, "missing_custom_id", f"{where}: custom_id must be a non-empty string")
    if custom_id in seen:
        return LineError(index, custom_id, "duplicate_custom_id",
                         f"{where}: custom_id {custom_id!r} is used by an earlier line; each must be unique")
    problem = _request_problem(item, endpoint, model)
    if problem is not None:
        return LineError(index, custom_id, problem[0], f"{where}: {problem[1]}")
    return Line(index, custom_id, msgspec.json.encode(item["body"]))


def _request_problem(item: dict[str, object], endpoint: str, model: str | None) -> tuple[str, str] | None:
    if item.get("method") != "POST":
        return "invalid_method", f"method must be POST, got {item.get('method')!r}"
    if item.get("url") != endpoint:
        return "mismatched_url", f"url must be the batch's endpoint {endpoint!r}, got {item.get('url')!r}"
    body = item.get("body")
    if not isinstance(body, dict):
        return "invalid_body", "body must be a JSON object"
    name = body.get("model")
    if not isinstance(name, str) or not name:
        return "missing_model", "body.model must be a non-empty string"
    if model is not None and name != model:
        return "mismatched_model", f"body.model {name!r} differs from the batch's model {model!r}; one model per batch"
    if body.get("stream") not in (None, False):
        return "unsupported_stream", "body.stream is not supported in a batch"
    return None
