"""The power-user scenario, as a client would live it: one tenant floods a model,
two others each send one request a moment later.

Used by ``extproc-dev demo`` (gateway vs. straight to the engine) and by the
integration tests. Each request is a streaming chat completion; we time the
first content chunk (time to first token), the end, and read the processor's
queue-wait header when the gateway sent one.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from extproc.adapters.protocol.contract import QUEUE_WAIT_HEADER


@dataclass(frozen=True)
class PowerUser:
    model: str
    flood_tenant: str = "alice"
    flood: int = 200
    newcomers: tuple[str, ...] = ("bob", "carol")
    newcomer_delay_s: float = 0.5
    max_tokens: int = 64


@dataclass(frozen=True)
class Outcome:
    tenant: str
    status: int
    ttft_s: float | None  # None when no token arrived (error)
    total_s: float
    queue_wait_s: float | None  # None when not sent through the gateway
    error: str = ""
    tokens: int = 0  # content chunks received (the simulator streams one token per chunk)


async def chat(
    session: aiohttp.ClientSession,
    base_url: str,
    tenant: str,
    model: str,
    *,
    api_key: str | None,
    max_tokens: int,
    extra_headers: Mapping[str, str] | None = None,
    prompt: str | None = None,
    extra_body: Mapping[str, object] | None = None,
) -> Outcome:
    """One streaming chat completion; never raises for HTTP or connection errors."""
    headers = {"content-type": "application/json", **(extra_headers or {})}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt or f"Hello from {tenant}, please answer at length."}],
        "max_tokens": max_tokens,
        "stream": True,
        **(extra_body or {}),
    }
    start = time.monotonic()
    ttft: float | None = None
    tokens = 0
    try:
        async with session.post(f"{base_url}/v1/chat/completions", json=body, headers=headers) as response:
            wait_ms = response.headers.get(QUEUE_WAIT_HEADER)
            queue_wait = int(wait_ms) / 1000 if wait_ms is not None else None
            if response.status != 200:
                text = await response.text()
                return Outcome(tenant, response.status, None, time.monotonic() - start, queue_wait, text[:200])
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    tokens += 1  # one token per content chunk (the simulator's, and vLLM's, default)
                    if ttft is None:
                        ttft = time.monotonic() - start
            return Outcome(tenant, 200, ttft, time.monotonic() - start, queue_wait, tokens=tokens)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Outcome(tenant, 0, None, time.monotonic() - start, None, repr(exc))


async def run_power_user(
    base_url: str, scenario: PowerUser, api_keys: Mapping[str, str] | None = None
) -> list[Outcome]:
    """Replay the scenario against ``base_url``; ``api_keys`` maps tenant -> key (gateway only)."""
    keys = api_keys or {}
    connector = aiohttp.TCPConnector(limit=0)  # one connection per request, as separate users would
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:

        def send(tenant: str) -> asyncio.Task[Outcome]:
            return asyncio.create_task(
                chat(session, base_url, tenant, scenario.model, api_key=keys.get(tenant), max_tokens=scenario.max_tokens)
            )

        flood = [send(scenario.flood_tenant) for _ in range(scenario.flood)]
        await asyncio.sleep(scenario.newcomer_delay_s)
        newcomers = [send(t) for t in scenario.newcomers]
        return list(await asyncio.gather(*flood, *newcomers))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass(frozen=True)
class TenantSummary:
    tenant: str
    requests: int
    ok: int
    wait_p50: float
    wait_p99: float
    ttft_p50: float
    ttft_p99: float


def summarize(outcomes: Sequence[Outcome]) -> list[TenantSummary]:
    tenants = sorted({o.tenant for o in outcomes})
    summaries = []
    for tenant in tenants:
        mine = [o for o in outcomes if o.tenant == tenant]
        waits = [o.queue_wait_s for o in mine if o.queue_wait_s is not None]
        ttfts = [o.ttft_s for o in mine if o.ttft_s is not None]
        summaries.append(
            TenantSummary(
                tenant, len(mine), sum(o.status == 200 for o in mine),
                percentile(waits, 50), percentile(waits, 99), percentile(ttfts, 50), percentile(ttfts, 99),
            )
        )
    return summaries
