"""The metrics reference (docs/reference/metrics.md) is the series table, so it cannot drift from the code."""

from __future__ import annotations

import re

import pytest
from prometheus_client import generate_latest

from extproc.adapters.telemetry import Telemetry
from extproc.tools import metrics_reference

pytestmark = pytest.mark.unit


def test_the_page_is_what_the_series_table_generates() -> None:
    page = metrics_reference.PAGE.read_text(encoding="utf-8")
    assert metrics_reference.rewrite(page) == page, (
        "docs/reference/metrics.md differs from the series table: run `python -m extproc.tools.metrics_reference --write`"
    )


def test_every_series_on_a_processors_page_is_in_the_reference() -> None:
    """Not only the declared table: a series built anywhere else on the registry must be listed too."""
    page = generate_latest(Telemetry().registry).decode()
    families = set(re.findall(r"^# TYPE (\S+) ", page, re.MULTILINE))
    listed = set(re.findall(r"^\| `(\w+)`", metrics_reference.table(), re.MULTILINE))
    ours = {name for name in families if name.startswith(("extproc_", "inference_pool_"))}
    assert ours and ours == listed
    assert families - ours <= {name for name in families if name.startswith(("process_", "python_"))}


def test_a_page_without_the_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="markers"):
        metrics_reference.rewrite("# Metrics\n\nno table here\n")
