"""Fault: cost poisoning through the real stack (client → Envoy → extproc → simulator), policy vtc.

A tenant sends ``max_tokens: 1e308`` and ``1e20`` (valid JSON numbers, which
the engine then refuses) while it floods. Each such request is released and
charged before the engine answers; unbounded, its charge was infinite, the
``vtc`` floor stayed at inf, and a newcomer tied with the flooder at inf and
lost every tie-break: it waited behind the whole flood. Bounded, the newcomer
goes after at most a round of releases. Invalid limits (a string, a negative
number, a bool) never reach the queue: the processor answers 400 naming the
field.

Assertions count releases and compare within one run (a noisy 2-core machine).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.tools.power_user import Outcome, chat
from extproc.tools.stack import Stack, start_stack
from tests.stackutil import TENANT_KEYS, metric, read_metrics, write_stack_config

pytestmark = pytest.mark.integration

# 4 sequences per batch, 10x faster than real time: the flood takes a few seconds.
SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "0.1"]
FLOOD = 40
POISON: list[dict[str, Any]] = [{"max_tokens": 1e308}, {"max_tokens": 1e20}, {"max_completion_tokens": 1e308}]
INVALID: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_completion_tokens": True}, "max_completion_tokens"),
]


async def post(http: aiohttp.ClientSession, stack: Stack, tenant: str, fields: dict[str, Any]) -> tuple[int, Any, str]:
    """One chat request with the given output-limit fields; (status, JSON body or None, x-extproc-reason)."""
    body = {"model": "m1", "messages": [{"role": "user", "content": "poison"}], **fields}
    headers = {"authorization": f"Bearer {TENANT_KEYS[tenant]}"}
    async with http.post(f"{stack.envoy_url}/v1/chat/completions", json=body, headers=headers) as response:
        payload = await response.json() if response.content_type == "application/json" else None
        return response.status, payload, response.headers.get("x-extproc-reason", "")


async def timed_chat(http: aiohttp.ClientSession, stack: Stack, tenant: str) -> tuple[float, Outcome]:
    """A normal streamed chat; (when its first token arrived, on the monotonic clock, or inf; outcome)."""
    sent = time.monotonic()
    outcome = await chat(http, stack.envoy_url, tenant, "m1", api_key=TENANT_KEYS[tenant], max_tokens=40)
    return (sent + outcome.ttft_s if outcome.ttft_s is not None else math.inf), outcome


@dataclass(frozen=True)
class Run:
    ahead: int  # flood requests whose first token came after the newcomer arrived and before its own
    waiting: int  # flood requests without a first token yet when the newcomer arrived
    newcomer_ttft_s: float
    flood_ttft_s: float  # from the newcomer's arrival to the flood's last first token


async def poisoned_flood(stack: Stack) -> Run:
    """Poison, then flood with more poison mixed in, then a newcomer (bob)."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        # The poison first, alone: charged at release, refused by the engine, corrected.
        for fields in POISON:
            status, _, _ = await post(http, stack, "alice", fields)
            assert status == 400  # the engine's own answer: not a whole number
        flood = [asyncio.create_task(timed_chat(http, stack, "alice")) for _ in range(FLOOD)]
        poison = [asyncio.create_task(post(http, stack, "alice", fields)) for fields in POISON]
        await asyncio.sleep(0.5)
        arrived = time.monotonic()
        newcomer_first, newcomer = await timed_chat(http, stack, "bob")
        flooded = await asyncio.gather(*flood)
        await asyncio.gather(*poison)
    assert newcomer.status == 200, newcomer.error
    assert all(o.status == 200 for _, o in flooded), [o.error for _, o in flooded if o.status != 200]
    return Run(
        ahead=sum(arrived <= first < newcomer_first for first, _ in flooded),
        waiting=sum(first >= arrived for first, _ in flooded),
        newcomer_ttft_s=newcomer_first - arrived,
        flood_ttft_s=max(first for first, _ in flooded) - arrived,
    )


async def test_poisoned_max_tokens_do_not_delay_a_newcomer_and_metrics_stay_finite(tmp_path: Path) -> None:
    config = write_stack_config(tmp_path, {"m1": {"policy": "vtc"}})
    async with await start_stack(config, tmp_path, sim_args=SIM) as stack:
        run = await poisoned_flood(stack)
        # The flood was still deep when the newcomer came (the comparison means something)...
        assert run.waiting >= FLOOD // 2, run
        # ...and the newcomer went after at most about one round: the engine's
        # slots and queue target (4 + 3) refilling once, not the rest of the flood.
        assert run.ahead <= 8, run

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            answers = [await post(http, stack, "carol", fields) for fields, _ in INVALID]
        for (status, payload, reason), (_, param) in zip(answers, INVALID, strict=True):
            assert status == 400 and reason == "invalid_max_tokens"
            assert payload["error"]["param"] == param and payload["error"]["type"] == "invalid_request_error"
            assert payload["error"]["code"] == "invalid_max_tokens"

        samples = await read_metrics(stack.metrics_url)
        assert samples and all(math.isfinite(v) for v in samples.values()), {
            k: v for k, v in samples.items() if not math.isfinite(v)}
        assert metric(samples, "extproc_rejected_total", model="m1", reason="invalid_max_tokens") == len(INVALID)
        assert metric(samples, "extproc_cost_clamped_total", model="m1") == 2 * len(POISON)
        # Every request ended once: the poison was released and answered by the engine.
        assert metric(samples, "extproc_released_total", model="m1") == 2 * len(POISON) + FLOOD + 1
        assert metric(samples, "extproc_queue_depth", model="m1") == 0
        assert metric(samples, "extproc_in_flight", model="m1") == 0
