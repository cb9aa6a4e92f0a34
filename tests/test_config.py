"""The config file's validation: every mistake at once, each with its key path (the policy settings: test_config_policies.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.adapters.config import ConfigError, load_config, parse_config

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
        "models[1].name: duplicate model name 'm'",
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
    ],
)
def test_one_mistake(raw: object, message: str) -> None:
    assert any(message in error for error in errors(raw)), errors(raw)


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
