"""`extproc check-config --explain`: every key of the effective configuration, with where its value came from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from extproc.adapters.config import parse_config
from extproc.adapters.config.explain import DERIVED, FROM_ENGINE, SECTIONS_DERIVED, SOURCES, Line, explain
from extproc.adapters.config.keys import keys
from extproc.cli import main

pytestmark = pytest.mark.unit

MODEL = {"name": "m", "endpoints": ["http://127.0.0.1:1"]}


def lines(raw: dict[str, Any]) -> dict[str, Line]:
    return {line.key: line for line in explain(raw, parse_config(raw))}


def test_a_minimal_file_lists_every_leaf_of_the_schema_once() -> None:
    got = [line.key for line in explain({"models": [MODEL]}, parse_config({"models": [MODEL]}))]
    assert len(got) == len(set(got))
    patterns = {line.replace("models[0]", "models[]") for line in got}
    # Every leaf outside an absent optional section or a mapping of entries; those show as one key (null, {}).
    absent = ("listen.tls.", "models[].prefix.", "envoy.jwt.", "cluster.", "shards.", "bands.", "tenants.", "budgets.",
              "batches.")
    expected = {k.path for k in keys() if not k.section and not k.path.startswith(absent)}
    assert expected <= patterns
    assert {"listen.tls", "models[].prefix", "envoy.jwt", "cluster", "shards", "budgets"} <= patterns
    assert {f"bands.{c}.min_share" for c in ("interactive", "standard", "batch")} <= patterns
    assert {"tenants.default.weight", "tenants.default.priorities"} <= patterns


def test_each_source_is_named_and_derived_values_say_from_what() -> None:
    raw = {
        "models": [{**MODEL, "policy": "locality", "target_waiting": 5}, {**MODEL, "name": "n", "max_context_tokens": 4096}],
        "listen": {"transport": "grpcio"},
        "priorities": ["gold", "bronze"],
        "tenants": {"default": {"weight": 2}, "alice": {"max_queued": 5}},
        "envoy": {"api_keys": {"sk-secret": "alice"}},
        "advanced": {"grpc": {"max_connections": 10}},
    }
    got = lines(raw)
    assert {line.source for line in got.values()} == set(SOURCES)
    assert got["models[0].target_waiting"] == Line("models[0].target_waiting", 5, "set")
    assert got["models[0].gate"] == Line("models[0].gate", "adaptive", "default")
    assert got["models[0].prefix.block_tokens"] == Line("models[0].prefix.block_tokens", 128, "derived",
                                                        "`policy: locality` (the defaults)")
    engine = got["models[0].max_context_tokens"]
    assert (engine.value, engine.source) == (None, "engine") and "max_model_len" in engine.note
    assert got["models[1].max_context_tokens"] == Line("models[1].max_context_tokens", 4096, "set")
    assert got["models[1].prefix"] == Line("models[1].prefix", None, "default")
    assert (got["envoy.admission_per_second"].value, got["envoy.admission_burst"].value) == (500, 1500)
    assert got["envoy.admission_per_second"].source == "derived"
    assert got["default_priority"] == Line("default_priority", "bronze", "derived",
                                           "`standard` if it is a class, else the lowest class")
    assert got["bands.gold.ttft_objective_s"].value == 5.0 and got["bands.bronze.idle_only"].value is True
    assert got["tenants.default.weight"] == Line("tenants.default.weight", 2.0, "set")
    assert got["tenants.alice.weight"] == Line("tenants.alice.weight", 2.0, "derived", "`tenants.default.weight`")
    assert got["tenants.alice.max_queued"] == Line("tenants.alice.max_queued", 5, "set")
    assert got["tenants.alice.priorities"].value == ["gold", "bronze"]
    assert got["advanced.grpc.max_connections"] == Line("advanced.grpc.max_connections", 10, "set")
    # Secrets are not printed.
    assert got["envoy.api_keys"].value == {"<key 1>": "alice"}
    clustered = lines({"models": [MODEL], "cluster": {"redis_url": "redis://u:hunter2@redis:6379/0", "lease_s": 4}})
    assert clustered["cluster.heartbeat_s"] == Line("cluster.heartbeat_s", 1.0, "derived", "`cluster.lease_s` / 4")
    assert clustered["cluster.redis_url"].value == "redis://u:<redacted>@redis:6379/0"


def test_every_derivation_names_a_key_of_the_schema() -> None:
    schema = {key.path for key in keys()}
    assert set(DERIVED) | set(FROM_ENGINE) | set(SECTIONS_DERIVED) <= schema


def test_the_cli_prints_one_line_per_key_and_json_on_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"models": [MODEL], "cluster": {"redis_url": "redis://r:6379"}}))
    assert main(["check-config", "--explain", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: ok (1 model(s): m)"
    assert '  models[0].name = "m"  (set)' in out
    assert "  cluster.heartbeat_s = 0.5  (derived: `cluster.lease_s` / 4)" in out
    assert '  listen.grpc = "127.0.0.1:50051"  (default)' in out
    assert main(["check-config", "--format", "json", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    entry = next(e for e in doc[str(path)] if e["key"] == "models[0].max_context_tokens")
    assert entry["source"] == "engine" and entry["value"] is None and entry["from"]
    assert [e["key"] for e in doc[str(path)]] == [line.split(" = ")[0].strip() for line in out[1:]]
    assert msgspec.json.decode(json.dumps(doc))  # plain JSON throughout
