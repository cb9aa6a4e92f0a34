"""The configuration reference (docs/configuration.md) is generated from the schema, so it cannot drift from the code."""

from __future__ import annotations

import pytest

from extproc.adapters.config.keys import keys
from extproc.tools import config_reference

pytestmark = pytest.mark.unit


def test_the_pages_tables_are_what_the_schema_generates() -> None:
    page = config_reference.PAGE.read_text(encoding="utf-8")
    assert config_reference.rewrite(page) == page, (
        "docs/configuration.md differs from the schema: run `python -m extproc.tools.config_reference --write`"
    )


def test_every_key_of_the_schema_has_a_row_with_a_meaning() -> None:
    page = config_reference.PAGE.read_text(encoding="utf-8")
    tables = "\n".join(config_reference.table(name, config_reference.read_meanings(page))
                       for name in config_reference.TABLES)
    assert config_reference.UNWRITTEN not in tables, "a key's meaning is still to be written in docs/configuration.md"
    rows = [line for line in tables.splitlines() if line.startswith("| `")]
    shown = [key for key in keys() if not config_reference.inline(key)]
    assert len(rows) == len(shown)


def test_a_key_added_to_the_schema_shows_as_a_row_to_write() -> None:
    page = config_reference.PAGE.read_text(encoding="utf-8")
    without = page.replace("| `policy` |", "| `policy_renamed` |")
    assert f"| `policy` | `round_robin` | one of round_robin, vtc, deadline, locality | {config_reference.UNWRITTEN} |" \
        in config_reference.rewrite(without)


def test_a_page_without_the_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="markers"):
        config_reference.rewrite("# Configuration\n\nno tables here\n")
