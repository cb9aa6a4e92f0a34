"""The examples under deploy/: their shape, and the Envoy config embedded in them.

Nothing here runs Kubernetes, Istio or Envoy Gateway. What is checked: the
manifests agree with each other and with the processor's config in the
ConfigMap (names, ports, probes), and the Envoy filters the Istio and Envoy
Gateway examples embed are exactly what ``extproc envoy-config --drop-in``
generates for that config (so they cannot drift from the generator) and
parse as Envoy's own protos.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from extproc.adapters.config import Config, parse_config, split_address
from extproc.adapters.envoy import drop_in, hold_timeout_s
from extproc.adapters.envoy.filters import DROP_IN_FILTER_PREFIX
from extproc.adapters.protocol.contract import METADATA_NAMESPACE, MODEL_HEADER
from extproc.adapters.web.app import build_app
from tests.envoyutil import bootstrap_message
from tests.paths import ROOT

pytestmark = pytest.mark.unit

DEPLOY = ROOT / "deploy"
PREFIXES = ("/v1/chat/completions", "/v1/completions")


def documents(name: str) -> dict[str, dict[str, Any]]:
    """The file's documents by kind (each kind once per file)."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), [d["kind"] for d in docs]
    return by_kind


def kubernetes() -> dict[str, dict[str, Any]]:
    return documents("kubernetes/extproc.yaml")


def processor_config() -> Config:
    return parse_config(yaml.safe_load(kubernetes()["ConfigMap"]["data"]["config.yaml"]))


def generated_filters(cluster: str) -> list[dict[str, Any]]:
    """The drop-in's filters for the ConfigMap's config, ext_proc pointed at ``cluster``."""
    filters: list[dict[str, Any]] = drop_in(processor_config(), prefixes=PREFIXES)["http_filters"]
    for item in filters:
        if item["name"] == DROP_IN_FILTER_PREFIX + "ext_proc":
            item["typed_config"]["grpc_service"] = {"envoy_grpc": {"cluster_name": cluster}}
    return filters


def check_envoy(filters: list[dict[str, Any]], enable: dict[str, Any], cluster: str) -> None:
    """The filters and per-route settings in a minimal bootstrap parse as Envoy's protos."""
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "x",
        "http_filters": [*copy.deepcopy(filters), {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
        }],
        "route_config": {"virtual_hosts": [{"name": "x", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": cluster}, "typed_per_filter_config": enable}
        ]}]},
    }
    listener = {"name": "x", "filter_chains": [{"filters": [{"name": "hcm", "typed_config": hcm}]}]}
    bootstrap_message({"static_resources": {"listeners": [listener]}})


def test_kubernetes_manifests_agree_with_the_processor_config() -> None:
    docs = kubernetes()
    assert set(docs) == {"ConfigMap", "Deployment", "Service"}
    config = processor_config()
    grpc_port = split_address(config.listen.grpc)[1]
    metrics_port = split_address(config.listen.metrics)[1]
    assert split_address(config.listen.grpc)[0] == "0.0.0.0"  # reachable from other pods

    deployment = docs["Deployment"]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    [container] = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": grpc_port, "metrics": metrics_port}
    # Probes ask the metrics port: readiness /readyz (503 while draining), liveness and startup /healthz,
    # paths the processor serves (adapters/web/app.py).
    routes = {r.resource.canonical for r in build_app(CollectorRegistry(), {}, lambda: False).router.routes()
              if r.resource is not None}
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz"), ("startupProbe", "/healthz")):
        assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, probe
        assert path in routes
    # The config file the container reads is the ConfigMap's key, mounted.
    config_arg = Path(container["args"][container["args"].index("--config") + 1])
    [mount] = container["volumeMounts"]
    assert str(config_arg.parent) == mount["mountPath"]
    [volume] = pod["spec"]["volumes"]
    assert volume["name"] == mount["name"] and volume["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert config_arg.name in docs["ConfigMap"]["data"]
    # Drained within the grace period.
    deadline = float(container["args"][container["args"].index("--deadline-seconds") + 1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > deadline

    service = docs["Service"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
    namespaces = {d["metadata"]["namespace"] for d in docs.values()}
    assert namespaces == {"llm"}


def service_cluster() -> tuple[str, str, int]:
    service = kubernetes()["Service"]
    [grpc] = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    return service["metadata"]["name"], service["metadata"]["namespace"], grpc["port"]


def test_istio_envoy_filter_embeds_the_generated_filters_on_the_llm_routes_only() -> None:
    docs = documents("istio/extproc.yaml")
    assert set(docs) == {"EnvoyFilter", "VirtualService"}
    name, namespace, port = service_cluster()
    cluster = f"outbound|{port}||{name}.{namespace}.svc.cluster.local"
    patches = docs["EnvoyFilter"]["spec"]["configPatches"]
    inserted = [p["patch"]["value"] for p in patches if p["applyTo"] == "HTTP_FILTER"]
    assert all(p["patch"]["operation"] == "INSERT_BEFORE" for p in patches if p["applyTo"] == "HTTP_FILTER")
    assert inserted == generated_filters(cluster)
    assert all(item["disabled"] is True for item in inserted)
    # Turned on for exactly the VirtualService's LLM routes.
    routes = [p for p in patches if p["applyTo"] == "HTTP_ROUTE"]
    enabled = {p["match"]["routeConfiguration"]["vhost"]["route"]["name"] for p in routes}
    http = docs["VirtualService"]["spec"]["http"]
    assert enabled == {route["name"] for route in http}
    for route in http:
        assert [m["uri"]["prefix"] for m in route["match"]] == list(PREFIXES)
    [enable] = {yaml.safe_dump(p["patch"]["value"]["typed_per_filter_config"]) for p in routes}
    assert set(yaml.safe_load(enable)) == {item["name"] for item in inserted}
    # The model route matches the header the processor sets, for each model of the config.
    config = processor_config()
    models = {m["headers"][MODEL_HEADER]["exact"] for r in http for m in r["match"] if "headers" in m}
    assert models == {m.name for m in config.models}
    check_envoy(inserted, yaml.safe_load(enable), cluster)


def test_envoy_gateway_policy_targets_the_llm_route_and_embeds_the_generated_filters() -> None:
    docs = documents("envoy-gateway/extproc.yaml")
    assert set(docs) == {"HTTPRoute", "EnvoyExtensionPolicy", "EnvoyPatchPolicy"}
    route = docs["HTTPRoute"]
    policy = docs["EnvoyExtensionPolicy"]["spec"]
    target = {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": route["metadata"]["name"]}
    assert policy["targetRefs"] == [target]
    name, namespace, port = service_cluster()
    [ext_proc] = policy["extProc"]
    assert ext_proc["backendRefs"] == [{"name": name, "port": port}]
    assert docs["EnvoyExtensionPolicy"]["metadata"]["namespace"] == namespace
    config = processor_config()
    # No max_message_timeout in its API: the message timeout must cover the longest hold.
    assert float(ext_proc["messageTimeout"].removesuffix("s")) >= hold_timeout_s(config)
    assert ext_proc["failOpen"] is True and ext_proc["processingMode"]["allowModeOverride"] is True
    assert ext_proc["metadata"]["accessibleNamespaces"] == [METADATA_NAMESPACE]

    ops = docs["EnvoyPatchPolicy"]["spec"]["jsonPatches"]
    added = [op["operation"]["value"] for op in ops if op["type"].endswith("Listener")]
    # Each is added at position 0, so the last added runs first: reversed, they are in the generated order.
    expected = [f for f in generated_filters("unused") if f["name"] != DROP_IN_FILTER_PREFIX + "ext_proc"]
    assert list(reversed(added)) == expected
    enables = [op["operation"] for op in ops if op["type"].endswith("RouteConfiguration")]
    matches = sum(len(rule["matches"]) for rule in route["spec"]["rules"])
    paths = {op["path"] for op in enables}
    assert paths == {
        f"/virtual_hosts/0/routes/{i}/typed_per_filter_config/{f['name']}" for i in range(matches) for f in expected
    }
    check_envoy(added, {f["name"]: enables[0]["value"] for f in expected}, "unused")
