"""deploy/gie/: the processor as an InferencePool's EPP on Kubernetes, and the gateway examples.

Nothing here runs Kubernetes or a gateway controller. What is checked:

* every document under deploy/gie/ against a schema: the built-in kinds against Kubernetes'
  own OpenAPI schemas for version ``K8S_VERSION`` (the ``kubernetes-validate`` package ships them;
  strict: an unknown field fails), the custom resources against our JSON Schemas in
  deploy/gie/schemas/ (each names the upstream source and commit it was written from), plus the
  upstream CEL rules that concern our manifests;
* that the documents agree with each other and with the processor's config in the ConfigMap
  (selectors, ports, probes, the TLS Secret, Redis for more than one replica);
* that validation can fail (mutated manifests are refused);
* our manifests against the upstream CRDs' own openAPIV3Schema at the commit our schemas cite
  (vendored in tests/fixtures/upstream_crds/, whose README names each source), and that our
  schemas refuse every mutation the upstream one refuses.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from extproc.adapters.config import parse_config, split_address
from extproc.adapters.web.app import build_app
from tests.paths import FIXTURES, ROOT
from tests.tlsutil import processor_tls

pytestmark = pytest.mark.unit

GIE = ROOT / "deploy" / "gie"
SCHEMAS = GIE / "schemas"
# The Kubernetes version whose built-in schemas the manifests are validated against.
K8S_VERSION = "1.33"
# The namespace the DNS names in the manifests assume (the documents themselves name none).
NAMESPACE = "default"

# Custom resources: (apiVersion, kind) -> our schema file.
CUSTOM = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.json",
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateway-v1.json",
    ("gateway.networking.k8s.io/v1", "GatewayClass"): "gatewayclass-v1.json",
    ("aigateway.envoyproxy.io/v1beta1", "AIGatewayRoute"): "aigatewayroute-v1beta1.json",
    ("cert-manager.io/v1", "Issuer"): "issuer-v1.json",
    ("cert-manager.io/v1", "Certificate"): "certificate-v1.json",
    ("networking.istio.io/v1", "DestinationRule"): "destinationrule-v1.json",
}


@dataclass(frozen=True)
class Doc:
    path: Path
    index: int
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.body["kind"])

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    def __str__(self) -> str:
        return f"{self.path.relative_to(GIE)}#{self.index} {self.kind}/{self.name}"


@cache
def all_documents() -> tuple[Doc, ...]:
    return tuple(Doc(path, i, body)
                 for path in sorted(GIE.rglob("*.yaml"))
                 for i, body in enumerate(d for d in yaml.safe_load_all(path.read_text()) if d))


def in_dir(directory: str) -> list[Doc]:
    return [d for d in all_documents() if d.path.parent == GIE / directory]


def one(directory: str, kind: str, name: str | None = None) -> dict[str, Any]:
    [doc] = [d.body for d in in_dir(directory) if d.kind == kind and (name is None or d.name == name)]
    return doc


def raw_config() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(one("base", "ConfigMap")["data"]["config.yaml"])
    return loaded


@cache
def schema(file: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SCHEMAS / file).read_text())
    return loaded


# --- the upstream CEL rules our schemas cannot say -----------------------------------------------


def cel_problems(body: dict[str, Any]) -> Iterator[str]:
    """The upstream x-kubernetes-validations rules that bear on what our manifests use."""
    spec = body.get("spec", {})
    if body["kind"] == "InferencePool":
        numbers = [p.get("number") for p in spec.get("targetPorts", [])]
        if len(set(numbers)) != len(numbers):  # rule: self.all(p1, self.exists_one(p2, p1.number==p2.number))
            yield "spec.targetPorts: port number must be unique"
        ref = spec.get("endpointPickerRef")
        if ref is not None and ref.get("kind", "Service") == "Service" and "port" not in ref:
            yield "spec.endpointPickerRef: port is required when kind is 'Service' or unspecified"
    if body["kind"] == "AIGatewayRoute":
        if any(ref.get("kind", "Gateway") != "Gateway" for ref in spec.get("parentRefs", [])):
            yield "spec.parentRefs: only Gateway is supported"
        for i, rule in enumerate(spec.get("rules", [])):
            refs = rule.get("backendRefs", [])
            for ref in refs:
                if ("group" in ref) != ("kind" in ref):
                    yield f"spec.rules[{i}]: group and kind must be specified together"
                if "group" in ref and (ref["group"], ref["kind"]) != ("inference.networking.k8s.io", "InferencePool"):
                    yield f"spec.rules[{i}]: only InferencePool from inference.networking.k8s.io group is supported"
            pools = [ref for ref in refs if "group" in ref]
            if pools and len(refs) > 1:
                yield f"spec.rules[{i}]: only one InferencePool backend is allowed per rule"
    if body["kind"] == "HTTPRoute":
        for i, rule in enumerate(spec.get("rules", [])):
            for ref in rule.get("backendRefs", []):
                if ref.get("group", "") == "" and ref.get("kind", "Service") == "Service" and "port" not in ref:
                    yield f"spec.rules[{i}].backendRefs: Must have port for Service reference"


def validate(body: dict[str, Any]) -> None:
    """Raise if ``body`` is not a valid document of its kind (jsonschema.ValidationError or AssertionError)."""
    custom = CUSTOM.get((body.get("apiVersion", ""), body.get("kind", "")))
    if custom is not None:
        jsonschema.Draft202012Validator(schema(custom)).validate(body)
        problems = list(cel_problems(body))
        assert not problems, problems
    else:
        kubernetes_validate.validate(body, K8S_VERSION, strict=True)


# --- every document is valid ---------------------------------------------------------------------


def test_the_schemas_are_valid_json_schemas_and_name_their_source() -> None:
    for file in sorted(set(CUSTOM.values())):
        jsonschema.Draft202012Validator.check_schema(schema(file))
        assert re.search(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", schema(file)["$comment"]), file
    assert {p.name for p in SCHEMAS.glob("*.json")} == set(CUSTOM.values())


@pytest.mark.parametrize("doc", all_documents(), ids=str)
def test_every_manifest_is_valid(doc: Doc) -> None:
    validate(doc.body)


def test_every_kind_is_checked_and_none_needs_api_access() -> None:
    kinds = {(d.body["apiVersion"], d.kind) for d in all_documents()}
    built_in = kinds - set(CUSTOM)
    assert built_in == {("v1", "ServiceAccount"), ("v1", "ConfigMap"), ("apps/v1", "Deployment"), ("v1", "Service"),
                        ("policy/v1", "PodDisruptionBudget"), ("networking.k8s.io/v1", "NetworkPolicy"),
                        ("v1", "Secret"), ("v1", "PersistentVolumeClaim")}
    # No RBAC: the processor reads nothing from the API (DNS only), and mounts no token.
    assert not any(api.startswith("rbac.") for api, _ in kinds)
    assert one("base", "ServiceAccount")["automountServiceAccountToken"] is False
    assert one("base", "Deployment", "extproc-epp")["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    # Namespace-agnostic: applied with `kubectl apply -n`.
    assert not [str(d) for d in all_documents() if "namespace" in d.body["metadata"]]


# --- validation can fail -------------------------------------------------------------------------


def mutated(directory: str, kind: str, name: str, change: Any) -> dict[str, Any]:
    body = copy.deepcopy(one(directory, kind, name))
    change(body)
    return body


def rename(mapping: dict[str, Any], old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


MUTATIONS = {
    "pool: misspelt endpointPickerRef": ("base", "InferencePool", "vllm-llama3-8b",
                                         lambda b: rename(b["spec"], "endpointPickerRef", "endpointPickerRefs")),
    "pool: port number as a string": ("base", "InferencePool", "vllm-llama3-8b",
                                      lambda b: b["spec"]["targetPorts"][0].update(number="8000")),
    "pool: unknown failureMode": ("base", "InferencePool", "vllm-llama3-8b",
                                  lambda b: b["spec"]["endpointPickerRef"].update(failureMode="FailSafe")),
    "pool: no selector": ("base", "InferencePool", "vllm-llama3-8b", lambda b: b["spec"].pop("selector")),
    "pool: a port twice (CEL)": ("base", "InferencePool", "vllm-llama3-8b",
                                 lambda b: b["spec"]["targetPorts"].append({"number": 8000})),
    "pool: EPP Service without port (CEL)": ("base", "InferencePool", "vllm-llama3-8b",
                                             lambda b: b["spec"]["endpointPickerRef"].pop("port")),
    "deployment: misspelt readinessProbe": ("base", "Deployment", "extproc-epp", lambda b: rename(
        b["spec"]["template"]["spec"]["containers"][0], "readinessProbe", "readinesProbe")),
    "deployment: replicas as a string": ("base", "Deployment", "extproc-epp", lambda b: b["spec"].update(replicas="2")),
    "service: port as a string": ("base", "Service", "extproc-epp",
                                  lambda b: b["spec"]["ports"][0].update(port="9002")),
    "pdb: misspelt minAvailable": ("base", "PodDisruptionBudget", "extproc-epp",
                                   lambda b: rename(b["spec"], "minAvailable", "minAvaliable")),
    "httproute: misspelt backendRefs": ("envoy-gateway", "HTTPRoute", "llm-route",
                                        lambda b: rename(b["spec"]["rules"][0], "backendRefs", "backendRef")),
    "aigatewayroute: unknown header match type": ("envoy-ai-gateway", "AIGatewayRoute", "llm-route", lambda b: (
        b["spec"]["rules"][0]["matches"][0]["headers"][0].update(type="Prefix"))),
    "certificate: unknown key algorithm": ("base", "Certificate", "extproc-epp-tls",
                                           lambda b: b["spec"]["privateKey"].update(algorithm="DSA")),
    "destinationrule: tls mode lower case": ("istio", "DestinationRule", "extproc-epp",
                                             lambda b: b["spec"]["trafficPolicy"]["tls"].update(mode="simple")),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_a_mutated_manifest_is_refused(case: str) -> None:
    directory, kind, name, change = MUTATIONS[case]
    validate(one(directory, kind, name))  # the original passes...
    with pytest.raises((jsonschema.ValidationError, AssertionError)):
        validate(mutated(directory, kind, name, change))  # ...and the mutant does not


# --- the documents agree with each other and with the config -------------------------------------


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def epp_pod() -> dict[str, Any]:
    pod: dict[str, Any] = one("base", "Deployment", "extproc-epp")["spec"]["template"]
    return pod


def epp_container() -> dict[str, Any]:
    [container] = epp_pod()["spec"]["containers"]
    return dict(container)


def arg(container: dict[str, Any], flag: str) -> str:
    args: list[str] = container["args"]
    return args[args.index(flag) + 1]


def test_the_epp_service_selects_the_epp_pods_on_the_ports_the_config_listens_on() -> None:
    listen = raw_config()["listen"]
    grpc_host, grpc_port = split_address(listen["grpc"])
    metrics_host, metrics_port = split_address(listen["metrics"])
    assert grpc_host == metrics_host == "0.0.0.0"  # reachable from the gateway and the kubelet
    deployment = one("base", "Deployment", "extproc-epp")
    assert selects(deployment["spec"]["selector"]["matchLabels"], epp_pod()["metadata"]["labels"])
    ports = {p["name"]: p["containerPort"] for p in epp_container()["ports"]}
    assert ports == {"grpc": grpc_port, "metrics": metrics_port}
    service = one("base", "Service", "extproc-epp")
    assert selects(service["spec"]["selector"], epp_pod()["metadata"]["labels"])
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert {name: p["targetPort"] for name, p in by_name.items()} == {"grpc": "grpc", "metrics": "metrics"}
    assert by_name["grpc"]["port"] == grpc_port
    # As on the EPP Services of GIE's conformance base (conformance/resources/base.yaml at 84436a96).
    assert by_name["grpc"]["appProtocol"] == "http2"


def test_the_probes_ask_the_metrics_port_paths_the_processor_serves() -> None:
    container = epp_container()
    routes = {r.resource.canonical for r in build_app(CollectorRegistry(), {}, lambda: False).router.routes()
              if r.resource is not None}
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz"), ("startupProbe", "/healthz")):
        assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, probe
        assert path in routes
    # Drained within the grace period; the drain itself shorter than the deadline.
    deadline = float(arg(container, "--deadline-seconds"))
    assert float(arg(container, "--drain-seconds")) < deadline < epp_pod()["spec"]["terminationGracePeriodSeconds"]


def test_the_config_file_and_the_tls_files_are_the_mounted_volumes() -> None:
    container, pod = epp_container(), epp_pod()
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert set(mounts) == set(volumes) == {"config", "tls"}
    assert not any("subPath" in m for m in container["volumeMounts"])  # subPath mounts are never updated
    config_file = Path(arg(container, "--config"))
    assert str(config_file.parent) == mounts["config"]
    configmap = one("base", "ConfigMap")
    assert volumes["config"]["configMap"]["name"] == configmap["metadata"]["name"]
    assert config_file.name in configmap["data"]
    tls = raw_config()["listen"]["tls"]
    assert {str(Path(tls["cert_file"]).parent), str(Path(tls["key_file"]).parent)} == {mounts["tls"]}
    secret = volumes["tls"]["secret"]["secretName"]
    # cert-manager writes tls.crt and tls.key into the Certificate's Secret; so does the hand-made one.
    certificate = one("base", "Certificate")
    assert certificate["spec"]["secretName"] == secret
    assert {Path(tls["cert_file"]).name, Path(tls["key_file"]).name} == {"tls.crt", "tls.key"}
    handmade = one("without-cert-manager", "Secret")
    assert handmade["metadata"]["name"] == secret and set(handmade["stringData"]) == {"tls.crt", "tls.key"}
    # The certificate names the EPP Service as the gateways address it.
    service = one("base", "Service", "extproc-epp")["metadata"]["name"]
    assert {service, f"{service}.{NAMESPACE}.svc", f"{service}.{NAMESPACE}.svc.cluster.local"} <= set(
        certificate["spec"]["dnsNames"])
    issuer = one("base", "Issuer")
    assert certificate["spec"]["issuerRef"] == {"name": issuer["metadata"]["name"], "kind": "Issuer",
                                                "group": "cert-manager.io"}


def test_the_pool_names_the_epp_service_and_selects_the_pods_of_the_headless_service() -> None:
    pool = one("base", "InferencePool")["spec"]
    service = one("base", "Service", "extproc-epp")
    ref = pool["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"] and ref.get("kind", "Service") == "Service"
    # The Service port, which the gateway dials (GIE api/v1: "the service port number, not the target port").
    assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"}

    # The processor learns the members from the headless Service's DNS, not from the pool's selector:
    # the two must select the same pods on the same port.
    headless = one("base", "Service", "vllm-llama3-8b")["spec"]
    assert headless["clusterIP"] == "None"
    assert headless["selector"] == pool["selector"]["matchLabels"]
    [target_port] = [p["number"] for p in pool["targetPorts"]]
    assert [p["port"] for p in headless["ports"]] == [target_port]
    servers = one("base", "Deployment", "vllm-llama3-8b")["spec"]["template"]
    assert selects(headless["selector"], servers["metadata"]["labels"])
    [server] = servers["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert named[headless["ports"][0]["targetPort"]] == target_port
    # The config's endpoint is that Service's name in the namespace, on the pool's port.
    [model] = raw_config()["models"]
    [endpoint] = model["endpoints"]
    url = urlsplit(endpoint)
    assert (url.scheme, url.hostname, url.port) == (
        "http", f"vllm-llama3-8b.{NAMESPACE}.svc.cluster.local", target_port)
    assert model["endpoint_picking"] is True  # the EPP names the endpoint of each request


def test_the_disruption_budget_keeps_one_of_the_replicas() -> None:
    pdb = one("base", "PodDisruptionBudget")["spec"]
    assert selects(pdb["selector"]["matchLabels"], epp_pod()["metadata"]["labels"])
    replicas = one("base", "Deployment", "extproc-epp")["spec"]["replicas"]
    assert 1 <= pdb["minAvailable"] < replicas  # a drain can proceed, and never takes the last one
    anti = epp_pod()["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert [t["podAffinityTerm"]["labelSelector"]["matchLabels"] for t in anti] == [pdb["selector"]["matchLabels"]]


def test_more_than_one_replica_share_the_redis_of_the_manifests() -> None:
    replicas = one("base", "Deployment", "extproc-epp")["spec"]["replicas"]
    assert replicas > 1
    cluster = raw_config()["cluster"]  # several replicas without it would each schedule alone
    url = urlsplit(cluster["redis_url"])
    service = one("base", "Service", url.hostname)
    assert url.port in {p["port"] for p in service["spec"]["ports"]}
    redis = one("base", "Deployment", url.hostname)
    assert redis["spec"]["replicas"] == 1 and redis["spec"]["strategy"]["type"] == "Recreate"  # one primary
    assert selects(service["spec"]["selector"], redis["spec"]["template"]["metadata"]["labels"])
    policy = one("base", "NetworkPolicy")["spec"]
    assert selects(policy["podSelector"]["matchLabels"], redis["spec"]["template"]["metadata"]["labels"])
    [rule] = policy["ingress"]
    assert [selects(f["podSelector"]["matchLabels"], epp_pod()["metadata"]["labels"]) for f in rule["from"]] == [True]


def routes() -> list[Doc]:
    """The gateway examples' routes (the batch API's, on any example's Gateway, are apart: batches/)."""
    return [d for d in all_documents() if d.kind in ("HTTPRoute", "AIGatewayRoute") and d.path.parent.name != "batches"]


def test_each_gateway_example_routes_to_the_pool_through_its_own_gateway() -> None:
    pool = one("base", "InferencePool")["metadata"]["name"]
    examples = {d.path.parent.name for d in routes()}
    assert examples == {"envoy-ai-gateway", "envoy-gateway", "kgateway", "istio"}
    classes = {"envoy-ai-gateway": None, "envoy-gateway": None, "kgateway": "kgateway", "istio": "istio"}
    for route in routes():
        here = in_dir(route.path.parent.name)
        gateways = {d.name: d.body for d in here if d.kind == "Gateway"}
        assert [p["name"] for p in route.body["spec"]["parentRefs"]] == list(gateways), route
        [gateway] = gateways.values()
        own_class = [d.name for d in here if d.kind == "GatewayClass"]
        expected = classes[route.path.parent.name]
        assert [gateway["spec"]["gatewayClassName"]] == (own_class if expected is None else [expected]), route
        refs = [ref for rule in route.body["spec"]["rules"] for ref in rule["backendRefs"]]
        assert refs == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool}], route
    for d in all_documents():
        if d.kind == "GatewayClass":  # Envoy AI Gateway and Envoy Gateway: Envoy Gateway's controller
            assert d.body["spec"]["controllerName"] == "gateway.envoyproxy.io/gatewayclass-controller"


def test_the_batch_routes_reach_the_epp_pods_api_and_with_the_runners_key_the_pool() -> None:
    """deploy/gie/batches/: the API to the EPP pods' batch port, the runner's lines by key to the pool."""
    gateways = {d.name for d in all_documents() if d.kind == "Gateway"}
    api, runner = one("batches", "HTTPRoute", "extproc-batch-api"), one("batches", "HTTPRoute", "extproc-batch-runner")
    for route in (api, runner):
        assert [p["name"] for p in route["spec"]["parentRefs"]] == list(gateways)  # every example names one
    [rule] = api["spec"]["rules"]
    assert [m["path"] for m in rule["matches"]] == [{"type": "PathPrefix", "value": "/v1/files"},
                                                    {"type": "PathPrefix", "value": "/v1/batches"}]
    service = one("batches", "Service", "extproc-batches")
    assert selects(service["spec"]["selector"], epp_pod()["metadata"]["labels"])
    [port] = service["spec"]["ports"]
    assert rule["backendRefs"] == [{"name": service["metadata"]["name"], "port": port["port"]}]
    [rule] = runner["spec"]["rules"]
    [match] = rule["matches"]
    assert [(h["type"], h["name"]) for h in match["headers"]] == [("Exact", "x-extproc-batch-key")]
    pool = one("base", "InferencePool")["metadata"]["name"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool}]
    assert one("batches", "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_ai_gateway_route_matches_every_name_the_model_serves() -> None:
    route = one("envoy-ai-gateway", "AIGatewayRoute")
    [rule] = route["spec"]["rules"]
    [[header]] = [m["headers"] for m in rule["matches"]]
    assert (header["name"], header["type"]) == ("x-ai-eg-model", "RegularExpression")
    pattern = re.compile(header["value"])
    [model] = raw_config()["models"]
    for name in model["served_names"]:  # a trailing * is a wildcard: try it with a suffix
        example = name.replace("*", "adapter-1")
        assert pattern.fullmatch(example), example
    assert not pattern.fullmatch("llama-3-70b")
    # Its body mode: duplex streams the answer (buffered would also buffer each response).
    annotations = one("base", "InferencePool")["metadata"]["annotations"]
    assert annotations["aigateway.envoyproxy.io/processing-body-mode"] == "duplex"


def test_the_istio_destination_rule_originates_tls_to_the_epp_service() -> None:
    rule = one("istio", "DestinationRule")["spec"]
    service = one("base", "Service", "extproc-epp")["metadata"]["name"]
    assert rule["host"] == f"{service}.{NAMESPACE}.svc.cluster.local"
    assert rule["trafficPolicy"]["tls"]["mode"] == "SIMPLE"


# --- the ConfigMap is the processor's config -----------------------------------------------------

# The keys the ConfigMap uses that the processor's config gains with EPP mode (being written on other
# branches). Until every one exists the parse below is expected to fail; from then on it runs as a plain test.
def test_the_configmap_parses_as_the_processor_config(tmp_path: Path) -> None:
    raw = raw_config()
    # The Secret's files exist only in the pod: the same paths' certificate, made here.
    tls, _ = processor_tls(tmp_path, mutual=False)
    assert set(raw["listen"]["tls"]) == {"cert_file", "key_file"}
    raw["listen"]["tls"] = {key: tls[key] for key in ("cert_file", "key_file")}
    config = parse_config(raw)
    assert split_address(config.listen.grpc)[1] == one("base", "InferencePool")["spec"]["endpointPickerRef"]["port"]["number"]
    [model] = config.models
    assert model.endpoint_picking and model.endpoints == tuple(raw_config()["models"][0]["endpoints"])
    assert config.cluster is not None and config.cluster.redis_url == raw_config()["cluster"]["redis_url"]


# --- the upstream CRDs, vendored -------------------------------------------------------------------

# The ``spec`` schema of each custom resource's upstream CRD, at the commit our schema names (the README there says
# which repository, commit and file each comes from, and how it was taken), by the same file name as ours.
UPSTREAM = FIXTURES / "upstream_crds"


def upstream_spec_schema(api_version: str, kind: str) -> dict[str, Any]:
    """The upstream CRD's openAPIV3Schema of ``spec``, made strict."""
    spec: dict[str, Any] = strict(json.loads((UPSTREAM / CUSTOM[(api_version, kind)]).read_text()))
    return spec


def strict(node: Any) -> Any:
    """What the API server does with kubectl's default --validate=strict: an unknown field is an error.

    Every object schema that lists its properties (and does not preserve unknown fields) gets
    additionalProperties: false; OpenAPI's nullable becomes a JSON Schema null type.
    """
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: strict(value) for key, value in node.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if out.pop("nullable", False) and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def leaf_mutants(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[str, Any]]:
    """(description, mutant of the whole ``node``) for each field: a wrong type, bounds, an unknown key."""
    def at(path: tuple[Any, ...], value: Any) -> Any:
        mutant = copy.deepcopy(node)
        target = mutant
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
        return mutant

    def walk(value: Any, here: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], Any]]:
        yield here, value
        if isinstance(value, dict):
            for key, child in value.items():
                yield from walk(child, (*here, key))
        elif isinstance(value, list):
            for i, child in enumerate(value):
                yield from walk(child, (*here, i))

    for where, value in walk(node, ()):
        name = ".".join(map(str, where)) or "spec"
        if isinstance(value, dict):
            mutant = copy.deepcopy(node)
            target = mutant
            for step in where:
                target = target[step]
            target["unknownField"] = "x"
            yield f"{name}: unknown field", mutant
        if not where:
            continue
        if isinstance(value, bool):
            yield f"{name}: a string", at(where, "true")
        elif isinstance(value, int):
            for bad in ("1", 0, -1, 70000, 2**40):
                yield f"{name}: {bad!r}", at(where, bad)
        elif isinstance(value, str):
            for bad in (1, "", "Not A Name!", "x" * 300):
                yield f"{name}: {bad!r}", at(where, bad)
        elif isinstance(value, list):
            yield f"{name}: a string", at(where, "x")
            yield f"{name}: empty", at(where, [])
        elif isinstance(value, dict):
            yield f"{name}: a string", at(where, "x")


@pytest.mark.parametrize("kind", sorted(CUSTOM), ids=lambda k: f"{k[1]}.{k[0]}")
def test_our_manifests_pass_the_upstream_crd_and_our_schema_is_not_looser(kind: tuple[str, str]) -> None:
    upstream = upstream_spec_schema(*kind)
    validator = jsonschema.Draft202012Validator(upstream)
    docs = [d for d in all_documents() if (d.body["apiVersion"], d.kind) == kind]
    assert docs
    refused = 0
    for doc in docs:
        assert not list(validator.iter_errors(doc.body["spec"])), doc
        for description, spec in leaf_mutants(doc.body["spec"]):
            if validator.is_valid(spec):
                continue
            refused += 1  # upstream refuses it: ours must too
            try:
                validate({**doc.body, "spec": spec})
            except (jsonschema.ValidationError, AssertionError):
                continue
            pytest.fail(f"{doc}: the upstream CRD refuses spec.{description}, our schema accepts it")
    assert refused  # the mutations reached the upstream schema's constraints
