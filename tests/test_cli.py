"""What an operator sees when something is wrong: one line per mistake, no traceback, a telling exit code.

``check-config`` and the busy-port checks run the real command in a child
process (``python -m extproc``, the demo's ``python -m extproc.tools``), as an operator would: integration
tests, each a second of a process importing the package. The decision lines go through a real dispatcher and the
JSON formatter, in-process: unit tests.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from extproc.adapters.config import parse_config
from extproc.adapters.logs import JsonFormatter, setup_logging
from extproc.adapters.runtime import build_runtimes
from extproc.adapters.telemetry import Telemetry
from extproc.adapters.telemetry.model import DECISIONS
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.values.outcomes import Refused
from extproc.tools.cli import build_parser as build_dev_parser
from extproc.tools.demo import DEMO_CONFIG, PORT_OFFSETS, with_port_base
from extproc.tools.procs import free_port

BROKEN = """\
listen:
  grpc: "127.0.0.1:50051"
  metrics: nope
models:
  - name: m
    endpoints: ["http://127.0.0.1:1"]
    target_waiting: 0
  - endpoints: []
    taget_waiting: 3
"""


def extproc(*args: str, module: str = "extproc") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.integration
def test_check_config_reports_every_mistake_with_file_line_and_key(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN)
    result = extproc("check-config", str(path))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: {path}:3: listen.metrics: must be HOST:PORT, got 'nope'",
        f"error: {path}:7: models[0].target_waiting: must be an integer >= 1, got 0",
        # A missing key points at the mapping that lacks it.
        f"error: {path}:8: models[1].name: is required",
        f"error: {path}:8: models[1].endpoints: must be a non-empty list, got []",
        f"error: {path}:9: models[1].taget_waiting: unknown key (allowed: " + result.stderr.split("(allowed: ")[1].split("\n")[0],
    ]


@pytest.mark.integration
def test_check_config_names_the_yaml_error_by_line_and_passes_a_good_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("models:\n  - name: m\n    endpoints: [\n")
    broken = extproc("check-config", str(DEMO_CONFIG), str(path))
    assert broken.returncode == 2
    [line] = broken.stderr.splitlines()
    assert line.startswith(f"error: {path}:4:1: not valid YAML: ") and "<unicode string>" not in line
    assert broken.stdout == f"{DEMO_CONFIG}: ok (2 model(s): demo-llama, demo-qwen)\n"
    assert extproc("check-config", str(DEMO_CONFIG)).returncode == 0


@pytest.mark.integration
def test_check_config_reports_what_only_envoy_needs(tmp_path: Path) -> None:
    path = tmp_path / "mixed.yaml"
    path.write_text("models: [{name: m, endpoints: ['http://a:1', 'https://b:2']}]\n")
    result = extproc("check-config", str(path))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"error: {path}: models[0].endpoints: mixes http and https; use one scheme per model"]


@pytest.fixture
def listening() -> Iterator[str]:
    """An address some other process listens on."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))  # below the ephemeral range, as the demo's ports would be
        held.listen()
        yield f"127.0.0.1:{held.getsockname()[1]}"


@pytest.mark.integration
@pytest.mark.parametrize("key", ["grpc", "metrics"])
def test_a_busy_port_is_one_line_naming_it_and_its_key(tmp_path: Path, listening: str, key: str) -> None:
    listen = {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}", key: listening}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"listen": listen, "models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"]}]}))
    result = extproc("serve", "--config", str(path))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"error: listen.{key}: {listening} is in use (set listen.{key} to a free address)"]


@pytest.mark.integration
def test_the_demo_names_its_busy_port_and_the_option_that_moves_them(listening: str) -> None:
    port = int(listening.rpartition(":")[2])
    # The port Envoy would listen on is checked first: other busy ports in the block cannot come before it.
    result = extproc("demo", "--once", "--port-base", str(port - PORT_OFFSETS["envoy.listen"]), module="extproc.tools")
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"error: port {port} (envoy.listen) is in use: stop what holds it, or move every demo port with --port-base N"
    ]


@pytest.mark.unit
def test_port_base_moves_every_port_of_the_demo() -> None:
    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    config = parse_config(with_port_base(raw, 20000))
    assert (config.envoy.listen, config.envoy.admin, config.listen.grpc, config.listen.metrics) == (
        "127.0.0.1:20000", "127.0.0.1:20001", "127.0.0.1:20002", "127.0.0.1:20003"
    )
    assert [m.endpoints for m in config.models] == [("http://127.0.0.1:20010",), ("http://127.0.0.1:20011",)]
    assert config.envoy.api_keys == parse_config(raw).envoy.api_keys
    with pytest.raises(SystemExit):
        build_dev_parser().parse_args(["demo", "--port-base", "80"])
    args = build_dev_parser().parse_args(["demo", "--port-base", "20000", "--keep", "--log-format", "json"])
    assert (args.port_base, args.keep, args.log_format, args.log_level) == (20000, True, "json", "info")


class Captured(logging.Handler):
    """The decision records, and each as the JSON line ``--log-format json`` writes."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[dict[str, object]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture
def decisions() -> Iterator[Captured]:
    handler = Captured()
    DECISIONS.addHandler(handler)
    try:
        yield handler
    finally:
        DECISIONS.removeHandler(handler)
        setup_logging()


def dispatcher_for_one_slot() -> ModelDispatcher:
    """One engine slot; bob may queue one request."""
    config = parse_config({
        "models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"], "gate": "static_concurrency", "max_in_flight": 1}],
        "tenants": {"bob": {"max_queued": 1}},
    })
    return build_runtimes(config, Telemetry())["m"].dispatcher


@pytest.mark.unit
async def test_debug_writes_one_json_decision_line_per_request(decisions: Captured) -> None:
    setup_logging("debug", "json")
    dispatcher = dispatcher_for_one_slot()
    first = dispatcher.submit("alice", 1)
    queued = dispatcher.submit("bob", 0)
    with pytest.raises(Refused):
        dispatcher.submit("bob", 0)  # bob's cap is one queued request
    dispatcher.end(queued)  # its client left
    dispatcher.end(first)
    assert [(d["tenant"], d["class"], d["model"], d["outcome"]) for d in decisions.lines] == [
        ("alice", "standard", "m", "released"),
        ("bob", "interactive", "m", "refused:tenant_queue_full"),
        ("bob", "interactive", "m", "abandoned"),
    ]
    assert all(d["logger"] == "extproc.decisions" and d["level"] == "debug" and "ts" in d for d in decisions.lines)
    assert all(isinstance(d["wait_ms"], float) and d["wait_ms"] >= 0 for d in decisions.lines)
    assert re.fullmatch(r"released m tenant=alice class=standard wait_ms=[0-9.]+ slack_ms=[0-9.]+",
                        str(decisions.lines[0]["msg"]))


@pytest.mark.unit
async def test_at_info_no_decision_line_is_made(decisions: Captured) -> None:
    setup_logging("info", "json")
    dispatcher = dispatcher_for_one_slot()
    dispatcher.submit("alice", 1)
    assert decisions.lines == []


@pytest.mark.unit
def test_debug_is_for_extprocs_loggers_only() -> None:
    try:
        setup_logging("debug", "text")
        assert logging.getLogger("extproc.decisions").isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("grpc._cython.cygrpc").isEnabledFor(logging.DEBUG)
    finally:
        setup_logging()


@pytest.mark.unit
def test_json_lines_carry_extra_fields_and_exceptions() -> None:
    record = logging.LogRecord("extproc.x", logging.ERROR, __file__, 1, "failed %s", ("once",), None)
    record.endpoint = "http://a:1"
    try:
        raise ValueError("boom")
    except ValueError:
        record.exc_info = sys.exc_info()
    line = json.loads(JsonFormatter().format(record))
    assert (line["level"], line["logger"], line["msg"], line["endpoint"]) == ("error", "extproc.x", "failed once", "http://a:1")
    assert "ValueError: boom" in str(line["exc"])
    assert str(line["ts"]).endswith("+00:00")
