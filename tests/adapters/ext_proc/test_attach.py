"""The attachments driven directly in the body modes Envoy declares: the reply's shape is the mode's, not the metadata's.

Our metadata with a body mode other than the generated filter's ``NONE`` (an
operator's filter, or a gateway that forwards our metadata), a filter that
does not send the body it is asked for, and a gateway's mode that sends no
body. tests/stack/test_attach_matrix.py runs every combination through Envoy 1.40;
tests/adapters/ext_proc/test_epp_stream.py drives the Endpoint Picker's own modes.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.core.held import Held
from extproc.core.prefix import NO_PREFIX
from tests.helpers.epp_stream import BUFFERED, DUPLEX, chat, first_message
from tests.helpers.epp_stream import answers as all_answers
from tests.helpers.processor import Stream, settle
from tests.helpers.prompt_prefix import BODY, body_message, headers_message, make

pytestmark = pytest.mark.unit

STREAMED = processing_mode_pb2.ProcessingMode.STREAMED


def declared(message: pb.ProcessingRequest, mode: int) -> pb.ProcessingRequest:
    message.protocol_config.request_body_mode = message.protocol_config.response_body_mode = mode
    return message


def released_headers(reply: pb.ProcessingResponse) -> dict[str, bytes]:
    common = reply.request_headers.response if reply.HasField("request_headers") else reply.request_body.response
    return {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}


async def test_metadata_in_full_duplex_holds_on_the_body_and_gives_it_back_in_chunks() -> None:
    processor, dispatcher, _ = make()
    stream = Stream(processor, declared(headers_message(BODY), DUPLEX))
    assert await all_answers(stream) == []  # no reply before the body is in: a headers reply would let it go
    stream.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY[:100])))
    stream.send(body_message(BODY[100:]))
    released = await all_answers(stream)
    assert released[0].HasField("request_headers") and released[0].request_headers.response.clear_route_cache
    assert released_headers(released[0])["x-model"] == b"m"
    assert not released[0].HasField("mode_override")  # Envoy ignores overrides in duplex mode
    given_back = [r.request_body.response.body_mutation.streamed_response for r in released[1:]]
    assert b"".join(g.body for g in given_back) == BODY and given_back[-1].end_of_stream
    assert dispatcher.in_flight == 1
    # Every later body answer is a streamed one: a plain body reply is "spurious" to Envoy there (500).
    stream.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    stream.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: one\n\n", end_of_stream=True)))
    headers_reply, chunk = await all_answers(stream)
    assert headers_reply.HasField("response_headers")
    assert chunk.response_body.response.body_mutation.streamed_response.body == b"data: one\n\n"
    stream.close()
    await stream.task
    assert dispatcher.in_flight == 0


async def test_metadata_in_full_duplex_rewrites_the_engine_priority_in_the_chunks_given_back() -> None:
    processor, _, _ = make(engine_priority=True)
    stream = Stream(processor, declared(headers_message(BODY), DUPLEX))
    stream.send(body_message(BODY))
    released = await all_answers(stream)
    body = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in released[1:])
    assert json.loads(body) == {**json.loads(BODY), "priority": 1}  # the default class, standard
    assert released_headers(released[0])["content-length"] == str(len(body)).encode()
    stream.close()
    await stream.task


async def test_metadata_buffered_releases_on_the_headers_keeping_the_declared_mode_and_passes_the_body() -> None:
    processor, _, _ = make()
    stream = Stream(processor, declared(headers_message(BODY), BUFFERED))
    (released,) = await all_answers(stream)
    assert released_headers(released)["x-model"] == b"m"
    override = released.mode_override
    if released.HasField("mode_override"):  # a checked release: the response headers on, the bodies as declared
        assert (override.request_body_mode, override.response_body_mode) == (BUFFERED, BUFFERED)
    stream.send(body_message(BODY))  # Envoy sends the buffered body once the headers are answered
    (passed,) = await all_answers(stream)
    assert passed.HasField("request_body") and not passed.request_body.HasField("response")
    stream.close()
    await stream.task


async def test_metadata_buffered_with_engine_priority_rewrites_the_body_that_follows_the_release() -> None:
    processor, _, _ = make(engine_priority=True)
    stream = Stream(processor, declared(headers_message(BODY), BUFFERED))
    (released,) = await all_answers(stream)
    assert released.mode_override.request_body_mode == BUFFERED
    stream.send(body_message(BODY))
    (rewritten,) = await all_answers(stream)
    assert json.loads(rewritten.request_body.response.body_mutation.body)["priority"] == 1  # standard
    stream.close()
    await stream.task


async def test_a_body_asked_for_and_not_sent_is_refused_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """The filter ignored the mode override (allow_mode_override false): the request went on without its body."""
    processor, dispatcher, submitted = make(prefix={})
    for _ in range(2):
        stream = Stream(processor, headers_message(BODY))
        (asked,) = await all_answers(stream)
        assert asked.mode_override.request_body_mode == BUFFERED
        stream.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))  # no body: the response
        (refused,) = await all_answers(stream)
        assert refused.immediate_response.status.code == 500
        assert json.loads(refused.immediate_response.body)["error"]["code"] == "gateway_error"
        await stream.task
    assert submitted == [] and dispatcher.queued == 0
    logged = [r for r in caplog.records if r.levelno == logging.WARNING and "request body" in r.getMessage()]
    assert len(logged) <= 1  # once per phase for the process (an earlier test may have logged it already)


@pytest.mark.parametrize("mode", [0, STREAMED])  # NONE, STREAMED: no body before the headers are answered
async def test_no_metadata_and_no_body_sent_is_refused_at_once_naming_the_mode(mode: int) -> None:
    processor, dispatcher, _ = make()
    stream = Stream(processor, first_message(mode))
    (answer,) = await all_answers(stream)
    error = json.loads(answer.immediate_response.body)["error"]
    assert (answer.immediate_response.status.code, error["code"]) == (400, "model_missing")
    name = "NONE" if mode == 0 else "STREAMED"
    assert f"request_body_mode {name}" in error["message"]
    assert dispatcher.queued == 0
    await settle()


async def test_no_metadata_duplex_and_buffered_still_read_the_body() -> None:
    for mode in (DUPLEX, BUFFERED):
        processor, dispatcher, _ = make()
        stream = Stream(processor, first_message(mode))
        await all_answers(stream)
        stream.send(body_message(chat(model="m")))
        released = await all_answers(stream)
        assert released and dispatcher.in_flight == 1, mode
        stream.close()
        await stream.task


async def test_release_replies_are_reused_for_short_waits_and_bounded_as_endpoints_come_and_go() -> None:
    processor, dispatcher, _ = make()
    own = processor.own_envoy
    stream = own.open(headers_message(BODY), None)
    held = dispatcher.submit("t", 0, prefix=NO_PREFIX)
    held.endpoint = "http://10.0.0.1:8000"
    first = own.release(stream, held, "m", 0.004, None)
    assert own.release(stream, held, "m", 0.004, None)[0] is first[0]  # the same wait and destination: reused
    assert released_headers(first[0])["x-gateway-destination-endpoint"] == b"10.0.0.1:8000"
    assert released_headers(first[0])["x-extproc-queue-wait-ms"] == b"4"
    assert own.release(stream, held, "m", 0.5, None)[0] is not own.release(stream, held, "m", 0.5, None)[0]
    for i in range(3000):  # a pool whose endpoints keep changing
        held.endpoint = f"http://10.1.{i // 250}.{i % 250}:8000"
        reply = own.release(stream, held, "m", 0.004, None)[0]
        assert released_headers(reply)["x-gateway-destination-endpoint"] == f"10.1.{i // 250}.{i % 250}:8000".encode()
    assert own.reused_replies <= 1024


async def test_a_preemption_that_meets_the_response_headers_answers_them_with_the_503() -> None:
    """The core preempts a batch request in the instant its response headers reach the processor: Envoy holds them
    for the reply (the release asked for them), so the 503 replaces them; a CONTINUE first would send the client a
    200 that the 503 then cuts."""
    processor, dispatcher, _ = make()
    helds: list[Held] = []
    submit = dispatcher.submit

    def keeping(*args: Any, **kwargs: Any) -> Held:
        helds.append(submit(*args, **kwargs))
        return helds[-1]

    dispatcher.submit = keeping  # type: ignore[method-assign]
    request = headers_message(BODY)
    request.request_headers.headers.headers.append(base_pb2.HeaderValue(key="x-priority", raw_value=b"batch"))
    stream = Stream(processor, request)
    (released,) = await all_answers(stream)
    assert released.mode_override.response_header_mode == processing_mode_pb2.ProcessingMode.SEND
    [held] = helds
    assert held.preempted is not None
    stream.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    held.preempted.set_result(None)  # in the same instant, before the stream reads the headers
    (answer,) = await all_answers(stream)
    assert answer.immediate_response.status.code == 503
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "preempted"
    await stream.task
