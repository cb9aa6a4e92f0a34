"""The batch API's Envoy pieces and its config section (the generated bootstrap is checked by every variant test)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgspec
import pytest

from extproc.adapters.config import Config, ConfigError
from extproc.adapters.envoy import bootstrap
from extproc.adapters.envoy.filters import EXT_PROC_FILTER
from extproc.adapters.reload import plan
from extproc.tools.procs import free_port
from tests.envoyutil import free_port_config

pytestmark = pytest.mark.unit


def batches(**settings: Any) -> dict[str, Any]:
    return {"directory": "/tmp/batches", "listen": f"127.0.0.1:{free_port()}",
            "runner_listen": f"127.0.0.1:{free_port()}", **settings}


def listeners(**settings: Any) -> dict[str, dict[str, Any]]:
    return listeners_of(bootstrap(free_port_config(batches=batches(**settings))))


def listeners_of(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {listener["name"]: listener["filter_chains"][0]["filters"][0]["typed_config"]
            for listener in doc["static_resources"]["listeners"]}


def routes(hcm: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = hcm["route_config"]["virtual_hosts"][0]["routes"]
    return found


def filter_names(hcm: dict[str, Any]) -> list[str]:
    return [f["name"] for f in hcm["http_filters"]]


def removed(hcm: dict[str, Any]) -> list[str]:
    mutation = hcm["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]
    return [m["remove"] for m in mutation]


def test_the_api_routes_come_first_after_auth_with_ext_proc_off() -> None:
    ingress = listeners()["ingress"]
    first = routes(ingress)[:2]
    assert [r["match"]["prefix"] for r in first] == ["/v1/files", "/v1/batches"]
    assert all(r["route"]["cluster"] == "extproc_batch_api" for r in first)
    assert all(r["typed_per_filter_config"][EXT_PROC_FILTER]["disabled"] for r in first)
    # The same chain as every request: a client's tenant header removed, then api_key_auth sets it.
    assert "envoy.filters.http.api_key_auth" in filter_names(ingress) and "x-tenant-id" in removed(ingress)


def test_the_runner_listener_keeps_the_tenant_header_has_no_auth_and_requires_its_key() -> None:
    runner = listeners(runner_key="k")["batch_runner"]
    assert "envoy.filters.http.api_key_auth" not in filter_names(runner)
    assert EXT_PROC_FILTER in filter_names(runner)
    assert "x-tenant-id" not in removed(runner) and "x-model" in removed(runner)
    *keyed, refused = routes(runner)
    assert all({"name": "x-extproc-batch-key", "string_match": {"exact": "k"}} in r["match"]["headers"]
               for r in keyed)
    assert all(r["request_headers_to_remove"] == ["x-extproc-batch-key"] for r in keyed if "route" in r)
    assert refused["direct_response"]["status"] == 401
    assert refused["typed_per_filter_config"][EXT_PROC_FILTER]["disabled"]


def test_only_the_runner_listener_keeps_a_batch_line_header() -> None:
    found = listeners()
    assert "x-extproc-batch-line" in removed(found["ingress"])
    assert "x-extproc-batch-line" not in removed(found["batch_runner"])


def cluster_config() -> Config:
    instances = {name: {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}",
                        "batches": f"127.0.0.1:{port}"} for name, port in (("a", 9101), ("b", 9102))}
    return free_port_config(batches=batches(), cluster={"redis_url": "redis://127.0.0.1:6379/0",
                                                        "instances": instances})


def test_a_clusters_api_is_every_instances_and_a_call_to_one_that_is_down_goes_to_another() -> None:
    config = cluster_config()
    doc = bootstrap(config)
    [api] = [c for c in doc["static_resources"]["clusters"] if c["name"] == "extproc_batch_api"]
    endpoints = api["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in endpoints] == [9101, 9102]
    first = routes(listeners_of(doc)["ingress"])[:2]
    assert all(r["route"]["retry_policy"]["retry_on"] == "connect-failure,reset-before-request" for r in first)
    # Each instance serves the API on its own address.
    listens = [settings.listen for settings in (config.for_instance(n).batches for n in "ab") if settings is not None]
    assert listens == ["127.0.0.1:9101", "127.0.0.1:9102"]


def test_without_batches_nothing_is_added() -> None:
    doc = bootstrap(free_port_config())
    assert [listener["name"] for listener in doc["static_resources"]["listeners"]] == ["ingress"]
    assert "extproc_batch_api" not in [c["name"] for c in doc["static_resources"]["clusters"]]


def test_a_cluster_with_its_files_in_s3_needs_no_directory() -> None:
    config = free_port_config(batches=batches(directory=None, files={"s3": {"bucket": "b", "prefix": "p/"}}),
                              cluster={"redis_url": "redis://127.0.0.1:6379/0"})
    assert config.batches is not None and config.batches.directory is None
    assert config.batches.files.s3 is not None and config.batches.files.s3.bucket == "b"


@pytest.mark.parametrize(("settings", "top", "error"), [
    ({"completion_windows": ["24 hours"]}, {}, "batches.completion_windows[0]: must be a window such as 24h"),
    ({"in_flight_per_batch": 500}, {}, "batches.in_flight_per_batch: must be <= max_in_flight (256)"),
    ({"listen": "127.0.0.1:9000", "runner_listen": "127.0.0.1:9000"}, {}, "batches.runner_listen: must differ"),
    ({"chunk_tokens": -1}, {}, "batches.chunk_tokens: must be"),
    ({"chunk_tokens": 8}, {}, "batches.chunk_tokens: must be 0 (every line sent whole) or at least 16"),
    ({}, {"shards": {"s": {"grpc": "127.0.0.1:9001", "metrics": "127.0.0.1:9002", "models": ["m-one", "m/two"]}}},
     "batches: cannot be used with shards:"),
    ({}, {"cluster": {"redis_url": "redis://127.0.0.1:6379/0",
                      "instances": {"a": {"grpc": "127.0.0.1:9001", "metrics": "127.0.0.1:9002"}}}},
     "cluster.instances.a.batches: is required with batches:"),
    ({"size": 1}, {}, "batches.size: unknown key"),
    ({"directory": None}, {}, "batches.directory: is required: the files' contents"),
    ({"directory": None, "files": {"s3": {"bucket": "b"}}}, {}, "batches.directory: is required: one instance's"),
    ({"files": {"s3": {"bucket": "b", "access_key_id": "k"}}}, {},
     "batches.files.s3.secret_access_key_file: is required with the other"),
    ({"files": {"s3": {"bucket": "b", "endpoint_url": "minio:9000"}}}, {}, "batches.files.s3.endpoint_url: must be"),
    ({"files": {"s3": {"prefix": "p/"}}}, {}, "batches.files.s3.bucket: is required"),
])
def test_the_section_is_checked(settings: dict[str, Any], top: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError) as refused:
        free_port_config(batches=batches(**settings), **top)
    assert any(e.startswith(error) for e in refused.value.errors), refused.value.errors


def test_a_reload_that_changes_batches_needs_a_restart_and_one_that_changes_tenants_does_not() -> None:
    old = free_port_config(batches=batches())
    assert old.batches is not None
    with pytest.raises(ConfigError) as refused:
        plan(old, replace(old, batches=msgspec.structs.replace(old.batches, in_flight_per_batch=8)))
    assert refused.value.errors == ("batches.in_flight_per_batch: changing it needs a restart "
                                    "(the running config is kept)",)
    assert plan(old, replace(old, tenants={})) is not None  # the runner reads entitlements from the config now
