"""An input file read into the lines a batch runs and the lines it reports bad, as OpenAI validates them.

Pure, and streaming: :class:`Reading` takes the file's raw lines one at a time
(:func:`raw_lines` reads them from a file, never more than the line limit at
once) and yields each as a :class:`Line` or a :class:`LineError`, keeping only
what validation needs (the ``custom_id``s seen, the batch's model), so a
200 MB file is never in memory whole. Each input line is
``{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body": {... "model" ...}}``.
OpenAI fails a whole batch on its first bad line; here a bad line is one
entry in the error file (its line number in the message) and the good lines
run. Only what makes the batch as a whole unusable (no valid line, too many
lines) fails it: :class:`Unusable`, raised once that is known.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import msgspec

from extproc.adapters.batches.files import FileStore


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


class Unusable(Exception):
    """The batch cannot run at all: its ``errors.data`` entry (code, message)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class LineLimits:
    max_lines: int
    max_line_bytes: int


_decoder = msgspec.json.Decoder()
READ_CHUNK = 1024 * 1024


def open_input(files: FileStore, file_id: str) -> BinaryIO:
    """A batch's input file, open for reading; :class:`Unusable` when it was deleted before the batch ran."""
    try:
        return files.open(file_id)
    except FileNotFoundError:
        raise Unusable("missing_file", "the input file was deleted before the batch ran") from None


def raw_lines(source: BinaryIO, limit: int) -> Iterator[bytes]:
    """The file's lines without their newline; one longer than ``limit`` is cut to ``limit + 1`` bytes (the rest skipped)."""
    while line := source.readline(limit + 1):
        if len(line) > limit and not line.endswith(b"\n"):
            while (rest := source.readline(READ_CHUNK)) and not rest.endswith(b"\n"):
                pass
        yield line.rstrip(b"\r\n")


class Reading:
    """One file's validation: :meth:`items` yields its lines; ``model`` is the batch's once they are read."""

    def __init__(self, endpoint: str, limits: LineLimits) -> None:
        self.endpoint, self.limits = endpoint, limits
        self.model: str | None = None
        self._seen: set[str] = set()

    def items(self, source: Iterable[bytes]) -> Iterator[Line | LineError]:
        """Every non-blank line, good or bad, in file order; raises :class:`Unusable` when the batch cannot run."""
        index = valid = 0
        first_error: LineError | None = None
        for raw in source:
            if not raw.strip():
                continue
            if index >= self.limits.max_lines:
                raise Unusable("too_many_requests", f"the file has more than {self.limits.max_lines} requests, "
                               "the most one batch may hold")
            item = self._line(raw, index)
            if isinstance(item, Line):
                valid += 1
            else:
                first_error = first_error or item
            yield item
            index += 1
        if not valid:
            if first_error is None:
                raise Unusable("empty_file", "the file has no valid request")
            raise Unusable("invalid_file", f"the file has no valid request (line {first_error.index + 1}: "
                           f"{first_error.message})")

    def _line(self, raw: bytes, index: int) -> Line | LineError:
        where = f"line {index + 1}"
        if len(raw) > self.limits.max_line_bytes:
            return LineError(index, None, "line_too_large", f"{where}: more than {self.limits.max_line_bytes} bytes")
        try:
            item = _decoder.decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError):
            item = None
        if not isinstance(item, dict):
            return LineError(index, None, "invalid_json_line", f"{where}: not a JSON object")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            return LineError(index, None, "missing_custom_id", f"{where}: custom_id must be a non-empty string")
        if custom_id in self._seen:
            return LineError(index, custom_id, "duplicate_custom_id",
                             f"{where}: custom_id {custom_id!r} is used by an earlier line; each must be unique")
        problem = self._request_problem(item)
        if problem is not None:
            return LineError(index, custom_id, problem[0], f"{where}: {problem[1]}")
        self._seen.add(custom_id)
        self.model = self.model or item["body"]["model"]
        return Line(index, custom_id, msgspec.json.encode(item["body"]))

    def _request_problem(self, item: dict[str, object]) -> tuple[str, str] | None:
        if item.get("method") != "POST":
            return "invalid_method", f"method must be POST, got {item.get('method')!r}"
        if item.get("url") != self.endpoint:
            return "mismatched_url", f"url must be the batch's endpoint {self.endpoint!r}, got {item.get('url')!r}"
        body = item.get("body")
        if not isinstance(body, dict):
            return "invalid_body", "body must be a JSON object"
        name = body.get("model")
        if not isinstance(name, str) or not name:
            return "missing_model", "body.model must be a non-empty string"
        if self.model is not None and name != self.model:
            return "mismatched_model", (f"body.model {name!r} differs from the batch's model {self.model!r}; "
                                        "one model per batch")
        if body.get("stream") not in (None, False):
            return "unsupported_stream", "body.stream is not supported in a batch"
        return None
