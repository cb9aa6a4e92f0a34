"""What other test modules share of test_policies_integration.py's: HEAVY_PROMPT, LIGHT_PROMPT, W_IN, W_OUT,
send, service_while_both_backlogged, session, weighted (written for its tests).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from extproc.tools.power_user import Outcome, chat
from extproc.tools.sim.server import estimate_tokens
from extproc.tools.stack import Stack
from tests.stackutil import TENANT_KEYS

# Weights of the default cost model (input 1, output 2), applied to the simulator's own token counts.
W_IN, W_OUT = 1, 2


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60))


async def send(
    http: aiohttp.ClientSession, stack: Stack, tenant: str, model: str, max_tokens: int, *,
    prompt: str | None = None, priority: str | None = None, body: Mapping[str, Any] | None = None,
) -> tuple[float, Outcome]:
    """One streamed chat through Envoy with the tenant's API key; returns (sent at, outcome)."""
    sent = time.monotonic()
    outcome = await chat(
        http, stack.envoy_url, tenant, model, api_key=TENANT_KEYS[tenant], max_tokens=max_tokens, prompt=prompt,
        extra_headers={"x-priority": priority} if priority else None, extra_body=body,
    )
    return sent, outcome


HEAVY_PROMPT = "Review this code. " * 110  # ~500 tokens


LIGHT_PROMPT = "Quick question?"


def weighted(prompt: str, max_tokens: int) -> int:
    """What a request really costs the engine, in the simulator's own token counts."""
    return W_IN * estimate_tokens(prompt) + W_OUT * max_tokens


def service_while_both_backlogged(runs: list[tuple[str, float, Outcome, int]]) -> dict[str, int]:
    """Weighted tokens released to each tenant until the first one's backlog ran out.

    A request's release time is when it was sent plus the queue wait the
    gateway reported for it.
    """
    released: dict[str, list[tuple[float, int]]] = {tenant: [] for tenant, *_ in runs}
    for tenant, sent, outcome, cost in runs:
        assert outcome.status == 200 and outcome.queue_wait_s is not None, outcome
        released[tenant].append((sent + outcome.queue_wait_s, cost))
    window = min(max(t for t, _ in items) for items in released.values())
    return {tenant: sum(c for t, c in items if t <= window) for tenant, items in released.items()}
