"""Budgets through real parts: the OpenAI SDK, Envoy, ``extproc serve`` and the simulator.

The SDK's own rate-limit handling is what a client of this gateway runs: it
must retry a ``rate_limit_exceeded`` 429 after its ``Retry-After`` and get
its answer, and give up at once on ``insufficient_quota`` (``x-should-retry:
false``). The rate headers must reach the client through Envoy, and the usage
export must show what was served.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from extproc.tools.stack import Stack, start_stack
from tests.lazy import openai
from tests.stackutil import TENANT_KEYS, metric, read_metrics, write_config
from tests.waitutil import eventually

pytestmark = pytest.mark.integration

FAST_SIM = ["--max-num-seqs", "8", "--step-ms", "20", "--time-scale", "0.1"]
# bob: one request a second, a minute's burst at once; carol: a day's budget of a few requests.
BOB_PER_MINUTE = 60
PAST_THE_BURST = 10  # bob's requests after his minute's burst
BUDGETS = {"tenants": {"default": {"requests_per_minute": 1000}, "bob": {"requests_per_minute": BOB_PER_MINUTE},
                       "carol": {"tokens_per_day": 200}, "dave": {"tokens_per_day": 300}}}


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    path = write_config(tmp_path)
    doc = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**doc, "budgets": {**BUDGETS, "store": str(tmp_path / "usage.sqlite")}}))
    async with await start_stack(path, tmp_path, sim_args=FAST_SIM) as s:
        yield s


async def ask(client: openai.AsyncOpenAI, max_tokens: int = 4) -> None:
    await client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens)


async def test_the_openai_sdk_retries_a_rate_limit_after_retry_after_and_gets_its_answers(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.envoy_url}/v1", api_key=TENANT_KEYS["bob"], max_retries=5)

    async def create() -> tuple[int, dict[str, str]]:
        answer = await client.chat.completions.with_raw_response.create(
            model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        return answer.status_code, dict(answer.headers)

    start = time.monotonic()
    async with client:
        # The minute's burst at once (one after the other, a slow machine's requests would let the window refill a
        # request a second as fast as they went), then ten more: those wait for the window, by Retry-After.
        answers = await asyncio.gather(*(create() for _ in range(BOB_PER_MINUTE)))
        for _ in range(PAST_THE_BURST):
            answers.append(await create())
    assert [status for status, _ in answers] == [200] * (BOB_PER_MINUTE + PAST_THE_BURST)
    elapsed = time.monotonic() - start
    headers = answers[-1][1]  # the last one's, through Envoy: the rate headers of bob's window
    assert headers["x-ratelimit-limit-requests"] == "60" and int(headers["x-ratelimit-remaining-requests"]) <= 1
    samples = await read_metrics(stack.metrics_url)
    refused = metric(samples, "extproc_budget_over_total", tenant="bob", over="rate", action="refuse")
    assert refused >= 1  # some attempts were refused, and the SDK retried each until it was let in
    # The window held: those past the burst came in at its rate, each as one request's room came back (half their
    # time at least: a slow burst lets the first few in sooner). A lower bound the window sets, which load cannot
    # break: a slower machine only takes longer.
    assert elapsed >= 0.5 * PAST_THE_BURST * 60 / BOB_PER_MINUTE, elapsed
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{stack.envoy_url}/v1/chat/completions",
                                json={"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4},
                                headers={"authorization": f"Bearer {TENANT_KEYS['bob']}"}) as refusal:
            body = await refusal.json()
            if refusal.status == 429:  # the window may have room by now
                assert body["error"]["code"] == "rate_limit_exceeded" and 1 <= int(refusal.headers["retry-after"]) <= 2
                assert refusal.headers["x-ratelimit-remaining-requests"] == "0"
        async with session.get(f"http://{stack.config.listen.metrics}/usage", params={"per": "month"}) as usage:
            rows = {row["tenant"]: row for row in await usage.json()}
    assert rows["bob"]["requests"] >= 70 and rows["bob"]["output_tokens"] >= 70 * 1


async def test_the_openai_sdk_does_not_retry_insufficient_quota(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.envoy_url}/v1", api_key=TENANT_KEYS["carol"], max_retries=5)
    async with client:
        await ask(client, max_tokens=50)  # 'hi' is a few tokens + 50: within 200
        await ask(client, max_tokens=50)
        with pytest.raises(openai.RateLimitError) as refused:
            await ask(client, max_tokens=199)  # with what the first two used, over 200
    assert refused.value.code == "insufficient_quota"
    assert refused.value.response.headers["x-should-retry"] == "false"
    # No retry: the gateway refused carol's one attempt, not the six max_retries allows.
    samples = await read_metrics(stack.metrics_url)
    assert metric(samples, "extproc_budget_over_total", tenant="carol", over="budget", action="refuse") == 1


async def usage_of(stack: Stack, tenant: str) -> float:
    """The tokens ``tenant`` used this month, as the processor's /usage says."""
    async with aiohttp.ClientSession() as session, session.get(
            f"http://{stack.config.listen.metrics}/usage", params={"per": "month"}) as answer:
        rows = [row for row in await answer.json() if row["tenant"] == tenant]
    total: float = sum(row["input_tokens"] + row["output_tokens"] for row in rows)
    return total


async def test_a_restart_in_the_middle_of_a_day_budget_does_not_hand_out_a_fresh_one(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.envoy_url}/v1", api_key=TENANT_KEYS["dave"], max_retries=0)
    async with client:
        await ask(client, max_tokens=100)
        await ask(client, max_tokens=100)

        async def both_ended() -> bool:  # the client has its answer before the processor sees the response end
            return metric(await read_metrics(stack.metrics_url), "extproc_in_flight") == 0

        await eventually(both_ended, timeout_s=10, what="both requests ended at the processor")
        used = await usage_of(stack, "dave")
        assert 10 <= used <= 202
        assert stack.processor is not None
        await stack.processor.stop()  # SIGTERM: drains, writes the store
        await stack.start_processor()
        assert await usage_of(stack, "dave") == used
        # Fits a fresh day (300), not what is left of this one.
        with pytest.raises(openai.RateLimitError) as refused:
            await ask(client, max_tokens=int(300 - used) + 2)
    assert refused.value.code == "insufficient_quota"
