"""Arrows run one way: tools -> adapters -> core, and the package names say which is which.

* ``extproc/core`` (queues, policies, band and release rules, load estimate,
  cost, the dispatcher) takes plain values and reports through
  ``core/values/report.py``; it imports only the core. An import from the core into
  the adapters would bring I/O and their settings into code tested as pure.
* ``extproc/adapters`` (the ext_proc servicer, engine metrics and scraping,
  Envoy config generation, telemetry, config, wiring, the server) import the
  core and each other, never the tools: a served gateway must not depend on
  the simulator, the benchmark or the local stack.
* ``extproc/tools`` (simulator, benchmark, demo, local stack, and their
  command ``extproc-dev``, ``tools/cli.py``) may import anything.
* The entry point (``extproc/cli.py``, ``__main__.py``: the ``extproc`` command)
  is the only module outside the three packages. It imports as the adapters
  do, never the tools: ``extproc serve``, ``check-config`` and
  ``envoy-config`` run in a process that has not loaded one of them, which
  the commands themselves show when run in a child process.
* Imports do not loop, those under ``TYPE_CHECKING`` included: two modules
  that need each other's types are one concept, or a seam in the wrong place.
  Nor do packages (each folder one node, a subpackage apart from its parent):
  what both sides of such a loop read belongs in a package below them both.
  The config imports no other adapter but the protocols' facts (``adapters/protocol/``).
* The optional features (the Batch API, tenant budgets, the cluster link and
  the grpcio transport) are imported only where their section (or
  ``listen.transport``) is on: ``extproc serve`` with the README's config, run
  in a child process, has loaded none of them, nor redis or boto3.
"""

from __future__ import annotations

import ast
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from extproc.adapters.config import load_config
from tests.helpers.readme import ADDRESS, readme_blocks
from tests.paths import FIXTURES, ROOT

PACKAGE = ROOT / "extproc"
ENTRY = {"extproc", "extproc.__main__", "extproc.cli"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(name: str) -> str | None:
    """``core``, ``adapters`` or ``tools`` for a module of ours; None for the entry point."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ("core", "adapters", "tools") else None


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == "extproc" or name.startswith("extproc.")}


MODULES = sorted(PACKAGE.rglob("*.py"))


def in_layer(wanted: str) -> list[Path]:
    return [p for p in MODULES if layer(module_name(p)) == wanted]


@pytest.mark.unit
def test_every_module_is_in_one_layer() -> None:
    loose = [module_name(p) for p in MODULES if layer(module_name(p)) is None and module_name(p) not in ENTRY]
    assert not loose, f"modules outside core/, adapters/ and tools/: {loose}"


@pytest.mark.unit
@pytest.mark.parametrize("path", in_layer("core"), ids=module_name)
def test_the_core_imports_only_the_core(path: Path) -> None:
    outside = sorted(name for name in imports(path) if layer(name) != "core")
    assert not outside, f"{module_name(path)} imports {outside}"


@pytest.mark.unit
@pytest.mark.parametrize("path", in_layer("adapters"), ids=module_name)
def test_adapters_do_not_import_tools(path: Path) -> None:
    tools = sorted(name for name in imports(path) if layer(name) not in ("core", "adapters"))
    assert not tools, f"{module_name(path)} imports {tools}"


@pytest.mark.unit
@pytest.mark.parametrize("path", [p for p in MODULES if module_name(p) in ENTRY], ids=module_name)
def test_the_entry_point_does_not_import_tools(path: Path) -> None:
    tools = sorted(name for name in imports(path) if layer(name) == "tools")
    assert not tools, f"{module_name(path)} imports {tools}"


@pytest.mark.unit
def test_every_module_is_in_the_architecture_map() -> None:
    """docs/architecture.md's package map names every module, so a newcomer finds each one there."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = doc.split("```")[1]  # the map is the first code block
    package = ROOT / "extproc"
    modules = [f for f in package.rglob("*") if f.suffix in (".py", ".lua", ".html") and f.name != "__init__.py"]
    assert modules
    assert [str(m.relative_to(package)) for m in modules if f" {m.name} " not in block] == []


# --- import cycles, type-level imports included -------------------------------------------------


def module_imports(path: Path, ours: set[str]) -> set[str]:
    """The modules of ours ``path`` imports, anywhere in it: under ``TYPE_CHECKING`` and inside functions too.

    ``from package import name`` is an import of ``package.name`` when that is
    a module, else of the package.
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in ours else node.module for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & ours


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of nodes that reach each other around a loop (Tarjan's strongly connected components), a node that
    reaches itself included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for other in graph[name]:
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            component: list[str] = []
            while not component or component[-1] != name:
                component.append(stack.pop())
            if len(component) > 1 or name in graph[name]:
                cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return cycles


def module_graph() -> dict[str, set[str]]:
    """Each module of ours and the modules of ours it imports."""
    ours = {module_name(p): p for p in MODULES}
    return {name: module_imports(path, set(ours)) for name, path in ours.items()}


def import_cycles() -> list[list[str]]:
    """Every set of modules that import each other, directly or around a loop."""
    return strongly_connected(module_graph())


# The modules whose imports must not loop, type-level imports included: a loop is a seam in the wrong place.
@pytest.mark.unit
def test_no_import_cycles() -> None:
    """No two modules import each other, even only for types: each such loop is a seam in the wrong place."""
    assert import_cycles() == []


@pytest.mark.unit
def test_the_cycle_finder_finds_a_loop() -> None:
    """The two tests above and below can fail: a loop of three, and a node that imports itself, are found."""
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}) == [["a", "b", "c"], ["e"]]


# --- the package graph: each folder one node, holding its own modules --------------------------------

# The `extproc-dev` command's entry point imports every tool it runs (the benchmark among them) and nothing
# imports it: a node of its own, as the `extproc` command's entry point (ENTRY) is outside the layers.
DEV_COMMAND = {"extproc.tools.cli", "extproc.tools.__main__"}


def package(name: str) -> str:
    """The folder a module is in (a package's ``__init__`` is its folder's); the dev command's entry point alone."""
    if name in DEV_COMMAND:
        return "extproc-dev"
    return name if (PACKAGE.parent / name.replace(".", "/")).is_dir() else name.rpartition(".")[0]


def package_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    """Each package and the packages it imports (type-level and function-level imports included); and, per edge, the
    module imports that make it."""
    graph: dict[str, set[str]] = {}
    why: dict[tuple[str, str], list[str]] = {}
    for name, imported in module_graph().items():
        graph.setdefault(package(name), set())
        for other in imported:
            edge = (package(name), package(other))
            if edge[0] != edge[1]:
                graph[edge[0]].add(edge[1])
                why.setdefault(edge, []).append(f"{name} -> {other}")
    return graph, why


@pytest.mark.unit
def test_no_package_cycles() -> None:
    """No two packages import each other, even around a loop, and a package and its subpackage count as two: a
    parent's modules that compose its subpackages import them, and the subpackages import none of those.

    A loop here is a value or a fact kept in the wrong package: the values both
    sides read go below them (``core/values/``, ``adapters/protocol/``,
    ``adapters/request/``), so the arrows run one way.
    """
    graph, why = package_graph()
    loops = strongly_connected(graph)
    assert loops == [], {" <-> ".join(loop): [m for (a, b), ms in why.items() if a in loop and b in loop for m in ms]
                         for loop in loops}


# The packages the config may import of the adapters: its own, and the protocols' facts it checks names against.
CONFIG_READS = ("extproc.adapters.config", "extproc.adapters.protocol")


@pytest.mark.unit
@pytest.mark.parametrize("path", [p for p in MODULES if module_name(p).startswith("extproc.adapters.config")],
                         ids=module_name)
def test_the_config_imports_no_other_adapter(path: Path) -> None:
    """Every adapter reads the config, so the config reads none of them (the protocols' facts are no adapter's)."""
    outside = sorted(name for name in imports(path) if layer(name) == "adapters"
                     and not any(name == p or name.startswith(p + ".") for p in CONFIG_READS))
    assert not outside, f"{module_name(path)} imports {outside}"


# Where a module of this size has grown two concepts; the core and the adapters are kept under it.
# --- the production command, run: no extproc.tools module in its process --------------------------

# `extproc ARGS` in a child process; its last stderr line lists every module it loaded (sys.modules at its exit).
CHILD = (
    "import json, sys\n"
    "from extproc.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    "sys.exit(code)\n"
)
DEMO_CONFIG = PACKAGE / "data" / "demo.yaml"
USER_ENVOY = FIXTURES / "user-envoy.yaml"


def loaded(stderr: str, *packages: str) -> list[str]:
    """The modules of ``packages`` (each a package or a module, with what is under it) the child had loaded."""
    modules: list[str] = json.loads(stderr.splitlines()[-1])
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)]


def tools_loaded(stderr: str) -> list[str]:
    return loaded(stderr, "extproc.tools")


@pytest.mark.unit
@pytest.mark.parametrize("argv", [
    ["check-config", str(DEMO_CONFIG)],
    ["envoy-config", "--config", str(DEMO_CONFIG)],
    ["envoy-config", "--config", str(DEMO_CONFIG), "--drop-in"],
    ["envoy-config", "--config", str(DEMO_CONFIG), "--into", str(USER_ENVOY)],
], ids=lambda argv: " ".join(a for a in argv if not a.startswith("/")))
def test_config_commands_load_no_tools(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert tools_loaded(done.stderr) == []


# The libraries of the optional extras (bench, s3, test): the image the compose demo runs has none of them,
# and its `extproc-dev sim` must start there.
EXTRAS = ("openai", "matplotlib", "numpy", "boto3", "moto", "h2", "hypothesis", "jwt", "jsonschema", "kubernetes_validate")


@pytest.mark.unit
def test_the_dev_command_loads_no_optional_extra() -> None:
    child = "import json, sys\nimport extproc.tools.cli\nprint(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert loaded(done.stderr, *EXTRAS) == []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def serve(config: Path, metrics: str) -> str:
    """``extproc serve --config config`` in a child process until it serves (its metrics port answers), then SIGTERM;
    the child's stderr (its last line: the modules it loaded)."""
    argv = ["serve", "--config", str(config), "--watch-config", "--drain-seconds", "1", "--deadline-seconds", "5"]
    child = subprocess.Popen([sys.executable, "-c", CHILD, *argv], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:  # serving: the metrics port answers
            assert child.poll() is None and time.monotonic() < deadline, "serve did not come up"
            try:
                with urllib.request.urlopen(f"http://{metrics}/healthz", timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        child.send_signal(signal.SIGTERM)
        _, stderr = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 0, stderr
    return stderr


@pytest.mark.integration  # a processor, serving until SIGTERM
@pytest.mark.parametrize("transport", ["builtin", "grpcio"])
def test_serve_loads_no_tools(tmp_path: Path, transport: str) -> None:
    metrics = f"127.0.0.1:{free_port()}"
    config = tmp_path / "config.yaml"
    config.write_text(
        f"listen: {{grpc: '127.0.0.1:{free_port()}', metrics: '{metrics}', transport: {transport}}}\n"
        "models: [{name: m, endpoints: ['http://127.0.0.1:1']}]\n"
    )
    assert tools_loaded(serve(config, metrics)) == []


# --- the optional features, loaded only where configured ------------------------------------------

# Each optional feature's packages, and the libraries only they use: redis (the cluster, and budgets and
# batches shared through it), boto3 (batch files in S3). aiohttp is not among them: the metrics port
# and the scrapers run on it, and the Batch API's server uses no part of it they do not.
OPTIONAL = {
    "batches": ("extproc.adapters.batches", "boto3", "botocore"),
    "budgets": ("extproc.adapters.budgets", "extproc.core.budgets"),
    "cluster": ("extproc.adapters.cluster", "redis"),
    "grpcio": ("extproc.adapters.grpc.grpcio_server", "grpc"),
}


def readme_config(tmp_path: Path, extra: str = "") -> tuple[Path, str]:
    """The README's config (its ``newcomer: config`` block) with free ports and ``extra`` appended; its metrics address."""
    ports: dict[str, str] = {}
    text = ADDRESS.sub(lambda m: f"127.0.0.1:{ports.setdefault(m[1], str(free_port()))}", readme_blocks()["config"])
    config = tmp_path / "config.yaml"
    config.write_text(text + extra, encoding="utf-8")
    return config, str(load_config(config).listen.metrics)


@pytest.mark.integration  # a processor, serving until SIGTERM
def test_serve_with_the_readme_config_loads_no_optional_feature(tmp_path: Path) -> None:
    stderr = serve(*readme_config(tmp_path))
    assert {name: loaded(stderr, *packages) for name, packages in OPTIONAL.items()} == dict.fromkeys(OPTIONAL, [])


@pytest.mark.integration  # a processor, serving until SIGTERM
def test_serve_loads_the_features_it_is_configured_with_and_no_other(tmp_path: Path) -> None:
    """The check above can fail: the same config with budgets and the grpcio transport loads those two."""
    config, metrics = readme_config(tmp_path, "budgets: {tenants: {alice: {requests_per_minute: 60}}}\n")
    config.write_text(config.read_text().replace("listen: {", "listen: {transport: grpcio, ", 1))
    stderr = serve(config, metrics)
    features = ("extproc.adapters.budgets.gate", "extproc.core.budgets.ledger", "extproc.adapters.grpc.grpcio_server",
                "grpc.aio")
    assert set(features) <= set(loaded(stderr, *features))
    assert loaded(stderr, *OPTIONAL["batches"], "extproc.adapters.cluster") == []
