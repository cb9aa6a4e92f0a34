"""The transport seam (adapters/grpc/transport.py): every ``listen.transport`` choice names a server, and only those.

The servers' behaviour is the conformance suite's (tests/adapters/grpc/test_transport_differential.py),
which runs each case against every entry of ``TRANSPORTS``.
"""

from __future__ import annotations

import logging

import pytest

from extproc.adapters.config import parse_config
from extproc.adapters.config.schema import OLD_TRANSPORT_NAMES, TRANSPORT_NAMES
from extproc.adapters.transports import TRANSPORTS

pytestmark = pytest.mark.unit

MODEL = {"name": "m", "endpoints": ["http://127.0.0.1:1"]}


def test_the_registry_and_the_config_name_the_same_transports() -> None:
    assert set(TRANSPORT_NAMES) == set(TRANSPORTS)
    assert set(OLD_TRANSPORT_NAMES.values()) <= set(TRANSPORTS)
    assert parse_config({"models": [MODEL]}).listen.transport == "builtin"


def test_the_old_name_h2_reads_as_builtin_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    assert parse_config({"models": [MODEL], "listen": {"transport": "h2"}}).listen.transport == "builtin"
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("listen.transport: 'h2' is the old name of 'builtin'") and "write 'builtin'" in line
    caplog.clear()
    assert parse_config({"models": [MODEL], "listen": {"transport": "grpcio"}}).listen.transport == "grpcio"
    assert caplog.records == []
