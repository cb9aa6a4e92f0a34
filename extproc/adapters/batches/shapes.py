"""OpenAI's objects and errors as the SDK reads them: the file, the batch, the list page, an output line.

The shapes follow the OpenAI Python SDK's own types (``openai/types/batch.py``,
``file_object.py``, ``file_deleted.py``, ``pagination.py``'s cursor page); the
tests decode every answer with those types.
"""

from __future__ import annotations

import secrets
from typing import Any

from aiohttp import web

Json = dict[str, Any]

# Every status a batch can have; the runner resumes the first four after a restart.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")
# The endpoints a batch may name: what the gateway schedules.
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS, "/v1/embeddings")
# How a batch ends, by the status it reached: its final status, and the error of each line not run.
ENDINGS: dict[str, tuple[str, Json | None]] = {
    "finalizing": ("completed", None),
    "cancelling": ("cancelled", {"code": "batch_cancelled", "message": "the batch was cancelled before this "
                                 "request ran"}),
    "expired": ("expired", {"code": "batch_expired", "message": "this request could not be executed before the "
                            "completion window expired"}),
}
# Batches the status page lists with their progress, at most (the oldest active first).
PROGRESS_LISTED = 50


def new_id(prefix: str) -> str:
    """A fresh id as OpenAI spells them (``file-…``, ``batch_…``)."""
    return prefix + secrets.token_hex(12)


def request_id(batch_id: str, index: int) -> str:
    """The id of a batch's line in the output and error files: fixed by the batch, so a redone finalization is the same."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{index}"


def file_object(file_id: str, purpose: str, filename: str, size: int, created_at: int) -> Json:
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at, "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}


def batch_object(batch_id: str, endpoint: str, input_file_id: str, window: str, created_at: int, expires_at: int,
                 metadata: dict[str, str] | None) -> Json:
    """A new batch, ``validating``."""
    return {
        "id": batch_id, "object": "batch", "endpoint": endpoint, "model": None, "errors": None,
        "input_file_id": input_file_id, "completion_window": window, "status": "validating",
        "output_file_id": None, "error_file_id": None, "created_at": created_at, "in_progress_at": None,
        "expires_at": expires_at, "finalizing_at": None, "completed_at": None, "failed_at": None,
        "expired_at": None, "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata, "usage": None,
    }


def page(data: list[Json], has_more: bool) -> Json:
    """A cursor page: the SDK asks for the next one with ``after`` = the last item's id."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def output_line(line_id: str, custom_id: str | None, response: Json | None, error: Json | None) -> Json:
    """One line of an output or error file."""
    return {"id": line_id, "custom_id": custom_id, "response": response, "error": error}


class ApiError(Exception):
    """An answer that is an OpenAI error: status, message, code, param, type."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status)


def not_found(kind: str, object_id: str) -> ApiError:
    """Unknown, deleted and another tenant's objects all read the same: the id reveals nothing."""
    return ApiError(404, f"No such {kind}: '{object_id}'", "not_found")
