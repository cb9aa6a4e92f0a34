"""A real Envoy speaking TLS (and mutual TLS) to ``extproc serve``: requests are scheduled over the encrypted hop.

Two shapes of Envoy: the bootstrap ``extproc envoy-config`` generates from a
config with ``listen.tls``, and the cluster a Gateway API Inference Extension
gateway (Envoy AI Gateway) builds for its endpoint picker: STRICT_DNS, TLS
with an empty validation context (any certificate), no SNI or ALPN set, and
explicit HTTP/2, the ext_proc filter naming an ``authority``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.adapters.envoy import bootstrap
from extproc.adapters.envoy.base import TYPE
from extproc.adapters.envoy.clusters import EXTPROC_CLUSTER
from extproc.tools.envoy_proc import start_envoy
from extproc.tools.power_user import chat
from extproc.tools.procs import free_port
from extproc.tools.stack import Stack, start_stack
from tests.stackutil import TENANT_KEYS, metric, read_metrics, write_stack_config
from tests.tlsutil import processor_tls

pytestmark = pytest.mark.integration

FAST_SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "0.1"]
# Where the AI Gateway's endpoint-picker cluster points (the Service's name and port).
EPP_AUTHORITY = "extproc.llm.svc:9002"


async def _handshakes(admin_url: str, cluster: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"{admin_url}/stats?format=json") as response:
        stats = (await response.json())["stats"]
    return sum(int(s.get("value", 0)) for s in stats if s.get("name") == f"cluster.{cluster}.ssl.handshake")


async def _chats_are_scheduled(stack: Stack, envoy_url: str, n: int = 4) -> None:
    """``n`` chats through the Envoy at ``envoy_url`` are answered in full, each released by the processor."""
    before = metric(await read_metrics(stack.metrics_url), "extproc_released_total", model="m1")
    async with aiohttp.ClientSession() as session:
        outcomes = [await chat(session, envoy_url, "alice", "m1", api_key=TENANT_KEYS["alice"], max_tokens=8)
                    for _ in range(n)]
    assert [o.status for o in outcomes] == [200] * n, outcomes
    assert all(o.tokens > 0 and o.queue_wait_s is not None for o in outcomes), outcomes
    after = metric(await read_metrics(stack.metrics_url), "extproc_released_total", model="m1")
    assert after - before == n


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
async def test_a_generated_envoy_schedules_chats_over_tls_to_the_processor(tmp_path: Path, mutual: bool) -> None:
    tls, envoy = processor_tls(tmp_path / "certs", mutual=mutual)
    config = write_stack_config(tmp_path, {"m1": {}}, listen={"tls": tls}, envoy=envoy)
    async with await start_stack(config, tmp_path, sim_args=FAST_SIM) as stack:
        assert stack.envoy is not None
        await _chats_are_scheduled(stack, stack.envoy_url)
        assert await _handshakes(stack.envoy.admin_url, EXTPROC_CLUSTER) >= 1


def _epp_shaped(doc: dict[str, Any], grpc: str) -> dict[str, Any]:
    """``doc`` with the processor's cluster and filter as the AI Gateway builds them for an endpoint picker."""
    doc = copy.deepcopy(doc)
    host, _, port = grpc.rpartition(":")
    name = "envoy.clusters.endpointpicker_pool_llm_ext_proc"
    clusters = doc["static_resources"]["clusters"]
    clusters[:] = [c for c in clusters if c["name"] != EXTPROC_CLUSTER] + [{
        "name": name,
        "connect_timeout": "10s",
        "type": "STRICT_DNS",
        "lb_policy": "LEAST_REQUEST",
        # Here localhost stands for the Service's name: with Envoy's default (AUTO) it resolves to ::1,
        # where nothing listens (a Service name resolves to its IPv4 ClusterIP).
        "dns_lookup_family": "V4_ONLY",
        "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": TYPE + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": {"validation_context": {}},
        }},
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": TYPE + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }},
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
            "socket_address": {"address": "localhost" if host == "127.0.0.1" else host, "port_value": int(port)}}}}]}]},
    }]
    manager = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    ext_proc["typed_config"]["grpc_service"] = {"envoy_grpc": {"cluster_name": name, "authority": EPP_AUTHORITY}}
    listen = doc["static_resources"]["listeners"][0]["address"]["socket_address"]
    listen["port_value"] = free_port()
    doc["admin"]["address"]["socket_address"]["port_value"] = free_port()
    return doc


async def test_an_envoy_shaped_as_the_ai_gateways_endpoint_picker_cluster_reaches_the_processor(tmp_path: Path) -> None:
    tls, _ = processor_tls(tmp_path / "certs", mutual=False)
    config_path = write_stack_config(tmp_path, {"m1": {}}, listen={"tls": tls})
    async with await start_stack(config_path, tmp_path, sim_args=FAST_SIM) as stack:
        doc = _epp_shaped(bootstrap(stack.config), stack.config.listen.grpc)
        async with await start_envoy(doc, tmp_path / "epp-envoy") as envoy:
            listen = doc["static_resources"]["listeners"][0]["address"]["socket_address"]
            await _chats_are_scheduled(stack, f"http://127.0.0.1:{listen['port_value']}")
            assert await _handshakes(envoy.admin_url, "envoy.clusters.endpointpicker_pool_llm_ext_proc") >= 1
