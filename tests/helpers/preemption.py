"""What other test modules share of test_preemption.py's: BATCH_TOKENS, Run, SIM, _flood_then_chat, batch,
batch_client, config, flood_then_chat, sim_running (written for its tests).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp

from extproc.tools.power_user import chat
from extproc.tools.stack import Stack
from tests.lazy import openai
from tests.stackutil import TENANT_KEYS, poll, read_metrics, write_config

# Two slots; a batch request of 300 tokens runs ~3 s, a chat's first token comes in ~one step.
SIM = ["--max-num-seqs", "2", "--step-ms", "10", "--time-scale", "1"]


BATCH_TOKENS = 300


def config(tmp_path: Path, **model: Any) -> Path:
    path = write_config(tmp_path, max_running=2, **model)
    text = path.read_text()
    # The chat's objective is tight, so a full engine puts it at risk at once.
    path.write_text(text + "bands:\n  interactive:\n    ttft_objective_s: 0.3\n")
    return path


async def sim_running(stack: Stack) -> float:
    samples = await read_metrics(f"{stack.sim_url('m1')}/metrics")
    return sum(v for (name, _), v in samples.items() if name == "vllm:num_requests_running")


def batch_client(stack: Stack, retries: int) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.envoy_url}/v1", api_key=TENANT_KEYS["bob"], max_retries=retries,
                              default_headers={"x-priority": "batch"})


async def batch(client: openai.AsyncOpenAI, **headers: str) -> tuple[str, float]:
    """One non-streamed batch completion: its outcome (ok, or the error code) and how long it took."""
    start = time.monotonic()
    try:
        await client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "summarise"}],
                                             max_tokens=BATCH_TOKENS, extra_headers=headers or None)
        return "ok", time.monotonic() - start
    except openai.APIStatusError as error:
        body = error.body if isinstance(error.body, dict) else {}
        assert error.response.headers.get("retry-after") == "1"
        return f"{error.status_code}:{body.get('code')}", time.monotonic() - start


Run = tuple[list[tuple[str, float]], float, float]


async def flood_then_chat(stack: Stack, client: openai.AsyncOpenAI, **headers: str) -> Run:
    """Two batch requests fill both slots; then one interactive chat.

    The batch outcomes, the chat's TTFT, and what the engine ran right after the chat.
    """
    async with client:
        return await _flood_then_chat(stack, client, **headers)


async def _flood_then_chat(stack: Stack, client: openai.AsyncOpenAI, **headers: str) -> Run:
    jobs = [asyncio.create_task(batch(client, **headers)) for _ in range(2)]
    assert await poll(lambda: sim_running(stack), lambda v: v == 2) == 2
    await asyncio.sleep(0.3)  # the scrape shows them running
    async with aiohttp.ClientSession() as session:
        outcome = await chat(session, stack.envoy_url, "alice", "m1", api_key=TENANT_KEYS["alice"], max_tokens=4,
                             extra_headers={"x-priority": "interactive"})
    assert outcome.status == 200 and outcome.ttft_s is not None, outcome.error
    running = await sim_running(stack)
    return await asyncio.gather(*jobs), outcome.ttft_s, running
