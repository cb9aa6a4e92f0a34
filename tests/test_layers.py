"""Arrows run one way: tools -> adapters -> core, and the package names say which is which.

* ``extproc/core`` (queues, policies, band and release rules, load estimate,
  cost, the dispatcher) takes plain values and reports through
  ``core/report.py``; it imports only the core. An import from the core into
  the adapters would bring I/O and their settings into code tested as pure.
* ``extproc/adapters`` (the ext_proc servicer, engine metrics and scraping,
  Envoy config generation, telemetry, config, wiring, the server) import the
  core and each other, never the tools: a served gateway must not depend on
  the simulator, the benchmark or the local stack.
* ``extproc/tools`` (simulator, benchmark, demo, local stack) may import anything.
* The entry point (``extproc/cli.py``, ``__main__.py``) dispatches to adapters
  and tools alike; it is the only module outside the three packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "extproc"
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


def test_every_module_is_in_one_layer() -> None:
    loose = [module_name(p) for p in MODULES if layer(module_name(p)) is None and module_name(p) not in ENTRY]
    assert not loose, f"modules outside core/, adapters/ and tools/: {loose}"


@pytest.mark.parametrize("path", in_layer("core"), ids=module_name)
def test_the_core_imports_only_the_core(path: Path) -> None:
    outside = sorted(name for name in imports(path) if layer(name) != "core")
    assert not outside, f"{module_name(path)} imports {outside}"


@pytest.mark.parametrize("path", in_layer("adapters"), ids=module_name)
def test_adapters_do_not_import_tools(path: Path) -> None:
    tools = sorted(name for name in imports(path) if layer(name) not in ("core", "adapters"))
    assert not tools, f"{module_name(path)} imports {tools}"


def test_every_module_is_in_the_architecture_map() -> None:
    """docs/architecture.md's package map names every module, so a newcomer finds each one there."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
    block = doc.split("```")[1]  # the map is the first code block
    package = Path(__file__).resolve().parent.parent / "extproc"
    modules = [f for f in package.rglob("*") if f.suffix in (".py", ".lua", ".html") and f.name != "__init__.py"]
    assert modules
    assert [str(m.relative_to(package)) for m in modules if f" {m.name} " not in block] == []
