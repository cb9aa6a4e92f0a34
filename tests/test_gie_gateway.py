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

import subprocess
from pathlib import Path
from typing import Any

import pytest

from extproc.adapters.config import parse_config
from extproc.adapters.envoy_config import render
from extproc.tools import gie_gateway
from extproc.tools.envoy_bin import EnvoyNotFound, find_envoy
from extproc.tools.procs import free_port
from tests.envoyutil import bootstrap_message

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
    assert "health_checks" not in picker and "circuit_breakers" not in picker
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
