"""Shutdown through real parts: SIGTERM to ``extproc serve`` behind a real Envoy, engines simulated.

What an operator expects (docs/guides/operate.md): health turns NOT_SERVING
and Envoy's health check notices; queued requests and new arrivals get the
JSON 503 ``shutting_down``; responses already streaming run to their end and
the process exits only after the last one; after the exit Envoy itself answers
JSON 503 ``processor_unavailable``. The hard deadline and a second signal make
the process exit at once; what still streams goes on through Envoy without it.
Assertions are on counts, statuses and order, not speed.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.tools.power_user import Outcome
from extproc.tools.stack import Stack, start_stack
from tests.lazy import openai
from tests.stackutil import TENANT_KEYS, metric, read_metrics, send_chat, wait_for_metric, write_config

pytestmark = pytest.mark.integration

# Two sequences at a time, real-time steps: a 400-token answer streams for about 8 s.
SLOW_SIM = ["--max-num-seqs", "2", "--step-ms", "20", "--time-scale", "1"]
LONG_ANSWER = 400
# The gate lets exactly two requests into the engine; the rest stay queued here.
TWO_IN_FLIGHT: dict[str, Any] = {"gate": "static_concurrency", "max_in_flight": 2}


async def extproc_health_flags(stack: Stack) -> str:
    """Envoy's health flags for the processor host (admin /clusters), e.g. ``healthy`` or ``/failed_active_hc``."""
    assert stack.envoy is not None
    async with aiohttp.ClientSession() as session, session.get(f"{stack.envoy.admin_url}/clusters") as response:
        text = await response.text()
    return next(line.rpartition("::")[2] for line in text.splitlines() if line.startswith("extproc::")
                and "::health_flags::" in line)


def error_code(outcome: Outcome) -> str:
    code: str = json.loads(outcome.error)["error"]["code"]
    return code


async def start_slow_stack(tmp_path: Path, *serve_args: str) -> Stack:
    config = write_config(tmp_path, **TWO_IN_FLIGHT)
    return await start_stack(config, tmp_path, sim_args=SLOW_SIM, serve_args=list(serve_args))


async def test_sigterm_lets_streaming_responses_finish_and_answers_everyone_else_json(tmp_path: Path) -> None:
    async with await start_slow_stack(tmp_path, "--drain-seconds", "0.5", "--deadline-seconds", "120") as stack:
        assert stack.processor is not None
        process = stack.processor.process
        assert await extproc_health_flags(stack) == "healthy"
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            streaming = [send_chat(session, stack, "alice", LONG_ANSWER) for _ in range(2)]
            assert await wait_for_metric(stack.metrics_url, "extproc_in_flight", lambda v: v == 2, model="m1") == 2
            queued = [send_chat(session, stack, "bob", LONG_ANSWER) for _ in range(6)]
            assert await wait_for_metric(stack.metrics_url, "extproc_queue_depth", lambda v: v == 6, model="m1") == 6

            process.send_signal(signal.SIGTERM)
            # The queue deadline (0.5 s) passes: every queued request is answered, none forwarded.
            queued_outcomes = await asyncio.gather(*queued)
            # New arrivals after the queue deadline, while responses still stream: the processor answers.
            late = await asyncio.gather(*(send_chat(session, stack, "carol", 4) for _ in range(5)))
            samples = await read_metrics(stack.metrics_url)
            assert process.returncode is None, "the processor exited while responses were still streaming"
            assert not any(task.done() for task in streaming), "the answers ended too soon for this test to mean much"
            # Envoy's health check sees NOT_SERVING; being the only processor, it is still used (panic mode).
            flags = ""
            for _ in range(100):
                flags = await extproc_health_flags(stack)
                if "failed_active_hc" in flags:
                    break
                await asyncio.sleep(0.1)
            assert "failed_active_hc" in flags

            finished = await asyncio.gather(*streaming)
            exit_code = await asyncio.wait_for(process.wait(), 30)
            # After the exit, Envoy itself answers: JSON, with a reason and Retry-After.
            async with session.post(
                f"{stack.envoy_url}/v1/chat/completions",
                json={"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                headers={"authorization": f"Bearer {TENANT_KEYS['dave']}"},
            ) as after:
                after_status, after_headers, after_body = after.status, after.headers, await after.json()

    assert [o.status for o in queued_outcomes] == [503] * 6, queued_outcomes
    assert {error_code(o) for o in queued_outcomes} == {"shutting_down"}
    assert [o.status for o in late] == [503] * 5, late
    assert {error_code(o) for o in late} == {"shutting_down"}
    assert metric(samples, "extproc_rejected_total", model="m1", reason="shutting_down") == 6 + 5
    assert metric(samples, "extproc_draining") == 1
    assert metric(samples, "extproc_released_total", model="m1") == 2
    # The responses that were streaming at SIGTERM ran to their end, intact.
    assert [(o.status, o.tokens) for o in finished] == [(200, LONG_ANSWER)] * 2, finished
    assert exit_code == 0
    assert after_status == 503
    assert after_headers["x-extproc-reason"] == "processor_unavailable" and after_headers["retry-after"] == "1"
    assert after_body["error"]["code"] == "processor_unavailable" and after_body["error"]["param"] is None


async def test_at_the_hard_deadline_the_process_exits_and_what_streams_goes_on(tmp_path: Path) -> None:
    async with await start_slow_stack(tmp_path, "--drain-seconds", "0.2", "--deadline-seconds", "1") as stack:
        assert stack.processor is not None
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            streaming = [send_chat(session, stack, "alice", LONG_ANSWER) for _ in range(2)]
            assert await wait_for_metric(stack.metrics_url, "extproc_in_flight", lambda v: v == 2, model="m1") == 2
            stack.processor.process.send_signal(signal.SIGTERM)
            exit_code = await asyncio.wait_for(stack.processor.process.wait(), 30)
            assert not any(task.done() for task in streaming)  # the exit came first ...
            answers = await asyncio.gather(*streaming)
    assert exit_code == 0
    # ... and the responses ran to their end without the processor (failure_mode_allow).
    assert [(o.status, o.tokens) for o in answers] == [(200, LONG_ANSWER)] * 2, answers


async def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    async with await start_slow_stack(tmp_path, "--drain-seconds", "60", "--deadline-seconds", "600") as stack:
        assert stack.processor is not None
        process = stack.processor.process
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            streaming = [send_chat(session, stack, "alice", LONG_ANSWER) for _ in range(2)]
            assert await wait_for_metric(stack.metrics_url, "extproc_in_flight", lambda v: v == 2, model="m1") == 2
            process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            assert process.returncode is None  # draining: the 8 s answers keep it alive
            process.send_signal(signal.SIGINT)
            exit_code = await asyncio.wait_for(process.wait(), 30)
            assert not any(task.done() for task in streaming)
            answers = await asyncio.gather(*streaming)
    assert exit_code == 0
    assert [(o.status, o.tokens) for o in answers] == [(200, LONG_ANSWER)] * 2, answers


async def test_openai_sdk_gets_typed_errors_while_draining(tmp_path: Path) -> None:
    """The SDK raises its typed 503 error with the processor's message; it does not retry on its own here."""
    async with (
        await start_slow_stack(tmp_path, "--drain-seconds", "60") as stack,
        aiohttp.ClientSession() as session,
    ):
        assert stack.processor is not None
        # A long answer keeps the draining processor up (it exits once nothing runs).
        streaming = send_chat(session, stack, "alice", 2000)
        assert await wait_for_metric(stack.metrics_url, "extproc_in_flight", lambda v: v == 1, model="m1") == 1
        stack.processor.process.send_signal(signal.SIGTERM)
        client = openai.AsyncOpenAI(base_url=f"{stack.envoy_url}/v1", api_key=TENANT_KEYS["bob"], max_retries=0)
        async with client:
            with pytest.raises(openai.InternalServerError) as err:
                await client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "x"}])
        assert not streaming.done()
        streaming.cancel()
        assert err.value.status_code == 503
        assert err.value.code == "shutting_down"
        assert "retry shortly" in err.value.message
        assert err.value.response.headers["retry-after"] == "1"
