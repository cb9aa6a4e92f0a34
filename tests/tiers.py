"""Test tiers: every test is exactly one of ``unit`` or ``integration``.

``pytest -m unit`` is the quick loop, so a test without a tier would silently
drop out of it (or out of CI's ``-m integration`` runs, if someone adds one).
Loaded with ``-p tests.tiers`` (``addopts`` in pyproject.toml), not from a
conftest, so it stays independent of the fixtures that live there.
"""

from __future__ import annotations

import pytest

TIERS = ("unit", "integration")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        tiers = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {sorted(tiers) or 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            "each test needs exactly one tier marker, unit or integration (e.g. `pytestmark = pytest.mark.unit`):\n  "
            + "\n  ".join(wrong)
        )
