"""Per-model sharding: each model scheduled by its own processor instance, chosen per route in Envoy.

The unit tests check the config rules and the generated Envoy config; the
integration test runs two real ``extproc serve --shard`` instances behind
real Envoy and counts who released what (never how fast).
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc.adapters.config import ConfigError, parse_config
from extproc.adapters.envoy import bootstrap, drop_in
from extproc.adapters.envoy.clusters import shard_cluster_name
from extproc.cli import main
from extproc.tools.envoy_proc import start_envoy
from extproc.tools.power_user import chat
from extproc.tools.procs import ManagedProcess, free_port
from extproc.tools.stack import PYTHON, start_sim
from tests.envoyutil import bootstrap_message
from tests.stackutil import TENANT_KEYS, metric, read_metrics, write_stack_config

EXT_PROC = "envoy.filters.http.ext_proc"


def sharded(**overrides: Any) -> dict[str, Any]:
    """Two models, each owned by its own shard."""
    raw: dict[str, Any] = {
        "models": [
            {"name": "m1", "endpoints": ["http://127.0.0.1:8001"]},
            {"name": "m2", "endpoints": ["http://127.0.0.1:8002"]},
        ],
        "shards": {
            "a": {"grpc": "127.0.0.1:50061", "metrics": "127.0.0.1:9465", "models": ["m1"]},
            "b": {"grpc": "0.0.0.0:50062", "metrics": "127.0.0.1:9466", "models": ["m2"]},
        },
    }
    raw.update(overrides)
    return raw


def problems(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw)
    return list(caught.value.errors)


@pytest.mark.unit
def test_each_shard_serves_only_its_models_on_its_addresses() -> None:
    config = parse_config(sharded())
    a, b = config.for_shard("a"), config.for_shard("b")
    assert ([m.name for m in a.models], a.listen.grpc, a.listen.metrics) == (["m1"], "127.0.0.1:50061", "127.0.0.1:9465")
    assert [m.name for m in b.models] == ["m2"]
    assert config.shard_of("m2") == "b"


@pytest.mark.unit
def test_an_instance_must_name_an_existing_shard_and_only_with_shards() -> None:
    config = parse_config(sharded())
    with pytest.raises(ConfigError, match=r"run each instance with --shard NAME \(one of: a, b\)"):
        config.for_shard(None)
    with pytest.raises(ConfigError, match="--shard c: no such shard"):
        config.for_shard("c")
    plain = parse_config({"models": sharded()["models"]})
    assert plain.for_shard(None) is plain
    with pytest.raises(ConfigError, match="no shards: section"):
        plain.for_shard("a")


@pytest.mark.unit
def test_shard_mistakes_name_their_key_paths() -> None:
    shards = {
        "a": {"grpc": "127.0.0.1:50061", "metrics": "127.0.0.1:9465", "models": ["m1", "m3"]},
        "b c": {"grpc": "127.0.0.1:50061", "metrics": "127.0.0.1:9466", "models": ["m1"]},
    }
    errors = problems(sharded(models=[*sharded()["models"], {"name": "m4", "endpoints": ["http://h:1"]}], shards=shards))
    assert "shards.a.models[1]: no model 'm3' in models" in errors
    assert any(e.startswith("shards.b c: a shard name may only use") for e in errors)
    assert "shards.b c.grpc: 127.0.0.1:50061 is already used by shards.a.grpc" in errors
    assert "shards.b c.models[0]: model 'm1' is already owned by shard 'a'" in errors
    assert "models[1].name: 'm2' is in no shard (with shards, every model needs one)" in errors
    assert any(e.startswith("shards.a.grpc:") for e in problems(sharded(shards={"a": {"grpc": "x", "metrics": "h:1",
                                                                                         "models": ["m1", "m2"]}})))


def _routes(doc: dict[str, Any]) -> list[dict[str, Any]]:
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes: list[dict[str, Any]] = hcm["route_config"]["virtual_hosts"][0]["routes"]
    return routes


def _override(route: dict[str, Any]) -> str | None:
    per_route = route.get("typed_per_filter_config", {}).get(EXT_PROC)
    return None if per_route is None else str(per_route["overrides"]["grpc_service"]["envoy_grpc"]["cluster_name"])


@pytest.mark.unit
@pytest.mark.parametrize("failure", ["closed", "open"])
def test_each_models_routes_send_ext_proc_to_its_shard(failure: str) -> None:
    doc = bootstrap(parse_config(sharded(envoy={"processor_failure": failure})))
    bootstrap_message(doc)  # every field exists in Envoy's API
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}

    def hosts(name: str) -> list[tuple[str, int]]:
        endpoints = clusters[name]["load_assignment"]["endpoints"][0]["lb_endpoints"]
        return [(e["endpoint"]["address"]["socket_address"]["address"],
                 e["endpoint"]["address"]["socket_address"]["port_value"]) for e in endpoints]

    # Each shard its own cluster (a wildcard bind is reached on loopback); the
    # filter's default lists both, for requests that name no configured model.
    assert hosts(shard_cluster_name("a")) == [("127.0.0.1", 50061)]
    assert hosts(shard_cluster_name("b")) == [("127.0.0.1", 50062)]
    assert hosts("extproc") == [("127.0.0.1", 50061), ("127.0.0.1", 50062)]
    routes = _routes(doc)
    by_name = {r["name"]: r for r in routes}
    # Released requests (model header) and the first match (body's model) both name the owner.
    assert _override(by_name["model_m1"]) == "extproc_a"
    assert _override(by_name["model_m2"]) == "extproc_b"
    intake = "_unscheduled" if failure == "open" else "_processor_unavailable"
    assert _override(by_name["model_m1" + intake]) == "extproc_a"
    assert _override(by_name["model_m2" + intake]) == "extproc_b"
    if failure == "closed":
        assert by_name["model_m1" + intake]["direct_response"]["status"] == 503
    # The catch-all keeps the default processor cluster and comes last.
    assert _override(routes[-1]) is None and routes[-1]["match"] == {"prefix": "/"}


@pytest.mark.unit
def test_without_shards_no_route_overrides_the_processor() -> None:
    doc = bootstrap(parse_config({"models": sharded()["models"]}))
    assert all(_override(r) is None for r in _routes(doc))
    assert [c["name"] for c in doc["static_resources"]["clusters"]][:1] == ["extproc"]
    assert not any(c["name"].startswith("extproc_") for c in doc["static_resources"]["clusters"])


@pytest.mark.unit
def test_the_drop_in_refuses_shards_clearly() -> None:
    with pytest.raises(ConfigError, match="drop-in does not support per-model sharding"):
        drop_in(parse_config(sharded()))


@pytest.mark.unit
def test_serve_without_shard_on_a_sharded_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(sharded()))
    assert main(["serve", "--config", str(path)]) == 2
    assert "run each instance with --shard NAME" in capsys.readouterr().err


async def _chats(http: aiohttp.ClientSession, url: str, model: str, n: int) -> Counter[int]:
    outcomes = await asyncio.gather(*(
        chat(http, url, "alice", model, api_key=TENANT_KEYS["alice"], max_tokens=5) for _ in range(n)
    ))
    return Counter(o.status for o in outcomes)


async def _released(url: str, model: str) -> float:
    return metric(await read_metrics(url), "extproc_released_total", model=model)


@pytest.mark.integration
async def test_two_instances_each_own_a_model_and_survive_each_other(tmp_path: Path) -> None:
    shards = {
        name: {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}", "models": [model]}
        for name, model in (("a", "m1"), ("b", "m2"))
    }
    path = write_stack_config(tmp_path, {"m1": {}, "m2": {}}, shards=shards)
    config = parse_config(yaml.safe_load(path.read_text()))
    procs: list[ManagedProcess] = []
    envoy = None
    try:
        for model in config.models:
            procs.append(await start_sim(model, model.endpoints[0], tmp_path))
        instances = {}
        for name, shard in config.shards.items():
            instances[name] = await ManagedProcess.start(
                f"extproc serve --shard {name}", [*PYTHON, "serve", "--config", str(path), "--shard", name],
                tmp_path / f"extproc-{name}.log", ready_url=f"http://{shard.metrics}/metrics",
            )
            procs.append(instances[name])
        envoy = await start_envoy(bootstrap(config), tmp_path)
        url = f"http://{config.envoy.listen}"
        a_metrics, b_metrics = (f"http://{config.shards[n].metrics}/metrics" for n in ("a", "b"))
        async with aiohttp.ClientSession() as http:
            assert await _chats(http, url, "m1", 6) == {200: 6}
            assert await _chats(http, url, "m2", 4) == {200: 4}
            # Each model's requests went through its owner only.
            assert (await _released(a_metrics, "m1"), await _released(a_metrics, "m2")) == (6, 0)
            assert (await _released(b_metrics, "m2"), await _released(b_metrics, "m1")) == (4, 0)
            # A model nobody owns still gets an answer (the default cluster: any instance).
            assert await _chats(http, url, "nope", 2) == {404: 2}
            instances["a"].process.send_signal(signal.SIGKILL)
            await instances["a"].process.wait()
            # m2 is untouched by A's death; m1 is refused (processor_failure: closed), never hangs.
            assert await asyncio.wait_for(_chats(http, url, "m2", 6), 60) == {200: 6}
            assert await _released(b_metrics, "m2") == 10
            assert await asyncio.wait_for(_chats(http, url, "m1", 2), 60) == {503: 2}
            # A restarted A rejoins by itself once Envoy's health check sees it.
            shard = config.shards["a"]
            instances["a"] = await ManagedProcess.start(
                "extproc serve --shard a", [*PYTHON, "serve", "--config", str(path), "--shard", "a"],
                tmp_path / "extproc-a-2.log", ready_url=f"http://{shard.metrics}/metrics",
            )
            procs.append(instances["a"])
            for _ in range(100):
                if await _chats(http, url, "m1", 1) == {200: 1}:
                    break
                await asyncio.sleep(0.1)
            assert await _chats(http, url, "m1", 3) == {200: 3}
            assert await _released(a_metrics, "m1") >= 3
    finally:
        if envoy is not None:
            await envoy.stop()
        for proc in reversed(procs):
            await proc.stop()
