"""Example budgets of the property tests: a few in the quick loop, each test's full count in CI.

Two hypothesis profiles, registered by tests/conftest.py: ``unit``, loaded by default,
and ``ci`` (``--hypothesis-profile ci``, as .ci/run passes it). A test names the
count CI runs, ``examples(200)``; the loaded profile scales it by its own
``max_examples`` over hypothesis' 100, which is also what a test that names no
count gets. The quick loop still tries every property with a tenth of the
examples (at least ``FLOOR``): enough to catch a property broken outright, while
CI keeps the search as deep as each test asks.

Both are derandomized, with no example database and no deadline: a run tries
the examples the test's own code seeds, the same on every machine and every
run, however busy, so a property test passes or fails by the code alone, never
by the draw or the clock (a bug the search finds at a depth stays found; one
it does not reach is not found by chance).
"""

from __future__ import annotations

from hypothesis import settings

FULL = 100  # hypothesis' default max_examples: the ci profile's, the base a test's own count is relative to
PROFILES = {"unit": FULL // 10, "ci": FULL}
FLOOR = 5


def register_profiles() -> None:
    """Both profiles, the quick one loaded (hypothesis' pytest plugin loads ``--hypothesis-profile`` after this)."""
    for name, max_examples in PROFILES.items():
        settings.register_profile(name, max_examples=max_examples, derandomize=True, database=None, deadline=None)
    settings.load_profile("unit")


def examples(full: int) -> int:
    """``full`` examples under the ci profile, the loaded profile's share of it otherwise (at least ``FLOOR``)."""
    return max(min(FLOOR, full), full * settings().max_examples // FULL)
