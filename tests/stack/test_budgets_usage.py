"""The engine's usage charged through real parts: the OpenAI SDK, Envoy, ``extproc serve`` and the simulator.

A budget is charged what the engine reports (``request/engine_usage.py``):
in a whole JSON answer, and at the end of a stream whose client asked for it
(``stream_options.include_usage``); a stream without it is charged the cost
model's estimate, and each client sees exactly the answer it asked for. A
request preempted before its response began and retried by the SDK is
charged once: for the retry, as the engine counted it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
import yaml

from extproc.tools.stack import Stack, start_stack
from tests.helpers.preemption import BATCH_TOKENS, SIM, batch_client, config, flood_then_chat
from tests.lazy import openai
from tests.stackutil import TENANT_KEYS, metric, read_metrics, write_config
from tests.waitutil import eventually

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

pytestmark = pytest.mark.integration

FAST_SIM = ["--max-num-seqs", "8", "--step-ms", "20", "--time-scale", "0.1"]
BUDGETS = {"tenants": {"default": {"tokens_per_day": 1_000_000}}}
# Long enough that the estimate from its size (bytes / 4) is not the engine's count.
PROMPT: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "tell me about the weather in the mountains today " * 8}]


def with_budgets(path: Path) -> Path:
    doc = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**doc, "budgets": BUDGETS}))
    return path


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    async with await start_stack(with_budgets(write_config(tmp_path)), tmp_path, sim_args=FAST_SIM) as s:
        yield s


def client(stack: Stack, tenant: str, retries: int = 0, **headers: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.envoy_url}/v1", api_key=TENANT_KEYS[tenant], max_retries=retries,
                              default_headers=headers or None)


async def charged(stack: Stack) -> dict[str, dict[str, Any]]:
    """Each tenant's row of this month, once every request ended at the processor (the client has its answer first)."""
    async def ended() -> bool:
        return metric(await read_metrics(stack.metrics_url), "extproc_in_flight") == 0

    await eventually(ended, timeout_s=10, what="every request ended at the processor")
    async with aiohttp.ClientSession() as session, session.get(
            f"http://{stack.config.listen.metrics}/usage", params={"per": "month"}) as answer:
        return {row["tenant"]: row for row in await answer.json()}


async def test_a_budget_is_charged_the_engines_usage_whole_and_streamed_and_the_estimate_without(
        stack: Stack) -> None:
    async with client(stack, "alice") as alice, client(stack, "bob") as bob, client(stack, "carol") as carol:
        whole = await alice.chat.completions.create(model="m1", messages=PROMPT, max_tokens=20)
        asked = [chunk async for chunk in await bob.chat.completions.create(
            model="m1", messages=PROMPT, max_tokens=20, stream=True, stream_options={"include_usage": True})]
        plain = [chunk async for chunk in await carol.chat.completions.create(
            model="m1", messages=PROMPT, max_tokens=20, stream=True)]
    rows = await charged(stack)
    assert whole.usage is not None and whole.usage.prompt_tokens != rows["carol"]["input_tokens"]  # not the estimate
    assert (rows["alice"]["input_tokens"], rows["alice"]["output_tokens"]) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens)
    # The stream's last event has the usage its client asked for; the budget was charged that.
    usage = asked[-1].usage
    assert usage is not None and asked[-1].choices == []
    assert (rows["bob"]["input_tokens"], rows["bob"]["output_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    # A stream without: no usage event reaches its client, and its budget is charged the estimate.
    assert all(chunk.usage is None and chunk.choices for chunk in plain)
    assert rows["carol"]["requests"] == 1 and 1 <= rows["carol"]["output_tokens"] <= 20
    assert rows["carol"]["input_tokens"] != whole.usage.prompt_tokens


async def test_a_preempted_request_retried_by_the_sdk_is_charged_once(tmp_path: Path) -> None:
    path = with_budgets(config(tmp_path))
    async with await start_stack(path, tmp_path, sim_args=SIM) as stack:
        results, _, _ = await flood_then_chat(stack, batch_client(stack, retries=2))
        assert [o for o, _ in results] == ["ok", "ok"], results
        samples = await read_metrics(stack.metrics_url)
        assert metric(samples, "extproc_preemptions_total", tenant="bob") == 1  # one was preempted, then retried
        async with client(stack, "carol") as carol:  # the engine's count of the batch requests' prompt
            prompt = (await carol.chat.completions.create(model="m1", messages=[{"role": "user", "content": "summarise"}],
                                                          max_tokens=1)).usage
        rows = await charged(stack)
    # Two answers, two requests charged: the preempted attempt gave its reservation back, the retry was charged
    # what the engine counted for it.
    assert prompt is not None
    assert (rows["bob"]["requests"], rows["bob"]["input_tokens"], rows["bob"]["output_tokens"]) == (
        2, 2 * prompt.prompt_tokens, 2 * BATCH_TOKENS)
