"""What other test modules share of test_readme.py's: ADDRESS, BLOCK, readme_blocks (written for its tests)."""

from __future__ import annotations

import re

from tests.paths import ROOT

BLOCK = re.compile(r"<!-- newcomer: (\w+) -->\n```\w*\n(.*?)```", re.DOTALL)


ADDRESS = re.compile(r"127\.0\.0\.1:(\d+)")


def readme_blocks() -> dict[str, str]:
    blocks = dict(BLOCK.findall((ROOT / "README.md").read_text(encoding="utf-8")))
    assert set(blocks) == {"install", "config", "run", "client"}, sorted(blocks)
    return blocks
