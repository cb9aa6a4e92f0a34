"""Batch files in an S3-compatible store (``batches.files.s3``) through real parts: Envoy, ``extproc serve``, the
simulator, Redis for a cluster, and moto's server mode as the store (tests/s3util.py).

One instance: the OpenAI SDK's workflow with every file in the bucket and none
on disk; the store away once the lines run: the API answers 503 saying so,
the lines go on, and the batch completes once the store is back. Two
instances on one Redis and one bucket, no shared directory: each line once in
the output, both instances running lines; the store away mid-batch: 503 on
either instance, no line lost or run twice, the batch completes once it is
back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.adapters.batches.s3 import READ_TIMEOUT_S
from extproc.tools.procs import free_port
from extproc.tools.stack import Stack, start_stack
from tests import batchutil
from tests.batchutil import chat_line, cluster_config, completed_count, entries, instance_api, jsonl, wait_final
from tests.lazy import openai
from tests.redisutil import RedisServer
from tests.s3util import S3Server
from tests.stackutil import metric, read_metrics, write_stack_config

pytestmark = pytest.mark.integration

# Four sequences of 20 ms steps: a 20-token line runs 0.4 s, so 24 lines take a few seconds.
SLOW_SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "1"]
LINES = 24


@pytest.fixture
def s3_server(tmp_path: Path) -> Iterator[S3Server]:
    server = S3Server(tmp_path)
    server.start()
    server.create_bucket()
    yield server
    server.stop()


async def create(sdk: openai.AsyncOpenAI, lines: list[dict[str, Any]]) -> tuple[str, str]:
    uploaded = await sdk.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")
    return uploaded.id, batch.id


async def until_completed(sdk: openai.AsyncOpenAI, batch_id: str, least: int) -> None:
    deadline = time.monotonic() + 30
    while (done := await completed_count(sdk, batch_id)) < least:
        assert time.monotonic() < deadline, f"{batch_id}: {done} lines completed after 30 s"
        await asyncio.sleep(0.05)


async def refused_while_away(sdk: openai.AsyncOpenAI, input_file_id: str) -> None:
    """An upload and a file's content each answer 503 saying the file store is away, neither waiting on it.

    Bounded by one of the store's read timeouts for both (the bound s3.py promises per attempt, for a store that
    takes the connection and never answers): a hang bound, whatever the machine's speed; a refused connection
    ends each far sooner.
    """
    async with asyncio.timeout(READ_TIMEOUT_S):
        with pytest.raises(openai.InternalServerError) as upload:
            await sdk.files.create(file=("more.jsonl", jsonl([chat_line("x")])), purpose="batch")
        with pytest.raises(openai.InternalServerError) as content:
            await sdk.files.content(input_file_id)
    for refused in (upload.value, content.value):
        assert refused.status_code == 503 and refused.response.headers["retry-after"] == "1"
        assert "cannot reach its file store" in refused.message, refused.message


async def engine_finished(stack: Stack) -> float:
    """Requests the simulator ran to their end (aborted ones apart)."""
    samples = await read_metrics(f"{stack.sim_url('m1')}/metrics")
    return sum(value for (name, labels), value in samples.items()
               if name == "vllm:request_success_total" and dict(labels).get("finished_reason") in ("stop", "length"))


async def test_one_instance_keeps_every_file_in_the_bucket_and_waits_out_the_store_away(
    tmp_path: Path, s3_server: S3Server
) -> None:
    directory = tmp_path / "batches"
    path = write_stack_config(
        tmp_path, {"m1": {"max_running": 4}},
        batches={"directory": str(directory), "listen": f"127.0.0.1:{free_port()}",
                 "runner_listen": f"127.0.0.1:{free_port()}", "files": {"s3": s3_server.settings()}},
        tenants={"bob": {"priorities": ["standard", "batch"]}},
    )
    async with await start_stack(path, tmp_path, sim_args=SLOW_SIM) as stack, \
            batchutil.client(stack.envoy_url, "bob") as sdk:
        quick = [chat_line(f"q{i}") for i in range(6)] + [{"custom_id": "bad"}]
        input_id, batch_id = await create(sdk, quick)
        done = await wait_final(sdk, batch_id)
        assert done.status == "completed" and done.request_counts is not None, done
        assert (done.request_counts.completed, done.request_counts.failed) == (6, 1)
        out, errors = await entries(sdk, done.output_file_id), await entries(sdk, done.error_file_id)
        assert sorted(e["custom_id"] for e in out) == [f"q{i}" for i in range(6)]
        assert [e["error"]["code"] for e in errors] == ["invalid_method"]
        assert (await sdk.files.content(input_id)).content == jsonl(quick)
        assert s3_server.keys() == sorted(f"batches/{f}" for f in (input_id, done.output_file_id, done.error_file_id))
        assert not (directory / "files").exists()  # the directory holds the SQLite state only
        await sdk.files.delete(done.error_file_id or "")
        assert s3_server.keys() == sorted(f"batches/{f}" for f in (input_id, done.output_file_id))

        # The store away once the lines run: they go on (their bodies are in SQLite), the batch waits to finalize.
        lines = [chat_line(f"r{i}", max_tokens=20) for i in range(LINES)]
        input_id, batch_id = await create(sdk, lines)
        await until_completed(sdk, batch_id, 2)
        s3_server.stop()
        await refused_while_away(sdk, input_id)
        await until_completed(sdk, batch_id, LINES)
        await asyncio.sleep(1.5)  # the finalization tried and failed at least once
        assert (await sdk.batches.retrieve(batch_id)).status in ("in_progress", "finalizing")
        s3_server.start()
        done = await wait_final(sdk, batch_id)
        assert done.status == "completed", done
        out = await entries(sdk, done.output_file_id)
    assert sorted(e["custom_id"] for e in out) == sorted(f"r{i}" for i in range(LINES))


async def test_two_instances_share_a_batch_through_the_bucket_and_lose_no_line_while_it_is_away(
    tmp_path: Path, redis_server: RedisServer, s3_server: S3Server
) -> None:
    path = cluster_config(tmp_path, redis_server.url, {"files": {"s3": s3_server.settings()}})  # no directory
    async with await start_stack(path, tmp_path, sim_args=SLOW_SIM) as stack, \
            instance_api(stack, "a") as on_a, instance_api(stack, "b") as on_b:
        lines = [chat_line(f"r{i}", max_tokens=20) for i in range(LINES)]
        input_id, batch_id = await create(on_a, lines)
        await until_completed(on_b, batch_id, 4)
        s3_server.stop()  # new lines' bodies cannot be read: claimed lines go back, nothing is sent twice
        await refused_while_away(on_b, input_id)
        await asyncio.sleep(1.0)
        assert (await on_a.batches.retrieve(batch_id)).status == "in_progress"
        s3_server.start()
        done = await wait_final(on_b, batch_id)
        assert done.status == "completed", done
        assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) == (
            LINES, 0)
        out = await entries(on_a, done.output_file_id)
        assert sorted(e["custom_id"] for e in out) == sorted(f"r{i}" for i in range(LINES))  # each exactly once
        assert await engine_finished(stack) == LINES  # and each ran once at the engine
        shares = [metric(await read_metrics(stack.metrics_urls[name]), "extproc_batch_lines_total", tenant="bob",
                         outcome="completed") for name in ("a", "b")]
        assert sum(shares) == LINES and min(shares) > 0, shares  # both instances ran lines
        # The lines file is gone once the batch is final; the input and output files stay.
        assert s3_server.keys() == sorted(f"batches/{f}" for f in (input_id, done.output_file_id))
