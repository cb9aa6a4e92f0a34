"""Where the tests find the repository and their fixtures, wherever in tests/ a test module lives."""

from __future__ import annotations

from pathlib import Path

# The repository's root (extproc/, deploy/, docs/ ...).
ROOT = Path(__file__).resolve().parent.parent
# The tests' own data files.
FIXTURES = ROOT / "tests" / "fixtures"
