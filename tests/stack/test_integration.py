"""The whole data path through real parts: client → Envoy → extproc (gRPC) → simulator.

Timing assertions are relative, with wide margins: these run on a noisy
2-core machine next to four other processes.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.tools.power_user import Outcome, PowerUser, chat, run_power_user, summarize
from extproc.tools.stack import Stack, start_stack
from tests.helpers.integration import FAST_SIM, gated_then_direct
from tests.lazy import openai
from tests.stackutil import TENANT_KEYS, metric, read_metrics, wait_for_metric, write_config

pytestmark = [pytest.mark.integration, pytest.mark.alone]


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    async with await start_stack(write_config(tmp_path, models=("m1", "m2")), tmp_path, sim_args=FAST_SIM) as s:
        yield s


async def test_power_user_does_not_delay_newcomers_and_engine_queue_stays_short(stack: Stack) -> None:
    scenario = PowerUser(model="m1", flood=60, max_tokens=40, newcomer_delay_s=0.3)
    gated, engine, direct = await gated_then_direct(stack, scenario)
    waiting = [w for _, w in engine]

    assert all(o.status == 200 and o.ttft_s is not None for o in gated + direct), [o for o in gated if o.error]
    flood_end = max(o.total_s for o in gated if o.tenant == "alice")
    for newcomer in ("bob", "carol"):
        [mine] = [o for o in gated if o.tenant == newcomer]
        [fifo] = [o for o in direct if o.tenant == newcomer]
        # Through the gateway the newcomer is done long before the flood is...
        assert mine.total_s < 0.5 * flood_end
        # ...and gets its first token far sooner than behind the engine's FIFO.
        assert mine.ttft_s is not None and fifo.ttft_s is not None
        assert mine.ttft_s * 3 < fifo.ttft_s
    # The engine's own queue never grew past the target (3) + 1 while we held the flood.
    assert max(waiting) <= 4, waiting
    assert max(r for r, _ in engine) >= 1, engine  # the sampler really watched the run: it saw the engine serve it
    # The power user's requests were held at the gateway, not in the engine.
    alice = next(s for s in summarize(gated) if s.tenant == "alice")
    assert alice.wait_p99 > 0.5 * flood_end - 0.3
    # And the direct FIFO run really made the engine's queue long (the comparison is meaningful).
    assert max(o.ttft_s or 0 for o in direct) > 0.5 * flood_end

    samples = await read_metrics(stack.metrics_url)
    assert metric(samples, "extproc_released_total", model="m1") == 62
    assert metric(samples, "extproc_in_flight", model="m1") == 0
    assert metric(samples, "extproc_queue_depth", model="m1") == 0
    assert metric(samples, "extproc_queue_wait_seconds_count", model="m1", priority="standard") == 62


async def test_openai_sdk_streams_through_envoy(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.envoy_url}/v1", api_key=TENANT_KEYS["bob"], max_retries=0)
    async with client:
        models = await client.models.list()
        assert sorted(m.id for m in models.data) == ["m1", "m2"]
        stream = await client.chat.completions.create(
            model="m2",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        assert text.strip()
        assert usage is not None and usage.completion_tokens == 12
        # Errors reach the SDK as the OpenAI error types it knows.
        with pytest.raises(openai.NotFoundError) as err:
            await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        assert err.value.code == "model_not_found"


async def test_the_body_decides_the_model_not_a_client_header(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        outcome = await chat(
            session, stack.envoy_url, "bob", "m1", api_key=TENANT_KEYS["bob"], max_tokens=4,
            extra_headers={"x-model": "m2"},
        )
    assert outcome.status == 200, outcome.error  # m2's engine would have answered 404


async def test_envoy_without_the_processor_routes_by_the_body_model(tmp_path: Path) -> None:
    """The benchmark's Envoy-only baseline reaches each model's engine, and 404s an unknown model."""
    config = write_config(tmp_path, models=("m1", "m2"))
    async with await start_stack(config, tmp_path, sim_args=FAST_SIM, gateway="envoy") as gateway:
        assert gateway.processor is None
        async with aiohttp.ClientSession() as session:
            for model in ("m1", "m2"):
                body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                headers = {"authorization": f"Bearer {TENANT_KEYS['bob']}"}
                async with session.post(f"{gateway.envoy_url}/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status == 200
                    assert (await r.json())["model"] == model  # the simulator of that model answered
            missing = await chat(session, gateway.envoy_url, "bob", "nope", api_key=TENANT_KEYS["bob"], max_tokens=2)
            assert missing.status == 404


async def test_json_with_a_charset_is_still_json(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        outcome = await chat(
            session, stack.envoy_url, "bob", "m1", api_key=TENANT_KEYS["bob"], max_tokens=4,
            extra_headers={"content-type": "application/json; charset=utf-8"},
        )
    assert outcome.status == 200, outcome.error


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "no-such-model", "messages": []}, 404, "model_not_found"),
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model_missing"),
    ],
)
async def test_bad_requests_get_json_errors_not_hangs(stack: Stack, body: dict[str, Any], status: int, code: str) -> None:
    headers = {"authorization": f"Bearer {TENANT_KEYS['bob']}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.post(f"{stack.envoy_url}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == status
            assert r.headers["content-type"] == "application/json"
            assert (await r.json())["error"]["code"] == code
        async with session.post(f"{stack.envoy_url}/v1/chat/completions", json=body) as r:
            assert r.status == 401  # no API key: Envoy's api_key_auth answers before anything else


async def test_a_client_that_leaves_while_queued_is_removed_at_once(tmp_path: Path) -> None:
    # One sequence at a time and long answers: nothing finishes during the test.
    sim = ["--max-num-seqs", "1", "--step-ms", "50", "--time-scale", "1"]
    async with await start_stack(write_config(tmp_path), tmp_path, sim_args=sim) as stack:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

            def send(tenant: str) -> asyncio.Task[Outcome]:
                return asyncio.create_task(
                    chat(session, stack.envoy_url, tenant, "m1", api_key=TENANT_KEYS[tenant], max_tokens=2000)
                )

            flood = [send("alice") for _ in range(10)]
            # 1 running + 3 waiting in the engine; 6 held by us.
            assert await wait_for_metric(stack.metrics_url, "extproc_queue_depth", lambda v: v == 6, model="m1") == 6
            bob = send("bob")
            assert await wait_for_metric(stack.metrics_url, "extproc_queue_depth", lambda v: v == 7, model="m1") == 7
            bob.cancel()
            assert await wait_for_metric(stack.metrics_url, "extproc_queue_depth", lambda v: v == 6, model="m1") == 6
            samples = await read_metrics(stack.metrics_url)
            assert metric(samples, "extproc_abandoned_total", model="m1") == 1
            assert metric(samples, "extproc_in_flight", model="m1") == 4
            # Everyone leaves: nothing stays queued or in flight.
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, bob, return_exceptions=True)
            assert await wait_for_metric(stack.metrics_url, "extproc_in_flight", lambda v: v == 0, model="m1") == 0
            assert await wait_for_metric(stack.metrics_url, "extproc_queue_depth", lambda v: v == 0, model="m1") == 0
            engine = await read_metrics(f"{stack.sim_url('m1')}/metrics")
            # The engine saw only what was released, never the abandoned requests.
            assert metric(engine, "vllm:num_requests_waiting") + metric(engine, "vllm:num_requests_running") <= 4


async def test_sigterm_drains_every_queued_request_to_an_answer(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    async with await start_stack(config, tmp_path, sim_args=FAST_SIM, serve_args=["--drain-seconds", "0.5"]) as stack:
        scenario = PowerUser(model="m1", flood=30, max_tokens=200, newcomers=("bob",), newcomer_delay_s=0.2)
        run = asyncio.create_task(run_power_user(stack.envoy_url, scenario, api_keys=TENANT_KEYS))
        queued = await wait_for_metric(stack.metrics_url, "extproc_queue_depth", lambda v: v > 10, model="m1")
        assert queued > 10
        assert stack.processor is not None
        stack.processor.process.send_signal(signal.SIGTERM)
        outcomes = await asyncio.wait_for(run, 60)
        assert await asyncio.wait_for(stack.processor.process.wait(), 60) == 0
    # Every request got an answer: served, or a clean 503 telling the client to retry.
    rejected = [o for o in outcomes if o.status == 503]
    assert all(json.loads(o.error)["error"]["code"] == "shutting_down" for o in rejected), rejected
    assert len(rejected) + sum(o.status == 200 for o in outcomes) == len(outcomes)
    assert rejected, "the drain deadline passed with requests still queued"
    assert sum(o.status == 200 for o in outcomes) >= 4  # what was in flight ran to its end


def test_a_bad_config_is_refused_with_its_key_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: m\n    endpoints: ['http://127.0.0.1:1']\n    target_waiting: three\n")
    result = subprocess.run(
        [sys.executable, "-m", "extproc", "serve", "--config", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "models[0].target_waiting: must be an integer >= 1, got 'three'" in result.stderr
