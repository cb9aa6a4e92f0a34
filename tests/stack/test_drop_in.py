"""The drop-in on a shared listener: LLM routes get the filters, every other route is untouched.

The operator's Envoy (tests/fixtures/user-envoy.yaml) has a ``/health``
route Envoy answers itself, an ``/api`` route to their own service and a
404 catch-all. The integration test runs it twice through a real Envoy 1.40,
as written and after ``extproc envoy-config --into``, and compares every
non-LLM answer byte for byte (status, body, the headers the service
received), while an LLM request goes through the processor to the simulator.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from extproc.adapters.config import Config, ConfigError, load_config
from extproc.adapters.envoy import DROP_IN_HEADER, LLM_PREFIXES, bootstrap, drop_in, merge, render
from extproc.adapters.protocol.contract import MODEL_HEADER
from extproc.cli import main
from extproc.tools.envoy_bin import find_envoy
from extproc.tools.envoy_proc import start_envoy
from extproc.tools.procs import ManagedProcess, free_port
from extproc.tools.stack import PYTHON, start_sim
from tests.envoyutil import DEMO_CONFIG, JWT_CONFIG, bootstrap_message
from tests.helpers.drop_in import user_envoy
from tests.stackutil import metric, read_metrics, write_config, write_stack_config

FAST_SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "0.1"]


def listen_url(doc: dict[str, Any]) -> str:
    address = doc["static_resources"]["listeners"][0]["address"]["socket_address"]
    return f"http://{address['address']}:{address['port_value']}"


def hcm(doc: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return config


# --- unit: the drop-in's shape and the merge ---------------------------------------------


@pytest.mark.unit
def test_drop_in_filters_are_off_except_on_its_own_routes_which_own_only_the_llm_paths() -> None:
    doc = drop_in(load_config(DEMO_CONFIG))
    names = [f["name"] for f in doc["http_filters"]]
    assert names == [
        "extproc.header_mutation", "extproc.api_key_auth", "extproc.json_to_metadata",
        "extproc.local_ratelimit", "extproc.ext_proc",
    ]
    assert all(f["disabled"] is True for f in doc["http_filters"])
    for route in doc["routes"]:
        assert route["name"].startswith("extproc-")
        assert route["match"]["prefix"] in LLM_PREFIXES, route["match"]
        assert set(route["typed_per_filter_config"]) == set(names)
    # No "/" catch-all: each prefix ends with its own catch-all; nothing else is shadowed.
    catch_alls = [r["match"]["prefix"] for r in doc["routes"] if "direct_response" in r]
    assert catch_alls == list(LLM_PREFIXES)


@pytest.mark.unit
def test_without_api_keys_or_jwt_the_tenant_header_is_left_to_the_operators_auth_filter(tmp_path: Path) -> None:
    """Their filter runs before ours and sets the tenant header; ours must not remove it (with keys or jwt it must)."""
    def removed(config: Config) -> list[str]:
        [sanitise] = [f for f in drop_in(config)["http_filters"] if f["name"] == "extproc.header_mutation"]
        return [m["remove"] for m in sanitise["typed_config"]["mutations"]["request_mutations"]]

    config = load_config(DEMO_CONFIG)
    assert config.identity.tenant_header in removed(config)
    assert MODEL_HEADER in removed(config)
    text = yaml.safe_load(DEMO_CONFIG.read_text())
    text["envoy"].pop("api_keys")
    path = tmp_path / "no-keys.yaml"
    path.write_text(yaml.safe_dump(text))
    config = load_config(path)
    assert config.identity.tenant_header not in removed(config)
    assert MODEL_HEADER in removed(config)


@pytest.mark.unit
def test_no_picked_endpoint_without_endpoint_picking() -> None:
    config = load_config(DEMO_CONFIG)
    assert not any(m.endpoint_picking for m in config.models)
    for doc in (drop_in(config), bootstrap(config)):
        assert "picked_endpoint" not in json.dumps(doc)


@pytest.mark.unit
def test_picked_endpoint_with_endpoint_picking(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, replicas=2, endpoint_picking=True))
    doc = drop_in(config)
    assert [c["name"] for c in doc["clusters"]][:2] == ["extproc", "picked_endpoint"]
    assert [r["name"] for r in doc["routes"] if r["match"]["prefix"] == LLM_PREFIXES[0]][0] == "extproc-picked_endpoint_0"


@pytest.mark.unit
def test_an_existing_cluster_is_used_instead_of_a_copy() -> None:
    config = load_config(DEMO_CONFIG)
    doc = drop_in(config, existing_clusters={"demo-llama": "vllm_llama"})
    assert [c["name"] for c in doc["clusters"]] == ["extproc", "model_demo-qwen"]
    clusters = {r["route"]["cluster"] for r in doc["routes"] if "route" in r}
    assert clusters == {"vllm_llama", "model_demo-qwen"}
    with pytest.raises(ConfigError, match="no model 'nope'"):
        drop_in(config, existing_clusters={"nope": "x"})


@pytest.mark.unit
def test_merge_puts_filters_before_the_router_routes_first_and_is_idempotent() -> None:
    piece = drop_in(load_config(DEMO_CONFIG))
    user = user_envoy(api_port=1)
    merged = merge(user, piece)
    bootstrap_message(merged)
    filters = [f["name"] for f in hcm(merged)["http_filters"]]
    assert filters == [f["name"] for f in piece["http_filters"]] + ["envoy.filters.http.router"]
    routes = hcm(merged)["route_config"]["virtual_hosts"][0]["routes"]
    theirs = hcm(user)["route_config"]["virtual_hosts"][0]["routes"]
    assert routes == piece["routes"] + theirs  # theirs unchanged, in their order, after ours
    assert hcm(merged)["stream_idle_timeout"] == piece["http_connection_manager"]["stream_idle_timeout"]  # 120s raised
    assert "request_timeout" not in hcm(merged)  # unset is no limit: left alone
    assert merge(merged, piece) == merged
    assert user == user_envoy(api_port=1) | {"admin": user["admin"], "static_resources": user["static_resources"]}


BATCHES = {"directory": "/tmp/batches", "listen": "127.0.0.1:8090", "runner_listen": "127.0.0.1:10001",
           "runner_key": "k"}


@pytest.mark.unit
def test_with_batches_the_api_routes_run_only_identity_and_the_runner_listener_is_added(tmp_path: Path) -> None:
    piece = drop_in(load_config(write_stack_config(tmp_path, {"m1": {}}, batches=BATCHES)))
    api = [r for r in piece["routes"] if r["name"].startswith("extproc-batch_api_")]
    assert [r["match"]["prefix"] for r in api] == ["/v1/files", "/v1/batches"] and piece["routes"][:2] == api
    assert all(set(r["typed_per_filter_config"]) == {"extproc.header_mutation", "extproc.api_key_auth"} for r in api)
    assert "extproc_batch_api" in [c["name"] for c in piece["clusters"]]
    [runner] = piece["listeners"]
    assert runner["name"] == "extproc-batch_runner"
    user = user_envoy(api_port=1)
    merged = merge(user, piece)
    bootstrap_message(merged)
    assert [item["name"] for item in merged["static_resources"]["listeners"]] == ["main", "extproc-batch_runner"]
    assert merge(merged, piece) == merged


@pytest.mark.unit
def test_merge_names_what_it_cannot_find() -> None:
    piece = drop_in(load_config(DEMO_CONFIG))
    user = user_envoy(api_port=1)
    with pytest.raises(ConfigError, match="no listener named 'web'.*'main'"):
        merge(user, piece, listener="web")
    hcm(user)["http_filters"] = []
    with pytest.raises(ConfigError, match="no envoy.filters.http.router"):
        merge(user, piece)


@pytest.mark.unit
def test_cli_drop_in_and_into(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["envoy-config", "--config", str(DEMO_CONFIG), "--drop-in"]) == 0
    out = capsys.readouterr().out
    assert out == render(drop_in(load_config(DEMO_CONFIG)), header=DROP_IN_HEADER)
    assert "rather than editing" not in out
    user = tmp_path / "envoy.yaml"
    user.write_text(yaml.safe_dump(user_envoy(api_port=1)))
    args = ["--config", str(DEMO_CONFIG), "--into", str(user), "--cluster", "demo-qwen=api", "--llm-prefix", "/llm/"]
    assert main(["envoy-config", *args]) == 0
    merged = yaml.safe_load(capsys.readouterr().out)
    assert [c["name"] for c in merged["static_resources"]["clusters"]] == ["api", "extproc", "model_demo-llama"]
    assert {r["match"]["prefix"] for r in hcm(merged)["route_config"]["virtual_hosts"][0]["routes"][:3]} == {"/llm/"}
    assert main(["envoy-config", "--config", str(DEMO_CONFIG), "--into", str(tmp_path / "no")]) == 2
    assert "error:" in capsys.readouterr().err


# --- integration: a real Envoy, a real processor, the simulator -----------------------------


def variant_config(variant: str, tmp_path: Path) -> Config:
    """Drop-ins of every kind: api keys, JWT from a JWKS URI, fail-open routes, endpoint picking."""
    if variant == "demo":
        return load_config(DEMO_CONFIG)
    if variant == "jwt":
        return load_config(JWT_CONFIG)
    if variant == "open":
        return load_config(write_stack_config(tmp_path, {"m1": {}}, envoy={"processor_failure": "open"}))
    if variant == "batches":
        return load_config(write_stack_config(tmp_path, {"m1": {}}, batches=BATCHES))
    assert variant == "picking"
    return load_config(write_config(tmp_path, replicas=2, endpoint_picking=True))


@pytest.mark.integration
@pytest.mark.parametrize("variant", ["demo", "jwt", "open", "picking", "batches"])
def test_envoy_validates_every_merged_drop_in(variant: str, tmp_path: Path) -> None:
    config = variant_config(variant, tmp_path)
    path = tmp_path / "merged.yaml"
    path.write_text(render(merge(user_envoy(api_port=1), drop_in(config))))
    result = subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(path), "--disable-hot-restart", "--log-level", "error"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


async def _echo(request: web.Request) -> web.Response:
    """The operator's /api service: says what it received."""
    body = await request.text()
    return web.json_response({"path": request.path_qs, "headers": dict(request.headers), "body": body})


@pytest.fixture
async def api_port() -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", _echo)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield port
    await runner.cleanup()


# Requests to the operator's routes, with everything the drop-in would act on
# were it not off there: an API key, a JSON body naming a model, client-sent
# tenant and model headers.
OTHER_REQUESTS = [
    ("GET", "/health", {}, None),
    ("POST", "/health", {"authorization": "Bearer key-alice"}, {"model": "m1"}),
    ("GET", "/api/items?x=1", {"x-tenant": "spoofed", "x-model": "m1"}, None),
    ("POST", "/api/chat", {"authorization": "Bearer nope", "x-tenant": "spoofed"}, {"model": "m1", "max_tokens": 5}),
    ("GET", "/elsewhere", {}, None),
    ("GET", "/v1/models", {}, None),
]
# What the Envoy in front of /api adds per request and may differ between runs.
VOLATILE = {"x-request-id", "host"}


async def answers(base: str) -> list[tuple[int, str, str]]:
    """Status, content type and body of each of OTHER_REQUESTS (the /api echo without volatile headers)."""
    result = []
    async with aiohttp.ClientSession() as session:
        for method, path, headers, body in OTHER_REQUESTS:
            async with session.request(method, base + path, headers=headers, json=body) as response:
                text = await response.text()
                if path.startswith("/api"):
                    echoed = json.loads(text)
                    echoed["headers"] = {k: v for k, v in echoed["headers"].items() if k.lower() not in VOLATILE}
                    text = json.dumps(echoed, sort_keys=True)
                result.append((response.status, response.headers.get("content-type", ""), text))
                assert "x-extproc-reason" not in response.headers
    return result


@pytest.mark.integration
async def test_shared_listener_other_routes_untouched_llm_routes_scheduled(tmp_path: Path, api_port: int) -> None:
    config_path = write_config(tmp_path)
    config = load_config(config_path)
    [model] = config.models
    user = user_envoy(api_port, engine=model.endpoints[0])
    async with await start_envoy(user, tmp_path / "before"):
        before = await answers(listen_url(user))
    assert [status for status, _, _ in before] == [200, 200, 200, 200, 404, 404]

    merged = merge(user, drop_in(config, existing_clusters={"m1": "my_engine"}))
    assert "model_m1" not in json.dumps(merged)  # their engine cluster, not a copy
    sim = await start_sim(model, model.endpoints[0], tmp_path, FAST_SIM)
    metrics_url = f"http://{config.listen.metrics}/metrics"
    processor = await ManagedProcess.start(
        "extproc serve", [*PYTHON, "serve", "--config", str(config_path)], tmp_path / "extproc.log",
        ready_url=metrics_url,
    )
    async with sim, processor, await start_envoy(merged, tmp_path / "after"):
        after = await answers(listen_url(merged))
        released_before_llm = metric(await read_metrics(metrics_url), "extproc_released_total", model="m1")
        async with aiohttp.ClientSession() as session:
            chat = {"model": "m1", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
            url = listen_url(merged) + "/v1/chat/completions"
            async with session.post(url, json=chat, headers={"authorization": "Bearer key-alice"}) as response:
                assert response.status == 200, await response.text()
                assert "x-extproc-queue-wait-ms" in {k.lower() for k in response.headers}
            async with session.post(url, json=chat) as response:
                assert response.status == 401
                assert response.headers["x-extproc-reason"] == "unauthenticated"
                assert (await response.json())["error"]["code"] == "unauthenticated"
        samples = await read_metrics(metrics_url)
    # Byte for byte what the operator's Envoy answered before the merge.
    assert after == before
    # Nothing on the other routes reached the processor; the LLM request did.
    assert released_before_llm == 0
    assert metric(samples, "extproc_released_total", model="m1") == 1
