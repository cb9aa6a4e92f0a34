"""Redis for the tests: the server helper and the rule for a missing binary.

:class:`RedisServer` lives in extproc/tools/redis_proc.py, so the
benchmark can start the same Redis.

Tests take the ``redis_server`` fixture (tests/conftest.py): a started
:class:`RedisServer` on a free loopback port, stopped after the test.
"""

from __future__ import annotations

import os

import pytest

from extproc.tools.redis_proc import RedisServer, RedisUnavailable, find_redis_server

__all__ = ["RedisServer", "redis_server_binary"]


def redis_server_binary() -> str:
    """The ``redis-server`` binary, or a skip that says why there is none.

    With ``EXTPROC_REDIS=require`` (CI, which installs Debian's redis-server)
    a missing binary fails instead: a skip would hide that the cluster tests
    stopped running.
    """
    try:
        return find_redis_server()
    except RedisUnavailable as exc:
        if os.environ.get("EXTPROC_REDIS") == "require":
            pytest.fail(f"EXTPROC_REDIS=require: {exc}")
        pytest.skip(str(exc))
