"""Arrows run one way: the scheduling core imports nothing from the adapters or the tools.

The core (queues, policies, dispatcher, gate, cost) takes plain values and
reports through core/report.py; the config, the ext_proc servicer, telemetry
and the rest build it and read it. An import from the core into them would
bring I/O and their settings into code that is tested as pure.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "extproc"
# The core beside extproc/core/ itself, until the package layout moves them there.
CORE = {"extproc.scheduler", "extproc.dispatcher", "extproc.gate", "extproc.controller", "extproc.cost", "extproc.limits"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def in_core(name: str) -> bool:
    return name in CORE or name == "extproc.core" or name.startswith("extproc.core.")


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == "extproc" or name.startswith("extproc.")}


CORE_FILES = [p for p in sorted(PACKAGE.rglob("*.py")) if in_core(module_name(p))]


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: module_name(p))
def test_the_core_imports_only_the_core(path: Path) -> None:
    outside = sorted(name for name in imports(path) if not in_core(name))
    assert not outside, f"{module_name(path)} imports {outside}"
