"""Batches shared by a cluster: two ``extproc serve`` instances, one Redis, one Envoy, the simulator.

Each instance's batch API is called directly (as Envoy would, with the
tenant header), so the test picks which instance takes each call: a batch
created on one is visible, and cancellable, on the other; both instances
run its lines; each line runs once at the engine (the simulator's own count
of requests it finished) and appears once in the output. One instance
killed (SIGKILL) mid-batch: its leases lapse, the other takes its lines,
and the output still has every line once.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from extproc.tools.stack import Stack, start_stack
from tests.batchutil import chat_line, cluster_config, completed_count, entries, instance_api, jsonl, wait_final
from tests.lazy import openai
from tests.redisutil import RedisServer
from tests.stackutil import metric, read_metrics

pytestmark = pytest.mark.integration

# Four sequences of 20 ms steps: a 30-token line runs 0.6 s, so a batch of 40 takes several seconds.
SLOW_SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "1"]
LINES = 40


async def engine_finished(stack: Stack) -> float:
    """Requests the simulator ran to their end (aborted ones apart)."""
    samples = await read_metrics(f"{stack.sim_url('m1')}/metrics")
    return sum(value for (name, labels), value in samples.items()
               if name == "vllm:request_success_total" and dict(labels).get("finished_reason") in ("stop", "length"))


async def sent_by(stack: Stack, name: str, **labels: str) -> float:
    return metric(await read_metrics(stack.metrics_urls[name]), "extproc_batch_lines_total", tenant="bob", **labels)


async def create(sdk: openai.AsyncOpenAI, lines: list[dict[str, Any]]) -> str:
    uploaded = await sdk.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return (await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")).id


async def until_completed(sdk: openai.AsyncOpenAI, batch_id: str, least: int) -> int:
    deadline = time.monotonic() + 30
    while (done := await completed_count(sdk, batch_id)) < least:
        assert time.monotonic() < deadline, f"{batch_id}: {done} lines completed after 30 s"
        await asyncio.sleep(0.05)
    return done


async def test_a_batch_is_shared_visible_and_cancellable_across_instances_and_runs_each_line_once(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    lines = [chat_line(f"r{i}", max_tokens=30) for i in range(LINES)]
    path = cluster_config(tmp_path, redis_server.url, {"directory": str(tmp_path / "shared")})
    async with await start_stack(path, tmp_path, sim_args=SLOW_SIM) as stack, \
            instance_api(stack, "a") as on_a, instance_api(stack, "b") as on_b:
        batch_id = await create(on_a, lines)
        assert (await on_b.batches.retrieve(batch_id)).id == batch_id  # on the other instance at once
        assert [b.id for b in (await on_b.batches.list()).data] == [batch_id]
        done = await wait_final(on_b, batch_id)
        assert done.status == "completed", done
        assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) == (
            LINES, 0)
        out = await entries(on_a, done.output_file_id)  # the file is on the shared directory
        assert sorted(e["custom_id"] for e in out) == sorted(f"r{i}" for i in range(LINES))
        assert await engine_finished(stack) == LINES  # each line ran once at the engine
        shares = {name: await sent_by(stack, name, outcome="completed") for name in ("a", "b")}
        assert sum(shares.values()) == LINES and min(shares.values()) > 0, shares  # both instances ran lines

        # Created on b, cancelled on a: b's runner cuts its lines too, and every line is in one file once.
        cancelled_id = await create(on_b, [chat_line(f"c{i}", max_tokens=30) for i in range(LINES)])
        await until_completed(on_a, cancelled_id, 2)
        assert (await on_a.batches.cancel(cancelled_id)).status == "cancelling"
        batch = await wait_final(on_b, cancelled_id)
        assert batch.status == "cancelled", batch
        counts = batch.request_counts
        assert counts is not None and 0 < counts.completed < LINES and counts.completed + counts.failed == LINES
        out, errors = await entries(on_b, batch.output_file_id), await entries(on_a, batch.error_file_id)
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        assert sorted(e["custom_id"] for e in out + errors) == sorted(f"c{i}" for i in range(LINES))
        await asyncio.sleep(0.5)  # the cut lines' ends reach the processors
        samples = [await read_metrics(stack.metrics_urls[name]) for name in ("a", "b")]
    assert all(metric(s, "extproc_batch_lines_in_flight", tenant="bob") == 0 for s in samples)


async def test_an_instance_killed_mid_batch_loses_and_duplicates_no_line(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    lines = [chat_line(f"r{i}", max_tokens=30) for i in range(LINES)]
    path = cluster_config(tmp_path, redis_server.url, {"directory": str(tmp_path / "shared")})
    async with await start_stack(path, tmp_path, sim_args=SLOW_SIM) as stack, instance_api(stack, "b") as on_b:
        batch_id = await create(on_b, lines)
        await until_completed(on_b, batch_id, 6)
        deadline = time.monotonic() + 10
        while not (held := metric(await read_metrics(stack.metrics_urls["a"]), "extproc_batch_lines_in_flight",
                                  tenant="bob")):
            assert time.monotonic() < deadline, "instance a never had a line in flight"
            await asyncio.sleep(0.02)
        killed = stack.processors["a"]
        killed.process.send_signal(signal.SIGKILL)  # its leases lapse (cluster.lease_s) and b takes its lines
        await killed.process.wait()
        done = await wait_final(on_b, batch_id)
        assert done.status == "completed", done
        out = await entries(on_b, done.output_file_id)
        finished = await engine_finished(stack)
    assert sorted(e["custom_id"] for e in out) == sorted(f"r{i}" for i in range(LINES))  # each exactly once
    assert done.request_counts is not None and done.request_counts.completed == LINES
    # The engine finished each line; a line the killed instance had in flight may have finished there too,
    # its answer lost with the instance, before b sent it again.
    assert LINES <= finished <= LINES + held, (finished, held)
