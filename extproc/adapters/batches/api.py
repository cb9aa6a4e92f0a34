"""The HTTP API: OpenAI's files and batches endpoints, on aiohttp, for Envoy's routes only.

Who calls is the tenant Envoy's auth named, read as admission reads it
(``request/admission.py``): every object is the caller's, and another
tenant's id answers 404 like an unknown one. Errors are OpenAI's: the status
and ``{"error": {"message", "type", "param", "code"}}`` (``shapes.ApiError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import BodyPartReader, web

from extproc.adapters.batches.books import Books, BooksUnavailable
from extproc.adapters.batches.files import FileStore, FilesUnavailable, Writer
from extproc.adapters.batches.shapes import ENDPOINTS, ApiError, Json, batch_object, new_id, not_found, page
from extproc.adapters.config import Config
from extproc.adapters.config.batches import window_s
from extproc.adapters.request.admission import identified_tenant
from extproc.core.values.outcomes import Refused

log = logging.getLogger(__name__)

# OpenAI's metadata bounds: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
# OpenAI's page sizes: batches 1-100 (20 by default), files up to 10,000 (all by default).
BATCH_PAGE, MAX_BATCH_PAGE = 20, 100
FILE_PAGE, MAX_FILE_PAGE = 10_000, 10_000
UPLOAD_CHUNK = 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as OpenAI's JSON error, aiohttp's own 404 and 405 too."""
    try:
        return await handler(request)
    except ApiError as error:
        return error.response()
    except BooksUnavailable as exc:  # the cluster's Redis is away: try again soon
        return _unavailable(f"the batch service cannot reach its state ({exc}); try again")
    except FilesUnavailable as exc:  # the file store (S3) is away: try again soon
        return _unavailable(f"the batch service cannot reach its file store ({exc}); try again")
    except Refused as refused:  # no tenant identity, with identity.missing_tenant: reject
        return ApiError(401, refused.message, refused.refusal.value, kind="authentication_error").response()
    except web.HTTPNotFound:
        return ApiError(404, f"Invalid URL ({request.method} {request.path})", "not_found").response()
    except web.HTTPMethodNotAllowed as exc:
        return ApiError(405, f"{exc.method} is not allowed on {request.path}", "method_not_allowed").response()


def _unavailable(message: str) -> web.Response:
    unavailable = ApiError(503, message, "service_unavailable", kind="server_error").response()
    unavailable.headers["Retry-After"] = "1"
    return unavailable


class Api:
    """The handlers, over the books (``books.py``: one instance's, or the cluster's) and the file store."""

    def __init__(self, current: Callable[[], Config], books: Books, files: FileStore,
                 clock: Callable[[], float] = time.time) -> None:
        """``current``: the config now (a reload changes identity; ``batches:`` needs a restart)."""
        settings = current().batches
        assert settings is not None
        self._current, self._settings, self._books, self._files, self._clock = current, settings, books, files, clock

    def app(self) -> web.Application:
        app = web.Application(middlewares=[openai_errors])
        app.router.add_post("/v1/files", self.create_file)
        app.router.add_get("/v1/files", self.list_files)
        app.router.add_get("/v1/files/{file_id}", self.get_file)
        app.router.add_delete("/v1/files/{file_id}", self.delete_file)
        app.router.add_get("/v1/files/{file_id}/content", self.file_content)
        app.router.add_post("/v1/batches", self.create_batch)
        app.router.add_get("/v1/batches", self.list_batches)
        app.router.add_get("/v1/batches/{batch_id}", self.get_batch)
        app.router.add_post("/v1/batches/{batch_id}/cancel", self.cancel_batch)
        return app

    def _tenant(self, request: web.Request) -> str:
        return identified_tenant(request.headers, self._current().identity)

    # --- files ----------------------------------------------------------------------------------

    async def create_file(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        if not request.content_type.startswith("multipart/"):
            raise ApiError(400, "the upload must be multipart/form-data with 'file' and 'purpose'", "invalid_request")
        file_id = new_id("file-")
        purpose, filename, written = None, None, None
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    continue
                if part.name == "purpose":
                    purpose = (await part.text()).strip()
                elif part.name == "file":
                    filename = part.filename or "upload.jsonl"
                    if written is not None:  # a second file part replaces the first
                        await asyncio.to_thread(written.abort)
                    written = await asyncio.to_thread(self._files.create, file_id)
                    await self._receive(part, written)
            if filename is None or written is None:
                raise ApiError(400, "'file' is required", "invalid_request", "file")
            if purpose != "batch":
                raise ApiError(400, f"purpose {purpose!r} is not served here; use 'batch'", "invalid_purpose", "purpose")
            size = await asyncio.to_thread(written.commit)
        except BaseException:
            if written is not None:
                with contextlib.suppress(FilesUnavailable):  # the first failure is the one to answer
                    await asyncio.to_thread(written.abort)
            raise
        try:
            return web.json_response(await self._books.add_file(file_id, tenant, purpose, filename, size,
                                                                 int(self._clock())))
        except BaseException:  # kept nowhere: its content goes too
            with contextlib.suppress(FilesUnavailable):
                await asyncio.to_thread(self._files.delete, file_id)
            raise

    async def _receive(self, part: BodyPartReader, written: Writer) -> None:
        """The file part to ``written``, refused (413) past ``max_file_bytes``."""
        limit = self._settings.max_file_bytes
        while chunk := await part.read_chunk(UPLOAD_CHUNK):
            if written.size + len(chunk) > limit:
                raise ApiError(413, f"the file is larger than {limit} bytes, the most a batch file may be",
                               "file_too_large", "file")
            await asyncio.to_thread(written.write, chunk)

    async def list_files(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be asc or desc, got {order!r}", "invalid_value", "order")
        data, more = await self._books.files(tenant, request.query.get("after"), _limit(request, FILE_PAGE, MAX_FILE_PAGE),
                                       order == "asc", request.query.get("purpose"))
        return web.json_response(page(data, more))

    async def get_file(self, request: web.Request) -> web.Response:
        return web.json_response(await self._file(request))

    async def _file(self, request: web.Request) -> Json:
        file_id = request.match_info["file_id"]
        found = await self._books.file(self._tenant(request), file_id)
        if found is None:
            raise not_found("file", file_id)
        return found

    async def delete_file(self, request: web.Request) -> web.Response:
        file_id = request.match_info["file_id"]
        if not await self._books.delete_file(self._tenant(request), file_id):
            raise not_found("file", file_id)
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        """The content streamed from the file store; a store lost midway cuts the response short of its length."""
        found = await self._file(request)
        try:
            source = await asyncio.to_thread(self._files.open, found["id"])
        except FileNotFoundError:
            raise not_found("file", found["id"]) from None
        try:
            response = web.StreamResponse(headers={"Content-Type": "application/octet-stream",
                                                   "Content-Length": str(found["bytes"])})
            await response.prepare(request)
            try:
                while chunk := await asyncio.to_thread(source.read, UPLOAD_CHUNK):
                    await response.write(chunk)
            except FilesUnavailable as exc:  # the status is sent: the connection closed short of the length
                log.warning("file %s: the file store failed midway (%s); the response is cut", found["id"], exc)
                response.force_close()
                return response
            await response.write_eof()
            return response
        finally:
            source.close()

    # --- batches --------------------------------------------------------------------------------

    async def create_batch(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", "invalid_request")
        endpoint, window, file_id = body.get("endpoint"), body.get("completion_window"), body.get("input_file_id")
        if endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}",
                           "invalid_value", "endpoint")
        windows = self._settings.completion_windows
        if window not in windows:
            raise ApiError(400, f"completion_window must be one of {', '.join(windows)}, got {window!r}",
                           "invalid_value", "completion_window")
        if not isinstance(file_id, str):
            raise ApiError(400, "input_file_id is required", "invalid_request", "input_file_id")
        found = await self._books.file(tenant, file_id)
        if found is None:
            raise not_found("file", file_id)
        if found["purpose"] != "batch":
            raise ApiError(400, f"the file {file_id!r} has purpose {found['purpose']!r}; a batch needs 'batch'",
                           "invalid_purpose", "input_file_id")
        metadata = _metadata(body.get("metadata"))
        now = int(self._clock())
        seconds = window_s(window)
        assert seconds is not None
        doc = batch_object(new_id("batch_"), endpoint, file_id, window, now, now + seconds, metadata)
        await self._books.create_batch(tenant, doc)
        return web.json_response(doc)

    async def list_batches(self, request: web.Request) -> web.Response:
        data, more = await self._books.batches(self._tenant(request), request.query.get("after"),
                                         _limit(request, BATCH_PAGE, MAX_BATCH_PAGE))
        return web.json_response(page(data, more))

    async def get_batch(self, request: web.Request) -> web.Response:
        return web.json_response(await self._batch(request))

    async def _batch(self, request: web.Request) -> Json:
        batch_id = request.match_info["batch_id"]
        found = await self._books.batch(self._tenant(request), batch_id)
        if found is None:
            raise not_found("batch", batch_id)
        return found

    async def cancel_batch(self, request: web.Request) -> web.Response:
        found = await self._batch(request)
        if found["status"] not in ("validating", "in_progress", "cancelling"):
            raise ApiError(409, f"Cannot cancel a batch with status '{found['status']}'.", "invalid_state")
        return web.json_response(await self._books.cancel(found["id"]))


def _limit(request: web.Request, default: int, most: int) -> int:
    written = request.query.get("limit")
    if written is None:
        return default
    if not written.isdigit() or not 1 <= int(written) <= most:
        raise ApiError(400, f"limit must be an integer from 1 to {most}, got {written!r}", "invalid_value", "limit")
    return int(written)


def _metadata(raw: Any) -> dict[str, str] | None:
    """OpenAI's metadata: up to 16 string pairs, keys up to 64 characters, values up to 512."""
    if raw is None:
        return None
    if (not isinstance(raw, dict) or len(raw) > MAX_METADATA
            or any(not isinstance(k, str) or not isinstance(v, str) or len(k) > MAX_METADATA_KEY
                   or len(v) > MAX_METADATA_VALUE for k, v in raw.items())):
        raise ApiError(400, f"metadata must map at most {MAX_METADATA} string keys (up to {MAX_METADATA_KEY} "
                       f"characters) to strings (up to {MAX_METADATA_VALUE})", "invalid_value", "metadata")
    return dict(raw)
