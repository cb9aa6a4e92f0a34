"""Prefix signatures through a real Envoy (the generated config) → extproc → simulator.

A model with ``prefix:`` has its body sent to the processor before the hold
(a buffered-body mode override on the headers reply), is held on that body
message and released by its reply: the request must reach the engine with its
body intact, streamed or not, and its signature must reach the dispatcher
(``extproc_prefix_blocks``). A model without it keeps the headers-only path:
its body never crosses to the processor (Envoy's bytes to the extproc cluster
say so).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.adapters.envoy.clusters import EXTPROC_CLUSTER
from extproc.tools.stack import Stack, start_stack
from tests.lazy import openai
from tests.stackutil import TENANT_KEYS, metric, read_metrics, write_stack_config

pytestmark = pytest.mark.integration

# Priority scheduling, so the engine takes the body's rewritten `priority` (engine_priority models).
FAST_SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "0.1", "--scheduling-policy", "priority"]
SYSTEM = "You are the ACME support desk's assistant; answer briefly and kindly. " * 30  # ~2 KB: 4 blocks of 512 B
QUESTION: Any = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is my order #1234?"}]


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    config = write_stack_config(tmp_path, {
        # One request at a time: the others are held, on their body message.
        "signed": {"prefix": {}, "gate": "static_concurrency", "max_in_flight": 1},
        "plain": {},
        "ranked": {"prefix": {}, "engine_priority": True},
    })
    async with await start_stack(config, tmp_path, sim_args=FAST_SIM) as s:
        yield s


async def sent_to_processor(stack: Stack) -> float:
    """Bytes Envoy has sent to the processor's cluster."""
    assert stack.envoy is not None
    url = f"{stack.envoy.admin_url}/stats?format=json&filter=^cluster\\.{EXTPROC_CLUSTER}\\.upstream_cx_tx_bytes_total$"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        stats = (await response.json())["stats"]
    return float(sum(s["value"] for s in stats if "value" in s))


async def direct_prompt_tokens(stack: Stack, model: str, messages: list[dict[str, Any]]) -> int:
    """What the engine counts of the prompt when the body reaches it unchanged."""
    async with aiohttp.ClientSession() as session, session.post(
        f"{stack.sim_url(model)}/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 1}
    ) as response:
        return int((await response.json())["usage"]["prompt_tokens"])


async def test_a_signed_model_is_held_on_its_body_and_served_intact_streamed_or_not(stack: Stack) -> None:
    expected = await direct_prompt_tokens(stack, "signed", QUESTION)
    client = openai.AsyncOpenAI(base_url=f"{stack.envoy_url}/v1", api_key=TENANT_KEYS["bob"], max_retries=0)
    async with client:
        async def plain() -> tuple[int, int, int]:
            raw = await client.chat.completions.with_raw_response.create(model="signed", messages=QUESTION,
                                                                          max_tokens=20)
            done = raw.parse()
            assert done.usage is not None
            return done.usage.prompt_tokens, done.usage.completion_tokens, int(raw.headers["x-extproc-queue-wait-ms"])

        async def streamed() -> tuple[int, int, int]:
            stream = await client.chat.completions.create(model="signed", messages=QUESTION, max_tokens=20,
                                                          stream=True, stream_options={"include_usage": True})
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            assert usage is not None
            return usage.prompt_tokens, usage.completion_tokens, -1

        results = await asyncio.gather(*(plain() for _ in range(3)), *(streamed() for _ in range(3)))
    # The engine read the very prompt a direct call gives it, and honoured max_tokens: the body arrived whole.
    assert all((prompt, completion) == (expected, 20) for prompt, completion, _ in results), (expected, results)
    # One slot for six requests: some were held (on their body message) and released by its reply.
    assert max(wait for *_, wait in results) > 0, results
    samples = await read_metrics(stack.metrics_url)
    assert metric(samples, "extproc_prefix_blocks_count", model="signed") == 6
    assert metric(samples, "extproc_prefix_blocks_sum", model="signed") == 6 * 4  # ~2 KB of leading text: 4 blocks
    assert metric(samples, "extproc_prefix_blocks_count", model="plain") == 0


async def test_a_model_without_prefix_never_sends_its_body_to_the_processor(stack: Stack) -> None:
    big = [{"role": "user", "content": "x" * 60_000}]
    body_bytes = len(json.dumps(big))

    async def across(model: str) -> float:
        before = await sent_to_processor(stack)
        async with aiohttp.ClientSession() as session, session.post(
            f"{stack.envoy_url}/v1/chat/completions", headers={"authorization": f"Bearer {TENANT_KEYS['bob']}"},
            json={"model": model, "messages": big, "max_tokens": 5},
        ) as response:
            assert response.status == 200, await response.text()
            assert (await response.json())["usage"]["completion_tokens"] == 5
        return await sent_to_processor(stack) - before

    plain, signed = await across("plain"), await across("signed")
    assert plain < body_bytes / 10, (plain, body_bytes)  # headers and trailers only
    assert signed > body_bytes, (signed, body_bytes)  # the body, for its signature


async def test_engine_priority_with_prefix_rewrites_the_body_in_the_release(stack: Stack) -> None:
    expected = await direct_prompt_tokens(stack, "ranked", QUESTION)
    async with aiohttp.ClientSession() as session, session.post(
        f"{stack.envoy_url}/v1/chat/completions", headers={"authorization": f"Bearer {TENANT_KEYS['bob']}"},
        json={"model": "ranked", "messages": QUESTION, "max_tokens": 7, "priority": "not a number"},
    ) as response:
        answer = await response.json()
    # The engine refuses a non-integer priority (400): it got the class's number, in a body of the right length.
    assert response.status == 200, answer
    assert (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]) == (expected, 7)
