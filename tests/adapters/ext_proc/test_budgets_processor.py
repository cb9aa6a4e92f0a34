"""Budgets at the processor's admission: refusals as OpenAI's 429s, downgrades, rate headers, what a request is charged."""

from __future__ import annotations

import calendar
import json
import sys
import types

import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.budgets.gate import BudgetGate
from extproc.adapters.config import parse_config
from extproc.adapters.ext_proc.servicer import Processor
from extproc.adapters.request.admission import Admission
from extproc.adapters.runtime import ModelRuntime
from extproc.adapters.telemetry import Telemetry
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.values.engine_load import EngineLoad
from tests.helpers.budgets_processor import request
from tests.helpers.epp_stream import DUPLEX, answers, first_message, send
from tests.helpers.processor import Stream, settle

pytestmark = pytest.mark.unit

NOON = float(calendar.timegm((2026, 12, 3, 12, 0, 0)))
MIDNIGHT = float(calendar.timegm((2026, 12, 4, 0, 0, 0)))
# The Python calls one admit and end may make with three scopes of limits (119 measured; a margin for small changes).
CALLS_PER_ADMISSION = 180


def make(budgets: dict[str, object], max_in_flight: int = 4) -> tuple[Processor, ModelDispatcher, list[float]]:
    config = parse_config({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"],
                                       "advanced": {"fallback_max_in_flight": max_in_flight}}],
                           "budgets": budgets})
    telemetry = Telemetry()
    runtime = ModelRuntime(config, config.models[0], telemetry)
    dispatcher = runtime.dispatcher
    processor = Processor(config, {"m": runtime}, telemetry)
    now = [NOON]
    assert processor.budgets is not None and config.budgets is not None
    processor.budgets = BudgetGate(config.budgets, len(config.bands) - 1, clock=lambda: now[0])  # the same, on our clock
    return processor, dispatcher, now


def set_headers(answer: pb.ProcessingResponse) -> dict[str, str]:
    mutation = (answer.immediate_response.headers if answer.HasField("immediate_response")
                else answer.request_headers.response.header_mutation)
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


async def test_over_a_rate_the_client_hears_openais_429_with_retry_after_and_the_rate_headers() -> None:
    processor, _, now = make({"tenants": {"default": {"requests_per_minute": 2}}})
    for _ in range(2):
        released = await Stream(processor, request()).answers.get()
        assert released.HasField("request_headers")
    answer = await Stream(processor, request()).answers.get()
    refusal = answer.immediate_response
    assert refusal.status.code == 429
    body = json.loads(refusal.body)["error"]
    assert (body["code"], body["type"]) == ("rate_limit_exceeded", "rate_limit_error")
    assert "requests per minute (2)" in body["message"]
    headers = set_headers(answer)
    assert headers["retry-after"] == "30"  # one request's room comes back after 60 s / 2
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"],
            headers["x-ratelimit-reset-requests"]) == ("2", "0", "1m0s")
    assert "x-should-retry" not in headers
    now[0] += 30
    assert (await Stream(processor, request()).answers.get()).HasField("request_headers")


async def test_over_a_day_budget_it_is_insufficient_quota_until_midnight_utc() -> None:
    processor, _, now = make({"tenants": {"default": {"tokens_per_day": 1000}}})
    assert (await Stream(processor, request(max_tokens=500)).answers.get()).HasField("request_headers")
    answer = await Stream(processor, request(max_tokens=500)).answers.get()  # 100 + 500 reserved, 1000 allowed
    body = json.loads(answer.immediate_response.body)["error"]
    assert answer.immediate_response.status.code == 429 and body["code"] == body["type"] == "insufficient_quota"
    headers = set_headers(answer)
    assert headers["retry-after"] == str(int(MIDNIGHT - NOON)) and headers["x-should-retry"] == "false"


async def test_released_requests_carry_the_rate_headers_for_envoy_to_echo() -> None:
    processor, _, _ = make({"tenants": {"default": {"requests_per_minute": 10, "output_tokens_per_minute": 1000}}})
    headers = set_headers(await Stream(processor, request(max_tokens=100)).answers.get())
    assert headers["x-ratelimit-remaining-requests"] == "9" and headers["x-ratelimit-remaining-tokens"] == "900"
    assert headers["x-ratelimit-reset-tokens"] == "6s"
    quiet, _, _ = make({"rate_headers": False, "tenants": {"default": {"requests_per_minute": 10}}})
    assert not any(k.startswith("x-ratelimit") for k in set_headers(await Stream(quiet, request()).answers.get()))


async def test_downgrade_queues_an_over_budget_request_in_the_lowest_class() -> None:
    processor, dispatcher, _ = make({"tenants": {"default": {"requests_per_minute": 1, "action": "downgrade"}}},
                                    max_in_flight=1)
    running = Stream(processor, request(priority="interactive"))
    assert (await running.answers.get()).HasField("request_headers")
    over = Stream(processor, request(priority="interactive"))
    assert (await over.answers.get()).HasField("override_message_timeout")  # held, not refused
    assert dispatcher.queued_in(2) == 1 and dispatcher.queued_in(0) == 0
    assert processor.budgets is not None and processor.budgets.over == {("t", "rate", "downgrade"): 1}
    over.task.cancel()  # batch runs only on idle capacity, which this engine without metrics never shows
    running.close()
    await settle()
    rows = {key: row for key, row in processor.budgets.budgets.book.rows()}
    assert rows[("t", "m", "2026-12-03")].requests == 1  # the one that left while queued is charged nothing


async def test_a_served_request_is_charged_what_it_used_and_one_gone_while_queued_nothing() -> None:
    processor, dispatcher, _ = make({"tenants": {"default": {"tokens_per_day": 100_000}}}, max_in_flight=1)
    gate = processor.budgets
    assert gate is not None
    served = Stream(processor, request(max_tokens=100))
    assert (await served.answers.get()).HasField("request_headers")
    gone = Stream(processor, request(max_tokens=5000))
    await gone.answers.get()
    day = {s.limit: s.used for s in gate.budgets.standings(NOON)}
    assert day == {"tokens_per_day": 100 + 100 + 100 + 5000}  # (480 - 80) / 4 prompt tokens + max_tokens, each
    gone.task.cancel()
    await settle()
    assert dispatcher.queued == 0
    assert {s.limit: s.used for s in gate.budgets.standings(NOON)} == {"tokens_per_day": 200}
    served.close()
    await settle()
    (key, row), = gate.budgets.book.rows()
    assert key == ("t", "m", "2026-12-03") and row.requests == 1 and row.input_tokens == 100
    assert row.output_tokens == 100  # no decode rate yet: the estimate stands (max_tokens)
    assert {s.limit: s.used for s in gate.budgets.standings(NOON)} == {"tokens_per_day": 200}


def usage_body(prompt: int, completion: int, cached: int) -> bytes:
    return json.dumps({"choices": [{"message": {"content": "hi"}}], "usage": {
        "prompt_tokens": prompt, "completion_tokens": completion, "prompt_tokens_details": {"cached_tokens": cached}}
    }).encode()


async def test_a_served_request_is_charged_the_usage_its_engine_reported() -> None:
    processor, _, _ = make({"tenants": {"default": {"tokens_per_day": 100_000}}})
    gate = processor.budgets
    assert gate is not None
    served = Stream(processor, request(max_tokens=100))
    release = await served.answers.get()
    # The answer is read: buffered, a body over Envoy's buffer limit sent in part (its usage then unread).
    assert release.mode_override.response_body_mode == ProcessingMode.BUFFERED_PARTIAL
    body = usage_body(37, 12, 16)
    served.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=body[:20])))
    served.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=body[20:], end_of_stream=True)))
    for _ in range(2):  # each chunk goes on as it came
        assert await served.answers.get() == pb.ProcessingResponse(response_body=pb.BodyResponse())
    served.close()
    await settle()
    (key, row), = gate.budgets.book.rows()
    assert (row.requests, row.input_tokens, row.cached_tokens, row.output_tokens) == (1, 37, 16, 12)
    assert {s.limit: s.used for s in gate.budgets.standings(NOON)} == {"tokens_per_day": 49}


# As json_to_metadata writes them (envoy/filters.py): `stream`, and `stream_options.include_usage` as its own key.
@pytest.mark.parametrize(("fields", "settings", "read"), [
    ({"stream": True, "include_usage": True}, {}, ProcessingMode.STREAMED),
    ({"stream": True}, {}, None),  # no usage will come: the estimate stands, no chunk is read
    ({"stream": True, "include_usage": True}, {"stream_usage": False}, None),
    ({"stream": False}, {}, ProcessingMode.BUFFERED_PARTIAL),
])
async def test_a_stream_is_read_only_when_its_usage_will_come_and_the_section_says_so(
        fields: dict[str, bool], settings: dict[str, object], read: int | None) -> None:
    processor, _, _ = make({**settings, "tenants": {"default": {"requests_per_minute": 10}}})
    stream = Stream(processor, request(body=fields))
    release = await stream.answers.get()
    # (An override may still turn the response headers on: a release the gate checks.)
    assert release.HasField("request_headers") and release.mode_override.response_body_mode == (read or 0)
    stream.close()
    await settle()


async def test_a_stream_without_usage_is_charged_the_estimate() -> None:
    processor, _, _ = make({"tenants": {"default": {"tokens_per_day": 100_000}}})
    gate = processor.budgets
    assert gate is not None
    served = Stream(processor, request(max_tokens=100, body={"stream": True}))
    await served.answers.get()
    served.close()
    await settle()
    (key, row), = gate.budgets.book.rows()
    assert (row.input_tokens, row.output_tokens) == (100, 100)  # Content-Length's estimate, max_tokens


async def test_through_an_endpoint_picker_the_usage_is_read_from_the_chunks_its_gateway_sends_anyway() -> None:
    processor, dispatcher, _ = make({"tenants": {"default": {"tokens_per_day": 100_000}}})
    dispatcher.record_scrape("http://127.0.0.1:1", EngineLoad(waiting=0, running=0), 0.0)
    gate = processor.budgets
    assert gate is not None
    stream = Stream(processor, first_message(DUPLEX, {"x-tenant-id": "t"}))  # no metadata: a gateway's filter
    body = json.dumps({"model": "m", "messages": [], "max_tokens": 50, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    send(stream, pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    released = await answers(stream)
    assert released[0].HasField("request_headers") and not released[0].HasField("mode_override")
    events = b'data: {"choices": [{"delta": {"content": "a"}}], "usage": null}\n\n' \
             b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}\n\ndata: [DONE]\n\n'
    for start in range(0, len(events), 40):
        send(stream, pb.ProcessingRequest(response_body=pb.HttpBody(body=events[start:start + 40])))
    given_back = [r.response_body.response.body_mutation.streamed_response.body for r in await answers(stream)]
    assert b"".join(given_back) == events  # passed back as it came
    stream.close()
    await settle()
    (key, row), = gate.budgets.book.rows()
    assert (row.input_tokens, row.output_tokens) == (7, 3)


async def test_a_reload_keeps_the_counts_and_removing_the_section_removes_the_checks() -> None:
    processor, _, _ = make({"tenants": {"default": {"requests_per_minute": 1}}})
    assert (await Stream(processor, request()).answers.get()).HasField("request_headers")
    gate = processor.budgets
    model = {"name": "m", "endpoints": ["http://127.0.0.1:1"], "advanced": {"fallback_max_in_flight": 4}}
    config = parse_config({"models": [model], "budgets": {"tenants": {"default": {"requests_per_minute": 2}}}})
    processor.reconfigure(config)
    assert processor.budgets is gate
    assert (await Stream(processor, request()).answers.get()).HasField("request_headers")
    assert (await Stream(processor, request()).answers.get()).immediate_response.status.code == 429
    processor.reconfigure(parse_config({"models": [model]}))
    assert processor.budgets is None
    assert (await Stream(processor, request()).answers.get()).HasField("request_headers")


async def test_an_absurd_max_tokens_reserves_the_context_not_infinity() -> None:
    processor, _, now = make({"tenants": {"default": {"output_tokens_per_minute": 1000, "tokens_per_day": 10**9}}})
    assert (await Stream(processor, request(max_tokens=10**15)).answers.get()).HasField("request_headers")
    assert processor.budgets is not None
    used = {s.limit: s.used for s in processor.budgets.budgets.standings(NOON)}
    assert used == {"output_tokens_per_minute": 32_768, "tokens_per_day": 32_768 + 100}  # max_context_tokens
    answer = await Stream(processor, request(max_tokens=10)).answers.get()
    assert set_headers(answer)["retry-after"] == str(round((32_768 - 990) * 60 / 1000))  # its debt drains first
    now[0] += 32 * 60
    assert (await Stream(processor, request(max_tokens=10)).answers.get()).HasField("request_headers")


async def test_the_admission_check_does_a_fixed_small_amount_of_work() -> None:
    """The gate's admit and end for one request with three scopes of limits: the same Python calls for the first
    request after the tenant's first and for one after thousands (nothing grows with the requests before it), and few. The time it
    takes is the overhead benchmark's to measure (``extproc-dev bench``), not a test's: a bound in microseconds fails
    on a busy machine."""
    config = parse_config({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"]}], "budgets": {
        "prices": {"m": {"input": 1, "output": 2}}, "groups": {"g": {"requests_per_minute": 1e9}},
        "tenants": {"default": {"requests_per_minute": 1e9, "output_tokens_per_minute": 1e12, "tokens_per_day": 1e15,
                                "cost_per_month": 1e9, "groups": ["g"], "models": {"m": {"input_tokens_per_minute": 1e12}}}}}})
    assert config.budgets is not None
    gate = BudgetGate(config.budgets, 2, clock=lambda: NOON)
    admission = Admission("m", "t", 1)

    async def one() -> None:
        _, passed = await gate.admit(admission, (100.0, 200.0))
        gate.end(passed, None)

    async def calls() -> int:
        """The Python function calls one admit and end make (coroutine steps included)."""
        counted = 0

        def count(frame: types.FrameType, event: str, arg: object) -> None:
            nonlocal counted
            counted += event == "call"

        sys.setprofile(count)
        try:
            await one()
        finally:
            sys.setprofile(None)
        return counted

    await one()  # the tenant's first request sets up its scopes' books
    second = await calls()
    for _ in range(5_000):
        await one()
    later = await calls()
    print(f"admission check: {second} Python calls per request")
    assert later == second and second <= CALLS_PER_ADMISSION, (second, later)
