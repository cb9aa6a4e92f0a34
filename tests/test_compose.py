"""The compose demo, checked without a Docker engine (none runs on these machines).

What can be checked here is: every command parses with the real CLI, every
mounted file exists and is valid, Envoy accepts its bootstrap, and the
service names, ports and models agree with the processor's config.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from extproc.adapters.config import load_config
from extproc.adapters.envoy_config import bootstrap, render
from extproc.cli import build_parser
from extproc.tools.envoy_bin import find_envoy

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]


def mounts(service: str) -> dict[str, Path]:
    """Container path -> repository file, for the service's bind mounts."""
    result = {}
    for volume in SERVICES[service].get("volumes", []):
        source, target, *_ = volume.split(":")
        result[target] = ROOT / source
    return result


def mounted(service: str, container_path: str) -> Path:
    path = mounts(service)[container_path]
    assert path.is_file(), path
    return path


@pytest.mark.unit
def test_every_service_runs_the_project_image_with_a_valid_command() -> None:
    parser = build_parser()
    for name, service in SERVICES.items():
        assert service["build"] == "." and service["image"] == "extproc:local", name
        if name != "envoy":
            parser.parse_args(service["command"])  # exits (SystemExit) on a bad command


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
    # Envoy's published port is the one it listens on; the processor listens under its service name.
    assert SERVICES["envoy"]["ports"] == [f"127.0.0.1:{config.envoy.listen.rpartition(':')[2]}:10000"]
    assert config.listen.grpc.startswith("extproc:")


@pytest.mark.unit
@pytest.mark.parametrize("model_index", [0, 1])
def test_each_model_endpoint_is_a_simulator_service_serving_that_model(model_index: int) -> None:
    config = load_config(mounted("extproc", "/etc/extproc/config.yaml"))
    model = config.models[model_index]
    [endpoint] = model.endpoints
    url = urlsplit(endpoint)
    args = build_parser().parse_args(SERVICES[url.hostname]["command"])
    assert (args.command, args.model, args.port, args.host) == ("sim", model.name, url.port, "0.0.0.0")
