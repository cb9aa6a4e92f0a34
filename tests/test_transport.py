"""The transport seam (adapters/ext_proc/transport.py): every ``listen.transport`` choice names a server, and only those.

The servers' behaviour is the conformance suite's (tests/test_transport_differential.py),
which runs each case against every entry of ``TRANSPORTS``.
"""

from __future__ import annotations

from typing import Literal, get_args, get_origin, get_type_hints

import pytest

from extproc.adapters.config import Listen
from extproc.adapters.server import TRANSPORTS

pytestmark = pytest.mark.unit


def test_the_registry_and_the_config_name_the_same_transports() -> None:
    choice = get_type_hints(Listen)["transport"]
    assert get_origin(choice) is Literal
    assert set(get_args(choice)) == set(TRANSPORTS)
