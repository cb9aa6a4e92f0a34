"""The batch API through real parts: Envoy, ``extproc serve`` and the simulator, the OpenAI SDK as the client.

The SDK's own workflow (files.create, batches.create, batches.retrieve until
final, files.content) through the generated Envoy; each line is a live
request of the batch's tenant in its lowest class (counted by the
processor's ``extproc_released``); a restart of the processor mid-batch
(SIGKILL) loses and duplicates no line; cancel; expiry with a short window;
hostile files.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.tools.power_user import chat
from extproc.tools.procs import free_port
from extproc.tools.sim.server import estimate_tokens
from extproc.tools.stack import Stack, start_stack
from tests import batchutil
from tests.batchutil import chat_line, completed_count, entries, jsonl, wait_final
from tests.lazy import openai
from tests.stackutil import TENANT_KEYS, metric, read_metrics, wait_for_metric, write_stack_config

pytestmark = pytest.mark.integration

FAST_SIM = ["--max-num-seqs", "8", "--step-ms", "5", "--time-scale", "1"]


def batch_config(tmp_path: Path, **batches: Any) -> Path:
    return write_stack_config(
        tmp_path, {"m1": {"max_running": 8}},
        batches={"directory": str(tmp_path / "batches"), "listen": f"127.0.0.1:{free_port()}",
                 "runner_listen": f"127.0.0.1:{free_port()}", "completion_windows": ["24h", "4s"], **batches},
        # bob may use standard and batch: its lines run in batch, the lowest it may use.
        tenants={"bob": {"priorities": ["standard", "batch"]}},
    )


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    serve_args = ["--log-format", "json", "--log-level", "debug"]  # the decision log, read by the workflow test
    # chunk_tokens: the lines of 8 tokens below are sent whole; the long lines of the chunk test in chunks.
    path = batch_config(tmp_path, chunk_tokens=16)
    async with await start_stack(path, tmp_path, sim_args=FAST_SIM, serve_args=serve_args) as running:
        yield running


def client(stack: Stack, tenant: str) -> openai.AsyncOpenAI:
    return batchutil.client(stack.envoy_url, tenant)


async def test_the_sdk_workflow_end_to_end(stack: Stack) -> None:
    async with client(stack, "bob") as sdk:
        uploaded = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(f"r{i}") for i in range(30)])),
                                          purpose="batch")
        assert (uploaded.purpose, uploaded.filename) == ("batch", "in.jsonl")
        assert (await sdk.files.retrieve(uploaded.id)).bytes == uploaded.bytes
        batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h", metadata={"job": "nightly"})
        assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
        done = await wait_final(sdk, batch.id)
        assert done.status == "completed", done
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (30, 30, 0)
        assert done.model == "m1" and done.error_file_id is None
        assert None not in (done.in_progress_at, done.finalizing_at, done.completed_at)
        out = await entries(sdk, done.output_file_id)
        assert sorted(e["custom_id"] for e in out) == sorted(f"r{i}" for i in range(30))
        assert all(e["response"]["status_code"] == 200 and e["response"]["body"]["choices"] for e in out)
        assert all(e["id"].startswith("batch_req_") and e["error"] is None for e in out)
        # Usage sums each completion's tokens: 8 generated per line here.
        assert done.usage is not None and done.usage.output_tokens == 30 * 8
        assert done.usage.input_tokens == sum(e["response"]["body"]["usage"]["prompt_tokens"] for e in out) > 0
        listed = await sdk.batches.list(limit=1)
        assert [b.id for b in listed.data] == [batch.id]
    # Each line ran as bob in batch, the lowest class bob may use, through the fair queue.
    samples = await read_metrics(stack.metrics_url)
    assert metric(samples, "extproc_released_total", tenant="bob", priority="batch") == 30
    assert metric(samples, "extproc_released_total", tenant="bob", priority="standard") == 0
    assert metric(samples, "extproc_batch_lines_total", tenant="bob", outcome="completed") == 30
    # The processor's own decision entry for each line names it: the batch and the line's index.
    logged = [json.loads(line) for line in (stack.workdir / "extproc.log").read_text().splitlines()]
    released = [d for d in logged if d["logger"] == "extproc.decisions" and d.get("outcome") == "released"]
    assert sorted(d["batch_line"] for d in released) == sorted(f"{batch.id}/{i}" for i in range(30))
    assert {(d["tenant"], d["class"]) for d in released} == {("bob", "batch")}


async def test_a_long_line_runs_in_chunks_through_the_queue_and_is_recorded_as_one_answer(stack: Stack) -> None:
    """40 tokens at chunk_tokens 16: three requests (16, 16, 8), each released through the fair queue."""
    completion = {"custom_id": "long", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "m1", "prompt": "say long", "max_tokens": 40}}
    before = await read_metrics(f"{stack.sim_url('m1')}/metrics")
    async with client(stack, "bob") as sdk:
        answers = {}
        for endpoint, line in (("/v1/chat/completions", chat_line("long", max_tokens=40)), ("/v1/completions", completion)):
            uploaded = await sdk.files.create(file=("in.jsonl", jsonl([line])), purpose="batch")
            done = await wait_final(sdk, (await sdk.batches.create(input_file_id=uploaded.id, endpoint=endpoint,  # type: ignore[arg-type]
                                                                   completion_window="24h")).id)
            assert done.status == "completed" and done.usage is not None, done
            assert (done.usage.input_tokens, done.usage.output_tokens) == (estimate_tokens("say long"), 40)
            (entry,) = await entries(sdk, done.output_file_id)
            answers[endpoint] = entry["response"]["body"]
    chat_answer, text_answer = answers["/v1/chat/completions"], answers["/v1/completions"]
    for body, text in ((chat_answer, chat_answer["choices"][0]["message"]["content"]),
                       (text_answer, text_answer["choices"][0]["text"])):
        # One answer: every chunk's words in one text, the last chunk's finish, the usage of one request.
        assert len(text.split()) == 40 and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": estimate_tokens("say long"), "completion_tokens": 40,
                                 "total_tokens": estimate_tokens("say long") + 40}
    after = await read_metrics(f"{stack.sim_url('m1')}/metrics")
    finished = metric(after, "vllm:request_success_total") - metric(before, "vllm:request_success_total")
    read = metric(after, "vllm:prompt_tokens_total") - metric(before, "vllm:prompt_tokens_total")
    assert finished == 6  # three chunks a line
    assert read > 6 * estimate_tokens("say long")  # each continuation re-read the text so far
    samples = await read_metrics(stack.metrics_url)
    assert metric(samples, "extproc_released_total", tenant="bob", priority="batch") == 6
    assert metric(samples, "extproc_batch_line_chunks_total", tenant="bob") == 4


async def test_a_tenant_sees_only_its_own_files_and_batches(stack: Stack) -> None:
    async with client(stack, "bob") as bob, client(stack, "alice") as alice:
        uploaded = await bob.files.create(file=("in.jsonl", jsonl([chat_line("a")])), purpose="batch")
        batch = await bob.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
        for call in (alice.files.retrieve(uploaded.id), alice.files.content(uploaded.id),
                     alice.files.delete(uploaded.id), alice.batches.retrieve(batch.id), alice.batches.cancel(batch.id),
                     alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                await call
        assert (await alice.batches.list()).data == []
        assert (await wait_final(bob, batch.id)).status == "completed"
    async with openai.AsyncOpenAI(base_url=f"{stack.envoy_url}/v1", api_key="wrong", max_retries=0) as nobody:
        with pytest.raises(openai.AuthenticationError):
            await nobody.batches.list()


async def test_hostile_files_fail_their_lines_only(stack: Stack) -> None:
    huge = chat_line("huge")
    huge["body"]["messages"][0]["content"] = "x" * (9 * 1024 * 1024)
    other_model = chat_line("other", model="m2")
    wrong_url = {**chat_line("url"), "url": "/v1/embeddings"}
    content = b"".join([
        jsonl([chat_line("ok1")]), b"this is not json\n", jsonl([huge]), jsonl([chat_line("ok1")]),
        jsonl([other_model, wrong_url]), b"[1, 2]\n", jsonl([chat_line("ok2")]),
    ])
    async with client(stack, "bob") as sdk:
        uploaded = await sdk.files.create(file=("hostile.jsonl", content), purpose="batch")
        batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
        done = await wait_final(sdk, batch.id)
        assert done.status == "completed", done
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 2, 6)
        assert sorted(e["custom_id"] for e in await entries(sdk, done.output_file_id)) == ["ok1", "ok2"]
        errors = await entries(sdk, done.error_file_id)
        assert [e["error"]["code"] for e in errors] == ["invalid_json_line", "line_too_large", "duplicate_custom_id",
                                                        "mismatched_model", "mismatched_url", "invalid_json_line"]
        assert all(e["response"] is None for e in errors)
        # Wrong requests of the API itself: OpenAI's errors.
        with pytest.raises(openai.BadRequestError) as bad:
            await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/moderations",
                                     completion_window="24h")
        assert bad.value.code == "invalid_value" and bad.value.param == "endpoint"
        with pytest.raises(openai.BadRequestError):
            await sdk.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
        # A file of nothing valid fails the batch as a whole.
        junk = await sdk.files.create(file=("junk.jsonl", b"not json\n{}\n"), purpose="batch")
        failed = await wait_final(sdk, (await sdk.batches.create(
            input_file_id=junk.id, endpoint="/v1/chat/completions", completion_window="24h")).id)
        assert failed.status == "failed" and failed.errors is not None and failed.errors.data
        assert failed.errors.data[0].code == "invalid_file"


SLOW_SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "1"]


@pytest.fixture
async def slow_stack(tmp_path: Path) -> AsyncIterator[Stack]:
    path = batch_config(tmp_path, in_flight_per_batch=6)
    async with await start_stack(path, tmp_path, sim_args=SLOW_SIM) as running:
        yield running


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
async def test_a_processor_stopped_mid_batch_resumes_losing_and_duplicating_nothing(slow_stack: Stack, sig: int) -> None:
    """Killed, or stopped as a deployment stops it (SIGTERM: the runner stops first, then the queue drains)."""
    lines = [chat_line(f"r{i}", max_tokens=30) for i in range(24)]
    async with client(slow_stack, "bob") as sdk:
        uploaded = await sdk.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch_id = (await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                             completion_window="24h")).id
        deadline = time.monotonic() + 30
        while (done := await completed_count(sdk, batch_id)) < 6:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert done < 24
        # The status page lists it, with its progress.
        async with aiohttp.ClientSession() as session, session.get(
                f"http://{slow_stack.config.listen.metrics}/status.json") as response:
            listed = (await response.json())["batches"]
        assert [(b["id"], b["tenant"], b["status"], b["total"]) for b in listed] == [(batch_id, "bob", "in_progress", 24)]
        assert listed[0]["completed"] >= 6 and listed[0]["lines_per_s"] > 0
        processor = slow_stack.processor
        assert processor is not None
        assert await processor.stop(sig=sig) == (-9 if sig == signal.SIGKILL else 0)  # in flight: unrecorded
        await slow_stack.start_processor()
        batch = await wait_final(sdk, batch_id)
        assert batch.status == "completed", batch
        out = await entries(sdk, batch.output_file_id)
    assert sorted(e["custom_id"] for e in out) == sorted(f"r{i}" for i in range(24))  # each exactly once
    assert batch.request_counts is not None and batch.request_counts.completed == 24


async def test_cancel_and_expiry_through_the_stack_keep_what_finished(slow_stack: Stack) -> None:
    lines = [chat_line(f"r{i}", max_tokens=30) for i in range(40)]
    async with client(slow_stack, "bob") as sdk:
        uploaded = await sdk.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        cancelled_id = (await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h")).id
        deadline = time.monotonic() + 30
        while await completed_count(sdk, cancelled_id) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert (await sdk.batches.cancel(cancelled_id)).status == "cancelling"
        expiring_id = (await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                completion_window="4s")).id  # type: ignore[arg-type]
        for batch_id, status, code in ((cancelled_id, "cancelled", "batch_cancelled"),
                                       (expiring_id, "expired", "batch_expired")):
            batch = await wait_final(sdk, batch_id)
            assert batch.status == status, batch
            counts = batch.request_counts
            assert counts is not None and 0 < counts.completed < 40 and counts.completed + counts.failed == 40
            out, errors = await entries(sdk, batch.output_file_id), await entries(sdk, batch.error_file_id)
            assert len(out) == counts.completed and {e["error"]["code"] for e in errors} == {code}
            assert sorted(e["custom_id"] for e in out + errors) == sorted(f"r{i}" for i in range(40))
    # Nothing of either batch is left in the queue or on the engine.
    samples = await read_metrics(slow_stack.metrics_url)
    assert metric(samples, "extproc_batch_lines_in_flight", tenant="bob") == 0


async def test_a_chat_at_risk_preempts_a_batch_line_which_runs_again_and_completes(tmp_path: Path) -> None:
    """Two slots full of batch lines; a chat with a tight objective preempts one, which is sent again."""
    path = write_stack_config(
        tmp_path, {"m1": {"max_running": 2}},
        batches={"directory": str(tmp_path / "batches"), "listen": f"127.0.0.1:{free_port()}",
                 "runner_listen": f"127.0.0.1:{free_port()}", "in_flight_per_batch": 2},
        bands={"interactive": {"ttft_objective_s": 0.3}},
    )
    sim = ["--max-num-seqs", "2", "--step-ms", "10", "--time-scale", "1"]
    async with await start_stack(path, tmp_path, sim_args=sim) as stack, client(stack, "bob") as sdk:
        uploaded = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(f"r{i}", 300) for i in range(3)])),
                                          purpose="batch")
        batch_id = (await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                             completion_window="24h")).id
        await wait_for_metric(stack.metrics_url, "extproc_released_total", lambda v: v >= 2, priority="batch")
        await asyncio.sleep(0.3)  # the scrape shows both running
        async with aiohttp.ClientSession() as session:
            outcome = await chat(session, stack.envoy_url, "alice", "m1", api_key=TENANT_KEYS["alice"],
                                 max_tokens=4, extra_headers={"x-priority": "interactive"})
        assert outcome.status == 200 and outcome.ttft_s is not None, outcome
        # It went ahead of the lines (3 s of steps each): answered before either running line ended.
        assert await completed_count(sdk, batch_id) == 0, outcome
        batch = await wait_final(sdk, batch_id)
        assert batch.status == "completed" and batch.request_counts is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 0)
        samples = await read_metrics(stack.metrics_url)
    assert metric(samples, "extproc_preemptions_total") >= 1
    assert metric(samples, "extproc_batch_line_retries_total", tenant="bob", reason="preempted") >= 1
