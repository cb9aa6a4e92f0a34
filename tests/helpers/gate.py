"""What other test modules share of test_gate.py's: make_gate (written for its tests)."""

from __future__ import annotations

from extproc.core.release import RULES, RuleSettings
from extproc.core.release.pool import Pool


def make_gate(
    endpoints: tuple[str, ...] = ("e1",), target: int = 3, fallback: int = 4, kind: str = "adaptive",
    pick: bool = False, **options: float,
) -> Pool:
    settings = RuleSettings(target, **options)  # type: ignore[arg-type]
    return Pool(endpoints, RULES[kind], settings, stale_after_s=1.0, fallback_max_in_flight=fallback, pick_endpoints=pick)
