"""Envoy's own answers through a real Envoy: every one the OpenAI error object with ``x-extproc-reason``.

The generated ``local_reply_config`` (adapters/envoy/local_replies.py) rewrites what Envoy
says itself — an auth filter's 401, an unreachable processor or engine, a
processor too slow to answer, a body too large, no route — and leaves the
processor's own JSON answers as they are. The OpenAI SDK then raises its
typed errors with a message, as it does for the engine's errors.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.adapters.config import Config, load_config
from extproc.adapters.envoy import bootstrap
from extproc.tools.envoy_proc import start_envoy
from extproc.tools.stack import start_stack
from tests.envoyutil import free_port_config
from tests.lazy import openai
from tests.stackutil import TENANT_KEYS, wait_for_metric, write_config

pytestmark = pytest.mark.integration

FAST_SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "0.1"]
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def post(url: str, *, api_key: str | None = TENANT_KEYS["bob"], **kwargs: Any) -> tuple[int, Any, Any]:
    """Status, headers and JSON body of one chat request (raises if the body is not JSON)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    headers.update(kwargs.pop("headers", {}))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        kwargs.setdefault("json", CHAT)
        async with session.post(f"{url}/v1/chat/completions", headers=headers, **kwargs) as response:
            assert response.content_type == "application/json", (response.status, await response.text())
            return response.status, response.headers, await response.json()


def assert_error(answer: tuple[int, Any, Any], status: int, reason: str, retry_after: str | None = None) -> None:
    got_status, headers, body = answer
    assert got_status == status, answer
    assert headers["x-extproc-reason"] == reason
    assert headers.get("retry-after") == retry_after
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == reason and body["error"]["param"] is None and body["error"]["message"]


async def sdk_error(url: str, api_key: str = TENANT_KEYS["bob"]) -> openai.APIStatusError:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)
    async with client:
        with pytest.raises(openai.APIStatusError) as err:
            await client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
    return err.value


async def test_auth_processor_and_engine_failures_are_json(tmp_path: Path) -> None:
    # A short queue wait: with its engine down a request waits for it, then gets queue_timeout.
    config = write_config(tmp_path, max_queue_wait_s=2)
    async with await start_stack(config, tmp_path, sim_args=FAST_SIM) as stack:
        url = stack.envoy_url
        assert_error(await post(url, api_key="not-a-key"), 401, "unauthenticated")
        assert_error(await post(url, api_key=None), 401, "unauthenticated")
        denied = await sdk_error(url, api_key="not-a-key")
        assert isinstance(denied, openai.AuthenticationError)
        assert denied.code == "unauthenticated" and denied.message.endswith("Client authentication failed.")

        # The processor's own answer passes through untouched: its message, once its reason.
        status, headers, body = await post(url, json={"model": "nope", "messages": []})
        assert status == 404 and headers.getall("x-extproc-reason") == ["model_not_found"]
        assert "served models: m1" in body["error"]["message"]

        too_large = b'{"model": "m1", "pad": "' + b"x" * (17 * 1024 * 1024) + b'"}'
        answer = await post(url, data=io.BytesIO(too_large), json=None, headers={"content-type": "application/json"})
        assert_error(answer, 413, "request_too_large")

        for sim in stack.sims:
            await sim.stop()
        # Once a scrape has seen the engine gone (before, a release could still reach it and get
        # Envoy's engine_unavailable), the gate holds the request (docs/gate.md), then times it out.
        assert await wait_for_metric(stack.metrics_url, "extproc_endpoint_up", lambda v: v == 0, model="m1") == 0
        status, headers, body = await post(url)
        assert status == 503 and body["error"]["code"] == "queue_timeout", (status, body)
        engine_down = await sdk_error(url)
        assert isinstance(engine_down, openai.InternalServerError) and engine_down.code == "queue_timeout"

        assert stack.processor is not None
        await stack.processor.stop()
        assert_error(await post(url), 503, "processor_unavailable", retry_after="1")
        processor_down = await sdk_error(url)
        assert isinstance(processor_down, openai.InternalServerError)
        assert processor_down.code == "processor_unavailable" and "unavailable" in processor_down.message


class Mute(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]  # the generated base is untyped
    """A processor that reads and never answers: a hung one."""

    async def Process(  # noqa: N802 (gRPC method name)
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for _ in request_iterator:
            await asyncio.Event().wait()
        return
        yield


@pytest.fixture
async def mute_processor_config() -> AsyncIterator[Config]:
    config = free_port_config(envoy={"message_timeout_ms": 300})
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Mute(), server)
    server.add_insecure_port(config.listen.grpc)
    await server.start()
    yield config
    await server.stop(0)


async def test_a_processor_that_does_not_answer_is_a_json_503(mute_processor_config: Config, tmp_path: Path) -> None:
    """Past message_timeout the request goes on without the model header: the catch-all refuses it, not a bare 504."""
    config = mute_processor_config
    async with await start_envoy(bootstrap(config), tmp_path) as envoy:
        assert envoy.admin_url
        url = f"http://{config.envoy.listen}"
        answer = await post(url, api_key="key-alice", json={**CHAT, "model": "m-one"})
        assert_error(answer, 503, "processor_unavailable", retry_after="1")


async def test_envoy_alone_answers_unknown_model_engine_down_and_missing_jwt_in_json(tmp_path: Path) -> None:
    """No route, no engine (the Envoy-only baseline) and jwt_authn's 401: no processor involved."""
    demo = load_config(write_config(tmp_path))
    async with await start_envoy(bootstrap(demo, ext_proc=False), tmp_path / "plain"):
        url = f"http://{demo.envoy.listen}"
        assert_error(await post(url, json={**CHAT, "model": "nope"}), 404, "model_not_found")
        # m1's engine is not running: connection refused, retried, then Envoy's 503.
        assert_error(await post(url), 503, "engine_unavailable", retry_after="1")
        engine_down = await sdk_error(url)
        assert isinstance(engine_down, openai.InternalServerError) and engine_down.code == "engine_unavailable"
    jwks = {"keys": [{"kty": "oct", "kid": "k", "alg": "HS256", "k": "c2VjcmV0LXNlY3JldC1zZWNyZXQ"}]}
    jwt = free_port_config(api_keys={}, envoy={"jwt": {"issuer": "me", "jwks": jwks}})
    async with await start_envoy(bootstrap(jwt), tmp_path / "jwt"):
        url = f"http://{jwt.envoy.listen}"
        assert_error(await post(url, api_key=None), 401, "unauthenticated")
        assert_error(await post(url, api_key="not.a.jwt"), 401, "unauthenticated")
