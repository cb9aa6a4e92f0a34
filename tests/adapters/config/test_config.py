"""The config file's validation: every mistake at once, each with its key path (the policy settings: test_config_policies.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extproc.adapters.config import ConfigError, load_config, parse_config
from extproc.cli import main

pytestmark = pytest.mark.unit

MODEL = {"name": "m", "endpoints": ["http://127.0.0.1:1"]}


def errors(raw: object) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as error:
        parse_config(raw)
    return error.value.errors


def test_every_mistake_is_reported_with_its_key_path() -> None:
    found = errors({
        "models": [{**MODEL, "target_waiting": "three", "taget_waiting": 3, "gate": "fast"}, {"endpoints": []}],
        "listen": {"grpc": "nope", "metrics": "127.0.0.1:0"},
        "identity": {"tenant_header": "X-Tenant"},
    })
    assert found == (
        "models[0].taget_waiting: unknown key (allowed: " + found[0].split("(allowed: ")[1],
        "models[0].target_waiting: must be an integer >= 1, got 'three'",
        "models[0].gate: must be one of adaptive, waiting_target, static_concurrency, static_rate, got 'fast'",
        "models[1].name: is required",
        "models[1].endpoints: must be a non-empty list, got []",
        "listen.grpc: must be HOST:PORT, got 'nope'",
        "listen.metrics: must be HOST:PORT, got '127.0.0.1:0'",
        "identity.tenant_header: must be a lower-case header name without spaces, got 'X-Tenant'",
    )


def test_rules_between_fields_are_reported_together() -> None:
    found = errors({
        "models": [{**MODEL, "gate": "static_rate", "endpoint_picking": True}, MODEL],
        "priorities": ["a", "b", "a"],
        "default_priority": "b",
    })
    assert found == (
        "models[0].release_rate: is required with gate: static_rate",
        "models[0].endpoint_picking: does not work with gate: static_rate (no per-endpoint state)",
        "priorities: must not repeat a class, got ['a', 'b', 'a']",
        "models[1].name: duplicate model name 'm' (models[0] serves it)",
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([1], "the document: must be a mapping, got list"),
        (None, "models: is required"),
        ({"models": [{**MODEL, "endpoints": ["http://a:99999"]}]}, "models[0].endpoints[0]: must be an http(s)://HOST:PORT URL"),
        ({"models": [{**MODEL, "max_running": True}]}, "models[0].max_running: must be an integer >= 1, got True"),
        ({"models": [MODEL], "tenants": {"a": {"priorities": []}}}, "tenants.a.priorities: must be a non-empty list"),
        ({"models": [MODEL], "envoy": {"api_keys": {"k": " "}}}, "envoy.api_keys.k: must be a non-empty string"),
        ({"models": [MODEL], "listen": {"transport": "quic"}},
         "listen.transport: must be one of builtin, grpcio (h2: builtin's old name), got 'quic'"),
    ],
)
def test_one_mistake(raw: object, message: str) -> None:
    assert any(message in error for error in errors(raw)), errors(raw)


def test_a_key_that_moved_or_went_is_refused_with_what_to_write_instead(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("models: [{name: m, endpoints: ['http://a:1'], stale_after_s: 2}]\n"
                    "listen: {grpc: '127.0.0.1:1', max_connections: 10}\n"
                    "identity:\n  model_header: x-model\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert error.value.errors == (
        f"{path}:1: models[0].stale_after_s: moved to models[0].advanced.stale_after_s",
        f"{path}:2: listen.max_connections: moved to advanced.grpc.max_connections",
        f"{path}:4: identity.model_header: is no longer a setting: the processor sets x-model, the header the "
        "generated Envoy (and deploy/'s manifests) route on; remove the key",
    )
    assert parse_config({"models": [MODEL], "advanced": {"grpc": {"max_connections": 10}}}).advanced.grpc.max_connections == 10


def test_empty_sections_take_their_defaults_and_endpoints_lose_a_trailing_slash() -> None:
    config = parse_config({"models": [{**MODEL, "endpoints": ["http://127.0.0.1:1/"]}], "listen": None, "envoy": None})
    assert config.listen.grpc == "127.0.0.1:50051" and config.envoy.api_keys == {}
    assert config.models[0].endpoints == ("http://127.0.0.1:1",)
    assert config.models[0].cost.weights().output_weight == 2.0


def test_a_file_names_itself_and_the_line_on_every_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("models: [{name: m, endpoints: ['http://a:1'], target_waiting: 0, gate: x}]\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert [e.split(": ", 2)[:2] for e in error.value.errors] == [
        [f"{path}:1", "models[0].target_waiting"], [f"{path}:1", "models[0].gate"]
    ]
    path.write_text("models: [\n")
    with pytest.raises(ConfigError, match=f"^{path}:2:1: not valid YAML"):
        load_config(path)


CLUSTER = {"redis_url": "redis://127.0.0.1:6379/0"}
INSTANCES = {"a": {"grpc": "127.0.0.1:50061", "metrics": "127.0.0.1:9465"},
             "b": {"grpc": "0.0.0.0:50062", "metrics": "127.0.0.1:9466"}}


def test_without_a_cluster_section_nothing_changes_and_its_defaults_are_documented_values() -> None:
    assert parse_config({"models": [MODEL]}).cluster is None
    cluster = parse_config({"models": [MODEL], "cluster": CLUSTER}).cluster
    assert cluster is not None
    assert (cluster.redis_url, cluster.key_prefix, cluster.lease_s, cluster.heartbeat_interval_s, cluster.redis_timeout_ms,
            cluster.instances) == ("redis://127.0.0.1:6379/0", "extproc", 2.0, 0.5, 250, {})
    longer = parse_config({"models": [MODEL], "cluster": {**CLUSTER, "lease_s": 10}}).cluster
    assert longer is not None and longer.heartbeat_interval_s == 2.5  # unset: a quarter of the lease


@pytest.mark.parametrize("url", ["redis://localhost", "rediss://user:secret@redis.internal:6380/2",
                                 "unix:///run/redis/redis.sock", "redis://[::1]:6379/"])
def test_redis_urls_redis_py_reads_are_accepted(url: str) -> None:
    cluster = parse_config({"models": [MODEL], "cluster": {"redis_url": url}}).cluster
    assert cluster is not None and cluster.redis_url == url


def test_cluster_mistakes_name_their_key_paths() -> None:
    def cluster_errors(**settings: object) -> tuple[str, ...]:
        return errors({"models": [MODEL], "cluster": settings})

    must_be = "must be a redis://HOST[:PORT][/DB], rediss://... or unix:///PATH URL, got "
    for url in ("http://127.0.0.1:6379", "redis://", "redis://h:99999", "redis://h:0", "redis://h/zero", "unix://", "h:6379"):
        assert cluster_errors(redis_url=url) == (f"cluster.redis_url: {must_be}{url!r}",)
    assert cluster_errors() == ("cluster.redis_url: is required",)
    assert cluster_errors(**CLUSTER, lease_s=1.0, heartbeat_s=0.5) == (
        "cluster.heartbeat_s: must be below lease_s / 2 (0.5), got 0.5",)
    assert cluster_errors(**CLUSTER, redis_timeout_ms=0, key_prefix="", leases=3) == (
        "cluster.leases: unknown key (allowed: heartbeat_s, instances, key_prefix, lease_s, redis_timeout_ms, redis_url)",
        "cluster.key_prefix: must be a non-empty string, got ''",
        "cluster.redis_timeout_ms: must be an integer >= 1, got 0",
    )
    clash = {"a b": INSTANCES["a"], "c": {"grpc": "127.0.0.1:9465", "metrics": "127.0.0.1:9467"}}
    assert cluster_errors(**CLUSTER, instances=clash) == (
        "cluster.instances.a b: an instance name may only use A-Z, a-z, 0-9, _ and -",
        "cluster.instances.c.grpc: 127.0.0.1:9465 is already used by cluster.instances.a b.metrics",
    )
    assert cluster_errors(**CLUSTER, instances={"a": {"grpc": "127.0.0.1:1"}}) == ("cluster.instances.a.metrics: is required",)


def test_cluster_and_shards_exclude_each_other() -> None:
    shards = {"s": {"grpc": "127.0.0.1:50061", "metrics": "127.0.0.1:9465", "models": ["m"]}}
    assert errors({"models": [MODEL], "cluster": CLUSTER, "shards": shards}) == (
        "cluster: use either cluster: (active-active) or shards: (per-model sharding), not both (docs/cluster.md)",
    )


def test_an_instance_takes_its_listen_addresses_and_every_model() -> None:
    config = parse_config({"models": [MODEL], "cluster": {**CLUSTER, "instances": INSTANCES}})
    b = config.for_instance("b")
    assert (b.listen.grpc, b.listen.metrics, b.models, b.cluster) == ("0.0.0.0:50062", "127.0.0.1:9466",
                                                                      config.models, config.cluster)
    # Without --instance the file's own listen: N files identical except `listen` form a cluster too.
    assert config.for_instance(None) is config
    with pytest.raises(ConfigError, match=r"--instance c: no such instance in cluster.instances \(one of: a, b\)"):
        config.for_instance("c")
    for plain in ({"models": [MODEL]}, {"models": [MODEL], "cluster": CLUSTER}):
        with pytest.raises(ConfigError, match="--instance a: the config has no cluster.instances: section"):
            parse_config(plain).for_instance("a")


def test_serve_with_an_unknown_instance_exits_2_before_listening(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"models": [MODEL], "cluster": {**CLUSTER, "instances": INSTANCES}}))
    assert main(["serve", "--config", str(path), "--instance", "z"]) == 2
    assert "--instance z: no such instance in cluster.instances (one of: a, b)" in capsys.readouterr().err


def test_a_cluster_refuses_a_release_rate_it_cannot_share() -> None:
    raw = {"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"], "gate": "static_rate", "release_rate": 5}],
           "cluster": {"redis_url": "redis://127.0.0.1:6379/0"}}
    with pytest.raises(ConfigError, match=r"models\[0\]\.gate: static_rate cannot be shared by a cluster"):
        parse_config(raw)
