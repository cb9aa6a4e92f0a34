"""Preemption through real parts: Envoy, the processor, a simulator, the OpenAI SDK as the client.

Batch requests fill the engine's slots; an interactive chat with a tight
objective arrives. With preemption the youngest batch request is ended with a
JSON 503 ``preempted`` (the engine aborts it: its running count drops) and the
chat starts at once; the SDK's own retry brings the batch request back, and
it is not preempted twice. Assertions compare runs, never absolute times.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.tools.power_user import chat
from extproc.tools.stack import Stack, start_stack
from tests.lazy import openai
from tests.stackutil import TENANT_KEYS, poll, read_metrics, write_config

pytestmark = pytest.mark.integration

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


async def test_a_chat_at_risk_preempts_the_youngest_batch_request_which_the_engine_aborts(tmp_path: Path) -> None:
    async with await start_stack(config(tmp_path), tmp_path, sim_args=SIM) as stack:
        results, ttft, running = await flood_then_chat(stack, batch_client(stack, retries=0))
    assert sorted(o for o, _ in results) == ["503:preempted", "ok"], results
    # The engine aborted the preempted request: only the other batch request ran after the chat.
    assert running == 1
    full = next(t for o, t in results if o == "ok")
    # The chat did not wait for a batch request to finish.
    assert ttft < full / 3, (ttft, full)


async def test_the_sdk_retries_a_preempted_request_and_a_retry_is_not_preempted(tmp_path: Path) -> None:
    async with await start_stack(config(tmp_path), tmp_path, sim_args=SIM) as stack:
        results, _, _ = await flood_then_chat(stack, batch_client(stack, retries=2))
        assert [o for o, _ in results] == ["ok", "ok"], results
        # Requests that say they are retries are not preempted: the chat waits for a slot.
        retried, waited, _ = await flood_then_chat(stack, batch_client(stack, retries=0),
                                                   **{"x-stainless-retry-count": "1"})
        assert [o for o, _ in retried] == ["ok", "ok"], retried
        assert waited > min(t for _, t in retried) / 3, (waited, retried)


async def test_without_preemption_the_chat_waits_for_a_slot(tmp_path: Path) -> None:
    async with await start_stack(config(tmp_path, max_preemptions_per_s=0), tmp_path, sim_args=SIM) as stack:
        results, ttft, _ = await flood_then_chat(stack, batch_client(stack, retries=0))
    assert [o for o, _ in results] == ["ok", "ok"], results
    assert ttft > min(t for _, t in results) / 3, (ttft, results)
