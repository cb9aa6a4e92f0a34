"""The compose demo: its shape without a Docker engine, and the whole of it run for real.

Without an engine, what can be checked is: every command parses with the real
CLI, every mounted file exists and is valid, Envoy accepts its bootstrap, the
service names, ports and models agree with the processor's config, and every
service has a healthcheck. With one (`test_compose_up_serves_through_envoy`),
`./dev compose` builds the image (offline where Docker Hub cannot be reached),
brings the services up on free ports, and requests go through Envoy on
127.0.0.1 as a user's would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from extproc.adapters.config import load_config
from extproc.adapters.envoy import bootstrap, render
from extproc.cli import build_parser
from extproc.tools.cli import build_parser as build_dev_parser
from extproc.tools.envoy_bin import find_envoy
from extproc.tools.power_user import PowerUser, run_power_user
from extproc.tools.procs import free_port
from tests.lazy import openai
from tests.paths import ROOT
from tests.stackutil import TENANT_KEYS, metric, read_metrics

COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
# What `up` starts; the `monitoring` profile (official Prometheus and Grafana images) is opt-in.
SERVICES = {name: service for name, service in COMPOSE["services"].items() if not service.get("profiles")}
DEFAULTS = re.compile(r"\$\{(\w+):-([^}]*)\}")
# The image's commands by name: the gateway's (the Dockerfile's ENTRYPOINT) and the development one.
PARSERS = {"extproc": build_parser, "extproc-dev": build_dev_parser}


def interpolated(text: str, env: dict[str, str] | None = None) -> str:
    """``${NAME:-default}`` as Compose resolves it (the only form compose.yaml uses)."""
    return DEFAULTS.sub(lambda m: (env or {}).get(m[1]) or m[2], text)


def mounts(service: str) -> dict[str, Path]:
    """Container path -> repository file, for the service's bind mounts."""
    result = {}
    for volume in SERVICES[service].get("volumes", []):
        source, target, *_ = volume.split(":")
        result[target] = ROOT / source
    return result


def parsed(service: str) -> argparse.Namespace:
    """The service's command, parsed by the CLI its entrypoint runs (exits, SystemExit, on a bad one)."""
    [entrypoint] = SERVICES[service].get("entrypoint", re.findall(r'^ENTRYPOINT \["(\S+)"\]$', DOCKERFILE, re.MULTILINE))
    return PARSERS[entrypoint]().parse_args(SERVICES[service]["command"])


def mounted(service: str, container_path: str) -> Path:
    path = mounts(service)[container_path]
    assert path.is_file(), path
    return path


@pytest.mark.unit
def test_every_service_runs_the_project_image_with_a_valid_command() -> None:
    for name, service in SERVICES.items():
        assert service["build"]["context"] == "." and service["image"] == "extproc:local", name
        if name != "envoy":
            parsed(name)


@pytest.mark.unit
def test_every_service_is_health_checked_and_starts_after_what_it_needs() -> None:
    for name, service in COMPOSE["services"].items():
        assert service["healthcheck"]["test"][0] == "CMD", name
    # Envoy answers clients only once the processor does: before that, with `processor_failure:
    # closed` (the default), a request would get a 503 instead of a place in the queue.
    assert SERVICES["envoy"]["depends_on"] == {"extproc": {"condition": "service_healthy"}}
    assert SERVICES["extproc"]["depends_on"] == {s: {"condition": "service_healthy"} for s in ("llama", "qwen")}
    [user] = re.findall(r"^USER (\S+)$", DOCKERFILE, re.MULTILINE)
    assert user not in ("root", "0")


@pytest.mark.integration  # runs Envoy's validation
def test_the_processor_config_and_the_envoy_bootstrap_belong_together() -> None:
    config_path = mounted("extproc", SERVICES["extproc"]["command"][2])
    config = load_config(config_path)
    bootstrap_path = mounted("envoy", SERVICES["envoy"]["command"][1])
    assert bootstrap_path.read_text() == render(bootstrap(config)), "regenerate envoy/compose-bootstrap.yaml"
    result = subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(bootstrap_path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The ports Envoy and the processor listen on are the ones published (on 127.0.0.1 only).
    for service, host_port, listen in (("envoy", 10000, config.envoy.listen), ("extproc", 9464, config.listen.metrics)):
        assert [interpolated(p) for p in SERVICES[service]["ports"]] == [f"127.0.0.1:{host_port}:{listen.rpartition(':')[2]}"]
    assert config.listen.grpc.startswith("extproc:")
    # The admin interface, which Envoy's healthcheck asks, is inside the container only.
    assert config.envoy.admin.startswith("127.0.0.1:") and config.envoy.admin.rpartition(":")[2] in str(
        SERVICES["envoy"]["healthcheck"]["test"]
    )


@pytest.mark.unit
@pytest.mark.parametrize("model_index", [0, 1])
def test_each_model_endpoint_is_a_simulator_service_serving_that_model(model_index: int) -> None:
    config = load_config(mounted("extproc", "/etc/extproc/config.yaml"))
    model = config.models[model_index]
    [endpoint] = model.endpoints
    url = urlsplit(endpoint)
    assert url.hostname is not None
    args = parsed(url.hostname)
    assert (args.command, args.model, args.port, args.host) == ("sim", model.name, url.port, "0.0.0.0")


def no_docker_reason() -> str | None:
    """Why the live test cannot run here, or None when a Docker engine and Compose answer."""
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no Docker engine: `docker info` failed ({exc})"
    if info.returncode != 0:
        return f"no Docker engine: `docker info` says {info.stderr.strip().splitlines()[-1:]}"
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    if v2.returncode != 0 and not shutil.which("docker-compose"):
        return "no Docker Compose: neither `docker compose` nor `docker-compose` runs"
    return None


@dataclass(frozen=True)
class Compose:
    project: str
    env: dict[str, str]
    envoy_url: str
    metrics_url: str

    def run(self, *args: str, timeout: float = 120) -> str:
        result = subprocess.run(
            [str(ROOT / "dev"), "compose", "-p", self.project, *args],
            cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout,
        )
        assert result.returncode == 0, f"./dev compose {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    def health(self) -> dict[str, str]:
        """Service -> its container's health status (starting, healthy, unhealthy)."""
        status = {}
        for service in SERVICES:
            [container] = self.run("ps", "-q", service).split()
            state = subprocess.run(
                ["docker", "inspect", "--format", "{{json .State.Health.Status}}", container],
                capture_output=True, text=True, timeout=30, check=True,
            )
            status[service] = json.loads(state.stdout)
        return status


@pytest.fixture(scope="module")
def compose() -> Iterator[Compose]:
    """The compose project on free host ports, under a name of its own; always taken down.

    Skips, saying why, where no Docker engine runs, unless EXTPROC_COMPOSE=require (CI, which
    starts one), where that is a failure.
    """
    reason = no_docker_reason()
    if reason:
        if os.environ.get("EXTPROC_COMPOSE") == "require":
            pytest.fail(f"EXTPROC_COMPOSE=require: {reason}")
        pytest.skip(reason)
    envoy_port, metrics_port = free_port(), free_port()
    env = {**os.environ, "EXTPROC_ENVOY_PORT": str(envoy_port), "EXTPROC_METRICS_PORT": str(metrics_port)}
    stack = Compose(
        f"extproc-test-{os.getpid()}", env, f"http://127.0.0.1:{envoy_port}", f"http://127.0.0.1:{metrics_port}/metrics"
    )
    try:
        # Cold (no cached base image or wheels) this includes debootstrap: minutes, not seconds.
        stack.run("up", "-d", "--build", timeout=1500)
        deadline = time.monotonic() + 120
        while (health := stack.health()) != dict.fromkeys(SERVICES, "healthy"):
            assert "unhealthy" not in health.values() and time.monotonic() < deadline, health
            time.sleep(1)
        yield stack
    finally:
        subprocess.run(
            [str(ROOT / "dev"), "compose", "-p", stack.project, "down", "-v", "--remove-orphans", "-t", "45"],
            cwd=ROOT, env=env, capture_output=True, timeout=300,
        )


@pytest.mark.integration
@pytest.mark.slow
async def test_compose_up_serves_through_envoy(compose: Compose) -> None:
    before = await read_metrics(compose.metrics_url)
    # The OpenAI SDK, as the README calls it.
    async with openai.AsyncOpenAI(base_url=f"{compose.envoy_url}/v1", api_key="key-dave") as client:
        reply = await client.chat.completions.create(
            model="demo-qwen", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8
        )
    assert reply.choices[0].message.content and reply.usage and reply.usage.completion_tokens == 8
    async with openai.AsyncOpenAI(base_url=f"{compose.envoy_url}/v1", api_key="key-nobody") as stranger:
        with pytest.raises(openai.AuthenticationError):
            await stranger.models.list()

    # The power-user scenario: alice floods demo-llama (8 sequences at a time); bob and carol come
    # half a second later and are served long before the flood is.
    scenario = PowerUser(model="demo-llama", flood=48, max_tokens=32)
    outcomes = await run_power_user(compose.envoy_url, scenario, api_keys=TENANT_KEYS)
    assert all(o.status == 200 and o.tokens == 32 for o in outcomes), [o for o in outcomes if o.status != 200][:3]
    flood_end = max(o.total_s for o in outcomes if o.tenant == "alice")
    for newcomer in scenario.newcomers:
        [mine] = [o for o in outcomes if o.tenant == newcomer]
        assert mine.total_s < 0.6 * flood_end, (newcomer, mine.total_s, flood_end)

    samples = await read_metrics(compose.metrics_url)
    for model, requests in (("demo-qwen", 1), ("demo-llama", 48 + 2)):
        released = metric(samples, "extproc_released_total", model=model) - metric(before, "extproc_released_total", model=model)
        assert released == requests, model
    assert metric(samples, "extproc_queue_depth") == 0
    # Readiness as the healthcheck asks it, from inside the processor's container.
    healthcheck = SERVICES["extproc"]["healthcheck"]["test"][1:]
    status = await asyncio.to_thread(compose.run, "exec", "-T", "extproc", *healthcheck)
    assert json.loads(status) == {"status": "ready"}


@pytest.mark.integration
@pytest.mark.slow
async def test_compose_runs_a_batch_through_envoy(compose: Compose) -> None:
    """The batch API on the demo: the SDK's workflow, each line through Envoy's runner listener and the queue."""
    lines = b"".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "demo-qwen", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4},
    }).encode() + b"\n" for i in range(5))
    async with openai.AsyncOpenAI(base_url=f"{compose.envoy_url}/v1", api_key="key-bob") as client:
        upload = await client.files.create(file=("requests.jsonl", lines), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        deadline = time.monotonic() + 60
        while (batch := await client.batches.retrieve(batch.id)).status != "completed":
            assert batch.status in ("validating", "in_progress", "finalizing") and time.monotonic() < deadline, batch
            await asyncio.sleep(0.5)
        assert batch.output_file_id is not None
        out = (await client.files.content(batch.output_file_id)).text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in out) == [f"r{i}" for i in range(5)]
    samples = await read_metrics(compose.metrics_url)
    assert metric(samples, "extproc_batch_lines_total", tenant="bob", outcome="completed") == 5
