"""A request attached by ext_proc alone, as a Gateway API Inference Extension gateway sends it.

The processor is driven directly with the messages Envoy sends in each body
mode (FULL_DUPLEX_STREAMED, BUFFERED): the body is read from the stream, the
answers come in the order Envoy requires (headers, then body), and the
release speaks the Endpoint Picker Protocol (tests/stack/test_gie_gateway.py runs
the same through a real Envoy).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.adapters.config import parse_config
from extproc.adapters.ext_proc.attach import base
from extproc.adapters.ext_proc.servicer import Processor
from extproc.adapters.grpc.builtin.server import BuiltinServer
from extproc.adapters.grpc.transport import Method
from extproc.adapters.runtime import Dispatchers, build_runtimes
from extproc.adapters.server import PROCESS_PATH
from extproc.adapters.telemetry import Telemetry
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.values.engine_load import EngineLoad
from extproc.tools.procs import free_port
from tests.helpers.epp_stream import BUFFERED, DUPLEX, answers, body, chat, first_message, send
from tests.helpers.processor import Stream, settle

pytestmark = pytest.mark.unit

ENDPOINTS = ("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000")
CONFIG = parse_config({
    "identity": {"fairness_id_headers": ["x-gateway-inference-fairness-id"],
                 "objectives": {"chat": "interactive"}},
    "endpoint_picker": {"fallbacks": 2},
    # The gateway in front sets the TTFT objective: trusted down to 0.1 s.
    "bands": {"interactive": {"min_ttft_objective_s": 0.1}},
    "models": [{"name": "base", "served_names": ["base-lora-*", "alias"], "endpoints": list(ENDPOINTS),
                "endpoint_picking": True, "target_waiting": 1}],
})


def make() -> tuple[Processor, ModelDispatcher]:
    telemetry = Telemetry()
    runtimes = build_runtimes(CONFIG, telemetry)
    dispatcher = runtimes["base"].dispatcher
    for endpoint in ENDPOINTS:  # idle engines, so releases go at once
        dispatcher.record_scrape(endpoint, EngineLoad(waiting=0, running=0), 0.0)
    return Processor(CONFIG, runtimes, telemetry), dispatcher


def destination(answer: pb.ProcessingResponse) -> tuple[str, str]:
    """(header value, envoy.lb metadata value) of a release."""
    common = answer.request_headers.response if answer.HasField("request_headers") else answer.request_body.response
    header = next(h.header.raw_value.decode() for h in common.header_mutation.set_headers
                  if h.header.key == "x-gateway-destination-endpoint")
    metadata = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    return header, metadata.string_value


async def test_full_duplex_holds_the_headers_until_release_then_gives_the_body_back_in_order() -> None:
    processor, dispatcher = make()
    stream = Stream(processor, first_message(DUPLEX, {"x-gateway-inference-fairness-id": "alice"}))
    data = chat() * 1  # one JSON body, sent in three chunks
    assert await answers(stream) == []  # nothing before the body ends: the router must not pick a host yet
    send(stream, body(data[:10], end=False))
    send(stream, body(data[10:20], end=False))
    assert await answers(stream) == []
    send(stream, body(data[20:]))
    released = await answers(stream)
    assert released[0].HasField("request_headers") and released[0].request_headers.response.clear_route_cache
    header, metadata = destination(released[0])
    picked = header.split(",")
    assert header == metadata and len(picked) == 3 and len(set(picked)) == 3  # the pick and two fallbacks
    assert all(p.removeprefix("10.0.0.") for p in picked)
    streamed = [a.request_body.response.body_mutation.streamed_response for a in released[1:]]
    assert b"".join(s.body for s in streamed) == data and streamed[-1].end_of_stream
    assert dispatcher.in_flight == 1
    # The response passes back chunk by chunk, unchanged; the stream's end frees the slot.
    send(stream, pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    send(stream, pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: one\n\n")))
    send(stream, pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True)))
    replies = await answers(stream)
    assert replies[0].HasField("response_headers")
    echoed = [r.response_body.response.body_mutation.streamed_response for r in replies[1:]]
    assert [(e.body, e.end_of_stream) for e in echoed] == [(b"data: one\n\n", False), (b"data: [DONE]\n\n", True)]
    stream.close()
    await stream.task
    assert dispatcher.in_flight == 0


async def test_buffered_answers_the_headers_first_and_releases_on_the_body() -> None:
    processor, dispatcher = make()
    stream = Stream(processor, first_message(BUFFERED))
    go_on = await answers(stream)
    assert len(go_on) == 1 and go_on[0].HasField("request_headers") and not go_on[0].request_headers.HasField("response")
    send(stream, body(chat(model="base-lora-sql")))  # a served name: the same gate
    (released,) = await answers(stream)
    assert released.HasField("request_body")
    header, metadata = destination(released)
    assert header == metadata
    assert not released.request_body.response.HasField("body_mutation")  # passed on unchanged
    stream.close()
    await stream.task
    assert dispatcher.in_flight == 0


@pytest.mark.parametrize(("hint", "status"), [([], 503), (["10.9.9.9:8000"], 503), (["10.0.0.2:8000"], None)])
async def test_a_subset_hint_is_obeyed_and_an_empty_or_foreign_one_is_503(hint: list[str], status: int | None) -> None:
    processor, _ = make()
    stream = Stream(processor, first_message(DUPLEX, subset=hint))
    send(stream, body(chat()))
    first = (await answers(stream))[0]
    if status is not None:
        assert first.immediate_response.status.code == status
        assert json.loads(first.immediate_response.body)["error"]["code"] == "no_endpoint"
        return
    assert destination(first) == ("10.0.0.2:8000", "10.0.0.2:8000")  # only inside the hint, no fallbacks outside
    stream.close()
    await stream.task


@pytest.mark.parametrize(("data", "status", "code"), [
    (b"[1, 2]", 400, "invalid_body"),
    (b"{not json", 400, "invalid_body"),
    (json.dumps({"messages": []}).encode(), 400, "model_missing"),
    (chat(model="other"), 404, "model_not_found"),
    (chat(max_tokens="many"), 400, "invalid_max_tokens"),
    (b"{" + b" " * (10 * 1024 * 1024) + b"}", 413, "body_too_large"),
])
async def test_a_bad_body_is_refused_with_the_openai_error(data: bytes, status: int, code: str) -> None:
    processor, dispatcher = make()
    stream = Stream(processor, first_message(DUPLEX))
    send(stream, body(data))
    (answer,) = await answers(stream)
    assert answer.immediate_response.status.code == status
    assert json.loads(answer.immediate_response.body)["error"]["code"] == code
    assert dispatcher.queued == 0 and dispatcher.in_flight == 0


async def test_fairness_id_objective_and_ttft_come_from_the_gateway_conventions() -> None:
    processor, dispatcher = make()
    stream = Stream(processor, first_message(DUPLEX, {
        "x-gateway-inference-fairness-id": "team-a", "x-gateway-inference-objective": "chat", "x-llm-d-slo-ttft-ms": "250",
    }))
    admitted: list[tuple[str, int, float | None]] = []
    submit = dispatcher.submit

    def spy(tenant: str, band: int, **kwargs: object):  # type: ignore[no-untyped-def]
        held = submit(tenant, band, **kwargs)  # type: ignore[arg-type]
        admitted.append((held.request.tenant, held.request.band, held.ttft_objective_s))
        return held

    dispatcher.submit = spy  # type: ignore[method-assign]
    send(stream, body(chat(model="alias")))
    await answers(stream)
    assert admitted == [("team-a", 0, 0.25)]
    stream.close()
    await stream.task
    bad = Stream(processor, first_message(DUPLEX, {"x-llm-d-slo-ttft-ms": "soon"}))
    send(bad, body(chat()))
    (answer,) = await answers(bad)
    assert answer.immediate_response.status.code == 400
    assert json.loads(answer.immediate_response.body)["error"]["param"] == "x-llm-d-slo-ttft-ms"


async def test_shed_under_load_is_429() -> None:
    config = parse_config({"models": [{"name": "m", "endpoints": ["http://10.0.0.1:8000"], "endpoint_picking": True,
                                       "max_queued": 1, "advanced": {"fallback_max_in_flight": 1}}]})
    telemetry = Telemetry()
    runtimes = build_runtimes(config, telemetry)
    dispatchers = Dispatchers(runtimes)
    processor = Processor(config, runtimes, telemetry)
    streams = [Stream(processor, first_message(DUPLEX)) for _ in range(3)]
    for s in streams:
        send(s, body(chat(model="m")))
    await settle()
    released, held, shed = [await answers(s) for s in streams]
    # One in flight (the unscraped engine's fallback cap), one held silently, the third shed: the protocol's 429.
    assert released[0].HasField("request_headers") and held == []
    assert shed[0].immediate_response.status.code == 429
    for s in streams:  # the clients leave: Envoy resets their streams
        s.task.cancel()
    await asyncio.gather(*(s.task for s in streams), return_exceptions=True)
    assert dispatchers["m"].queued == 0 and dispatchers["m"].in_flight == 0


async def test_with_no_endpoint_of_the_pool_up_requests_are_held_until_one_answers_then_refused_at_the_cold_start(
) -> None:
    """The cold start as on the fast path: held past the class's wait while no engine is up, released to the first
    engine that answers; refused with Retry-After once the cold-start wait runs out (the protocol's status for
    what waited too long, 429); a subset hint whose endpoints are down while another is up is still 503 at once."""
    pods = ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    config = parse_config({"models": [{"name": "m", "endpoints": list(pods), "endpoint_picking": True,
                                       "max_queue_wait_s": 0.05, "cold_start_wait_s": 2.0}]})
    telemetry = Telemetry()
    runtimes = build_runtimes(config, telemetry)
    dispatcher = runtimes["m"].dispatcher
    processor = Processor(config, runtimes, telemetry)
    for pod in pods:  # scaled to zero: nothing answers
        dispatcher.record_scrape(pod, None, time.monotonic(), reachable=False)
    early = Stream(processor, first_message(DUPLEX))
    send(early, body(chat(model="m")))
    assert await answers(early) == []
    await asyncio.sleep(0.1)  # past the class's wait (0.05 s): kept, no engine being up
    assert await answers(early) == [] and dispatcher.queued == 1 and dispatcher.demand().engines > 0
    dispatcher.record_scrape(pods[1], EngineLoad(waiting=0, running=0), time.monotonic())  # an engine answers
    released = await answers(early)
    assert destination(released[0])[0].split(",")[0] == "10.0.0.2:8000"
    hinted = Stream(processor, first_message(DUPLEX, subset=["10.0.0.1:8000"]))  # down, while the other is up
    send(hinted, body(chat(model="m")))
    (answer,) = await answers(hinted)
    assert answer.immediate_response.status.code == 503
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "no_endpoint"
    dispatcher.record_scrape(pods[1], None, time.monotonic(), reachable=False)  # gone again: the pool is at zero
    late = Stream(processor, first_message(DUPLEX, subset=["10.0.0.1:8000"]))  # no endpoint up at all: held too
    send(late, body(chat(model="m")))
    refusal = await late.answers.get()  # once its cold-start wait (2 s) ran out
    assert refusal.immediate_response.status.code == 429
    error = json.loads(refusal.immediate_response.body)["error"]
    assert error["code"] == "queue_timeout" and "no engine of the pool was up" in error["message"]
    assert any(h.header.key.lower() == "retry-after" for h in refusal.immediate_response.headers.set_headers)
    early.close()
    await asyncio.gather(early.task, hinted.task, late.task)
    assert dispatcher.queued == 0


async def test_the_served_endpoint_read_back_moves_the_count_and_marks_the_pick_down() -> None:
    processor, dispatcher = make()
    stream = Stream(processor, first_message(DUPLEX))
    send(stream, body(chat()))
    released = await answers(stream)
    picked, fallback, _ = destination(released[0])[0].split(",")
    served = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
    report = struct_pb2.Struct()
    report.update({"x-gateway-destination-endpoint-served": fallback})
    served.metadata_context.filter_metadata["envoy.lb"].CopyFrom(report)
    send(stream, served)
    await answers(stream)
    endpoints = {e.url: e for e in dispatcher.status(0).endpoints}  # where the count went
    assert endpoints[f"http://{fallback}"].in_flight == 1 and endpoints[f"http://{picked}"].in_flight == 0
    assert endpoints[f"http://{picked}"].down
    stream.close()
    await stream.task


async def test_an_envoy_before_1_34_declares_no_mode_and_its_buffered_body_is_asked_for_over_real_grpc(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Envoy declares its body modes (protocol_config) since 1.34, the release that brought duplex: an older one's
    stream, as it sends it, is taken as BUFFERED, its one mode that brings the body before the request goes upstream.
    The headers get an empty answer, the body comes, the release answers it; one warning names the version. A stream
    whose filter sends no body (NONE: the request went on) is answered 500, not held."""
    processor, dispatcher = make()
    server = BuiltinServer({PROCESS_PATH: Method(pb.ProcessingRequest.FromString, processor.process)})
    port = free_port()
    await server.start("127.0.0.1", port)
    channel: Any = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    process = channel.stream_stream(PROCESS_PATH, request_serializer=pb.ProcessingRequest.SerializeToString,
                                    response_deserializer=pb.ProcessingResponse.FromString)
    try:
        with caplog.at_level(logging.WARNING, logger=base.__name__):
            for _ in range(2):
                call = process()
                await call.write(first_message(None, {"x-gateway-inference-fairness-id": "alice"}))
                go_on = await call.read()
                assert go_on.HasField("request_headers") and not go_on.request_headers.HasField("response"), go_on
                await call.write(body(chat()))
                released = await call.read()
                assert released.HasField("request_body"), released
                header, metadata = destination(released)
                assert header == metadata and header.startswith("10.0.0.")
                await call.write(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
                assert (await call.read()).HasField("response_headers")
                await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: one\n\n")))
                assert (await call.read()).response_body == pb.BodyResponse()  # not duplex: left as it came
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF  # type: ignore[attr-defined]
            # A filter that sends no body: its request went upstream on the empty answer, unrouted.
            call = process()
            await call.write(first_message(None))
            await call.read()
            await call.write(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
            refused = await call.read()
            assert refused.immediate_response.status.code == 500
            assert json.loads(refused.immediate_response.body)["error"]["code"] == "gateway_error"
            await call.done_writing()
        told = [r.getMessage() for r in caplog.records if "protocol_config" in r.getMessage()]
        assert len(told) == 1 and "older than 1.34" in told[0] and "as BUFFERED" in told[0], told
        assert dispatcher.queued == 0
        await asyncio.sleep(0.05)
        assert dispatcher.in_flight == 0
    finally:
        await channel.close()
        await server.stop(0)
