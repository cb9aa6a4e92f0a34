"""HTTP front end of the vLLM simulator: vLLM's OpenAI-compatible API on aiohttp.

Endpoints mirror ``vllm serve``: ``POST /v1/chat/completions``,
``POST /v1/completions`` (streaming SSE or one JSON body), ``GET /v1/models``,
``GET /health`` and ``GET /metrics``. Errors use vLLM's JSON error shape
``{"error": {"message", "type", "param", "code"}}`` for every failure, so
clients and the ext_proc plugin never have to handle a bare-text 500.

Request handling, also as in vLLM:

* prompt tokens are estimated at ~4 characters per token (at least 1) over all
  message texts, as there is no tokenizer: the prompt's tokens are its
  successive 4-character chunks (:func:`prompt_units`), so with
  ``--prefix-caching`` prompts with the same leading text share their
  leading KV blocks (a list of token ids is its own tokens): a completion's
  prompt followed by its answer so far, or a chat continued with
  ``continue_final_message`` (``add_generation_prompt: false``; both true is
  vLLM's 400), hits the first request's prompt blocks (:func:`chat_prompt`);
* the output is exactly ``max_completion_tokens``/``max_tokens`` tokens (else
  ``--default-max-tokens``), finish reason ``length``; ``min_tokens``, stop
  strings and sampling parameters are accepted and ignored; ``n`` must be 1;
* ``priority`` (an integer, lower first) orders the engine's waiting queue
  with ``--scheduling-policy priority``; without it any value is accepted
  and ignored, as vLLM 0.32 does (its input processor no longer checks it);
* ``--dev-mode`` serves ``GET /server_info?config_format=json`` as vLLM does
  with ``VLLM_SERVER_DEV_MODE=1``: its ``vllm_config.scheduler_config``
  (``max_num_seqs``, ``policy``), what the gateway reads of it;
* a client that disconnects is aborted in the engine at once (aiohttp's handler
  cancellation), freeing its batch slot and KV, like vLLM's disconnect handling
  (its ``AsyncLLM.generate`` aborts the request when the handler is cancelled),
  whether the request was waiting or running, streamed or not;
* ``--max-num-queued-reqs`` / ``--max-num-queued-tokens`` are vLLM's own
  valves (:meth:`~extproc.tools.sim.engine.SimEngine.check_admission`): a
  refusal is 503 with vLLM's body, counted in
  ``vllm:admission_rejections_total{reason}``; a stream that passed the first
  check and fails the second (requests that arrive together) is answered 200
  with the error as its one event, then ``[DONE]``, as vLLM 0.32 does;
* ``--kv-mode incremental`` allocates KV in ``--block-size`` blocks as the
  request decodes and preempts on KV pressure, as vLLM's scheduler does
  (:mod:`extproc.tools.sim.engine`);
* on SIGTERM with ``--shutdown-timeout S`` (vLLM 0.32's option of that name,
  ``vllm/entrypoints/launchers/launcher.py``) it refuses new requests (503)
  and lets those in flight finish, for up to S seconds, before it exits;
  without it (0, vLLM's default too) they are cut.

``--dialect`` makes ``/metrics`` speak another engine's names
(:mod:`extproc.tools.sim.dialects`). For tests of broken metrics, ``/metrics`` can
be made to fail: ``--metrics-fault`` at start, or at run time
``PUT /sim/metrics-fault`` with ``{"mode": MODE}``; modes are ``ok``,
``garbage`` (200 with unparseable text), ``error`` (HTTP 500), ``slow``
(answers after 30 s), ``frozen`` (the same page forever), ``nan`` (a
well-formed page whose vLLM queue and KV gauges read NaN, as a broken
exporter's can; vLLM dialect only) and ``reset`` (the connection is reset
before an answer, as a broken proxy in front of the exporter does, while
the API and ``/health`` still serve).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import uvloop
from aiohttp import web
from prometheus_client.exposition import choose_encoder

from extproc.tools.sim.dialects import DIALECT_NAMES, DialectMetrics
from extproc.tools.sim.engine import (
    FINISH_ABORT,
    KV_MODES,
    SCHEDULING_POLICIES,
    QueueFull,
    RequestHandle,
    RequestTooLong,
    SimEngine,
    SimSettings,
)
from extproc.tools.sim.metrics import VllmMetrics

logger = logging.getLogger(__name__)

Metrics = VllmMetrics | DialectMetrics
ENGINE_KEY = web.AppKey("sim_engine", SimEngine)
METRICS_KEY: web.AppKey[Metrics] = web.AppKey("sim_metrics")
METRICS_FAULTS = ("ok", "garbage", "error", "slow", "frozen", "nan", "reset")
_SLOW_METRICS_S = 30.0
# A sample of vLLM's queue and KV gauges, up to its value: the ``nan`` fault's target.
_GAUGE_SAMPLE = re.compile(rb"^((?:vllm:num_requests_\w+|vllm:kv_cache_usage_perc)(?:\{[^}]*\})? )\S+", re.M)

# Where each dialect's engine says its limits (adapters/engines/limits.py reads them); vLLM's is /v1/models.
_INFO_PATHS = {"sglang": "/server_info", "tgi": "/info", "llamacpp": "/props"}
_CHARS_PER_TOKEN = 4
_MAX_BODY_BYTES = 32 * 1024 * 1024  # long prompts are the point of some tests


class ApiError(Exception):
    """An error answered in vLLM's/OpenAI's JSON error shape."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.err_type = err_type
        self.param = param

    def response(self) -> web.Response:
        error = {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}
        return web.json_response({"error": error}, status=self.status)


def _bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message, "BadRequestError", param)


def estimate_tokens(text: str) -> int:
    """Approximate token count of ``text`` (~4 characters per token, at least 1)."""
    return max(1, -(-len(text) // _CHARS_PER_TOKEN))


def prompt_units(text: str) -> list[str]:
    """The simulator's tokens of ``text``: its 4-character chunks, ``estimate_tokens(text)`` of them.

    Deterministic and prefix-preserving: equal leading text gives equal
    leading units, hence equal leading block hashes.
    """
    return [text[i:i + _CHARS_PER_TOKEN] for i in range(0, len(text), _CHARS_PER_TOKEN)] or [""]


def _message_text(message: object, index: int) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _bad_request(f"messages[{index}] must be an object with a string 'role'", "messages")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    raise _bad_request(f"messages[{index}].content must be a string or a list of parts", "messages")


def chat_prompt(body: dict[str, Any]) -> str:
    """The chat prompt: the message texts, concatenated in order.

    No role markers and no generation prompt (a template's header for the
    answer) are counted, so ``add_generation_prompt`` changes nothing here;
    ``continue_final_message`` with it is refused as vLLM's request validator
    refuses it. A final assistant message left open to continue is thus the
    prompt's last text: the prompt of a continuation is the first request's
    prompt followed by the text so far, and shares its leading blocks.
    """
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise _bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad_request("'messages' must be a non-empty list", "messages")
    return "".join(_message_text(m, i) for i, m in enumerate(messages))


def completion_prompt(body: dict[str, Any]) -> str | list[int]:
    """The completion prompt: its text, or the token ids as sent."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt  # already token ids
    raise _bad_request("'prompt' must be a string or a list of token ids (one prompt only)", "prompt")


@dataclass(frozen=True)
class _Params:
    """The request fields that shape the simulated generation."""

    max_tokens: int
    stream: bool
    include_usage: bool
    priority: int = 0


def _parse_params(body: dict[str, Any], default_max_tokens: int) -> _Params:
    max_tokens = default_max_tokens
    for field in ("max_tokens", "max_completion_tokens"):  # the latter wins, as in vLLM
        value = body.get(field)
        if value is None:
            continue
        if type(value) is not int or value < 1:
            raise _bad_request(f"'{field}' must be a positive integer", field)
        max_tokens = value
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise _bad_request("the simulator supports only n=1", "n")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _bad_request("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad_request("'stream_options' must be an object", "stream_options")
    priority = body.get("priority", 0)
    if type(priority) is not int:
        raise _bad_request("'priority' must be an integer", "priority")
    return _Params(max_tokens, bool(stream), bool(options.get("include_usage")), priority)


@dataclass(frozen=True)
class _Api:
    """The differences between the chat and the legacy completions response shapes."""

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def chunk_choice(self, piece: str, finish_reason: str | None) -> dict[str, Any]:
        content = {"delta": {"content": piece}} if self.chat else {"text": piece}
        return {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}

    def full_choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}


_CHAT = _Api("chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)
_COMPLETION = _Api("cmpl-", "text_completion", "text_completion", chat=False)


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Handlers:
    """Route handlers bound to one simulator's engine and settings."""

    def __init__(self, settings: SimSettings, engine: SimEngine, metrics: Metrics, metrics_fault: str,
                 dialect: str = "vllm") -> None:
        self.settings = settings
        self.dialect = dialect
        self.engine = engine
        self.metrics = metrics
        self.metrics_fault = metrics_fault
        self._frozen: web.Response | None = None
        # Completions being answered, and whether new ones are refused (the drain: RunningSim.drain).
        self.in_flight = 0
        self.draining = False

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        model = self.settings.model
        card = {
            "id": model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": self.settings.kv_cache_tokens,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def server_info(self, request: web.Request) -> web.Response:
        """vLLM's development ``/server_info?config_format=json``: of its config, the scheduler's part we model."""
        s = self.settings
        scheduler = {"max_num_seqs": s.max_num_seqs, "policy": s.scheduling_policy,
                     "max_num_queued_reqs": s.max_num_queued_reqs}
        return web.json_response({"vllm_config": {"scheduler_config": scheduler}, "vllm_env": {}, "system_env": {}})

    async def info(self, request: web.Request) -> web.Response:
        """What the dialect's engine says of its limits (SGLang /server_info, TGI /info, llama.cpp /props).

        The simulator's queue cap counts running and waiting, as vLLM's: SGLang's
        counts only waiting, so it is given as the cap less the batch.
        """
        s = self.settings
        cap = s.max_num_queued_reqs
        documents: dict[str, dict[str, Any]] = {
            "sglang": {"max_running_requests": s.max_num_seqs, "context_length": s.kv_cache_tokens,
                       "max_queued_requests": cap - s.max_num_seqs if cap is not None else None},
            "tgi": {"max_concurrent_requests": cap if cap is not None else 128, "max_total_tokens": s.kv_cache_tokens},
            "llamacpp": {"total_slots": s.max_num_seqs, "default_generation_settings": {"n_ctx": s.kv_cache_tokens}},
        }
        return web.json_response(documents[self.dialect])

    async def prometheus(self, request: web.Request) -> web.Response:
        fault = self.metrics_fault
        if fault == "reset":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if fault == "error":
            raise ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, "metrics exporter failed", "InternalServerError")
        if fault == "garbage":
            return web.Response(text="<html><body>502 Bad Gateway {{{ not prometheus</body></html>\n")
        if fault == "slow":
            await asyncio.sleep(_SLOW_METRICS_S)
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = encoder(self.metrics.registry)
        if fault == "nan":
            body = _GAUGE_SAMPLE.sub(rb"\1NaN", body)
        page = web.Response(body=body, headers={"Content-Type": content_type})
        if fault == "frozen":
            if self._frozen is None:
                self._frozen = page
            return web.Response(body=self._frozen.body, headers={"Content-Type": content_type})
        self._frozen = None
        return page

    async def set_metrics_fault(self, request: web.Request) -> web.Response:
        """Test hook: break or heal ``/metrics`` at run time."""
        try:
            mode = (await request.json())["mode"]
        except (ValueError, KeyError, TypeError) as exc:
            raise _bad_request('body must be {"mode": MODE}') from exc
        if mode not in METRICS_FAULTS:
            raise _bad_request(f"mode must be one of {', '.join(METRICS_FAULTS)}", "mode")
        self.metrics_fault = mode
        return web.json_response({"mode": mode})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_request(request)
        return await self._generate(request, _CHAT, body, chat_prompt(body))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_request(request)
        return await self._generate(request, _COMPLETION, body, completion_prompt(body))

    async def _read_request(self, request: web.Request) -> dict[str, Any]:
        """The JSON body, once it is known to be an object addressed to the served model."""
        try:
            body = json.loads(await request.read())
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise _bad_request(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise _bad_request("request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad_request("'model' must be a string", "model")
        if model is not None and model != self.settings.model:
            raise ApiError(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return body

    async def _generate(
        self, request: web.Request, api: _Api, body: dict[str, Any], prompt: str | list[int]
    ) -> web.StreamResponse:
        if self.draining:
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, "The simulator is shutting down.", "ServiceUnavailableError")
        self.in_flight += 1
        try:
            return await self._answer(request, api, body, prompt)
        finally:
            self.in_flight -= 1

    async def _answer(
        self, request: web.Request, api: _Api, body: dict[str, Any], prompt: str | list[int]
    ) -> web.StreamResponse:
        params = _parse_params(body, self.settings.default_max_tokens)
        tokens = estimate_tokens(prompt) if isinstance(prompt, str) else len(prompt)
        # The units only where they are hashed: cutting a 32 MB prompt into its 8 million takes 1.4 s.
        units: Sequence[Hashable] = ()
        if self.settings.prefix_caching:
            units = prompt_units(prompt) if isinstance(prompt, str) else prompt
        try:
            self.engine.check_admission()  # vLLM's preflight: before any response begins
        except QueueFull as exc:
            raise _queue_full(exc) from exc
        await asyncio.sleep(0)  # vLLM renders the prompt between its two checks; others arrive meanwhile
        try:
            handle = self.engine.submit(tokens, params.max_tokens, params.priority, units)
        except RequestTooLong as exc:
            raise _bad_request(str(exc)) from exc
        except QueueFull as exc:
            if not params.stream:
                raise _queue_full(exc) from exc
            return await self._refused_stream(request, exc)
        try:
            meta = {
                "id": api.id_prefix + uuid.uuid4().hex,
                "created": int(time.time()),
                "model": self.settings.model,
            }
            if params.stream:
                return await self._stream(request, api, handle, params, meta)
            return await self._whole(api, handle, meta)
        finally:
            # Client gone (handler cancelled) or anything else unexpected: free the slot.
            handle.abort()

    async def _refused_stream(self, request: web.Request, exc: QueueFull) -> web.StreamResponse:
        """vLLM 0.32's answer to a stream its second admission check refuses: 200, the error, [DONE].

        Its streaming response has begun by then (``serving.py``'s stream
        generator writes the exception as an event), so the status cannot say it.
        """
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        error = _queue_full(exc)
        event = {"error": {"message": error.message, "type": error.err_type, "param": None, "code": error.status}}
        await response.write(f"data: {json.dumps(event)}\n\n".encode())  # vLLM's json.dumps: default separators
        await response.write(_sse("[DONE]"))
        await response.write_eof()
        return response

    async def _stream(
        self,
        request: web.Request,
        api: _Api,
        handle: RequestHandle,
        params: _Params,
        meta: dict[str, Any],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        chunk = {**meta, "object": api.chunk_object}
        generated = 0
        try:
            async for piece in handle:
                if generated == 0 and api.chat:  # vLLM opens a chat stream with the role
                    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}
                    await response.write(_sse({**chunk, "choices": [role]}))
                generated += 1
                finish = handle.request.finish_reason if generated == handle.request.max_tokens else None
                await response.write(_sse({**chunk, "choices": [api.chunk_choice(piece, finish)]}))
            if handle.request.finish_reason == FINISH_ABORT:
                return response  # engine shut down: end without [DONE] so the client sees truncation
            if params.include_usage:
                usage = _usage(handle.request.prompt_tokens, generated)
                await response.write(_sse({**chunk, "choices": [], "usage": usage}))
            await response.write(_sse("[DONE]"))
            await response.write_eof()
        except ConnectionResetError:
            logger.debug("client disconnected mid-stream")
        return response

    async def _whole(self, api: _Api, handle: RequestHandle, meta: dict[str, Any]) -> web.Response:
        pieces = [piece async for piece in handle]
        reason = handle.request.finish_reason
        if reason == FINISH_ABORT:
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, "The simulator is shutting down.", "ServiceUnavailableError")
        assert reason is not None
        return web.json_response(
            {
                **meta,
                "object": api.object,
                "choices": [api.full_choice("".join(pieces), reason)],
                "usage": _usage(handle.request.prompt_tokens, len(pieces)),
            }
        )


def _queue_full(exc: QueueFull) -> ApiError:
    """vLLM's answer when its queue caps refuse a request (a ``GracefulHTTPError``: the status's phrase as type)."""
    return ApiError(HTTPStatus.SERVICE_UNAVAILABLE, exc.message, HTTPStatus.SERVICE_UNAVAILABLE.phrase)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _error_type(status: int) -> str:
    if status == HTTPStatus.NOT_FOUND:
        return "NotFoundError"
    return "BadRequestError" if status < 500 else "InternalServerError"


HANDLERS_KEY = web.AppKey("sim_handlers", _Handlers)


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Answer every failure in the OpenAI error shape, never as aiohttp's text pages."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return ApiError(exc.status, exc.reason, _error_type(exc.status)).response()
    except Exception:
        logger.exception("unexpected error handling %s %s", request.method, request.path)
        return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, "Internal server error", "InternalServerError").response()


def create_app(settings: SimSettings, dialect: str = "vllm", metrics_fault: str = "ok") -> web.Application:
    """Build the aiohttp app; its engine starts on app startup and stops on shutdown."""
    engine = SimEngine(settings)
    metrics: Metrics = (
        VllmMetrics(settings.model, engine.scheduler)
        if dialect == "vllm"
        else DialectMetrics(dialect, settings.model, engine.scheduler)
    )
    engine.observer = metrics
    handlers = _Handlers(settings, engine, metrics, metrics_fault, dialect)

    app = web.Application(middlewares=[_json_errors], client_max_size=_MAX_BODY_BYTES)
    app[ENGINE_KEY] = engine
    app[METRICS_KEY] = metrics
    app[HANDLERS_KEY] = handlers
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.prometheus)
    app.router.add_put("/sim/metrics-fault", handlers.set_metrics_fault)
    if dialect == "vllm" and settings.dev_mode:
        app.router.add_get("/server_info", handlers.server_info)
    if dialect in _INFO_PATHS:
        app.router.add_get(_INFO_PATHS[dialect], handlers.info)

    async def start_engine(_: web.Application) -> None:
        engine.start()

    async def stop_engine(_: web.Application) -> None:
        await engine.close()  # ends in-flight streams so the server can drain quickly

    app.on_startup.append(start_engine)
    app.on_shutdown.append(stop_engine)
    return app


@dataclass
class RunningSim:
    """A simulator listening on a socket, started by :func:`start_sim`."""

    settings: SimSettings
    engine: SimEngine
    metrics: Metrics
    host: str
    port: int
    _runner: web.AppRunner
    _handlers: _Handlers

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8000`` (append ``/v1`` for OpenAI clients)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests and wait, up to ``timeout_s``, until those in flight are answered."""
        self._handlers.draining = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._handlers.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Abort in-flight requests, close connections and free the port."""
        await self._runner.cleanup()

    async def __aenter__(self) -> RunningSim:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


async def start_sim(
    settings: SimSettings, host: str = "127.0.0.1", port: int = 0, *, dialect: str = "vllm", metrics_fault: str = "ok"
) -> RunningSim:
    """Start a simulator in the running event loop; ``port=0`` picks a free port."""
    app = create_app(settings, dialect, metrics_fault)
    # handler_cancellation: a client disconnect cancels its handler, which aborts
    # the request in the engine, as vLLM does.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port = runner.addresses[0][1]
    return RunningSim(settings, app[ENGINE_KEY], app[METRICS_KEY], host, bound_port, runner, app[HANDLERS_KEY])


# The SimSettings fields as ``extproc-dev sim`` options, in --help order: (field, type, choices, help).
# The option is the field's name with dashes; its default is SimSettings's.
_SETTINGS_OPTIONS: tuple[tuple[str, type[bool | int | float | str], tuple[str, ...] | None, str], ...] = (
    ("max_num_seqs", int, None, "maximum sequences in a batch"),
    ("kv_cache_tokens", int, None, "KV cache capacity in tokens, also the max model length"),
    ("prefill_ms_per_token", float, None, "prefill time per prompt token, added to the admitting step"),
    ("step_ms", float, None, "base decode step time"),
    ("step_ms_per_seq", float, None, "extra step time per running sequence"),
    ("time_scale", float, None, "multiplies every simulated duration; 0.1 runs 10x faster"),
    ("default_max_tokens", int, None, "output length when a request sets no max_tokens"),
    ("seed", int, None, "seed for the generated words"),
    ("scheduling_policy", str, SCHEDULING_POLICIES,
     "waiting-queue order: arrival, or the body's priority (lower first)"),
    ("kv_mode", str, KV_MODES,
     "KV reserved whole at admission (reserve), or allocated block by block with vLLM's preemption on KV "
     "pressure (incremental)"),
    ("block_size", int, None, "tokens per KV block, as vLLM's --block-size; incremental kv mode or prefix caching"),
    ("prefix_caching", bool, None,
     "cache full prompt blocks and prefill only the uncached tokens, as vLLM's --enable-prefix-caching"),
    ("visibility_delay_ms", float, None,
     "wall-clock time from a request's arrival to the scheduler and /metrics, as in vLLM; 0 for none"),
    ("visibility_delay_per_pending_ms", float, None, "extra delay for each request still on its way"),
    ("visibility_delay_max_ms", float, None, "cap of the delay"),
    ("max_num_queued_reqs", int, None,
     "refuse a request (503) when waiting + running would exceed this, as vLLM's --max-num-queued-reqs; off by default"),
    ("max_num_queued_tokens", int, None,
     "refuse a request (503) while this many prompt tokens await their prefill, as vLLM's --max-num-queued-tokens"),
    ("dev_mode", bool, None, "serve GET /server_info (the scheduler's settings), as vLLM with VLLM_SERVER_DEV_MODE=1"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``extproc-dev sim`` options (defaults are :class:`SimSettings`'s)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--model", required=True, help="served model name; other names get 404")
    for field, kind, choices, text in _SETTINGS_OPTIONS:
        option, default = "--" + field.replace("_", "-"), getattr(SimSettings, field)
        if kind is bool:  # a switch: --prefix-caching / --no-prefix-caching
            parser.add_argument(option, action=argparse.BooleanOptionalAction, default=default, help=text)
            continue
        parser.add_argument(
            option, type=kind, choices=choices, default=default, help=f"{text} (default: %(default)s)",
        )
    parser.add_argument(
        "--dialect", choices=DIALECT_NAMES, default="vllm",
        help="whose metric names /metrics uses (default: %(default)s)",
    )
    parser.add_argument(
        "--shutdown-timeout", type=float, default=0.0,
        help="on SIGTERM, refuse new requests and let those in flight finish for up to this many seconds, as vLLM's "
        "--shutdown-timeout (default: %(default)s, cut them)",
    )
    parser.add_argument(
        "--metrics-fault", choices=METRICS_FAULTS, default="ok",
        help="make /metrics fail from the start, for tests (default: %(default)s)",
    )


def settings_from_args(args: argparse.Namespace) -> SimSettings:
    return SimSettings(model=args.model, **{field: getattr(args, field) for field, *_ in _SETTINGS_OPTIONS})


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; returns the process exit code."""
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        logger.error("invalid simulator settings: %s", exc)
        return 2
    uvloop.run(_serve_until_signalled(settings, args.host, args.port, args.dialect, args.metrics_fault,
                                      args.shutdown_timeout))
    return 0


async def _serve_until_signalled(settings: SimSettings, host: str, port: int, dialect: str, fault: str,
                                 shutdown_timeout_s: float) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    sim = await start_sim(settings, host, port, dialect=dialect, metrics_fault=fault)
    print(f"simulator ({dialect} metrics) serving {settings.model!r} on {sim.url}", flush=True)
    try:
        await stop.wait()
        if shutdown_timeout_s > 0:
            await sim.drain(shutdown_timeout_s)
    finally:
        await sim.stop()
