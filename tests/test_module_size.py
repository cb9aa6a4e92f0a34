"""Every module of the core and the adapters within its line bound: 500, and 300 for the two that grow fastest.

A module past its bound has taken on a second concept (the split is by
concept, the bound only says when to look). The servicer and the dispatcher
are where every feature lands first, so theirs is tighter: each routes to
the parts that own the work (the attachments, the model's runtime, the
budgets' gate; the model's state, the pool, the strategy) and does little
itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.paths import ROOT

PACKAGE = ROOT / "extproc"
BOUND = 500
# Relative to extproc/: the modules held to a tighter bound.
TIGHT = {"adapters/ext_proc/servicer.py": 300, "core/dispatcher.py": 300}
MODULES = sorted(path for layer in ("core", "adapters") for path in (PACKAGE / layer).rglob("*.py"))


def lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


@pytest.mark.unit
def test_the_tight_bounds_name_modules_that_exist() -> None:
    """A renamed or moved module must take its bound along, or the bound would guard nothing."""
    assert [name for name in TIGHT if not (PACKAGE / name).is_file()] == []


@pytest.mark.unit
def test_every_core_and_adapter_module_is_within_its_bound() -> None:
    assert MODULES
    over = {str(path.relative_to(PACKAGE)): (n, bound) for path in MODULES
            if (n := lines(path)) > (bound := TIGHT.get(str(path.relative_to(PACKAGE)), BOUND))}
    assert over == {}, f"modules over their line bound (lines, bound): {over}"
