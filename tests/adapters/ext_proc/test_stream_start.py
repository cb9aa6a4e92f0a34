"""A stream's first event read before its headers go on: an engine's refusal inside a 200 becomes 503 engine_full.

The reading itself (:class:`FirstEvent`, each engine's refusal as its source
writes it), then the processor driven with the messages Envoy sends when the
release asks for the response body in duplex (tests/stack/test_stream_start_envoy.py
runs it through Envoy 1.40 and the simulator).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.adapters.config import ConfigError, parse_config
from extproc.adapters.ext_proc.attach.body import DUPLEX
from extproc.adapters.ext_proc.attach.stream_start import MOST_HELD_BYTES, FirstEvent, Verdict
from extproc.adapters.ext_proc.servicer import Processor
from extproc.adapters.protocol.dialects import DIALECTS
from extproc.adapters.runtime import Dispatchers, build_runtimes
from extproc.adapters.telemetry import Telemetry
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.values.engine_load import EngineLimits, EngineLoad
from tests.helpers.epp_stream import answers, body, chat, first_message
from tests.helpers.processor import Stream

pytestmark = pytest.mark.unit

# vLLM 0.32's refused stream, byte for byte (docs/engines.md), and its first token's event.
VLLM_REFUSED = (b'data: {"error": {"message": "The engine is currently busy and cannot accept new requests. Please try '
                b'again later or on a different instance.", "type": "Service Unavailable", "param": null, "code": 503}}'
                b"\n\ndata: [DONE]\n\n")
TOKEN = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
SGLANG_REFUSED = (b'data: {"error": {"object": "error", "message": "The request queue is full.", '
                  b'"type": "ServiceUnavailable", "code": 503}}\n\n')
TGI_OPENAI_REFUSED = b'data:{"error":{"message":"Model is overloaded","http_status_code":422}}\n\n'
TGI_OWN_REFUSED = b'data:{"error":"Model is overloaded","error_type":"overloaded"}\n\n'


def verdict(dialect: str, *chunks: bytes) -> Verdict | None:
    refusal = DIALECTS[dialect].stream_refusal
    assert refusal is not None
    first = FirstEvent(refusal)
    found = None
    for i, chunk in enumerate(chunks):
        found = first.feed(chunk, i == len(chunks) - 1)
        if found is not None:
            break
    return found


@pytest.mark.parametrize(("dialect", "data"), [
    ("vllm", VLLM_REFUSED), ("sglang", SGLANG_REFUSED), ("tgi", TGI_OPENAI_REFUSED), ("tgi", TGI_OWN_REFUSED),
])
def test_each_engines_refusal_reads_as_one_whole_or_split_anywhere(dialect: str, data: bytes) -> None:
    assert verdict(dialect, data) is Verdict.REFUSED
    for cut in range(1, len(data)):
        assert verdict(dialect, data[:cut], data[cut:]) is Verdict.REFUSED, cut


@pytest.mark.parametrize("data", [
    TOKEN,
    b'data: {"error": {"message": "bad", "code": 400}}\n\n',  # an error, but not the engine's "full"
    b"data: [DONE]\n\n",
    b"data: not json\n\n",
    b"data: [1, 2]\n\n",
])
def test_anything_else_goes_on(data: bytes) -> None:
    assert verdict("vllm", data) is Verdict.GOES_ON


def test_the_first_event_with_data_decides_past_comments_and_in_any_line_ending() -> None:
    keep_alive = b": keep-alive\n\n"
    assert verdict("vllm", keep_alive + VLLM_REFUSED) is Verdict.REFUSED
    assert verdict("vllm", VLLM_REFUSED.replace(b"\n", b"\r\n")) is Verdict.REFUSED
    assert verdict("vllm", keep_alive + TOKEN + VLLM_REFUSED) is Verdict.GOES_ON
    first = FirstEvent(DIALECTS["vllm"].stream_refusal)  # type: ignore[arg-type]
    assert first.feed(b"data: {\"err", False) is None  # an event not yet whole: no verdict
    assert first.held() == b"data: {\"err"  # the chunks so far, to give back


def test_no_event_by_the_bodys_end_or_within_the_bound_goes_on() -> None:
    assert verdict("vllm", b"data: {") is Verdict.GOES_ON  # the end
    first = FirstEvent(DIALECTS["vllm"].stream_refusal)  # type: ignore[arg-type]
    assert first.feed(b"x" * MOST_HELD_BYTES, False) is None
    assert first.feed(b"x", False) is Verdict.GOES_ON


def test_a_check_on_an_engine_without_a_cap_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"models\[0\]\.check_stream_start: engine llamacpp has no queue cap"):
        parse_config({"models": [{"name": "l", "endpoints": ["http://127.0.0.1:1"], "engine": "llamacpp",
                                  "check_stream_start": True}]})


ENDPOINT = "http://10.0.0.1:8000"


def make(check: bool | None = True, engine: str = "vllm", **top: Any) -> tuple[Processor, ModelDispatcher, Telemetry]:
    model = {"name": "m", "endpoints": [ENDPOINT], "engine": engine, **({} if check is None else {"check_stream_start": check})}
    config = parse_config({"models": [model], **top})
    telemetry = Telemetry()
    runtimes = build_runtimes(config, telemetry)
    runtimes["m"].dispatcher.record_scrape(ENDPOINT, EngineLoad(waiting=0, running=0), 0.0)
    return Processor(config, runtimes, telemetry), runtimes["m"].dispatcher, telemetry


def request(stream: bool = True) -> pb.ProcessingRequest:
    """Our Envoy's request headers: the body's fields in metadata (a stream: ``stream`` written too), no body declared."""
    pairs = {":method": "POST", ":path": "/v1/chat/completions", "x-tenant-id": "t"}
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])),
        protocol_config=pb.ProtocolConfiguration(),
    )
    fields = struct_pb2.Struct()
    fields.update({"model": "m", **({"stream": True} if stream else {})})
    message.metadata_context.filter_metadata["extproc"].CopyFrom(fields)
    return message


def response_headers(status: str = "200", content_type: str = "text/event-stream") -> pb.ProcessingRequest:
    pairs = {":status": status, "content-type": content_type, "x-envoy-upstream-service-time": "3"}
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])))


def chunk(data: bytes, end: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end))


def refused_full(telemetry: Telemetry) -> float:
    return sum(s.value for m in telemetry.registry.collect() for s in m.samples
               if s.name == "extproc_release_refused_full_total")


def given_back(replies: list[pb.ProcessingResponse]) -> list[tuple[bytes, bool]]:
    streamed = [r.response_body.response.body_mutation.streamed_response for r in replies if r.HasField("response_body")]
    return [(s.body, s.end_of_stream) for s in streamed]


async def released(processor: Processor, message: pb.ProcessingRequest) -> tuple[Stream, pb.ProcessingResponse]:
    stream = Stream(processor, message)
    (release,) = await answers(stream)
    return stream, release


async def test_a_refusal_as_the_first_event_is_answered_503_engine_full_in_place_of_the_200() -> None:
    processor, dispatcher, telemetry = make()
    stream, release = await released(processor, request())
    # The release asks for the response headers and, in duplex, its body: the headers wait while its chunks come.
    assert release.mode_override.response_header_mode == release.mode_override.SEND
    assert release.mode_override.response_body_mode == DUPLEX
    stream.send(response_headers())
    (hold,) = await answers(stream)
    assert hold.HasField("override_message_timeout")  # until the engine's first token, not Envoy's 2 s
    stream.send(chunk(VLLM_REFUSED[:40]))
    assert await answers(stream) == []  # the event is not whole yet
    stream.send(chunk(VLLM_REFUSED[40:]))
    (refused,) = await answers(stream)
    answer = refused.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in answer.headers.set_headers}
    assert answer.status.code == 503 and headers["x-extproc-reason"] == "engine_full" and headers["retry-after"] == "1"
    error: dict[str, Any] = json.loads(answer.body)["error"]
    assert error["code"] == "engine_full" and "The engine is currently busy" in error["message"]
    assert refused_full(telemetry) == 1  # the gate read it as the engine's refusal: its limit cut there
    stream.close()
    await stream.task
    assert dispatcher.in_flight == 0


async def test_a_first_token_lets_the_headers_go_and_every_chunk_comes_back_as_it_came() -> None:
    processor, dispatcher, telemetry = make()
    stream, _ = await released(processor, request())
    stream.send(response_headers())
    await answers(stream)
    stream.send(chunk(TOKEN[:10]))
    stream.send(chunk(TOKEN[10:]))
    first = await answers(stream)
    assert first[0].HasField("response_headers") and not first[0].response_headers.HasField("response")
    assert given_back(first) == [(TOKEN, False)]
    stream.send(chunk(TOKEN))
    stream.send(chunk(b"", end=True))
    assert given_back(await answers(stream)) == [(TOKEN, False), (b"", True)]
    stream.close()
    await stream.task
    assert dispatcher.in_flight == 0 and refused_full(telemetry) == 0


@pytest.mark.parametrize(("status", "content_type"), [("200", "application/json"), ("400", "application/json"),
                                                      ("503", "text/event-stream")])
async def test_a_response_that_is_no_stream_begun_goes_on_at_once(status: str, content_type: str) -> None:
    processor, _, _ = make()
    stream, _ = await released(processor, request())
    stream.send(response_headers(status, content_type))
    (headers_reply,) = await answers(stream)
    assert headers_reply.HasField("response_headers")
    stream.send(chunk(VLLM_REFUSED, end=True))  # whatever it says: passed back
    assert given_back(await answers(stream)) == [(VLLM_REFUSED, True)]
    stream.close()
    await stream.task


async def test_trailers_before_any_event_let_everything_go() -> None:
    processor, _, _ = make()
    stream, _ = await released(processor, request())
    stream.send(response_headers())
    await answers(stream)
    stream.send(chunk(b": keep-alive"))
    stream.send(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    headers_reply, *rest, trailers_reply = await answers(stream)
    assert headers_reply.HasField("response_headers") and trailers_reply.HasField("response_trailers")
    assert given_back(rest) == [(b": keep-alive", False)]
    stream.close()
    await stream.task


@pytest.mark.parametrize(("check", "stream_requested"), [(False, True), (True, False)])
async def test_no_check_unless_the_model_checks_and_the_request_is_a_stream(check: bool, stream_requested: bool) -> None:
    processor, _, _ = make(check)
    stream, release = await released(processor, request(stream_requested))
    assert release.mode_override.response_body_mode != DUPLEX
    stream.close()
    await stream.task


async def test_a_budget_charges_a_stream_its_engine_refused_nothing_and_a_served_one_its_use() -> None:
    processor, _, _ = make(budgets={"tenants": {"default": {"requests_per_minute": 100}}})
    for first in (VLLM_REFUSED, TOKEN):
        stream, _ = await released(processor, request())
        stream.send(response_headers())
        stream.send(chunk(first))
        await answers(stream)
        stream.close()
        await stream.task
    assert processor.budgets is not None
    assert processor.budgets.usage[("t", "m")][0] == 1  # one request charged: the one served


async def test_behind_an_endpoint_picker_gateway_in_duplex_the_check_costs_no_override() -> None:
    """GIE's filter streams the response in duplex already: the headers' answer waits (with nothing sent to hold
    them: the gateway's own timeout is long) and a refusal is answered 503, the protocol's status for it."""
    config = parse_config({"models": [{"name": "m", "endpoints": [ENDPOINT], "check_stream_start": True,
                                       "endpoint_picking": True}]})
    telemetry = Telemetry()
    runtimes = build_runtimes(config, telemetry)
    dispatchers = Dispatchers(runtimes)
    dispatchers["m"].record_scrape(ENDPOINT, EngineLoad(waiting=0, running=0), 0.0)
    processor = Processor(config, runtimes, telemetry)
    for first, refused in ((VLLM_REFUSED, True), (TOKEN, False)):
        stream = Stream(processor, first_message(DUPLEX))
        stream.send(body(chat("m", stream=True)))
        released = await answers(stream)
        assert released[0].HasField("request_headers") and not released[0].HasField("mode_override")
        stream.send(response_headers())
        assert await answers(stream) == []  # held, silently
        stream.send(chunk(first))
        replies = await answers(stream)
        if refused:
            assert replies[0].immediate_response.status.code == 503
        else:
            assert replies[0].HasField("response_headers") and given_back(replies) == [(TOKEN, False)]
        stream.close()
        await stream.task
    assert dispatchers["m"].in_flight == 0


@pytest.mark.parametrize("engine", ["sglang", "tgi", "vllm"])
async def test_unset_the_check_follows_what_the_engine_says_of_its_cap(engine: str) -> None:
    """SGLang says its --max-queued-requests (/server_info), TGI its --max-concurrent-requests (/info): while one of
    the model's engines says it caps what it holds, its streams are checked. vLLM says nothing of its caps."""
    processor, dispatcher, _ = make(None, engine)

    async def checked() -> bool:
        stream, release = await released(processor, request())
        stream.close()
        await stream.task
        return bool(release.mode_override.response_body_mode == DUPLEX)

    assert not await checked()  # nothing said yet
    said = {"sglang": EngineLimits(max_running=8, max_held=12), "tgi": EngineLimits(max_held=128),
            "vllm": EngineLimits(max_model_len=4096)}[engine]
    dispatcher.record_limits(ENDPOINT, said)
    assert await checked() == (engine != "vllm")
    dispatcher.record_limits(ENDPOINT, EngineLimits())  # back without a cap (its flag removed, a restart)
    assert not await checked()
