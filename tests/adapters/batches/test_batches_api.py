"""The batch service in process: the API over real HTTP with the OpenAI SDK, the runner against a stand-in gateway.

The stand-in plays Envoy's runner listener: it records what each line
carried, answers as a test tells it (a chat completion, a refusal such as
``preempted``, or nothing until released), and counts how many lines are in
flight at once. The SDK talks to the API port directly, naming its tenant
in the header Envoy's auth would set.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from extproc.adapters.batches.sender import retry_after
from extproc.adapters.batches.service import BatchService
from extproc.adapters.config import Config, parse_config
from extproc.adapters.telemetry.labels import TenantLabels
from extproc.tools.procs import free_port
from tests.lazy import openai

pytestmark = pytest.mark.unit

Answer = Callable[[str, int], web.Response | None]  # custom id, attempt -> the answer (None: hold it)


def completion(custom_id: str) -> web.Response:
    return web.json_response({"id": f"chatcmpl-{custom_id}", "object": "chat.completion",
                              "choices": [{"index": 0, "message": {"role": "assistant", "content": custom_id}}]})


def refusal(reason: str, status: int = 503) -> web.Response:
    return web.json_response({"error": {"message": reason, "type": "server_error", "param": None, "code": reason}},
                             status=status, headers={"x-extproc-reason": reason, "retry-after": "1"})


@dataclass
class Gateway:
    """The runner listener's stand-in."""

    answer: Answer = lambda custom_id, attempt: completion(custom_id)
    attempts: Counter[str] = field(default_factory=Counter)
    headers: list[dict[str, str]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        custom_id = body["messages"][0]["content"]
        self.attempts[custom_id] += 1
        self.headers.append(dict(request.headers))
        self.bodies.append(body)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            answer = self.answer(custom_id, self.attempts[custom_id])
            while answer is None and not self.release.is_set():  # held until the test ends, or the runner leaves
                if request.transport is None or request.transport.is_closing():
                    return web.Response(status=499)
                await asyncio.sleep(0.02)
            return answer or completion(custom_id)
        finally:
            self.in_flight -= 1


def config(tmp_path: Path, gateway_port: int, **batches: Any) -> Config:
    return parse_config({
        "priorities": ["interactive", "standard", "batch"],
        # m2's engine is not vLLM: its lines are never chunked.
        "models": [{"name": "m1", "endpoints": ["http://127.0.0.1:1"]},
                   {"name": "m2", "endpoints": ["http://127.0.0.1:2"], "engine": "sglang"}],
        "tenants": {"bob": {"priorities": ["interactive", "standard"]}},
        "batches": {"directory": str(tmp_path / "batches"), "listen": f"127.0.0.1:{free_port()}",
                    "gateway_url": f"http://127.0.0.1:{gateway_port}", "runner_key": "k",
                    "in_flight_per_batch": 3, "completion_windows": ["24h", "2s", "1s"], **batches},
    })


class Served:
    """The gateway stand-in and the batch service (restartable on the same directory)."""

    def __init__(self, tmp_path: Path) -> None:
        self.gateway = Gateway()
        self.gateway_port = free_port()
        self.config = config(tmp_path, self.gateway_port)
        self.service: BatchService | None = None
        self.registry = CollectorRegistry()
        self.clock: Callable[[], float] = time.time

    async def start_gateway(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.gateway.handle)
        self._gateway = web.AppRunner(app, access_log=None)
        await self._gateway.setup()
        await web.TCPSite(self._gateway, "127.0.0.1", self.gateway_port).start()

    async def stop_gateway(self) -> None:
        await self._gateway.cleanup()

    async def start(self) -> None:
        self.registry = CollectorRegistry()
        self.service = BatchService(lambda: self.config, self.registry, TenantLabels(["bob"]), clock=self.clock)
        await self.service.start()

    async def stop(self) -> None:
        if self.service is not None:
            await self.service.stop()
            self.service = None

    def client(self, tenant: str) -> openai.AsyncOpenAI:
        assert self.config.batches is not None
        return openai.AsyncOpenAI(base_url=f"http://{self.config.batches.listen}/v1", api_key="unused",
                                  max_retries=0, default_headers={"x-tenant-id": tenant})

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    served = Served(tmp_path)
    await served.start_gateway()
    await served.start()
    yield served
    served.gateway.release.set()
    await served.stop()
    await served.stop_gateway()


def chat_lines(count: int, prefix: str = "r") -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m1", "messages": [{"role": "user", "content": f"{prefix}{i}"}]},
    }).encode() + b"\n" for i in range(count))


async def start_batch(sdk: openai.AsyncOpenAI, content: bytes, window: str = "24h") -> str:
    uploaded = await sdk.files.create(file=("in.jsonl", content), purpose="batch")
    batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window=window)  # type: ignore[arg-type]
    return batch.id


async def final(sdk: openai.AsyncOpenAI, batch_id: str, timeout_s: float = 20) -> Any:
    deadline = time.monotonic() + timeout_s
    while (batch := await sdk.batches.retrieve(batch_id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.05)
    return batch


async def lines_of(sdk: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in (await sdk.files.content(file_id)).text.splitlines()]


async def until(check: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def test_lines_go_as_the_tenant_in_its_lowest_class_paced_and_a_preempted_one_is_retried(
        served: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="extproc.decisions")
    gateway = served.gateway
    # Every third line is preempted on its first attempt; "r4" is a bad request the engine refuses.
    gateway.answer = lambda cid, attempt: (
        refusal("preempted") if int(cid[1:]) % 3 == 0 and attempt == 1
        else web.json_response({"error": {"message": "bad"}}, status=400) if cid == "r4"
        else completion(cid))
    async with served.client("bob") as sdk:
        batch = await final(sdk, await start_batch(sdk, chat_lines(10)))
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (10, 9, 1)
    async with served.client("bob") as sdk:
        out, errors = await lines_of(sdk, batch.output_file_id), await lines_of(sdk, batch.error_file_id)
    assert sorted(e["custom_id"] for e in out) == sorted(f"r{i}" for i in range(10) if i != 4)
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == out[0]["custom_id"]
    assert [(e["custom_id"], e["response"]["status_code"], e["error"]) for e in errors] == [("r4", 400, None)]
    # bob may use interactive and standard: its lines ask for standard; with the runner's key.
    assert {(h["x-tenant-id"], h["x-priority"], h["x-extproc-batch-key"]) for h in gateway.headers} == {
        ("bob", "standard", "k")}
    # Sent again after its preemption, a line says it is a retry (so it is not preempted twice); never before.
    retried = sorted(h.get("x-stainless-retry-count", "0") for h in gateway.headers)
    assert retried == ["0"] * 10 + ["1"] * 4
    assert gateway.most_in_flight <= 3
    assert gateway.attempts == Counter({f"r{i}": 2 if i % 3 == 0 else 1 for i in range(10)})
    assert served.sample("extproc_batch_line_retries_total", tenant="bob", reason="preempted") == 4
    assert served.sample("extproc_batch_lines_total", tenant="bob", outcome="completed") == 9
    assert served.sample("extproc_batch_lines_pending", tenant="bob") == 0
    assert served.sample("extproc_batches", status="completed") == 1
    # The decision log marks each attempt's end of a batch line.
    decided = Counter(getattr(r, "outcome", "") for r in caplog.records if getattr(r, "batch", None) == batch.id)
    assert decided == Counter({"completed": 9, "failed:400": 1, "retry:preempted": 4})


def chunk(text: str, tokens: int, finish: str = "length") -> web.Response:
    return web.json_response({"id": f"chatcmpl-{text.strip()}", "object": "chat.completion",
                              "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                           "finish_reason": finish}],
                              "usage": {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}})


def line(custom_id: str, max_tokens: int, model: str = "m1") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": custom_id}], "max_tokens": max_tokens}}


async def test_a_long_line_runs_as_chunks_a_preempted_chunk_is_sent_again_and_its_answer_is_one(
        served: Served, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """chunk_tokens 16: a line of 40 tokens is three requests (16, 16, 8), the second preempted once and sent again."""
    caplog.set_level(logging.DEBUG, logger="extproc.decisions")
    await served.stop()
    served.config = config(tmp_path, served.gateway_port, chunk_tokens=16)
    await served.start()
    long = {1: chunk(" a", 16), 2: refusal("preempted"), 3: chunk(" b", 16), 4: chunk(" c", 8)}
    served.gateway.answer = lambda cid, attempt: long[attempt] if cid == "long" else chunk(f" {cid}", 8, "stop")
    async with served.client("bob") as sdk:
        chunked = await final(sdk, await start_batch(sdk, b"".join(
            json.dumps(x).encode() + b"\n" for x in (line("long", 40), line("short", 8)))))
        whole = await final(sdk, await start_batch(sdk, json.dumps(line("other", 40, "m2")).encode()))
        out = {e["custom_id"]: e["response"] for e in await lines_of(sdk, chunked.output_file_id)}
    assert chunked.status == whole.status == "completed"
    assert served.gateway.attempts == Counter({"long": 4, "short": 1, "other": 1})
    sent = [(body, headers.get("x-stainless-retry-count", "0"))
            for body, headers in zip(served.gateway.bodies, served.gateway.headers, strict=True)
            if body["messages"][0]["content"] == "long"]
    assert [(body["max_tokens"], retry) for body, retry in sent] == [(16, "0"), (16, "0"), (16, "1"), (8, "0")]
    assert sent[0][0] == line("long", 16)["body"]
    assert sent[1][0] == sent[2][0] == {**line("long", 16)["body"], "continue_final_message": True,
                                        "add_generation_prompt": False, "messages": [
                                            {"role": "user", "content": "long"}, {"role": "assistant", "content": " a"}]}
    assert sent[3][0]["messages"][-1] == {"role": "assistant", "content": " a b"}
    assert out["long"]["request_id"] == "chatcmpl-a" and out["long"]["body"]["id"] == "chatcmpl-a"
    assert out["long"]["body"]["choices"][0]["message"] == {"role": "assistant", "content": " a b c"}
    assert out["long"]["body"]["usage"] == {"prompt_tokens": 5, "completion_tokens": 40, "total_tokens": 45}
    assert out["short"]["body"]["choices"][0]["message"]["content"] == " short"
    assert [body["max_tokens"] for body in served.gateway.bodies if body["model"] == "m2"] == [40]  # sent whole
    assert served.sample("extproc_batch_line_chunks_total", tenant="bob") == 2
    decided = Counter(getattr(r, "outcome", "") for r in caplog.records if getattr(r, "batch", None) == chunked.id)
    assert decided == Counter({"completed": 2, "chunk:16": 1, "chunk:32": 1, "retry:preempted": 1})


async def test_a_restart_mid_batch_loses_and_duplicates_no_line(served: Served) -> None:
    gateway = served.gateway
    # Lines r0-r4 answer at once, the rest wait: the service stops with 3 of them in flight.
    gateway.answer = lambda cid, attempt: completion(cid) if int(cid[1:]) < 5 or attempt > 1 else None
    async with served.client("bob") as sdk:
        batch_id = await start_batch(sdk, chat_lines(12))
        await until(lambda: gateway.in_flight == 3 and sum(gateway.attempts.values()) == 8)
        progress = await sdk.batches.retrieve(batch_id)
        assert progress.status == "in_progress" and progress.request_counts is not None
        assert progress.request_counts.completed == 5
    await served.stop()
    gateway.answer = lambda cid, attempt: completion(cid)
    await served.start()
    async with served.client("bob") as sdk:
        batch = await final(sdk, batch_id)
        out = await lines_of(sdk, batch.output_file_id)
    assert batch.status == "completed" and batch.request_counts.completed == 12
    assert sorted(e["custom_id"] for e in out) == sorted(f"r{i}" for i in range(12))
    # The three in flight at the stop were sent again; none recorded before it was.
    assert gateway.attempts == Counter({f"r{i}": 2 if i in (5, 6, 7) else 1 for i in range(12)})


async def test_cancel_ends_what_runs_and_reports_every_line_not_run(served: Served) -> None:
    served.gateway.answer = lambda cid, attempt: completion(cid) if cid == "r0" else None
    async with served.client("bob") as sdk:
        batch_id = await start_batch(sdk, chat_lines(6))
        await until(lambda: served.gateway.in_flight == 3)
        cancelling = await sdk.batches.cancel(batch_id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
        batch = await final(sdk, batch_id)
        assert batch.status == "cancelled" and batch.cancelled_at is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 5)
        errors = await lines_of(sdk, batch.error_file_id)
        assert [e["custom_id"] for e in errors] == [f"r{i}" for i in range(1, 6)]
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        with pytest.raises(openai.ConflictError):
            await sdk.batches.cancel(batch_id)
    await until(lambda: served.gateway.in_flight == 0)  # the lines in flight were cut


async def test_a_batch_past_its_window_expires_keeping_what_finished(served: Served) -> None:
    served.gateway.answer = lambda cid, attempt: completion(cid) if cid in ("r0", "r2") else None
    async with served.client("bob") as sdk:
        batch = await final(sdk, await start_batch(sdk, chat_lines(5), window="2s"))
        assert batch.status == "expired" and batch.expired_at is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 3)
        assert sorted(e["custom_id"] for e in await lines_of(sdk, batch.output_file_id)) == ["r0", "r2"]
        errors = await lines_of(sdk, batch.error_file_id)
        assert sorted(e["custom_id"] for e in errors) == ["r1", "r3", "r4"]
        assert {e["error"]["code"] for e in errors} == {"batch_expired"}
        with pytest.raises(openai.BadRequestError):
            await start_batch(sdk, chat_lines(1), window="1h")


async def test_a_batch_expires_at_its_window_even_if_the_wall_clock_steps_back(served: Served) -> None:
    """The window is waited for on the loop's clock; a wall clock read after the wait may say it is not over yet.

    The wall clock steps back a second once the first line is sent (as an NTP step does; the same as a
    loop timer that fires before the wall clock reaches the end, as uvloop's do by up to a millisecond).
    The batch still expires at its window's end, rather than being left in progress until the next start.
    """
    stepped, shift = False, 0.0

    def clock() -> float:
        return time.time() - shift - (1.0 if stepped else 0.0)

    def answer(cid: str, attempt: int) -> web.Response | None:
        nonlocal stepped
        stepped = True
        return completion(cid) if cid == "r0" else None

    await served.stop()
    served.clock, served.gateway.answer = clock, answer
    await served.start()
    async with served.client("bob") as sdk:
        shift = time.time() % 1  # created on a whole second (times are whole seconds): the window is a whole 1 s
        batch = await final(sdk, await start_batch(sdk, chat_lines(3), window="1s"), timeout_s=10)
    assert batch.status == "expired"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 2)


async def test_files_and_batches_are_listed_paged_and_deleted_per_tenant(served: Served) -> None:
    async with served.client("bob") as bob, served.client("carol") as carol:
        ids = [await start_batch(bob, chat_lines(1, prefix=f"b{i}")) for i in range(3)]
        first = await bob.batches.list(limit=2)
        assert [b.id for b in first.data] == ids[:0:-1] and first.has_more
        assert [b.id async for b in bob.batches.list(limit=2)] == ids[::-1]
        assert (await carol.batches.list()).data == []
        for batch_id in ids:
            assert (await final(bob, batch_id)).status == "completed"
        files = await bob.files.list(purpose="batch")
        assert len(files.data) == 3 and (await carol.files.list()).data == []
        assert len((await bob.files.list(purpose="batch_output")).data) == 3
        deleted = await bob.files.delete(files.data[0].id)
        assert deleted.deleted and deleted.id == files.data[0].id
        with pytest.raises(openai.NotFoundError):
            await bob.files.retrieve(files.data[0].id)
        with pytest.raises(openai.NotFoundError):
            await carol.batches.retrieve(ids[0])


async def test_an_upload_over_the_size_limit_is_refused(tmp_path: Path) -> None:
    served = Served(tmp_path)
    served.config = config(tmp_path, served.gateway_port, max_file_bytes=1000)
    await served.start()
    try:
        async with served.client("bob") as sdk:
            with pytest.raises(openai.APIStatusError) as refused:
                await sdk.files.create(file=("big.jsonl", b"x" * 2000), purpose="batch")
            assert refused.value.status_code == 413 and refused.value.code == "file_too_large"
            assert (await sdk.files.list()).data == []
    finally:
        await served.stop()


@pytest.mark.parametrize(("status", "headers", "again"), [
    (503, {"x-extproc-reason": "preempted", "retry-after": "1"}, ("preempted", 1.0)),
    (503, {"x-extproc-reason": "queue_timeout", "retry-after": "30"}, ("queue_timeout", 30.0)),
    (429, {"x-extproc-reason": "tenant_queue_full", "retry-after": "999"}, ("tenant_queue_full", 60.0)),
    (503, {"x-extproc-reason": "processor_unavailable"}, ("processor_unavailable", 1.0)),
    (429, {"x-extproc-reason": "insufficient_quota", "retry-after": "86400"}, ("insufficient_quota", 60.0)),
    (429, {}, ("429", 1.0)),
    (200, {}, None),
    (400, {"x-extproc-reason": "model_not_found"}, None),
    (504, {"x-extproc-reason": "upstream_timeout"}, None),
    (503, {"x-extproc-reason": "something_new"}, None),
    (500, {}, None),
])
def test_which_answers_send_a_line_again_and_when(status: int, headers: dict[str, str],
                                                   again: tuple[str, float] | None) -> None:
    assert retry_after(status, headers.get) == again
