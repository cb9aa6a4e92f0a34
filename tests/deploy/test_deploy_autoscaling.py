"""deploy/autoscaling/: the engines an autoscaler sizes on the processor's demand, with KEDA or an HPA.

Nothing here runs Kubernetes, KEDA or prometheus-adapter. What is checked:

* every document against a schema: the built-in kinds (the HPA among them) against Kubernetes'
  own OpenAPI schemas (``kubernetes-validate``, strict: an unknown field fails); KEDA's
  ScaledObject against its CRD's schema, vendored in deploy/autoscaling/schemas/ with every object
  closed as ``kubectl --validate=strict`` closes it (that file is what :func:`closed` makes of the
  CRD at the commit it names, vendored verbatim in tests/fixtures/upstream_crds/), plus its
  CEL rule; prometheus-adapter's config against a schema written from its ``pkg/config/config.go``
  (it parses with ``yaml.UnmarshalStrict``: an unknown key fails too); KEDA's Prometheus trigger's
  metadata against the scaler's own keys;
* that validation can fail (mutated documents are refused);
* that the documents agree with each other and with the processor's config in
  extproc-config.yaml (names, ports, the batch size, the drain's timeouts against DNS refresh);
* against a real Prometheus (Debian's) scraping a running processor: the ScaledObject's query and
  the adapter's, rendered as the adapter renders it, and each query of the metrics reference's
  autoscaling table, return what the guide says for a known queue.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import jsonschema
import kubernetes_validate
import pytest
import yaml

from extproc.adapters.config import parse_config
from extproc.tools.autoscale import Settings
from extproc.tools.hosts import command, write_hosts
from extproc.tools.power_user import chat
from extproc.tools.procs import ManagedProcess, free_port
from extproc.tools.stack import start_sim, start_stack
from tests.helpers.monitoring import query, tool
from tests.paths import FIXTURES, ROOT
from tests.stackutil import TENANT_KEYS, read_metrics, write_stack_config
from tests.waitutil import eventually

AUTOSCALING = ROOT / "deploy" / "autoscaling"
SCHEMAS = AUTOSCALING / "schemas"
K8S_VERSION = "1.33"
SCALED_OBJECT = "scaledobject-v1alpha1.json"
ADAPTER_CONFIG = "prometheus-adapter-config.json"
# KEDA's ScaledObject CRD: where it is upstream, and the commit the vendored schema was made from.
KEDA = ("kedacore/keda", "config/crd/bases/keda.sh_scaledobjects.yaml")
# That CRD, vendored: the check below runs everywhere, reading nothing outside the repository.
UPSTREAM_CRD = FIXTURES / "upstream_crds" / "keda.sh_scaledobjects.yaml"
# The Prometheus scaler's metadata keys (kedacore/keda 8b4f083c, pkg/scalers/prometheus_scaler.go,
# prometheusMetadata's `keda:"name=..."` tags); its authentication's are not used here.
PROMETHEUS_SCALER_KEYS = {"serverAddress", "query", "queryParameters", "threshold", "activationThreshold",
                          "namespace", "customHeaders", "ignoreNullValues", "unsafeSsl", "awsRegion", "timeout",
                          "identityOwner"}
# Dropped from the CRD's schema: words, and what only the API server acts on (the one CEL rule is checked below).
DROPPED = ("description", "default", "x-kubernetes-list-type", "x-kubernetes-validations",
           "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields")


def documents(relative: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((AUTOSCALING / relative).read_text()) if d]


def one(relative: str, kind: str) -> dict[str, Any]:
    [doc] = [d for d in documents(relative) if d["kind"] == kind]
    return doc


def all_documents() -> list[tuple[str, dict[str, Any]]]:
    return [(str(path.relative_to(AUTOSCALING)), doc) for path in sorted(AUTOSCALING.rglob("*.yaml"))
            for doc in documents(str(path.relative_to(AUTOSCALING)))]


@cache
def schema(file: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SCHEMAS / file).read_text())
    return loaded


def closed(node: Any) -> Any:
    """An ``openAPIV3Schema`` node as a JSON Schema, every object with properties closed to others (as
    ``kubectl --validate=strict`` refuses an unknown field) and :data:`DROPPED` left out."""
    if isinstance(node, list):
        return [closed(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: ({name: closed(sub) for name, sub in value.items()} if key == "properties" else closed(value))
           for key, value in node.items() if key not in DROPPED}
    if "properties" in node and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


def scaled_object_schema(crd: dict[str, Any], comment: str) -> dict[str, Any]:
    """The vendored file's content for KEDA's ScaledObject ``crd``."""
    [version] = crd["spec"]["versions"]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$comment": comment,
            "title": f"ScaledObject ({crd['spec']['group']}/{version['name']})",
            **closed(version["schema"]["openAPIV3Schema"])}


def cel_problems(body: dict[str, Any]) -> list[str]:
    """The CRD's one CEL rule (x-kubernetes-validations on spec)."""
    spec = body.get("spec", {})
    if "minReplicaCount" in spec and spec["minReplicaCount"] > spec.get("maxReplicaCount", 100):
        return ["minReplicaCount must be less than or equal to maxReplicaCount"]
    return []


def adapter_config(doc: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(doc["data"]["config.yaml"])
    return loaded


def validate(body: dict[str, Any]) -> None:
    """Raise if ``body`` is not a valid document of its kind (jsonschema.ValidationError or AssertionError)."""
    if (body.get("apiVersion"), body.get("kind")) == ("keda.sh/v1alpha1", "ScaledObject"):
        jsonschema.Draft202012Validator(schema(SCALED_OBJECT)).validate(body)
        assert not cel_problems(body), cel_problems(body)
        for trigger in body["spec"]["triggers"]:
            if trigger["type"] == "prometheus":
                assert set(trigger["metadata"]) <= PROMETHEUS_SCALER_KEYS, set(trigger["metadata"])
                float(trigger["metadata"]["threshold"])
        return
    kubernetes_validate.validate(body, K8S_VERSION, strict=True)
    if body["kind"] == "ConfigMap" and body["metadata"]["name"] == "prometheus-adapter":
        jsonschema.Draft202012Validator(schema(ADAPTER_CONFIG)).validate(adapter_config(body))


# --- every document is valid, and validation can fail --------------------------------------------


@pytest.mark.unit
def test_the_schemas_are_valid_json_schemas_and_name_their_source() -> None:
    for file in (SCALED_OBJECT, ADAPTER_CONFIG):
        jsonschema.Draft202012Validator.check_schema(schema(file))
        assert re.search(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", schema(file)["$comment"]), file
    assert {p.name for p in SCHEMAS.glob("*.json")} == {SCALED_OBJECT, ADAPTER_CONFIG}


@pytest.mark.unit
@pytest.mark.parametrize(("where", "doc"), all_documents(), ids=lambda x: x if isinstance(x, str) else x["kind"])
def test_every_manifest_is_valid(where: str, doc: dict[str, Any]) -> None:
    validate(doc)


def rename(mapping: dict[str, Any], old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


MUTATIONS: dict[str, tuple[str, str, Callable[[dict[str, Any]], object]]] = {
    "scaledobject: misspelt pollingInterval": ("keda/scaledobject.yaml", "ScaledObject",
                                               lambda b: rename(b["spec"], "pollingInterval", "pollInterval")),
    "scaledobject: no triggers": ("keda/scaledobject.yaml", "ScaledObject", lambda b: b["spec"].pop("triggers")),
    "scaledobject: min above max (CEL)": ("keda/scaledobject.yaml", "ScaledObject",
                                          lambda b: b["spec"].update(minReplicaCount=9)),
    "scaledobject: a window as a string": ("keda/scaledobject.yaml", "ScaledObject", lambda b: b["spec"]["advanced"][
        "horizontalPodAutoscalerConfig"]["behavior"]["scaleUp"].update(stabilizationWindowSeconds="0")),
    "scaledobject: the scaler's key misspelt": ("keda/scaledobject.yaml", "ScaledObject", lambda b: rename(
        b["spec"]["triggers"][0]["metadata"], "activationThreshold", "activation_threshold")),
    "scaledobject: a threshold that is no number": ("keda/scaledobject.yaml", "ScaledObject", lambda b: b["spec"][
        "triggers"][0]["metadata"].update(threshold="one")),
    "hpa: misspelt averageValue": ("hpa/hpa.yaml", "HorizontalPodAutoscaler", lambda b: rename(
        b["spec"]["metrics"][0]["external"]["target"], "averageValue", "average")),
    "hpa: a policy's period as a string": ("hpa/hpa.yaml", "HorizontalPodAutoscaler", lambda b: b["spec"][
        "behavior"]["scaleUp"]["policies"][0].update(periodSeconds="15")),
    "adapter: misspelt metricsQuery": ("hpa/prometheus-adapter.yaml", "ConfigMap", lambda b: b["data"].update(
        {"config.yaml": b["data"]["config.yaml"].replace("metricsQuery", "metricQuery")})),
    "engines: misspelt preStop": ("engines.yaml", "Deployment", lambda b: rename(
        b["spec"]["template"]["spec"]["containers"][0]["lifecycle"], "preStop", "prestop")),
}


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_a_mutated_manifest_is_refused(case: str) -> None:
    relative, kind, change = MUTATIONS[case]
    original = one(relative, kind)
    validate(original)
    mutant = copy.deepcopy(original)
    change(mutant)
    with pytest.raises((jsonschema.ValidationError, AssertionError, ValueError,
                        kubernetes_validate.ValidationError)):
        validate(mutant)


@pytest.mark.unit
def test_the_vendored_scaled_object_schema_is_kedas_crd_closed_at_the_commit_it_names() -> None:
    comment = schema(SCALED_OBJECT)["$comment"]
    commit = re.search(r"@([0-9a-f]{40})", comment)
    assert commit is not None
    upstream = UPSTREAM_CRD.read_text(encoding="utf-8")
    assert upstream.startswith(f"# {KEDA[0]}@{commit[1]}: {KEDA[1]},")  # the CRD at the commit the schema names
    crd = yaml.safe_load(upstream)
    assert scaled_object_schema(crd, comment) == schema(SCALED_OBJECT)


# --- the documents agree with each other and with the processor's config -------------------------


def processor_config() -> Any:
    return parse_config(yaml.safe_load(one("extproc-config.yaml", "ConfigMap")["data"]["config.yaml"]))


def arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.unit
def test_the_processor_resolves_the_headless_service_of_the_engines_and_knows_their_size() -> None:
    [model] = processor_config().models
    service, deployment = one("engines.yaml", "Service"), one("engines.yaml", "Deployment")
    assert service["spec"]["clusterIP"] == "None"
    url = urlsplit(model.endpoints[0])
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    assert (url.hostname, url.port) == (f"{name}.{namespace}.svc.cluster.local", service["spec"]["ports"][0]["port"])
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert "replicas" not in deployment["spec"]  # the autoscaler owns the count
    [engine] = pod["spec"]["containers"]
    assert arg(engine["args"], "--served-model-name") == model.name
    assert int(arg(engine["args"], "--max-num-seqs")) == model.max_running
    assert model.endpoint_picking  # Envoy sends where the processor picked: it needs no DNS of its own
    # Only ready pods are in the Service's DNS; a cold start waits for the slowest start the probe allows.
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
    # Leaving: the pod serves on through the preStop sleep, longer than the processor takes to see it gone;
    # then vLLM drains what is in flight, within the grace period.
    sleep = engine["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert sleep >= 2 * model.dns_refresh_s
    drain = int(arg(engine["args"], "--shutdown-timeout"))
    assert pod["spec"]["terminationGracePeriodSeconds"] > sleep + drain > 0


@pytest.mark.unit
def test_keda_and_the_hpa_scale_the_engines_on_the_models_demand_one_engine_per_unit() -> None:
    [model] = processor_config().models
    deployment = one("engines.yaml", "Deployment")["metadata"]
    scaled = one("keda/scaledobject.yaml", "ScaledObject")
    hpa = one("hpa/hpa.yaml", "HorizontalPodAutoscaler")
    assert scaled["spec"]["scaleTargetRef"] == {"name": deployment["name"]}  # KEDA's default: an apps/v1 Deployment
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment["name"]}
    assert scaled["metadata"]["namespace"] == hpa["metadata"]["namespace"] == deployment["namespace"]
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["metadata"]["query"] == f'sum(extproc_engines_needed{{model="{model.name}"}})'
    assert (trigger["metadata"]["threshold"], trigger["metadata"]["activationThreshold"]) == ("1", "0")
    assert scaled["spec"]["minReplicaCount"] == 0  # from zero: the processor holds requests meanwhile
    [metric] = hpa["spec"]["metrics"]
    assert metric["external"]["metric"] == {"name": "extproc_engines_needed",
                                            "selector": {"matchLabels": {"model": model.name}}}
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    assert hpa["spec"]["minReplicas"] >= 1  # an HPA does not scale to zero
    # The same pace both ways, the simulated autoscaler's (extproc-dev autoscale): one engine more per 15 s of
    # need, the surplus stopped after 60 s of none.
    behavior = hpa["spec"]["behavior"]
    assert behavior == scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    simulated = Settings()
    assert behavior["scaleUp"] == {"stabilizationWindowSeconds": simulated.up_window_s, "policies": [
        {"type": "Pods", "value": 1, "periodSeconds": simulated.up_every_s}]}
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == simulated.down_window_s
    assert behavior["scaleDown"]["policies"] == [{"type": "Percent", "value": 100, "periodSeconds": 15}]
    # The cold-start wait covers KEDA's reaction.
    assert model.cold_start_wait() > scaled["spec"]["pollingInterval"]
    [rule] = adapter_config(one("hpa/prometheus-adapter.yaml", "ConfigMap"))["externalRules"]
    assert rule["resources"] == {"namespaced": False}  # the processor's series carry no namespace of their own


# --- the queries, against a real Prometheus scraping a running processor -------------------------


def adapter_query(model: str) -> str:
    """The adapter rule's metricsQuery as prometheus-adapter renders it for the HPA's selector (Go template, << >>)."""
    [rule] = adapter_config(one("hpa/prometheus-adapter.yaml", "ConfigMap"))["externalRules"]
    series = re.fullmatch(r"(\w+)\{.*\}", rule["seriesQuery"])
    assert series is not None
    rendered: str = rule["metricsQuery"].replace("<<.Series>>", series[1])
    return rendered.replace("<<.LabelMatchers>>", f'model="{model}"')


def guide_query() -> str:
    """The guide's query for every class but the idle-only one (its indented block, one query on two lines)."""
    page = (ROOT / "docs" / "guides" / "autoscaling.md").read_text()
    [block] = [b for b in re.findall(r"(?m)(?:^    .+\n)+", page) if 'priority!="batch"' in b]
    return " ".join(line.strip() for line in block.splitlines())


def reference_queries() -> dict[str, str]:
    """The metrics reference's autoscaling table: series -> the query an autoscaler sends ($model: the model)."""
    page = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    section = page.split("\n## Autoscaling", 1)[1].split("\n## ", 1)[0]
    rows = [re.findall(r"`([^`]+)`", line) for line in section.splitlines() if line.startswith("| `")]
    return {row[0]: row[1] for row in rows}


# The engines' size as extproc-config.yaml gives it: 4 sequences (max_running) + target_waiting 3.
MAX_RUNNING, TARGET_WAITING, SENT = 4, 3, 21
SLOW_SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "1.0"]


@pytest.mark.integration
async def test_the_guides_queries_return_what_it_says_for_a_known_queue(tmp_path: Path) -> None:
    """21 requests held for a pool with no engine, then with one engine that runs 4 and queues 3 and none finishes.

    The demand is the same both times: 21 over what one engine holds (4 + 3) is 3 engines.
    """
    prometheus_bin = tool("prometheus")
    hosts = tmp_path / "hosts.json"
    write_hosts(hosts, {})
    config = write_stack_config(tmp_path, {"m1": {
        "endpoints": ["http://m1-engines.test:8000"], "endpoint_picking": True, "dns_refresh_s": 0.2,
        "max_running": MAX_RUNNING, "target_waiting": TARGET_WAITING}})
    model = parse_config(yaml.safe_load(config.read_text())).models[0]
    engine = f"http://127.0.0.1:{free_port()}"
    async with await start_stack(config, tmp_path, engines=False, command=command(hosts)) as stack, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        port = free_port()
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s"},
            "scrape_configs": [{"job_name": "extproc", "static_configs": [
                {"targets": [stack.metrics_url.removeprefix("http://").removesuffix("/metrics")]}]}],
        }))
        prometheus = f"http://127.0.0.1:{port}"
        argv = [prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"]
        requests = [asyncio.create_task(chat(http, stack.envoy_url, "alice", "m1", api_key=TENANT_KEYS["alice"],
                                             max_tokens=2000)) for _ in range(SENT)]
        async with await ManagedProcess.start("prometheus", argv, tmp_path / "prometheus.log",
                                              ready_url=f"{prometheus}/-/ready"):
            queries = {**{series: q.replace("$model", "m1") for series, q in reference_queries().items()},
                       "keda": one("keda/scaledobject.yaml", "ScaledObject")["spec"]["triggers"][0]["metadata"][
                           "query"].replace('model="llama"', 'model="m1"'),
                       "adapter": adapter_query("m1"),
                       "not batch": guide_query().replace('model="llama"', 'model="m1"')}

            async def answers() -> dict[str, float]:
                found = {}
                for name, expr in queries.items():
                    result = await query(http, prometheus, expr)
                    found[name] = sum(float(s["value"][1]) for s in result) if result else math.nan
                return found

            # No engine: 21 held, the engines' size the one configured.
            expected = {"keda": 3.0, "adapter": 3.0, "not batch": 3.0, "extproc_engines_needed": 3.0,
                        "extproc_demand_requests": float(SENT), "extproc_engine_capacity_requests": 7.0,
                        "extproc_drain_seconds": math.inf, "inference_pool_ready_pods": 0.0,
                        "inference_pool_average_queue_size": float(SENT)}
            seen: dict[str, float] = {}

            async def shows(wanted: dict[str, float]) -> bool:
                seen.update(await answers())
                return all(seen.get(k) == v for k, v in wanted.items())

            await eventually(lambda: shows(expected), timeout_s=60, what=f"the demand with no engine: {expected}")
            assert set(seen) >= set(expected)
            # One engine: 7 released to it (4 run, 3 wait in it), 14 held; nothing finishes (2,000 tokens at 20 ms).
            async with await start_sim(model, engine, tmp_path, SLOW_SIM):
                write_hosts(hosts, {"m1-engines.test": [engine]})
                expected = {"keda": 3.0, "adapter": 3.0, "extproc_engines_needed": 3.0,
                            "extproc_demand_requests": float(SENT), "extproc_engine_capacity_requests": 7.0,
                            "inference_pool_ready_pods": 1.0, "inference_pool_average_queue_size": float(SENT - 7 + 3),
                            "inference_pool_average_running_requests": 4.0}
                await eventually(lambda: shows(expected), timeout_s=60, what=f"the demand with one engine: {expected}")
                page = await read_metrics(stack.metrics_url)
                for task in requests:
                    task.cancel()
                await asyncio.gather(*requests, return_exceptions=True)
    held = sum(v for (n, labels), v in page.items() if n == "extproc_demand_requests" and ("state", "held") in labels)
    assert held == SENT - 7
    assert not [name for name, value in seen.items() if math.isnan(value)]  # every query of the table answered
