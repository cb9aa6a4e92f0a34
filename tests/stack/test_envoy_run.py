"""The generated Envoy configuration in a real Envoy: validation, the launcher and the filter chain."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf.json_format import MessageToDict

from extproc.adapters.envoy import bootstrap, render
from extproc.tools.envoy_bin import ENV_VAR, find_envoy
from extproc.tools.envoy_proc import start_envoy
from extproc.tools.procs import ProcessStartError
from tests.envoyutil import VARIANTS, free_port_config, variant_bootstrap

pytestmark = pytest.mark.integration


def validate(doc: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "bootstrap.yaml"
    path.write_text(render(doc), encoding="utf-8")
    return subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(path), "--disable-hot-restart", "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_find_envoy_default_is_envoy_1_40(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    out = subprocess.run([find_envoy(), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "/1.40." in out.stdout



@pytest.mark.parametrize("variant", VARIANTS)
def test_envoy_validates_the_bootstrap(variant: str, tmp_path: Path) -> None:
    result = validate(variant_bootstrap(variant, tmp_path), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


# --- a real Envoy ----------------------------------------------------------------------------------------


async def post(url: str, *, headers: dict[str, str] | None = None, body: Any = None) -> tuple[int, str]:
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url, json=body or {"model": "m-one", "max_tokens": 8}, headers=headers) as r:
            return r.status, await r.text()


async def test_envoy_runs_the_filter_chain(tmp_path: Path) -> None:
    config = free_port_config()
    url = f"http://{config.envoy.listen}/v1/chat/completions"
    async with await start_envoy(bootstrap(config), tmp_path) as envoy:
        assert envoy.admin_url == f"http://{config.envoy.admin}"
        # api_key_auth rejects a missing or unknown key before anything else runs.
        assert (await post(url))[0] == 401
        assert (await post(url, headers={"Authorization": "Bearer nope"}))[0] == 401
        # A valid key reaches ext_proc; with no processor listening and
        # failure_mode_allow false, Envoy answers an error itself.
        status, _ = await post(url, headers={"Authorization": "Bearer key-alice"})
        assert status == 503
    assert envoy.returncode is not None
    assert envoy.log_path.exists()


async def test_two_envoys_run_side_by_side(tmp_path: Path) -> None:
    configs = [free_port_config(), free_port_config(api_keys={})]
    envoys = await asyncio.gather(
        *(start_envoy(bootstrap(c), tmp_path / f"e{i}") for i, c in enumerate(configs))
    )
    try:
        for config in configs:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://{config.envoy.admin}/ready") as r:
                    assert r.status == 200
    finally:
        await asyncio.gather(*(e.stop() for e in envoys))
    assert all(e.returncode is not None for e in envoys)


async def test_start_envoy_reports_a_bad_bootstrap(tmp_path: Path) -> None:
    config = free_port_config()
    doc = bootstrap(config)
    doc["static_resources"]["clusters"][0]["connect_timeout"] = "soon"
    with pytest.raises(ProcessStartError, match="exited") as info:
        await start_envoy(doc, tmp_path)
    assert "connect_timeout" in str(info.value) or "soon" in str(info.value)



class FakeProcessor(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]  # untyped generated base
    """Records what Envoy sends; routes to the model named in `x-route-to`."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.finished = 0

    async def Process(self, requests: Any, context: Any) -> Any:  # noqa: N802 (gRPC name)
        try:
            async for request in requests:
                if request.WhichOneof("request") != "request_headers":
                    continue
                headers = {
                    h.key: h.raw_value.decode() or h.value for h in request.request_headers.headers.headers
                }
                metadata = MessageToDict(request.metadata_context).get("filterMetadata", {})
                self.seen.append({"headers": headers, "metadata": metadata.get("extproc", {})})
                mutation = ext_proc_pb2.HeaderMutation()
                if "x-route-to" in headers:
                    for key, value in (("x-model", headers["x-route-to"]), ("x-extproc-queue-wait-ms", "42")):
                        mutation.set_headers.append(
                            base_pb2.HeaderValueOption(
                                header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                            )
                        )
                common = ext_proc_pb2.CommonResponse(header_mutation=mutation, clear_route_cache=True)
                yield ext_proc_pb2.ProcessingResponse(request_headers=ext_proc_pb2.HeadersResponse(response=common))
        finally:
            # Envoy ends the stream (or cancels it) once the response is done.
            self.finished += 1


async def test_envoy_with_a_processor_routes_and_forwards_metadata(tmp_path: Path) -> None:
    config = free_port_config()
    model_port = int(config.models[0].endpoints[0].rsplit(":", 1)[1])
    received: list[dict[str, str]] = []

    async def model_server(request: web.Request) -> web.Response:
        received.append(dict(request.headers))
        return web.json_response({"object": "chat.completion"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", model_server)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", model_port).start()
    processor = FakeProcessor()
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    server.add_insecure_port(config.listen.grpc)
    await server.start()
    url = f"http://{config.envoy.listen}/v1/chat/completions"
    auth = {"Authorization": "Bearer key-alice", "x-tenant-id": "mallory"}
    try:
        async with await start_envoy(bootstrap(config), tmp_path):
            body = {"model": "m-one", "max_tokens": 3, "max_completion_tokens": 9}
            timeout = aiohttp.ClientTimeout(total=30)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.post(url, headers={**auth, "x-route-to": "m-one"}, json=body) as r:
                    assert r.status == 200, await r.text()
                    # The processor's queue-wait request header is echoed to the client.
                    assert r.headers["x-extproc-queue-wait-ms"] == "42"
                # A client-sent model header is dropped: a request the processor let through
                # without one cannot reach a model (processor_failure: closed), JSON 503.
                async with session.post(url, headers={**auth, "x-model": "m-one"}, json={"model": "nope"}) as r:
                    assert r.status == 503
                    assert r.headers["content-type"] == "application/json"
                    assert r.headers["x-extproc-reason"] == "processor_unavailable"
                    assert (await r.json())["error"]["code"] == "processor_unavailable"
                    assert "x-extproc-queue-wait-ms" not in r.headers
    finally:
        await server.stop(None)
        await runner.cleanup()
    routed, unrouted = processor.seen
    assert routed["headers"]["x-tenant-id"] == "alice"  # set by api_key_auth, not the client
    assert routed["metadata"] == {"model": "m-one", "max_tokens": 3, "max_completion_tokens": 9}
    assert "authorization" not in routed["headers"]  # hide_credentials
    assert "x-model" not in unrouted["headers"]
    assert unrouted["metadata"] == {"model": "nope"}
    (upstream,) = received
    assert upstream["x-tenant-id"] == "alice"
    assert "Authorization" not in upstream  # the tenant's key stays at the edge
    assert processor.finished == 2
