"""Our processor as a GIE Endpoint Picker, attached by ext_proc alone, through a real Envoy in real gateways' shapes.

The shapes are extproc/tools/gie_gateway.py's (Envoy AI Gateway's
InferencePool translation, and a fail-open variant). The integration cases
are named after the Gateway API Inference Extension conformance tests they
reproduce (kubernetes-sigs/gateway-api-inference-extension @
84436a96b9e6ce2b59ddacd3d04c31b4fbd442de, conformance/tests/): three
simulators play the suite's three model-server pods, the OpenAI SDK the
client, and the processor reads each request's body itself (its config has no
Envoy of ours: no json_to_metadata, no api keys).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import statistics
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
import pytest_asyncio

from extproc.adapters.config import parse_config
from extproc.adapters.envoy import render
from extproc.adapters.protocol.epp_protocol import SERVED_KEY
from extproc.core.release import picking
from extproc.tools import gie_gateway
from extproc.tools.bench.overhead import idle_engine_metrics
from extproc.tools.envoy_bin import EnvoyNotFound, find_envoy
from extproc.tools.envoy_proc import start_envoy
from extproc.tools.power_user import Outcome, chat
from extproc.tools.procs import free_port
from extproc.tools.stack import Stack, start_stack
from tests.envoyutil import bootstrap_message
from tests.lazy import openai
from tests.stackutil import metric, poll, read_metrics, wait_for_metric, write_stack_config
from tests.tlsutil import CA, Pair

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

SHAPES = ("strict", "fail_open")
BODIES: tuple[gie_gateway.BodyMode, ...] = ("duplex", "buffered")


def _free_config() -> dict[str, Any]:
    """A processor config for three simulators on free ports (nothing listens in the unit tier)."""
    return {
        "listen": {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}"},
        "models": [{
            "name": "m1", "endpoints": [f"http://127.0.0.1:{free_port()}" for _ in range(3)], "endpoint_picking": True,
        }],
        "envoy": {"listen": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}"},
    }


def _shape(shape: str, body: gie_gateway.BodyMode, tls: bool) -> dict[str, Any]:
    build = gie_gateway.strict if shape == "strict" else gie_gateway.fail_open
    return build(parse_config(_free_config()), "m1", body=body, tls=tls)


def _filters(doc: dict[str, Any]) -> list[dict[str, Any]]:
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters: list[dict[str, Any]] = hcm["http_filters"]
    return filters


def _clusters(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["static_resources"]["clusters"]}


# --- unit: the shapes, checked against Envoy's API and by Envoy itself ------------------------


@pytest.mark.unit
@pytest.mark.parametrize("tls", [False, True])
@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_envoy_validates_every_shape(shape: str, body: gie_gateway.BodyMode, tls: bool, tmp_path: Path) -> None:
    """``envoy --mode validate`` takes about 50 ms, so every shape is checked by Envoy itself in the quick loop."""
    doc = _shape(shape, body, tls)
    bootstrap_message(doc)
    try:
        envoy = find_envoy()
    except EnvoyNotFound as exc:
        pytest.skip(str(exc))
    path = tmp_path / "envoy.yaml"
    path.write_text(render(doc))
    result = subprocess.run(
        [envoy, "--mode", "validate", "-c", str(path), "--disable-hot-restart", "--log-level", "error"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.unit
@pytest.mark.parametrize("body", BODIES)
def test_strict_is_ai_gateways_inference_pool_translation(body: gie_gateway.BodyMode) -> None:
    """Field for field what envoyproxy/ai-gateway's inferencepool.go and post_cluster_modify.go write."""
    doc = _shape("strict", body, tls=True)
    names = [f["name"] for f in _filters(doc)]
    assert names == [
        "envoy.filters.http.lua", "envoy.filters.http.ext_proc/endpointpicker/pool_default_ext_proc",
        "envoy.filters.http.header_to_metadata", "envoy.filters.http.router",
    ]
    epp = _filters(doc)[1]["typed_config"]
    mode = gie_gateway.BODY_MODES[body]
    assert epp["processing_mode"] == {
        "request_header_mode": "SEND", "request_body_mode": mode, "request_trailer_mode": "SEND",
        "response_header_mode": "SEND", "response_body_mode": mode, "response_trailer_mode": "SEND",
    }
    assert (epp["allow_mode_override"], epp["failure_mode_allow"], epp["message_timeout"]) == (False, False, "300s")
    assert epp["grpc_service"]["envoy_grpc"]["cluster_name"] == gie_gateway.EPP_CLUSTER
    assert epp["grpc_service"]["envoy_grpc"]["authority"].startswith("epp.default.svc:")
    clusters = _clusters(doc)
    picker = clusters[gie_gateway.EPP_CLUSTER]
    assert (picker["type"], picker["lb_policy"], picker["connect_timeout"]) == ("STRICT_DNS", "LEAST_REQUEST", "10s")
    assert picker["transport_socket"]["typed_config"]["common_tls_context"] == {"validation_context": {}}
    assert "health_checks" not in picker and "circuit_breakers" not in picker  # Envoy's default: 1024 streams
    raised = gie_gateway.strict(parse_config(_free_config()), "m1", epp_max_requests=20_000)
    assert _clusters(raised)[gie_gateway.EPP_CLUSTER]["circuit_breakers"] == {"thresholds": [{"max_requests": 20_000}]}
    pool = clusters[gie_gateway.POOL_CLUSTER]
    assert (pool["type"], pool["lb_policy"], pool["connect_timeout"]) == ("ORIGINAL_DST", "CLUSTER_PROVIDED", "10s")
    assert pool["original_dst_lb_config"] == {"use_http_header": True, "http_header_name": "x-gateway-destination-endpoint"}
    assert "json_to_metadata" not in render(doc)  # the processor reads the body itself
    assert "transport_socket" not in _clusters(_shape("strict", body, tls=False))[gie_gateway.EPP_CLUSTER]


@pytest.mark.unit
def test_fail_open_lists_the_pool_under_override_host_and_health_checks_the_picker() -> None:
    config = parse_config(_free_config())
    doc = gie_gateway.fail_open(config, "m1")
    assert _filters(doc)[1]["typed_config"]["failure_mode_allow"] is True
    pool = _clusters(doc)[gie_gateway.POOL_CLUSTER]
    listed = [
        f"{e['endpoint']['address']['socket_address']['address']}:{e['endpoint']['address']['socket_address']['port_value']}"
        for e in pool["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert listed == gie_gateway.pool_endpoints(config, "m1")
    policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    assert policy["typed_config"]["override_host_sources"] == [
        {"header": "x-gateway-destination-endpoint"},
        {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}},
    ]
    picker = _clusters(doc)[gie_gateway.EPP_CLUSTER]
    assert picker["health_checks"][0]["grpc_health_check"] == {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"}
    assert picker["common_lb_config"] == {"healthy_panic_threshold": {"value": 0}}


# --- integration: the processor behind a real Envoy in those shapes ----------------------------

MODEL = "m1"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
# 4 sequences per batch, 10x faster than real time (tests/stack/test_integration.py's).
FAST_SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "0.1"]
# The tenant whose queue is capped (held-requests case): what it sends beyond is shed.
HOG, HOG_QUEUE = "hog", 20
IN_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")


class _BrokenEngine(asyncio.Protocol):
    """An endpoint whose /metrics reports an idle engine but which resets every other request.

    The processor sees nothing wrong with it until a request fails there, so
    it stays first in the processor's list: the "dead first endpoint" of the
    fallback cases, deterministic where a stopped simulator is noticed by the
    next scrape within 100 ms.
    """

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._received = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None
        self._received += data
        if b"\r\n\r\n" not in self._received:
            return
        if not self._received.startswith(b"GET /metrics"):
            self._transport.abort()  # a reset before any response byte: Envoy retries elsewhere
            return
        page = idle_engine_metrics(MODEL).encode()
        self._transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (len(page), page))
        self._received = b""


@dataclass
class Gateways:
    """Three simulators; per shape a processor and the Envoy in front of it (see :func:`gateways`)."""

    pods: list[str]  # the simulators, ip:port (the conformance suite's three model-server pods)
    broken: str  # the fail-open pool's fourth endpoint (_BrokenEngine)
    strict: Stack  # AI Gateway's shape, duplex, TLS to the processor; which names one endpoint (no fallbacks, the default)
    strict_buffered_url: str  # the same shape, buffered, in front of the same processor
    open: Stack  # the fail-open shape, duplex; its processor names two fallbacks

    def url(self, shape: str) -> str:
        return {"strict/duplex": self.strict.envoy_url, "strict/buffered": self.strict_buffered_url,
                "fail_open/duplex": self.open.envoy_url}[shape]


def _on_free_ports(doc: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``doc`` listening (and its admin) on free ports: a second Envoy in front of the same processor."""
    port = free_port()
    doc["admin"]["address"]["socket_address"]["port_value"] = free_port()
    doc["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = port
    return doc, f"http://127.0.0.1:{port}"


def _processor_config(folder: Path, pods: list[str], tls: Pair | None = None, **picker: Any) -> Path:
    """A processor attached by ext_proc alone: endpoint picking over ``pods``, tenants from the fairness header.

    ``tls``: its gRPC port serves TLS with this certificate (AI Gateway's
    cluster accepts any certificate and presents none).
    """
    folder.mkdir()
    top: dict[str, Any] = {"identity": {"fairness_id_headers": [FAIRNESS_HEADER]}, "tenants": {HOG: {"max_queued": HOG_QUEUE}}}
    if tls is not None:
        top["listen"] = {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}",
                         "tls": {"cert_file": str(tls.cert), "key_file": str(tls.key)}}
    if picker:
        top["endpoint_picker"] = picker
    return write_stack_config(
        folder, {MODEL: {"endpoints": [f"http://{pod}" for pod in pods], "endpoint_picking": True}}, api_keys={}, **top,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateways(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Gateways]:
    """One set of processes for the module (about 10 s to start on 2 cores).

    Two processors share the simulators: AI Gateway's ORIGINAL_DST cluster
    takes exactly one endpoint (a list is an invalid address there), so the
    strict shape's processor names no fallbacks (the default), while the
    fail-open shape's cluster walks the list its processor names.
    """
    workdir = tmp_path_factory.mktemp("gie")
    broken_port = free_port()
    listener = await asyncio.get_running_loop().create_server(_BrokenEngine, "127.0.0.1", broken_port)
    pods = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    broken = f"127.0.0.1:{broken_port}"
    async with contextlib.AsyncExitStack() as running:
        certificate = CA(workdir / "ca").issue("epp")
        strict = await running.enter_async_context(await start_stack(
            _processor_config(workdir / "strict", pods, certificate), workdir / "strict", sim_args=FAST_SIM,
            envoy_bootstrap=functools.partial(gie_gateway.strict, model=MODEL, body="duplex", tls=True),
        ))
        open_ = await running.enter_async_context(await start_stack(
            _processor_config(workdir / "open", [*pods, broken], fallbacks=2), workdir / "open", engines=False,
            envoy_bootstrap=functools.partial(gie_gateway.fail_open, model=MODEL, body="duplex"),
        ))
        doc, buffered_url = _on_free_ports(gie_gateway.strict(strict.config, MODEL, body="buffered", tls=True))
        await running.enter_async_context(await start_envoy(doc, workdir / "strict-buffered", concurrency=1))
        yield Gateways(pods, broken, strict, buffered_url, open_)
    listener.close()


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Write as if you were a critic: San Francisco"}]


async def _served(url: str, *, hint: str | None = None, stream: bool = False, tenant: str = "conformance",
                  max_tokens: int = 8, messages: list[ChatCompletionMessageParam] = MESSAGES) -> tuple[str, str, str]:
    """One chat completion through the SDK: (the endpoint that served it, what the EPP picked, the text)."""
    headers = {FAIRNESS_HEADER: tenant}
    if hint is not None:
        headers[gie_gateway.SUBSET_HINT_HEADER] = hint
    async with _client(url) as client:
        if stream:
            raw_stream = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=max_tokens, stream=True, extra_headers=headers,
                stream_options={"include_usage": True},
            )
            pieces, usage = [], None
            async for chunk in raw_stream.parse():
                pieces += [c.delta.content or "" for c in chunk.choices]
                usage = chunk.usage or usage
            assert usage is not None and usage.completion_tokens == max_tokens
            text, headers_seen = "".join(pieces), raw_stream.headers
        else:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=max_tokens, extra_headers=headers,
            )
            completion = raw.parse()
            assert completion.usage is not None and completion.usage.completion_tokens == max_tokens
            text, headers_seen = completion.choices[0].message.content or "", raw.headers
    # Envoy leaves the picked header out when the EPP named nothing (it was down).
    return headers_seen[SERVED_KEY], headers_seen.get(gie_gateway.PICKED_HEADER, ""), text


@IN_MODULE_LOOP
@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("shape", ["strict/duplex", "strict/buffered"])
async def test_gateway_following_epp_routing(gateways: Gateways, shape: str, stream: bool) -> None:
    """GatewayFollowingEPPRouting (gateway_following_epp_routing.go): requests reach only the endpoints the EPP names.

    As there, the subset of pods the EPP may pick is set per request (the
    suite sets it through its test EPP's header; here the data plane's subset
    hint, which our processor must honour): one pod, two pods, all three.
    """
    url = gateways.url(shape)
    pods = gateways.pods
    for pod in pods:
        served, picked, text = await _served(url, hint=pod, stream=stream)
        assert (served, picked) == (pod, pod)
        assert text.strip()
    for allowed in ([pods[2]], pods[:2], pods):
        seen = await asyncio.gather(*(_served(url, hint=",".join(allowed), stream=stream) for _ in range(10)))
        assert {served for served, _, _ in seen} <= set(allowed), seen
        assert all(served == picked for served, picked, _ in seen)  # one endpoint named, and it served


@IN_MODULE_LOOP
@pytest.mark.integration
@pytest.mark.alone
@pytest.mark.parametrize("shape", ["strict/duplex", "strict/buffered", "fail_open/duplex"])
async def test_bodies_pass_unchanged_and_only_duplex_streams(gateways: Gateways, shape: str) -> None:
    """A 200 KB prompt (four of the processor's 62,000-byte chunks) reaches the engine whole; tokens stream in duplex.

    The engine parses the JSON and counts the prompt's tokens from its length:
    the same as when the body is sent to the engine directly. Streaming stays streaming only in duplex mode: buffered
    (AI Gateway's "buffered" annotation) buffers the response body as well, so
    the first token arrives with the last.
    """
    prompt = " ".join(f"w{i}" for i in range(33_000))
    direct = f"http://{gateways.pods[0]}"
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
        async with session.post(f"{direct}/v1/chat/completions", json=body) as response:
            expected = (await response.json())["usage"]["prompt_tokens"]
        async with session.post(f"{gateways.url(shape)}/v1/chat/completions", json=body,
                                headers={gie_gateway.SUBSET_HINT_HEADER: gateways.pods[0]}) as response:
            assert response.status == 200, await response.text()
            assert (await response.json())["usage"]["prompt_tokens"] == expected
        outcome = await chat(session, gateways.url(shape), "streamer", MODEL, api_key=None, max_tokens=60,
                             extra_headers={FAIRNESS_HEADER: "streamer"})
    assert outcome.status == 200 and outcome.ttft_s is not None and outcome.tokens == 60, outcome
    if shape.endswith("duplex"):
        assert outcome.ttft_s < 0.5 * outcome.total_s  # 60 tokens at 2 ms a step and more: the first came early
    else:
        assert outcome.ttft_s > 0.9 * outcome.total_s  # all at once, at the end


@IN_MODULE_LOOP
@pytest.mark.integration
@pytest.mark.parametrize("shape", ["strict/duplex", "strict/buffered"])
async def test_subset_hints_restrict_the_pick_and_an_unservable_one_is_503(gateways: Gateways, shape: str) -> None:
    """The protocol's subset hint (004-endpoint-picker-protocol, "Endpoint Subset"): pick inside it, else 503.

    An empty list, or one naming no endpoint of the pool, is answered 503 by
    the processor (``no_endpoint``): nothing reaches an engine.
    """
    url = gateways.url(shape)
    seen = await asyncio.gather(*(_served(url, hint=gateways.pods[1]) for _ in range(5)))
    assert {served for served, _, _ in seen} == {gateways.pods[1]}
    async with _client(url) as client:
        for hint in ("", "10.255.255.1:8000", "10.255.255.1:8000,10.255.255.2:8000"):
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={gie_gateway.SUBSET_HINT_HEADER: hint},
                )
            assert refused.value.status_code == 503, hint
            assert refused.value.code == "no_endpoint", hint


@IN_MODULE_LOOP
@pytest.mark.integration
async def test_gateway_destination_endpoint_served_walks_the_fallbacks(gateways: Gateways) -> None:
    """GatewayDestinationEndpointServed (gateway_destination_endpoint_served.go), with the fallbacks it exists for.

    The EPP names a list; where the first endpoint is the broken one (it
    looks idle to the processor) it resets the request, Envoy's retry goes on to the
    next, and the endpoint that served comes back to the processor as
    ``envoy.lb`` / ``x-gateway-destination-endpoint-served``. Served is not
    picked: the processor learns from it that the first endpoint failed.
    """
    url = gateways.url("fail_open/duplex")
    hint = f"{gateways.broken},{gateways.pods[0]}"
    broken, pod = f"http://{gateways.broken}", f"http://{gateways.pods[0]}"
    # Each tenant's favourite of the two, both idle, is its rendezvous-hash first (core/release/picking.py): three
    # tenants chosen to go to the broken endpoint first, and one to the pod, computed with the processor's own ranking.
    tenants = (f"fallback-{i}" for i in itertools.count())
    to_broken = list(itertools.islice((t for t in tenants if picking.ranked(t, [broken, pod], lambda _: 1, 0)[0] == broken), 3))
    to_pod = next(t for t in tenants if picking.ranked(t, [broken, pod], lambda _: 1, 0)[0] == pod)
    before = metric(await read_metrics(gateways.open.metrics_url), "extproc_served_elsewhere_total", model=MODEL)
    seen = []
    for tenant in [*to_broken, to_pod]:
        # A failure there marks it down until its next scrape (idle, as ever) brings it back: wait for that.
        assert await wait_for_metric(gateways.open.metrics_url, "extproc_endpoint_up", lambda v: v == 1,
                                     model=MODEL, endpoint=broken) == 1
        # A prompt of its own: the endpoint that served the earlier ones holds their prefix in its cache, and the
        # processor's picking would prefer it over the tenant's favourite.
        own: list[ChatCompletionMessageParam] = [{"role": "user", "content": f"{tenant}: {MESSAGES[0]['content']}"}]
        seen.append(await _served(url, hint=hint, tenant=tenant, messages=own))
    assert {served for served, _, _ in seen} == {gateways.pods[0]}, seen
    assert all(set(picked.split(",")) <= set(hint.split(",")) for _, picked, _ in seen)
    firsts = [picked.split(",")[0] for _, picked, _ in seen]
    assert firsts == [gateways.broken] * 3 + [gateways.pods[0]], seen  # the list was really walked, where it should be
    fallbacks = firsts.count(gateways.broken)
    after = metric(await read_metrics(gateways.open.metrics_url), "extproc_served_elsewhere_total", model=MODEL)
    assert after - before == fallbacks  # each one reported back: served is not picked


@IN_MODULE_LOOP
@pytest.mark.integration
@pytest.mark.alone
async def test_a_newcomer_overtakes_a_power_users_flood(gateways: Gateways) -> None:
    """Fair scheduling through AI Gateway's shape: tenants from ``x-gateway-inference-fairness-id``.

    A power user sends 120 requests at once (ten times what the three engines
    run at a time), a newcomer one shortly after; the newcomer's first token
    comes far sooner than the flood's median (relative, with a wide margin: a
    noisy 2-core machine).
    """
    url = gateways.strict.envoy_url
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        def send(tenant: str) -> asyncio.Task[Outcome]:
            return asyncio.create_task(chat(session, url, tenant, MODEL, api_key=None, max_tokens=100,
                                            extra_headers={FAIRNESS_HEADER: tenant}))

        flood = [send("alice") for _ in range(120)]
        # Most of the flood held at the gateway (the engines run 12 at a time): then the newcomer arrives.
        assert await wait_for_metric(gateways.strict.metrics_url, "extproc_queue_depth", lambda v: v >= 60, model=MODEL) >= 60
        newcomer = await send("bob")
        outcomes = await asyncio.gather(*flood)
    assert all(o.status == 200 and o.ttft_s is not None for o in [*outcomes, newcomer]), [o for o in outcomes if o.error]
    flood_median = statistics.median(o.ttft_s or 0 for o in outcomes)
    assert newcomer.ttft_s is not None and newcomer.ttft_s * 3 < flood_median, (newcomer, flood_median)


@IN_MODULE_LOOP
@pytest.mark.integration
async def test_held_requests_with_bodies_all_end_served_or_refused_with_json(gateways: Gateways) -> None:
    """Duplex: 150 requests with 2 KB bodies from a tenant allowed 20 queued; each ends, none hangs.

    What the engines and the tenant's queue take is served; the rest is shed
    at once as 429 (attached by ext_proc alone) with an OpenAI-style JSON error.
    """
    prompt = "x" * 2048
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        outcomes = await asyncio.wait_for(asyncio.gather(*(
            chat(session, gateways.strict.envoy_url, HOG, MODEL, api_key=None, max_tokens=20, prompt=prompt,
                 extra_headers={FAIRNESS_HEADER: HOG})
            for _ in range(150)
        )), timeout=60)
    served = [o for o in outcomes if o.status == 200]
    shed = [o for o in outcomes if o.status != 200]
    assert all(o.status == 429 and json.loads(o.error)["error"]["code"] for o in shed), shed[:3]
    assert len(served) >= HOG_QUEUE and shed, (len(served), len(shed))
    assert await wait_for_metric(gateways.strict.metrics_url, "extproc_in_flight", lambda v: v == 0, model=MODEL) == 0


@IN_MODULE_LOOP
@pytest.mark.integration
async def test_epp_unavailable_fail_open(gateways: Gateways) -> None:
    """EppUnAvailableFailOpen (epp_unavailable_fail_open.go): with the EPP stopped, requests still reach the pool.

    In duplex mode only once Envoy knows the EPP is down (its gRPC health
    check, or the first refused connection): until then a request gets 500,
    see tools/gie_gateway.py. After that, every request succeeds, on any
    endpoint of the pool (the fourth, broken one is retried past).
    """
    stack = gateways.open
    assert stack.processor is not None
    assert (await _served(stack.envoy_url, hint=gateways.pods[2]))[0] == gateways.pods[2]  # phase 1: EPP routing
    await stack.processor.stop()
    try:
        async def succeeds() -> float:
            try:
                await _served(stack.envoy_url)
            except openai.APIStatusError:
                return 0.0
            return 1.0

        assert await poll(succeeds, lambda ok: ok == 1.0, timeout_s=10) == 1.0
        seen = await asyncio.gather(*(_served(stack.envoy_url, hint=gateways.pods[2]) for _ in range(9)))
        assert {served for served, _, _ in seen} <= set(gateways.pods)  # any pod: nobody picked
        assert all(picked == "" for _, picked, _ in seen)
    finally:
        await stack.start_processor()


@IN_MODULE_LOOP
@pytest.mark.integration
async def test_strict_epp_unavailable_fails_the_request_at_once(gateways: Gateways) -> None:
    """AI Gateway's shape (failure_mode_allow false): with the EPP stopped, a 5xx at once, nothing hangs."""
    stack = gateways.strict
    assert stack.processor is not None
    await stack.processor.stop()
    try:
        for url in (stack.envoy_url, gateways.strict_buffered_url):
            async with _client(url) as client:
                for _ in range(3):
                    with pytest.raises(openai.InternalServerError) as failed:
                        await asyncio.wait_for(client.chat.completions.create(
                            model=MODEL, messages=MESSAGES, max_tokens=4), timeout=10)
                    assert failed.value.status_code >= 500
    finally:
        await stack.start_processor()
