"""What other test modules share of test_monitoring.py's: query, tool (written for its tests)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import aiohttp
import pytest


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        reason = f"{name} is not installed (Debian: apt-get install prometheus)"
        if os.environ.get("EXTPROC_PROMETHEUS") == "require":
            pytest.fail(f"EXTPROC_PROMETHEUS=require: {reason}")
        pytest.skip(reason)
    return found


async def query(session: aiohttp.ClientSession, prometheus: str, expr: str) -> list[dict[str, Any]]:
    async with session.get(f"{prometheus}/api/v1/query", params={"query": expr}) as response:
        body = await response.json()
    assert body["status"] == "success", (expr, body)
    return list(body["data"]["result"])
